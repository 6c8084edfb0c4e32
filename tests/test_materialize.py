"""Module-by-module materialisation of a meta model (autopar.runtime.materialize), single process."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.runtime.materialize import InitError, materialize, materialize_pieces

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

CONFIG = gpt.GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8)


def _meta_gpt():
    with torch.device("meta"):
        return gpt.GPT(CONFIG, init=False)


def test_same_seed_same_weights_and_ties_kept():
    a, b, c = materialize(_meta_gpt(), seed=3), materialize(_meta_gpt(), seed=3), materialize(_meta_gpt(), seed=4)
    assert a.lm_head.weight is a.transformer.wte.weight
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert p.device.type == "cpu" and torch.equal(p, q), name
        if name.endswith("weight") and "ln" not in name:
            assert not torch.equal(p, r), name
    # the model's own init ran: GPT._init_weights (std 0.02, scaled residual projections), LayerNorm's reset
    assert abs(float(a.transformer.h[0].mlp.c_fc.weight.detach().std()) - 0.02) < 0.004
    assert float(a.transformer.h[0].mlp.c_proj.weight.detach().std()) < 0.015
    assert torch.equal(a.transformer.ln_f.weight.detach(), torch.ones(16))


def test_a_module_does_not_depend_on_which_others_are_materialised():
    """A pipeline rank walks only its stages: module values depend on (seed, path) only."""
    whole = materialize(_meta_gpt(), seed=7)
    got = {}

    def take(fqn, value):
        got[fqn] = value.clone()
        return False

    model = _meta_gpt()
    walked = materialize_pieces(model, seed=7, want=lambda f: f.startswith("transformer.h.1."), take=take)
    assert walked and all(w.startswith("transformer.h.1") for w in walked), walked
    assert set(got) == {n for n, _ in whole.named_parameters() if n.startswith("transformer.h.1.")}
    for fqn, value in got.items():
        assert torch.equal(value, whole.get_parameter(fqn).detach()), fqn
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing kept: take said False


class _Rotary(nn.Module):
    def __init__(self, with_reset: bool):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("cos", torch.cos(torch.arange(4.0)), persistent=False)
        if with_reset:
            self.reset_parameters = lambda: self.cos.copy_(torch.cos(torch.arange(4.0)))


def test_buffers_need_an_init_or_a_clear_error():
    with torch.device("meta"):
        bare = _Rotary(with_reset=False)
    with pytest.raises(InitError, match=r"buffer 'cos' \(\(4,\), torch.float32\) of module '<root>' \(_Rotary\).*init_fn"):
        materialize(bare, seed=0)
    with torch.device("meta"):
        own = _Rotary(with_reset=True)
    assert torch.equal(materialize(own, seed=0).cos, torch.cos(torch.arange(4.0)))
    with torch.device("meta"):
        given = _Rotary(with_reset=False)

    def init_fn(module):
        if isinstance(module, _Rotary):
            module.cos.copy_(torch.cos(torch.arange(4.0)))

    assert torch.equal(materialize(given, seed=0, init_fn=init_fn).cos, torch.cos(torch.arange(4.0)))


def test_a_parameter_no_init_writes_is_an_error():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = Bare()
    with pytest.raises(InitError, match="parameter 'scale'.*no initialisation set it.*init_fn"):
        materialize(model, seed=0)


def test_llama_from_meta_gets_its_own_initialisation():
    """examples/llama.py on meta: every module is initialised as the CPU-built model is (the root's
    init_weights never runs per module; Transformer._init_weights and RMSNorm.reset_parameters do):
    the same distribution per parameter (normal std 0.02, wo/w2 scaled by 1/sqrt(2 n_layers), norms
    ones), drawn from the per-module seeds."""
    import llama

    meta, *_ = llama.build(size="small", n_layers=4, device="meta", dtype="fp32")
    materialize(meta, seed=5)
    cpu, *_ = llama.build(size="small", n_layers=4)
    for (name, p), (_, q) in zip(meta.named_parameters(), cpu.named_parameters()):
        p, q = p.detach(), q.detach()
        assert p.device.type == "cpu" and p.shape == q.shape, name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        assert not torch.equal(p, q), name  # drawn from the module's seed, not the construction-order stream
        assert abs(float(p.std()) / float(q.std()) - 1) < 0.05, (name, float(p.std()), float(q.std()))
        assert abs(float(p.mean())) < 0.1 * float(q.std()), name
    wo = meta.layers[0].attention.wo.weight.detach()
    assert abs(float(wo.std()) - 0.02 / (2 * 4) ** 0.5) < 0.001

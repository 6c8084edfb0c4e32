"""autopar.runtime.context in one process: the micro-batch stacking, the label shift and the program rewrite.

(The multi-process training runs are tests/dist/test_cp_training.py.)
"""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.context import sequence_positions, shard_sequence, unshard_sequence
from autopar.errors import InputError, PlanError
from autopar.runtime.context import apply_cp, local_rows, runtime_variant, shift_hf_labels, stack_sequences


def test_stacked_rows_are_each_ranks_balanced_chunks():
    groups, mbs, cp, seq = 2, 3, 2, 12
    x = torch.arange(groups * mbs * seq).reshape(groups * mbs, seq)
    other = torch.tensor(7)  # not batched: passed through
    out = stack_sequences({"x": x, "n": other}, cp=cp, seq=seq, rows=groups * mbs, groups=groups)
    assert out["n"] is other and out["x"].shape == (groups * cp * mbs, seq // cp)
    dp = groups * cp
    blocks = out["x"].chunk(dp)  # what each dp rank takes of the rows
    for d in range(dp):
        assert torch.equal(blocks[d], local_rows(x, cp=cp, dp=dp, dp_rank=d))
        g, r = divmod(d, cp)
        assert torch.equal(blocks[d], shard_sequence(x[g * mbs:(g + 1) * mbs], 1, cp, r))
    for g in range(groups):  # the cp ranks of a group hold the whole sequences between them
        assert torch.equal(unshard_sequence(list(blocks[g * cp:(g + 1) * cp]), 1), x[g * mbs:(g + 1) * mbs])


def test_stacking_refuses_what_it_cannot_split():
    with pytest.raises(InputError, match=r"input 'y' of shape \(4,\) has no sequence dim of 12 tokens"):
        stack_sequences({"x": torch.zeros(4, 12), "y": torch.zeros(4)}, cp=2, seq=12, rows=4, groups=1)
    with pytest.raises(InputError, match=r"2 x cp = 8 equal chunks, but input 'x' has 12 tokens; pad sequences "
                                         r"to a multiple of 8"):
        stack_sequences({"x": torch.zeros(4, 12)}, cp=4, seq=12, rows=4, groups=1)


def test_hf_causal_lm_labels_are_shifted_on_the_whole_sequence():
    class TinyForCausalLM(torch.nn.Module):
        loss_function = None

    labels = torch.tensor([[5, 6, 7, 8]])
    got = shift_hf_labels(TinyForCausalLM(), {"input_ids": labels, "labels": labels})
    assert torch.equal(got["shift_labels"], torch.tensor([[6, 7, 8, -100]]))
    assert got["labels"] is labels
    assert "shift_labels" not in shift_hf_labels(torch.nn.Linear(1, 1), {"labels": labels})


def test_runtime_variant_is_the_plans_single_choice_else_the_ring():
    assert runtime_variant({"variants": ["allgather"]}) == "allgather"
    assert runtime_variant({"variants": ["allgather", "ring"]}) == "ring"
    assert runtime_variant({}) == "ring"


def _program(mask: str, seq: int = 8, dropout: float = 0.0, kv_heads: int = 2):
    """A forward + backward program of causal attention whose output is weighted by positions
    (grouped-query K/V repeated to 2 heads when ``kv_heads`` is 1)."""
    def f(q, k_grouped, v_grouped, pad):
        k, v = (x.repeat_interleave(2 // kv_heads, dim=1) for x in (k_grouped, v_grouped))
        pos = torch.arange(q.shape[2])
        if mask == "causal":
            m = torch.where(pos[:, None] >= pos[None, :], 0.0, float("-inf")).to(q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        elif mask == "padding":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=pad)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        loss = (out * (1.0 + pos.double())[None, None, :, None]).sum()
        return (loss, *torch.autograd.grad(loss, (q, k_grouped, v_grouped)))

    q = torch.randn(2, 2, seq, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    pad = torch.ones(seq, seq, dtype=torch.bool)
    return make_fx(f)(q, k, v, pad), (q, k, v, pad)


@pytest.mark.parametrize("mask,kv_heads", [("causal", 2), ("flag", 2), ("flag", 1)])
def test_the_rewrite_runs_the_same_attention(mask, kv_heads):
    gm, args = _program(mask, kv_heads=kv_heads)
    want = gm(*args)
    kernels = [n for n in gm.graph.nodes if "flash_attention" in str(n.target)]
    assert len(kernels) == 2  # forward and backward
    assert apply_cp(gm, cp=1, group="", rank=0, seq=8, variant="ring") == 1
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("flash_attention" in t for t in targets)
    assert {"autopar.cp_attention.default", "autopar.cp_attention_backward.default"} <= targets
    for a, b in zip(gm(*args), want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # grouped-query K/V reach the op grouped (the exchange sends them so, as the plan prices it)
    op = next(n for n in gm.graph.nodes if n.target is torch.ops.autopar.cp_attention.default)
    assert [n.meta["val"].shape[1] for n in op.args[1:3]] == [kv_heads, kv_heads]
    if kv_heads == 1:  # the repeat's copies are gone from the program
        assert not any(n.target is torch.ops.aten.expand.default and n.meta["val"].dim() == 5 for n in gm.graph.nodes)


def test_positions_become_the_ranks_global_ones():
    gm, _ = _program("flag", seq=6)  # traced at a rank's 6 of 24 tokens (cp = 2: chunks of 6)
    apply_cp(gm, cp=2, group="cp", rank=1, seq=12, variant="ring")
    consts = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr" and "_cp_positions" in n.target]
    assert len(consts) == 1 and torch.equal(consts[0], sequence_positions(12, 2, 1))
    assert torch.equal(consts[0], torch.tensor([3, 4, 5, 6, 7, 8]))  # chunks 1 and 2 of 4
    assert not any("arange" in str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_what_cp_cannot_run_is_refused():
    gm, _ = _program("padding")
    with pytest.raises(PlanError, match="depends on the inputs or is not causal"):
        apply_cp(gm, cp=2, group="cp", rank=0, seq=16, variant="ring")
    gm, _ = _program("flag", dropout=0.1)  # (on CPU, SDPA with dropout runs as separate ops)
    with pytest.raises(PlanError, match=r"no scaled-dot-product attention op .* attention dropout"):
        apply_cp(gm, cp=2, group="cp", rank=0, seq=16, variant="ring")
    plain = make_fx(lambda x: (x @ x.T).sum())(torch.randn(3, 3))
    with pytest.raises(PlanError, match="no scaled-dot-product attention op"):
        apply_cp(plain, cp=2, group="cp", rank=0, seq=16, variant="ring")

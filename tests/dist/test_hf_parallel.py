"""Unmodified Hugging Face models (configs only, random init) trained on 2 gloo ranks
against the same model in one process: data parallel and tensor parallel (losses, the
last gradients and the parameters, as accurate as one fp32 process against the model
trained in fp64: ``parallel_compare`` gives the tolerance scheme and its reasons)."""

import sys
from pathlib import Path

import pytest
import torch

from autopar.testing import spawn_world, tp_friendly_cluster
from parallel_compare import Reference, assert_matches, errors, train_alongside

pytest.importorskip("transformers")

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)  # eps: see test_parallel.py


def _train(rank, world, model_name, configs):
    sys.path.insert(0, EXAMPLES)
    import autopar
    import hf

    out = {}
    for name, cluster, fixed in configs:
        torch.manual_seed(0)
        model, inputs, _, _ = hf.build(model=model_name, batch=8)
        reference = Reference(model, _optimizer)
        pm = autopar.parallelize(model, cluster=cluster, fixed=fixed, optimizer=_optimizer)
        losses = train_alongside(pm, reference, steps=3, run=lambda pm: pm.train_step(inputs),
                                 run_reference=lambda ref, like: ref(**like(inputs)).loss)  # labels are in the inputs
        grad_err, param_err = errors(pm, reference)
        missing = sorted(set(dict(reference.fp32.named_parameters())) - set(grad_err))
        out[name] = (losses, grad_err, param_err, missing, pm.plan.mesh)
    return out


CONFIGS = [("dp", "1x2xcpu", {"dp": 2}), ("tp", tp_friendly_cluster("1x2xcpu"), {"tp": 2})]


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_hf_model_on_two_ranks_matches_one_process(model_name):
    result = spawn_world(_train, 2, model_name, CONFIGS)[0]
    for name, (losses, grad_err, param_err, missing, mesh) in result.items():
        assert not missing, f"{model_name} {name}: no gradient for {missing}"
        assert_matches(losses, grad_err, param_err, f"{model_name} {name}")
    assert result["tp"][4]["tp"] == 2 and result["dp"][4]["dp"] == 2

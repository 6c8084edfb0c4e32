"""Unmodified Hugging Face models (configs only, random init) trained on 2 gloo ranks
against the same model in one process: data parallel and tensor parallel (losses, the
last gradients and the parameters, 1e-5 relative)."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from autopar.testing import spawn_world, tp_friendly_cluster

pytest.importorskip("transformers")

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


def _train(rank, world, model_name, configs):
    sys.path.insert(0, EXAMPLES)
    import autopar
    import hf

    out = {}
    for name, cluster, fixed in configs:
        torch.manual_seed(0)
        model, inputs, _, _ = hf.build(model=model_name, batch=8)
        reference = copy.deepcopy(model)
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-5)
        pm = autopar.parallelize(model, cluster=cluster, fixed=fixed,
                                 optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-5))
        losses = []
        for _ in range(3):
            loss = pm.train_step(inputs)
            opt.zero_grad()
            ref = reference(**inputs).loss  # the model's own loss: labels are in the inputs
            ref.backward()
            opt.step()
            losses.append((loss, ref.item()))
        state, grads = pm.state_dict(), pm.full_gradients()
        errors = {k: float((state[k] - p.detach()).norm() / p.norm()) for k, p in reference.named_parameters()}
        errors.update({f"grad of {k}": float((grads[k] - p.grad).norm() / p.grad.norm())
                       for k, p in reference.named_parameters()})
        out[name] = (losses, max(errors.values()), max(errors, key=errors.get), pm.plan.mesh)
    return out


CONFIGS = [("dp", "1x2xcpu", {"dp": 2}), ("tp", tp_friendly_cluster("1x2xcpu"), {"tp": 2})]


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_hf_model_on_two_ranks_matches_one_process(model_name):
    result = spawn_world(_train, 2, model_name, CONFIGS)[0]
    for name, (losses, worst, where, mesh) in result.items():
        for step, (got, want) in enumerate(losses):
            assert got == pytest.approx(want, rel=1e-5), f"{model_name} {name}: loss of step {step}"
        assert worst < 1e-5, f"{model_name} {name}: {where} differs by {worst:.2e}"
    assert result["tp"][3]["tp"] == 2 and result["dp"][3]["dp"] == 2

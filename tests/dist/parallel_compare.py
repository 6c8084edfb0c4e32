"""Shared by the multi-process tests: train a ParallelModule beside a one-process reference
and measure how far apart they are.

Errors are relative, as a norm over each tensor: ``|a - b| / |b|``. 1e-5 is the
tolerance in fp32 (test_parallel.py explains why AdamW runs use eps=1e-5).
"""

import pytest
import torch

RTOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def train_alongside(pm, reference, ref_opt, *, steps: int, run, run_reference) -> list[tuple[float, float]]:
    """``steps`` steps of both; (autopar's loss, the reference's loss) per step.

    ``run(pm)`` makes one ``train_step`` and returns its loss; ``run_reference(model)``
    returns the reference's loss tensor on the same global batch.
    """
    losses = []
    for _ in range(steps):
        loss = run(pm)
        ref_opt.zero_grad()
        ref_loss = run_reference(reference)
        ref_loss.backward()
        ref_opt.step()
        losses.append((loss, ref_loss.item()))
    return losses


def errors(pm, reference, skip=()) -> tuple[dict[str, float], dict[str, float]]:
    """Relative errors of the last gradients and of the parameters, per parameter name
    (collectives: every rank calls this)."""
    grads, state = pm.full_gradients(), pm.state_dict()
    ref = dict(reference.named_parameters())
    names = [k for k in grads if k not in skip]
    return ({k: rel(grads[k], ref[k].grad) for k in names}, {k: rel(state[k], ref[k].detach()) for k in names})


def assert_matches(losses, grad_err, param_err, where: str, rtol: float = RTOL) -> None:
    for step, (got, want) in enumerate(losses):
        assert got == pytest.approx(want, rel=rtol), f"{where}: loss of step {step}"
    worst_g = max(grad_err, key=grad_err.get)
    worst_p = max(param_err, key=param_err.get)
    assert grad_err[worst_g] < rtol, f"{where}: gradient of {worst_g} differs by {grad_err[worst_g]:.2e}"
    assert param_err[worst_p] < rtol, f"{where}: parameter {worst_p} differs by {param_err[worst_p]:.2e}"

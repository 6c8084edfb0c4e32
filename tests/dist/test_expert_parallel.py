"""Expert parallelism (``autopar.runtime.expert``) on spawned gloo worlds against one process.

The MoE example (top-2 of 8 experts, shared expert, balance loss) trains 3 AdamW steps
under ep=2, ep=4 and ep=2 folded over dp=4 (two replicas of each expert half); every
step's loss, every gradient and every parameter must equal the same model trained in
one process, and each rank must hold only its E/ep experts.

Tolerance: fp32, 1e-5 relative to the tensor's largest entry (plus 1e-7 absolute for
tensors near zero). Expert rows reach their expert in the same order as in one process
(ranks hold consecutive batch slices and the all-to-all delivers source-major), so the
expert matmuls see the same rows; what differs is the order of sums across ranks
(all-reduce of gradients, the loss mean), a few fp32 ulps (~1e-7 relative), and what
AdamW (eps=1e-5) makes of it in 3 steps. A routing or grouping bug (a token sent to the
wrong expert, a gradient summed over the wrong ranks or not divided by dp) moves values
by percents.
"""

import sys
from pathlib import Path

import pytest
import torch

from autopar.testing import spawn_world

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
STEPS = 3
RTOL, ATOL = 1e-5, 1e-7


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


def _build():
    sys.path.insert(0, EXAMPLES)
    import moe
    return moe.build(size="tiny", batch=8, shared_expert=True, aux_loss=0.01)


def _train(rank, world, eps):
    """On every rank, for each ep: train under EP and compare with the model trained in this process alone."""
    from autopar.parallel import _init_process_group

    _init_process_group("cpu", 300)
    return [_train_one(rank, world, ep) for ep in eps]


def _train_one(rank, world, ep):
    import torch.distributed as dist

    from autopar.runtime.expert import EpLayout, ExpertParallel

    ref_losses, ref_grads, ref_params, E = _reference()
    model, inputs, loss_fn, target = _build()
    engine = ExpertParallel(model, layout=EpLayout(dp=world, ep=ep), loss_fn=loss_fn, optimizer=_optimizer)
    losses = []
    for step in range(STEPS):
        if step == STEPS - 1:  # keep the last step's gradients: the optimizer would clear them
            engine.optimizer.zero_grad = lambda set_to_none=True: None
        losses.append(engine.train_step(inputs, target))
    part = rank % ep
    problems = []
    for s, (got, want) in enumerate(zip(losses, ref_losses)):
        if abs(got - want) > RTOL * abs(want):
            problems.append(f"step {s}: loss {got} vs {want}")
    named = dict(model.named_parameters())
    for name, p in named.items():
        rows = slice(part * E // ep, (part + 1) * E // ep) if name in engine.expert_names else slice(None)
        for kind, got, ref in (("gradient", p.grad, ref_grads[name][rows]), ("parameter", p.detach(),
                                                                              ref_params[name][rows])):
            if got.shape != ref.shape:
                problems.append(f"{kind} {name} is {tuple(got.shape)}, expected {tuple(ref.shape)}")
            elif _close(got, ref) > 1:
                problems.append(f"{kind} {name} off by {(got - ref).abs().max():.3g} ({_close(got, ref):.1f}x "
                                f"the tolerance)")
    held = {n: tuple(named[n].shape) for n in engine.expert_names}
    groups = {"ep": dist.get_process_group_ranks(engine.ep_group),
              "replicas": dist.get_process_group_ranks(engine.replica_group)}
    return {"problems": problems, "held": held, "groups": groups, "E": E, "losses": losses}


def _reference():
    model, inputs, loss_fn, target = _build()
    opt = _optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        if step < STEPS - 1:
            opt.zero_grad(set_to_none=True)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, grads, params, model.config.n_experts


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| over its allowance (<= 1 passes)."""
    return ((got - want).abs().max() / (RTOL * want.abs().max() + ATOL)).item()


@pytest.mark.parametrize("world, eps", [(2, (2,)), (4, (4, 2))], ids=["ep2", "ep4+ep2xdp2"])
def test_moe_trains_like_one_process(world, eps):
    """One world per size (spawning is most of the cost): world 4 runs ep=4, then ep=2 x dp=2."""
    for ep, results in zip(eps, zip(*spawn_world(_train, world, eps))):
        for rank, r in enumerate(results):
            part = rank % ep
            assert r["groups"] == {"ep": list(range(rank - part, rank - part + ep)),
                                   "replicas": list(range(part, world, ep))}
            # only this rank's experts are held: E/ep rows of each stacked weight, 3 per block
            assert len(r["held"]) == 3 * 2 and all(s[0] == r["E"] // ep for s in r["held"].values()), r["held"]
            assert not r["problems"], f"ep={ep} rank {rank}: " + "; ".join(r["problems"])
        assert results[0]["losses"][-1] < results[0]["losses"][0]

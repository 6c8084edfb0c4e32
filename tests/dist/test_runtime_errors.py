"""Runtime mistakes on a 2-rank gloo world: every rank gets the same one-line error.

One world runs the cases in turn (each starts a fresh ParallelModule on the same
process group): a plan file made for another model, a plan made for another batch
size, a batch that changes between steps, and a loss that is not a scalar.
"""

import sys
from pathlib import Path

import torch

from autopar.testing import spawn_world

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _cases(rank, world, gpt_plan_path, mlp_plan_json):
    sys.path.insert(0, EXAMPLES)
    import autopar
    import mlp

    out = {}
    torch.manual_seed(0)
    model, inputs, loss_fn, target = mlp.build(size="tiny", batch=8)
    kw = dict(cluster="1x2xcpu", loss_fn=loss_fn, timeout_s=60)

    pm = autopar.parallelize(model, plan=gpt_plan_path, **kw)
    out["other_model"] = _error(lambda: pm.train_step(inputs, target))

    pm = autopar.parallelize(model, plan=autopar.Plan.from_json(mlp_plan_json), **kw)  # planned for batch 4
    out["other_batch"] = _error(lambda: pm.train_step(inputs, target))

    pm = autopar.parallelize(model, fixed={"dp": 2, "pp": 1}, **kw)
    pm.train_step(inputs, target)
    out["second_batch"] = _error(lambda: pm.train_step(inputs[0][:4], target[:4]))
    out["third_step"] = _error(lambda: pm.train_step(inputs, target))  # the module is still usable

    kw["loss_fn"] = lambda output, target: (output - target) ** 2  # per element: no reduction
    pm = autopar.parallelize(model, fixed={"dp": 2, "pp": 1}, **kw)
    out["non_scalar_loss"] = _error(lambda: pm.train_step(inputs, target))
    out["stepped"] = bool(getattr(pm, "optimizer", None) and pm.optimizer.state)
    return out


def test_runtime_mistakes_are_one_clear_error_on_every_rank(tmp_path):
    sys.path.insert(0, EXAMPLES)
    import autopar
    import gpt
    import mlp

    model, inputs, loss_fn, target = gpt.build(size="tiny", batch=8)
    gpt_plan = tmp_path / "gpt-plan.json"
    autopar.plan(model, inputs, cluster="1x2xcpu", loss_fn=loss_fn, example_target=target,
                 fixed={"pp": 1}).save(gpt_plan)
    model, inputs, loss_fn, target = mlp.build(size="tiny", batch=4)
    mlp_plan = autopar.plan(model, inputs, cluster="1x2xcpu", loss_fn=loss_fn, example_target=target,
                            fixed={"pp": 1})

    results = spawn_world(_cases, 2, str(gpt_plan), mlp_plan.to_json(), timeout_s=600)
    for rank, r in enumerate(results):
        assert r["other_model"].startswith("PlanError: planning failed on rank 0: PlanError: this plan was made "
                                           "for GPT"), (rank, r)
        assert "the plan was made for a global batch of 4, but train_step got a batch of 8" in r["other_batch"], \
            (rank, r)
        assert r["second_batch"] == (
            "ValueError: train_step got a batch of 4, but the first call had a batch of 8 (the plan, the traced "
            "program and the micro-batches are built for it); pass batches of 8 on every step (drop or pad a "
            "last partial batch), or parallelize again for a batch of 4"), (rank, r)
        assert r["third_step"] == "no error", (rank, r)
        assert "not a scalar" in r["non_scalar_loss"] and "(8, 64)" in r["non_scalar_loss"], (rank, r)
        assert not r["stepped"], (rank, r)  # found before the first optimizer step

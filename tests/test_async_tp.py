"""Async TP priced (make_plan(async_tp=True)): the tp all-gathers into GEMMs and reduce-scatters out
of them overlap those GEMMs, at the simulator's overlap slowdown (autopar.planner.evaluation)."""

import sys
from pathlib import Path

import pytest

from autopar.cost.step import OVERLAP_SLOWDOWN
from autopar.planner.make import make_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama  # noqa: E402


@pytest.fixture(scope="module")
def plans():
    """Two layers of Llama 3.1 8B, 8 x 2048 tokens, tp=8 with sequence parallelism on one node, priced
    with the tp collectives blocking and under async TP."""
    model, inputs, loss_fn, target = llama.build(size="8b", n_layers=2, batch=8, seq=2048, device="meta")
    fixed = {"tp": 8, "sp": True, "dp": 1, "pp": 1, "zero": 0, "recompute": "none", "microbatch_size": 8,
             "microbatches": 1}
    kw = dict(cluster="1x8xH100", loss_fn=loss_fn, example_target=target, fixed=fixed)
    return make_plan(model, inputs, **kw), make_plan(model, inputs, async_tp=True, **kw)


def _tp_seconds(plan, kind):
    return plan.communication.get(kind, {}).get("tp", {}).get("time_s", 0.0)


def test_async_tp_hides_part_of_the_sequence_parallel_collectives(plans):
    blocking, overlapped = plans
    assert overlapped.mesh == blocking.mesh and overlapped.ops == blocking.ops  # the same layout, priced apart
    saved = blocking.predicted["step_time_s"] - overlapped.predicted["step_time_s"]
    assert saved > 0
    gathers = _tp_seconds(blocking, "all_gather") + _tp_seconds(blocking, "reduce_scatter")
    hidden = gathers - _tp_seconds(overlapped, "all_gather") - _tp_seconds(overlapped, "reduce_scatter")
    assert 0 < hidden <= gathers / OVERLAP_SLOWDOWN  # at most the transfers' time at the overlap slowdown
    assert saved == pytest.approx(hidden, rel=1e-6)  # (one micro-batch, one stage: the step saves exactly that)
    # what async TP does not touch: the all-reduces and the work
    assert _tp_seconds(overlapped, "all_reduce") == _tp_seconds(blocking, "all_reduce")
    assert overlapped.predicted["hardware_flops_per_step"] == blocking.predicted["hardware_flops_per_step"]


def test_async_tp_changes_nothing_without_tensor_parallelism():
    model, inputs, loss_fn, target = llama.build(size="small", batch=8, seq=256, device="meta")
    fixed = {"tp": 1, "dp": 8, "pp": 1, "zero": 1, "microbatch_size": 1, "microbatches": 1}
    kw = dict(cluster="1x8xH100", loss_fn=loss_fn, example_target=target, fixed=fixed)
    assert make_plan(model, inputs, async_tp=True, **kw).predicted == make_plan(model, inputs, **kw).predicted

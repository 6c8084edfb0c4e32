"""Async TP priced (make_plan(async_tp=True)): the tp all-gathers into GEMMs and reduce-scatters out
of them overlap those GEMMs, at the simulator's overlap slowdown, less the local work torch's fused
ops add (autopar.planner.evaluation)."""

import sys
from pathlib import Path

import pytest

from autopar.cost import comm
from autopar.cost.compute import MEMORY_EFFICIENCY
from autopar.cost.devices import DEVICES
from autopar.cost.step import OVERLAP_SLOWDOWN
from autopar.planner.make import make_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama  # noqa: E402


def _plans(tp: int):
    """Two layers of Llama 3.1 8B, 8 x 2048 tokens, ``tp`` ranks with sequence parallelism (one
    node of ``tp`` GPUs), priced with the tp collectives blocking and under async TP."""
    model, inputs, loss_fn, target = llama.build(size="8b", n_layers=2, batch=8, seq=2048, device="meta")
    fixed = {"tp": tp, "sp": True, "dp": 1, "pp": 1, "zero": 0, "recompute": "none", "microbatch_size": 8,
             "microbatches": 1}
    kw = dict(cluster=f"1x{tp}xH100", loss_fn=loss_fn, example_target=target, fixed=fixed)
    return make_plan(model, inputs, **kw), make_plan(model, inputs, async_tp=True, **kw)


@pytest.fixture(scope="module")
def plans():
    return _plans(8)


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


def test_the_fused_reduce_scatter_pays_for_summing_its_stacked_partials():
    """torch's fused_matmul_reduce_scatter pulls every rank's partial sums of a chunk into a stacked
    buffer and sums it on the compute stream: a read of the whole GEMM output and a write of its
    1/tp share, at the local copy rate, which async TP cannot hide and NCCL's blocking reduce-scatter
    does inside its own kernel. (Without that term these reduce-scatters, whose transfers at tp=2 are
    shorter than their GEMMs, would save transfer / slowdown in full.)"""
    blocking, overlapped = _plans(2)
    before, after = (p.communication["reduce_scatter"]["tp"] for p in (blocking, overlapped))
    assert after["bytes"] == before["bytes"] and after["count"] == before["count"]
    h100 = DEVICES["H100"]
    link = comm.group_link(group_size=2, stride=1, devices_per_node=2, device=h100)
    transfers_s = before["count"] * comm.reduce_scatter_s(before["bytes"] / before["count"], 2, link)
    summed_s = before["bytes"] * (1 + 1 / 2) / (h100.hbm_bytes_per_s * MEMORY_EFFICIENCY)
    saved = before["time_s"] - after["time_s"]
    assert 0 < saved <= transfers_s / OVERLAP_SLOWDOWN - summed_s + 1e-12


def test_async_tp_changes_nothing_without_tensor_parallelism():
    model, inputs, loss_fn, target = llama.build(size="small", batch=8, seq=256, device="meta")
    fixed = {"tp": 1, "dp": 8, "pp": 1, "zero": 1, "microbatch_size": 1, "microbatches": 1}
    kw = dict(cluster="1x8xH100", loss_fn=loss_fn, example_target=target, fixed=fixed)
    assert make_plan(model, inputs, async_tp=True, **kw).predicted == make_plan(model, inputs, **kw).predicted

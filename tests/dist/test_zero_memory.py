"""Measured per-rank memory of ZeRO's state during a step against the plan's prediction.

Two gloo ranks train a 4-block Llama (untied embedding and head) under dp=2 with two
micro-batches, at ZeRO stages 0-3. What is measured, per rank, during the second step
(the first allocates AdamW's state):

- parameters, gradients and gathered ZeRO-3 weights: the runtime registers every buffer
  it allocates for them with :class:`autopar.runtime.memtrack.LiveBytes`, which counts a
  storage from its allocation until the storage is freed (a weakref finalizer on the
  storage, so a view kept by the program keeps it counted); the peak of their sum over
  the step. Gathered weights live from their layer group's gather to the program's last
  use of them, so a runtime that holds the whole model (the old ZeRO-3) or keeps full
  gradients at stage 2 shows up here.
- optimizer state: the AdamW tensors (exp_avg, exp_avg_sq), which do not change size.

Not counted: activations and autograd temporaries (the plan's activations figure, not
this test's business) and the collectives' transient send/receive buffers (the runtime tracks
them, but a bucket of one parameter sends the program's own gradient tensor, which the backward
holds anyway, so their peak is not the buffers' alone). The plan's ``zero_buffers`` is checked
against its own parts: the gathered weights (measured) and its buckets.

Predicted: the plan's per-stage ``memory_bytes`` params + grads + optimizer, plus for
ZeRO-3 the gathered weights :mod:`autopar.zero_def` implies (the group in use and the one
prefetched: the largest sum of ``PREFETCH_GROUPS + 1`` consecutive groups' all-gather
buckets in the plan). The two must agree within 10%.
"""

import sys
from pathlib import Path

import pytest
import torch

from autopar.testing import spawn_world

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
STAGES = (0, 1, 2, 3)


def _measure(rank, world):
    sys.path.insert(0, EXAMPLES)
    import autopar
    import llama
    from autopar.zero_def import MAX_INFLIGHT_REDUCES, PREFETCH_GROUPS

    out = {}
    for zero in STAGES:
        torch.manual_seed(0)
        model, inputs, loss_fn, target = llama.build(size="tiny", batch=8, n_layers=4)
        pm = autopar.parallelize(model, cluster="1x2xcpu", loss_fn=loss_fn,
                                 fixed={"dp": 2, "tp": 1, "pp": 1, "zero": zero, "microbatches": 2})
        pm.train_step(inputs, target)
        pm.train_step(inputs, target)
        live = pm.params.live
        held = pm.memory_bytes()
        predicted = pm.plan.stages[0]["predicted"]["memory_bytes"]
        gathered = 0
        if zero == 3:
            gathered = _window(pm.plan, "all_gather", PREFETCH_GROUPS + 1)
        out[zero] = {
            "measured": live.peak_of["state"] + held.optimizer,
            "predicted": predicted["params"] + predicted["grads"] + predicted["optimizer"] + gathered,
            "by_kind": dict(live.peak_by_kind), "full_params": sum(e.numel * 4 for e in pm.params.entries.values()),
            "zero_buffers": predicted["zero_buffers"], "gathered_window": gathered,
            "sends_window": _window(pm.plan, "reduce_scatter", MAX_INFLIGHT_REDUCES) if zero >= 2 else 0,
            "matmuls_after_reduce": _matmuls_after_each_reduce(pm.step_program),
        }
    return out


def _matmuls_after_each_reduce(program) -> list[int]:
    """For each REDUCE_GRAD call in the rank's step program, in program order, how many matmuls
    run after it."""
    nodes = list(program.graph.nodes)
    mm = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    calls = [i for i, n in enumerate(nodes) if getattr(n.target, "__name__", "") == "grads_ready"]
    return [sum(j > i for j in mm) for i in calls]


def _window(plan, kind: str, window: int) -> float:
    """The largest sum of ``window`` consecutive dp buckets of collective ``kind`` in the plan."""
    sizes = [b["bytes"] for b in plan.communication[kind]["dp"]["buckets"]]
    return max(sum(sizes[i:i + window]) for i in range(len(sizes)))


@pytest.fixture(scope="module")
def measured():
    return spawn_world(_measure, 2)


@pytest.mark.parametrize("zero", STAGES)
def test_state_peak_within_ten_percent_of_plan(measured, zero):
    for rank, r in enumerate(measured):
        m = r[zero]
        assert abs(m["measured"] - m["predicted"]) <= 0.10 * m["predicted"], (rank, zero, m)


@pytest.mark.parametrize("zero", STAGES)
def test_gradients_are_reduced_while_the_backward_runs(measured, zero):
    """Each layer group's REDUCE_GRAD sits right after the group's last gradient in the real step
    program (``reshape`` views and all, as the per-rank program has them), so the dp reductions
    overlap the rest of the backward and no group's gradients outlive their bucket: of the
    program's seven REDUCE_GRADs (the head, the final norm, blocks 3 to 0, the embedding: 57, 56,
    42, 28, 14, 0, 0 matmuls after them), only the first block's and the embedding's, the last
    two, have none left. (From 2026-12-03 to 2026-12-07 every one of them ran after the last
    matmul: 0 for all seven.)"""
    for r in measured:
        after = r[zero]["matmuls_after_reduce"]
        assert len(after) >= 6, after
        assert all(a > 0 for a in after[:-2]), after


def test_zero3_never_holds_the_whole_model(measured):
    """The gathered weights at their peak are a few layer groups, not every parameter."""
    for r in measured:
        m = r[3]
        assert m["by_kind"]["gathered"] < 0.75 * m["full_params"], m


def test_zero2_holds_no_full_gradient(measured):
    """Stage 2's gradients are the 1/dp slice; stage 1 keeps the full buffer it reduces from."""
    for r in measured:
        assert r[2]["by_kind"]["grads"] * 2 == r[1]["by_kind"]["grads"], (r[1]["by_kind"], r[2]["by_kind"])


@pytest.mark.parametrize("zero", STAGES)
def test_plan_counts_what_the_collectives_hold(measured, zero):
    """The plan's ``zero_buffers`` (autopar.zero_def.buffer_bytes_per_param, over the fullest window
    of layer groups) is, at stage 3, the gathered weights of the group in use and the prefetched one,
    which covers what the runtime gathered at its peak, plus, at stages 2-3, the send buffers of the
    gradient buckets in flight (the largest MAX_INFLIGHT_REDUCES consecutive buckets of the plan's
    reduce-scatters, full size in the wire dtype). At stages 0-1 in fp32 the buckets reduce in
    place and nothing is gathered: nothing is priced."""
    for r in measured:
        m = r[zero]
        if zero < 2:
            assert m["zero_buffers"] == 0
            assert m["by_kind"].get("gathered", 0) == 0
            continue
        gathered = m["zero_buffers"] - m["sends_window"]
        assert m["sends_window"] > 0
        if zero == 2:
            assert gathered == pytest.approx(0, abs=1e-6)
        else:
            assert gathered == pytest.approx(m["gathered_window"], rel=0.05)
            assert m["by_kind"]["gathered"] <= 1.1 * gathered, (m["by_kind"], gathered)

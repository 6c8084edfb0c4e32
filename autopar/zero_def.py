"""What each ZeRO stage shards, which collectives it issues and when: the one definition.

The cost model (``cost/memory.py``), the planner (``planner/search.py``,
``planner/make.py``) and the runtime (``runtime/zero.py``) all read this table, so a
plan prices exactly the collectives and buffers the runtime creates.

Per rank, for the parameters of its (tp/pp) shard, over ``dp`` data-parallel ranks:

    stage  params  grads held           optimizer  gradient collective      parameter all-gather
    0      full    full, across micro   full       all-reduce, once a step  none
    1      full    full, across micro   1/dp       reduce-scatter, a step   after the optimizer step
    2      full    1/dp slice           1/dp       reduce-scatter, per mb   after the optimizer step
    3      1/dp    1/dp slice           1/dp       reduce-scatter, per mb   per layer group, before
                                                                            forward and again before
                                                                            backward, every micro-batch

Rajbhandari et al. 2020 ("ZeRO", sec. 5) define stages 1-3 by what is partitioned.
The collectives follow from that: a rank that keeps only its gradient slice (2, 3)
must reduce at every micro-batch, since a full-size buffer to accumulate into is
exactly what stage 2 removes; stage 1 keeps that buffer and reduces once, at the
last micro-batch. Stage 3 frees a gathered layer group after its use (reshard after
forward, as FSDP's default), so it gathers twice per micro-batch.

Gradient collectives are bucketed one bucket per layer group (the planner's layer
groups, ``passes/layers.py``) and dtype, issued as soon as that group's gradients are
final, so they overlap the rest of the backward. Stage 3 gathers one layer group
ahead of its use (prefetch depth 1): at most two gathered groups are alive at once.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_INFLIGHT_REDUCES", "PREFETCH_GROUPS", "ZeroStage", "buffer_bytes_per_param", "stage", "state_shards",
           "step_collective_counts"]

PREFETCH_GROUPS = 1
"""Stage 3 gathers this many layer groups ahead of the one in use."""

MAX_INFLIGHT_REDUCES = 2
"""Gradient buckets in flight at once; one more waits for the oldest first."""


@dataclass(frozen=True)
class ZeroStage:
    stage: int
    params_sharded: bool
    grads_sharded: bool
    optimizer_sharded: bool
    grad_collective: str
    """``"all_reduce"`` or ``"reduce_scatter"`` over dp."""
    grad_reduce_every_microbatch: bool
    """True: each micro-batch's gradients are reduced; False: once a step, after accumulation."""
    param_gather: str
    """``"none"``, ``"after_step"`` (sharded update gathered back) or ``"per_use"`` (stage 3)."""

    @property
    def full_grad_buffer(self) -> bool:
        """A full-size gradient accumulates across micro-batches on this rank."""
        return not self.grads_sharded


_STAGES = {
    0: ZeroStage(0, False, False, False, "all_reduce", False, "none"),
    1: ZeroStage(1, False, False, True, "reduce_scatter", False, "after_step"),
    2: ZeroStage(2, False, True, True, "reduce_scatter", True, "after_step"),
    3: ZeroStage(3, True, True, True, "reduce_scatter", True, "per_use"),
}


def stage(zero: int) -> ZeroStage:
    """The definition of ZeRO stage ``zero`` (0..3)."""
    if isinstance(zero, bool) or zero not in _STAGES:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    return _STAGES[zero]


def state_shards(zero: int, dp: int) -> tuple[int, int, int]:
    """Divisors of ``(params, grads, optimizer)`` bytes per rank under stage ``zero``."""
    s = stage(zero)
    return (dp if s.params_sharded else 1, dp if s.grads_sharded else 1, dp if s.optimizer_sharded else 1)


def buffer_bytes_per_param(zero: int, *, compute_bytes: float, grad_bytes: float,
                           wire_bytes: float) -> tuple[float, float]:
    """What stage ``zero``'s collectives hold beside the training state, as the runtime runs them
    (``runtime/zero_gather.py``, ``runtime/zero_reduce.py``), in bytes per parameter of two windows
    of consecutive layer groups: ``(gathered, sends)``.

    ``gathered``: at stage 3, the gathered copies (``compute_bytes`` per element) of the group in
    use and the :data:`PREFETCH_GROUPS` after it (a window of ``1 + PREFETCH_GROUPS`` groups).
    ``sends``: the send buffers of the :data:`MAX_INFLIGHT_REDUCES` gradient buckets in flight (a
    window of that many groups), in the reduction's dtype (``wire_bytes``): at stages 2-3 each is
    a new full-size copy of a group's gradients (only the 1/dp slice is held); at stages 0-1 only
    a reduction in another dtype than the full buffer's (``grad_bytes``) copies it."""
    s = stage(zero)
    gathered = compute_bytes if s.params_sharded else 0.0
    sends = wire_bytes if s.grads_sharded or wire_bytes != grad_bytes else 0.0
    return gathered, sends


def step_collective_counts(zero: int, *, n_micro: int) -> dict[str, int]:
    """How often each dp collective runs per layer-group bucket in one step.

    ``{"all_reduce": k}`` or ``{"reduce_scatter": k, "all_gather": j}``; each moves
    the bucket's full (unsharded) bytes through the ring.
    """
    if isinstance(n_micro, bool) or not isinstance(n_micro, int) or n_micro < 1:
        raise ValueError(f"n_micro must be an integer >= 1, got {n_micro!r}")
    s = stage(zero)
    reduces = n_micro if s.grad_reduce_every_microbatch else 1
    out = {s.grad_collective: reduces}
    if s.param_gather == "after_step":
        out["all_gather"] = 1
    elif s.param_gather == "per_use":
        out["all_gather"] = 2 * n_micro
    return out

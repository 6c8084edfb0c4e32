"""A stage's training-state memory as the search counts it: bytes per parameter by ZeRO stage
(expert parameters sharded over their dp/ep replicas) and ZeRO's collective buffers.

Kept apart from :mod:`autopar.planner.search` (the outer search) so that module stays one
screenful of search; the partition's memory rule (:mod:`autopar.planner.partition`) and the
estimate of a candidate (``search._estimate``) use these."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from autopar import zero_def
from autopar.cost.memory import PRECISIONS, StateBytes, training_state_bytes
from autopar.planner.bounds import _grad_elem_bytes
from autopar.planner.partition import window_sums

if TYPE_CHECKING:
    from autopar.planner.search import Config, Unit

__all__ = ["state_per_param", "zero_buffers", "zero_buffer_bytes"]


def state_per_param(zero: int, dp: int, ep: int, precision: str) -> tuple[float, float]:
    """Training-state bytes per parameter at ZeRO stage ``zero`` over ``dp`` ranks, and what an
    expert parameter under ``ep`` holds beyond that: ZeRO shards its (1/ep part's) state over its
    ``dp / ep`` replicas, as :class:`autopar.runtime.zero.ShardedParams` does, not over dp."""
    base = training_state_bytes(n_params=1, zero_stage=zero, dp=dp, precision=precision).total
    if ep == 1 or zero == 0:
        return base, 0.0
    return base, training_state_bytes(n_params=1, zero_stage=zero, dp=dp // ep, precision=precision).total - base


def _state(n_params: float, expert_params: float, cfg: Config, precision: str) -> StateBytes:
    """:func:`training_state_bytes` of a stage holding ``n_params``, ``expert_params`` of them
    expert parameters (sharded over the dp/ep replicas; :func:`state_per_param`)."""
    rest = training_state_bytes(n_params=n_params - expert_params, zero_stage=cfg.zero, dp=cfg.dp, precision=precision)
    if not expert_params:
        return rest
    experts = training_state_bytes(n_params=expert_params, zero_stage=cfg.zero, dp=cfg.dp // cfg.ep_dp,
                                   precision=precision)
    return replace(rest, **{f: getattr(rest, f) + getattr(experts, f) for f in ("params", "grads", "optimizer")})


def zero_buffers(zero: int, precision: str) -> tuple[float, float]:
    """Bytes per parameter that ZeRO stage ``zero``'s collectives hold beside the training state under
    ``precision``, of the fullest window of gathered groups and of gradient buckets in flight:
    :func:`autopar.zero_def.buffer_bytes_per_param` with the compute copy's and the gradient's bytes
    of :data:`autopar.cost.memory.PRECISIONS` and the reduction's
    (:func:`autopar.planner.bounds._grad_elem_bytes`)."""
    compute, grad, _ = PRECISIONS[precision]
    return zero_def.buffer_bytes_per_param(zero, compute_bytes=compute, grad_bytes=grad,
                                           wire_bytes=_grad_elem_bytes(precision))


def zero_buffer_bytes(chunk: list[Unit], buffers: tuple[float, float]) -> float:
    """ZeRO's buffers (:func:`zero_buffers`) on a stage of layer groups ``chunk``: the fullest window
    of ``1 + PREFETCH_GROUPS`` groups gathered, and of ``MAX_INFLIGHT_REDUCES`` buckets in flight."""
    gathered, sends = buffers
    sizes = [u.n_params for u in chunk]
    total = 0.0
    for per_param, w in ((gathered, 1 + zero_def.PREFETCH_GROUPS), (sends, zero_def.MAX_INFLIGHT_REDUCES)):
        if per_param and sizes:
            total += per_param * max(window_sums(sizes, w))
    return total

"""Why a search found no plan: the memory the smallest configuration needs, and the one-line error.

:func:`autopar.planner.search.search` collects the configurations no cut fits; :func:`_min_memory`
sizes each (an even split, or the pinned layout's stages), :func:`_largest_op` names the op no cut
can shrink, and :func:`_infeasible` says which decision to change.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autopar.cluster import Cluster
from autopar.errors import InfeasibleError, PlanError
from autopar.planner.bounds import stage_activation_bytes
from autopar.planner.pipeline_states import zero_bubble_moments
from autopar.planner.fixed import Fixed
from autopar.planner.state_memory import zero_buffer_bytes

if TYPE_CHECKING:
    from autopar.planner.search import Config, Unit

__all__ = ["MEMORY_RESERVE"]

MEMORY_RESERVE = 0.10
"""Fraction of HBM kept free for the CUDA context, NCCL buffers and allocator
fragmentation (PyTorch's caching allocator typically leaves 5-10% unusable;
Megatron and torchtitan memory estimates leave similar headroom)."""


def _min_memory(units: list[Unit], cfg: Config, per_param: tuple[float, float], inflight: tuple[int, ...],
                buffers: tuple[float, float] = (0.0, 0.0), starts: tuple[int, ...] | None = None) -> float:
    """Peak stage memory of an even split (of the pinned layout's stages where ``starts`` gives
    them; for the 'smallest device that would fit' message), counted as :meth:`_Layers.fits`
    counts it: state, activations in flight with the largest op's working set
    (:func:`~autopar.planner.bounds.stage_activation_bytes`: a stage cannot hold less than its
    biggest unit's, however the cuts fall) and ZeRO's buffers for the largest group."""
    n, pp = len(units), cfg.pp
    size = math.ceil(n / pp) if pp <= n else 1
    points = [0, *starts, n] if starts is not None else None
    worst = 0.0
    for s in range(len(points) - 1 if points else min(pp, n)):
        chunk = units[points[s]:points[s + 1]] if points else units[s * size:(s + 1) * size]
        if not chunk:
            break
        state = per_param[0] * sum(u.n_params for u in chunk) + per_param[1] * sum(u.expert_params for u in chunk)
        moments = zero_bubble_moments(cfg.schedule, cfg.pp, cfg.microbatches)
        worst = max(worst, state + stage_activation_bytes(chunk, cfg.recompute, inflight[s], moments and moments[s])
                    + zero_buffer_bytes(chunk, buffers))
    return worst


def _largest_op(units: list[Unit]) -> tuple[str, float]:
    """The unit with the largest single-op working set, and that working set."""
    u = max(units, key=lambda u: u.transient_bytes)
    return u.path, u.transient_bytes


def _infeasible(least, cluster: Cluster, fixed: Fixed, skipped_batch: int, batch: int, world: int) -> Exception:
    need, cfg, largest = least
    if cfg is None:
        if skipped_batch:
            return PlanError(
                f"the global batch {batch} cannot be split evenly over any data-parallel degree the "
                f"{world}-device cluster allows{' with ' + str(fixed.to_dict()) if fixed.to_dict() else ''}; "
                f"use a batch divisible by the data-parallel degree, or pin dp/pp/tp with fixed=")
        return PlanError(f"no mesh of {world} devices fits the pinned decisions {fixed.to_dict()}; "
                         f"tp must divide the {cluster.devices_per_node} devices per node and pp must not "
                         f"exceed the number of layers")
    have = cluster.device.hbm_bytes * (1 - MEMORY_RESERVE)
    path, op_bytes = largest
    biggest = (f"; the largest single op (in {path}) alone needs {op_bytes / 1e9:.1f} GB, which neither cuts "
               f"nor more devices of this kind change: shorten the sequence, shrink the micro-batch, shard that op "
               f"(tp) or split the sequence (cp)" if op_bytes > 0.5 * have else "")
    return InfeasibleError(
        f"the model fits no configuration on {cluster.spec}: the smallest need is {need / 1e9:.1f} GB per "
        f"device (tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} zero={cfg.zero} recompute={cfg.recompute} "
        f"microbatch_size={cfg.microbatch_size} {cfg.schedule}) but a {cluster.device.name} offers "
        f"{have / 1e9:.1f} GB after a {MEMORY_RESERVE:.0%} reserve; use more devices, a device with more "
        f"memory, or a smaller batch or sequence{biggest}"
        f"{'; or move the pinned cuts (or leave them to the partitioner)' if fixed.cuts else ''}")

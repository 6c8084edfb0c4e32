"""Why a search found no plan: the memory the smallest configuration needs, and the one-line error.

:func:`autopar.planner.search.search` collects the configurations no cut fits; :func:`_min_memory`
sizes each (an even split, or the pinned layout's stages), :func:`_largest_op` names the op no cut
can shrink, and :func:`_infeasible` says which decision to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.cluster import Cluster
from autopar.errors import InfeasibleError, PlanError
from autopar.planner.bounds import (held_message_shares, message_bytes, rank_activation_shares,
                                    stage_activation_bytes, stage_cut_bytes)
from autopar.planner.pipeline_states import held_messages, rank_states, zero_bubble_moments
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
    """Peak device memory of an even split into the configuration's stages (the pinned layout's
    where ``starts`` gives them; for the 'smallest device that would fit' message), counted as
    the partitioner counts it: each stage's state and ZeRO buffers for its largest group, and
    activations in flight with the largest op's working set
    (:func:`~autopar.planner.bounds.stage_activation_bytes`: a stage cannot hold less than its
    biggest unit's, however the cuts fall). An interleaved rank holds ``virtual_stages`` stages
    at once: its need is theirs together, activations at the rank's fullest state
    (:func:`~autopar.planner.bounds.rank_activation_shares`, as the plan counts them). (Until
    2026-12-06 an interleaved configuration was sized as pp stages of v stages' units each, at
    one stage's micro-batches in flight, or, pinned, as each stage alone on a device.)"""
    n, stages = len(units), min(cfg.n_stages, len(units))  # (the search tries no more stages than units)
    points = [0, *starts, n] if starts is not None else [s * n // stages for s in range(stages + 1)]
    chunks = [units[i:j] for i, j in zip(points, points[1:])]

    def held(chunk: list[Unit]) -> float:  # state and ZeRO buffers
        return (per_param[0] * sum(u.n_params for u in chunk) + per_param[1] * sum(u.expert_params for u in chunk)
                + zero_buffer_bytes(chunk, buffers))

    msgs = [message_bytes(u) for u in units]
    cut_bytes = [stage_cut_bytes(msgs, i, j) for i, j in zip(points, points[1:])]
    received = held_messages(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
    if cfg.virtual_stages > 1:
        worst = 0.0
        for r, states in enumerate(rank_states(cfg.pp, cfg.microbatches, cfg.virtual_stages)):
            mine = chunks[r::cfg.pp]
            worst = max(worst, sum(map(held, mine)) + sum(rank_activation_shares(mine, cfg.recompute, states))
                        + sum(held_message_shares(cut_bytes[r::cfg.pp], received[r])))
        return worst
    moments = zero_bubble_moments(cfg.schedule, cfg.pp, cfg.microbatches)
    return max(held(chunk) + stage_activation_bytes(chunk, cfg.recompute, inflight[s], moments and moments[s])
               + (sum(held_message_shares([cut_bytes[s]], received[s])) if s < len(received) else 0.0)
               for s, chunk in enumerate(chunks))


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

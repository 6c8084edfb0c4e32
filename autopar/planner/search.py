"""The outer search: mesh shape, pipeline cuts, micro-batching, ZeRO, recompute, schedule.

For every tensor-parallel degree ``tp`` (a divisor of the devices per node, so
tp never leaves a node) the sharding ILP (:mod:`autopar.planner.ilp`) is
solved once; its per-layer costs are then re-evaluated at every micro-batch
size. For every ``pp x dp`` that fills the rest of the world, every micro-batch
size that divides the data-parallel share of the global batch, every ZeRO stage
and recompute policy and every schedule:

1. Layers (repeated blocks expanded) are cut into ``pp`` contiguous stages that
   minimise the slowest stage's F+B+W time subject to each stage fitting the
   device: binary search on the time bound with a greedy packing, which is
   exact for contiguous min-max partitions with additive, monotone constraints.
2. Stage memory = training state (:func:`autopar.cost.memory.training_state_bytes`
   by ZeRO stage over dp) + activations x micro-batches in flight on that stage
   (read off the schedule's action lists) must stay under
   ``hbm_bytes * (1 - MEMORY_RESERVE)``.
3. The step time comes from the step program (:mod:`autopar.cost.step`): the
   schedule's F, B, W per stage and micro-batch, split per layer group where a
   collective hangs off it, each cut's p2p transfer over its own link
   (:meth:`autopar.cluster.Cluster.pipeline_links`), the dp collectives of the ZeRO
   stage (:mod:`autopar.zero_def`: one gradient bucket per layer group, issued when its
   gradients are final; ZeRO-3 gathers one group ahead), tied-parameter all-reduces and
   the optimizer step, timed with a compute stream and collective streams per rank
   (:func:`autopar.cost.simulate.simulate_step`), so communication hidden behind compute
   costs only the overlap slowdown. A cheap estimate (the pipeline formula plus a bound
   on the exposed dp time, :func:`autopar.cost.step.estimate_exposed_s`) ranks all
   configurations and the best ``SIMULATE_TOP`` are simulated; the reported times are all simulated.

Ties (equal simulated time) go to the simpler plan: lower ZeRO stage, no
recompute, larger dp; then to the one that needs less memory.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import logging
import math
import time
from dataclasses import dataclass, field, replace

from autopar.cluster import Cluster
from autopar.cost.simulate import SimResult, StepResult
from autopar.cost.step import GroupCost, StageCost, StepSpec, estimate_exposed_s, group_dp_s
from autopar.planner.fixed import (FIXED_KEYS, RECOMPUTE, RECOMPUTE_POLICIES, SCHEDULES, Fixed,  # noqa: F401
                                   mesh_shapes)  # (FIXED_KEYS re-exported)
from autopar.planner.infeasible import MEMORY_RESERVE, _infeasible, _largest_op, _min_memory
from autopar.planner.partition import _partition
from autopar.planner.pipeline_states import _inflight, held_messages, rank_states, zero_bubble_moments
from autopar.planner.state_memory import _state, state_per_param, zero_buffer_bytes, zero_buffers  # noqa: F401
from autopar.planner.bounds import (ADAM_BYTES_PER_PARAM, FUSED_BACKWARD, _config_bound_s,  # noqa: F401
                                    _cuts_bound_s, _dp_comm_prefix, _grad_elem_bytes, _optimizer_s,
                                    _pipeline_bound_s, _prefix_sums, _schedule, _unit_times, _work_s, lower_bound_s,
                                    _busiest_load_s, _chain_s, _unit_loads, held_message_shares, message_bytes,
                                    rank_activation_shares, replica_group, stage_activation_bytes, stage_cut_bytes)
from autopar import zero_def
from autopar.planner.timing import (_simulate, cut_times, grad_sync_s, pipeline_bound_s,  # noqa: F401 (re-exported)
                                    simulate_stages, step_spec)

log = logging.getLogger(__name__)

__all__ = ["Fixed", "Config", "Unit", "StagePlan", "Candidate", "search", "simulate_stages", "step_spec", "cut_times",
           "lower_bound_s", "pipeline_bound_s", "grad_sync_s",
           "MEMORY_RESERVE"]

SIMULATE_TOP = 24
"""How many configurations, best estimate first, get a full schedule simulation."""


VIRTUAL_STAGES = (2, 3, 4)
"""Model chunks per rank tried under the interleaved schedule (Megatron-LM uses 2 to 4 in
Narayanan et al. 2021, sec. 2.2; more chunks shrink the bubble but add p2p messages)."""
KEEP = 6
"""Configurations the search ranks exactly (the plan and its runners-up): the bound prunes
only what cannot enter this list."""


def _schedules(fixed: Fixed, pp: int) -> tuple[str, ...]:
    if fixed.schedule:
        return (fixed.schedule,)
    return SCHEDULES if pp > 1 else ("1f1b",)


def _virtual_options(kind: str, fixed: Fixed, pp: int, m: int, n_units: int) -> tuple[int, ...]:
    """Chunks per rank to try: 1 except under the interleaved schedule, which needs pp > 1 and
    micro-batches in groups of pp (Megatron's interleaving) and at least one layer per stage."""
    if kind != "interleaved":
        return (1,)
    if pp == 1 or m % pp:
        return ()
    options = [fixed.virtual_stages] if fixed.virtual_stages else VIRTUAL_STAGES
    return tuple(v for v in options if v >= 2 and pp * v <= n_units)


@dataclass(frozen=True, kw_only=True)
class Config:
    tp: int
    pp: int
    dp: int
    microbatch_size: int
    microbatches: int
    zero: int
    recompute: str
    schedule: str
    virtual_stages: int = 1
    """Stages per pipeline rank (> 1 only for the interleaved schedule)."""
    sp: bool = False
    """Sequence parallelism in the sharding MIP's solution this configuration uses."""
    ep: int = 1
    """Expert parallelism folded over the dp ranks (``autopar.planner.experts``; 1: none), and
    over the tp ranks too where ``ep_tp`` > 1."""
    ep_tp: int = 1
    """How many of an ep group's ranks are tp ranks: tp where ep is folded over tp as well
    (``fixed.etp = 1``: :mod:`autopar.planner.expert_folding`), else 1."""
    cp: int = 1
    """Context parallelism folded over the dp ranks: dp / cp groups split the batch, each
    sequence is split over the cp ranks of a group (1: none)."""

    @property
    def batch_groups(self) -> int:
        """Data-parallel groups the global batch is split over (dp / cp)."""
        return self.dp // self.cp

    @property
    def ep_dp(self) -> int:
        """The data-parallel ranks of an ep group: the dp ranks apart from which the same experts
        have replicas (``dp / ep_dp`` of them)."""
        return self.ep // self.ep_tp

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One layer instance, as the partitioner sees it, at one (tp, micro-batch size)."""

    path: str
    f_s: float
    b_s: float
    w_s: float
    comm_s: float
    cheap_f_s: float
    act_bytes: float
    cheap_act_bytes: float
    boundary_bytes: float
    sac_f_s: float = 0.0
    """Forward time of every second matmul (op-level SAC recomputes them: ``recompute="sac"``)."""
    sac_act_bytes: float = 0.0
    """What op-level SAC keeps less than selective recompute (``evaluation.LayerCost.sac_activation_bytes``)."""
    n_params: float
    """Parameters held per device under tensor parallelism (before ZeRO)."""
    expert_params: float = 0.0
    """Of ``n_params``, the expert parameters held under expert parallelism (their ``1/ep``
    part): ZeRO shards their state over the ``dp / ep`` replicas of that part, not over dp."""
    transient_bytes: float = 0.0
    """Largest single-op working set beyond saved activations (``evaluation.LayerCost.transient_bytes``)."""
    moe_f_s: float = 0.0
    """Forward time of the MoE layers' ops with FLOPs and, under ep, their token exchange (what
    ``recompute="moe"`` makes again beyond selective: ``evaluation.LayerCost.moe_forward_s``)."""
    moe_act_bytes: float = 0.0
    """What "moe" keeps less than selective recompute (``evaluation.LayerCost.moe_activation_bytes``)."""
    remade_extra_bytes: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """(selective, sac, moe, full): what the copies made again in the unit's backward add to
    ``transient_bytes`` at their peak (``evaluation.LayerCost.remade_extra_bytes``)."""
    full_kept_bytes: float = 0.0
    """What full recompute keeps of the unit (``evaluation.LayerCost.full_kept_bytes``; in a program
    that re-runs layers whole, ``boundary_bytes``)."""
    whole_layer_remade: bool = False
    """Recompute makes what the unit dropped again all at once as its backward begins (``torch.utils.
    checkpoint``, Megatron-LM), not each copy before its first reader as autopar's runtime does:
    ``make_plan(whole_layer_recompute=True)``."""
    w_held_bytes: float | None = None
    """What a micro-batch holds for this unit between its B and its W, the two apart under a
    zero-bubble schedule (``evaluation.LayerCost.weight_gradient_input_bytes``); None: as much as
    it keeps from its forward without recompute (``act_bytes``)."""
    expert_transient: tuple[float, tuple[tuple[float, float], ...]] = (0.0, ())
    """``evaluation.LayerCost.expert_transient``: what expert parallelism makes of ``transient_bytes``."""
    send_forward: tuple[tuple[str, float, float, float], ...] | None = None
    """The messages (one per dtype) one rank sends across a cut right after this unit, per
    micro-batch, as :class:`autopar.planner.cuts.Messages` gives them: (dtype, bytes, bytes
    with replicated values as tp pieces, bytes the tp group gathers); None: one of
    ``boundary_bytes``."""
    send_backward: tuple[tuple[str, float, float, float], ...] | None = None
    """The same for the gradient messages sent back across that cut; None: one of ``boundary_bytes``."""
    shared_params: tuple[tuple[str, str, float], ...] = ()
    """Parameters this unit reads that another unit owns (a tied embedding read by the output
    head): (name, owning unit, parameters per device). A stage without the owner holds a copy."""


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    layers: tuple[str, ...]
    f_s: float
    b_s: float
    w_s: float
    comm_s: float
    inflight: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    grad_sync_s: float
    optimizer_s: float
    send_messages: tuple[tuple[str, float, float, float], ...] = ()
    """What one rank sends to the next stage per micro-batch (nothing on the last stage): the
    messages, one per dtype, as ``Unit.send_forward`` gives them (whole bytes, bytes
    as tp pieces, gathered bytes: :func:`autopar.planner.timing.cut_sends` picks one way)."""
    back_messages: tuple[tuple[str, float, float, float], ...] = ()
    """The gradient messages the next stage sends back across the cut, per micro-batch."""
    groups: tuple[GroupCost, ...] = ()
    """Per layer group (unit) of the stage: times per micro-batch and gradient-bucket bytes."""
    copies: tuple[tuple[str, str, str, float], ...] = ()
    """Parameters this stage holds a copy of (owned by a unit of another stage):
    (name, reading unit here, owning unit, gradient bytes)."""
    zero_buffers_bytes: float = 0.0
    """What ZeRO's collectives hold beside the state, over the stage's fullest windows of consecutive
    layer groups: stage 3's gathered copies, the gradient buckets' send buffers in flight
    (:func:`zero_buffer_bytes`)."""

    @property
    def memory_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.zero_buffers_bytes)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    config: Config
    step_time_s: float
    estimate_s: float
    bubble_fraction: float
    stages: tuple[StagePlan, ...]
    p2p_s: float = 0.0
    """Time of the slowest transfer (a micro-batch's activations or gradients) across a cut, as simulated."""
    p2p_cut_s: tuple[float, ...] = ()
    """Per cut (stage c -> c + 1), the time of a micro-batch's activation messages over that cut's link."""
    p2p_back_cut_s: tuple[float, ...] = ()
    """Per cut, the time of a micro-batch's gradient messages back (stage c + 1 -> c)."""
    spec: StepSpec | None = field(default=None, compare=False)
    """What the step program was lowered from (after simulation)."""
    step: StepResult | None = field(default=None, compare=False)
    """The simulated step: per-rank hidden and exposed communication, the timeline."""

    @property
    def peak_memory_bytes(self) -> float:
        """The fullest rank: the sum of its stages (one, or several when interleaved)."""
        per_rank = [0.0] * self.config.pp
        for s, st in enumerate(self.stages):
            per_rank[s % self.config.pp] += st.memory_bytes
        return max(per_rank)


def search(*, units_for, n_units: int, global_batch: int, cluster: Cluster, fixed: Fixed,
           precision: str, tp_options: list[int], sp_options: dict[int, tuple[bool, ...]] | None = None,
           keep: int = KEEP, ep_options: tuple[int, ...] = (),
           cp_options: tuple[int, ...] = (1,), variants: frozenset[tuple[int, bool, bool]] | None = None,
           moe_layers: bool = False) -> tuple[list[Candidate], dict]:
    """The ``keep`` best configurations by simulated step time, best first (the first is the
    plan), and search statistics (counts, and seconds by part under keys ending in ``_s``).

    ``units_for(tp, microbatch_size, sp) -> list[Unit]`` gives per-layer costs under the
    sharding MIP's solution at ``tp`` with sequence parallelism ``sp`` (one of
    ``sp_options[tp]``, default ``(False,)``); with expert parallelism ``ep`` > 1 it is called
    ``units_for(tp, microbatch_size, sp, ep)``. ``ep_options``: the ep degrees > 1 the model's
    experts allow (none: no experts); each is tried where it divides dp, with every ZeRO stage
    (expert state sharded over the dp/ep replicas: ``state_memory.state_per_param``) and any
    pp. A pinned ``fixed.ep`` is the only one tried. ``variants``: the (tp, sp, folded) sharding
    MIPs solved (default: every (tp, sp) unfolded); where a folded one exists (ep over tp as well:
    :mod:`autopar.planner.expert_folding`), ep = tp x k (k dividing dp) is tried on it, calling
    ``units_for(tp, microbatch_size, sp, ep, cp, tp)``. A pinned
    ``fixed.cp`` (context parallelism, folded over dp like ep, and with it), or else each of
    ``cp_options`` that divides dp, calls ``units_for(tp, microbatch_size, sp, ep, cp)`` for
    cp > 1 and splits the batch over dp / cp groups. ``moe_layers``: the model has MoE layers, so
    recompute "moe" is weighed too (elsewhere it is "selective"). Branch and bound: mesh shapes (tp, sp, pp,
    dp, micro-batch size) are visited in order of a compute-only lower bound on their step
    time: the busiest rank computes at least the average,
    ``microbatches * work / pp`` (:func:`_work_s`), and at least its whole layers' share
    (:func:`_busiest_load_s`), and no step is shorter than one micro-batch's F and B through every
    layer (:func:`_chain_s`); once ``keep`` configurations are simulated, a shape or a
    cut whose bound exceeds the ``keep``-th best time is skipped, and so is every shape
    after it. Every ZeRO stage, recompute policy and schedule of a visited shape is
    partitioned and, unless its own bound rules it out, simulated.
    Raises :class:`InfeasibleError` with the smallest memory any configuration needs.
    """
    start = time.perf_counter()
    clock = {"units_s": 0.0, "partition_s": 0.0, "pipeline_bound_s": 0.0, "simulate_s": 0.0}
    world = cluster.world_size
    cap = cluster.device.hbm_bytes * (1 - MEMORY_RESERVE)
    sp_options = sp_options or {}
    counts = {"configurations": 0, "feasible": 0, "simulated": 0, "shapes": 0, "shapes_pruned": 0,
              "cuts_pruned": 0}
    skipped_batch = 0
    recomputes = [fixed.recompute] if fixed.recompute else RECOMPUTE_POLICIES if moe_layers else RECOMPUTE

    def policies(pp: int):
        """The recompute policies weighed at ``pp``: sac only without a pipeline (pinned, it is
        planned and run under one too). Its memory under pipelines is counted right since the
        twenty-third session (the copies alive in a unit's backward,
        :func:`~autopar.planner.bounds.running_bytes`; ``python bench/recompute.py --pp 1f1b``: the
        stages' peaks -6.3% and +3.2% from their plans), but weighing it there made the search a
        third slower for the same plans (``bench/planner_speed.py --targets``: Llama 70B on
        64x8xH100 2.5 -> 3.6 s, GPT 1T 10.7 -> 13.9 s; 3.3 and 11.6 s with sac skipped wherever
        selective's cut without a memory cap fits, a rule tried and not kept). Sac pays where
        selective does not fit, and a pipeline is the search's other way to fit."""
        return recomputes if fixed.recompute or pp == 1 else [r for r in recomputes if r != "sac"]

    def zeros(dp: int):
        return [fixed.zero] if fixed.zero is not None else range(4) if dp > 1 else (0,)

    def units_at(tp: int, mbs: int, sp: bool, ep: int, cp: int = 1, ept: int = 1) -> list[Unit]:
        if ept > 1:
            return units_for(tp, mbs, sp, ep, cp, ept)
        if cp > 1:
            return units_for(tp, mbs, sp, ep, cp)
        return units_for(tp, mbs, sp) if ep == 1 else units_for(tp, mbs, sp, ep)

    def cps(dp: int) -> list[int]:
        """The cp degrees a shape is tried with: the pinned one or ``cp_options``, where they
        divide dp (ep, folded over dp too, exchanges each rank's own tokens, whichever
        sequence's chunks they are)."""
        tried = [fixed.cp] if fixed.cp else cp_options
        return [c for c in tried if dp % c == 0]

    def pinned_starts(units: list[Unit]) -> tuple[int, ...] | None:
        """The pinned cuts' stage starts (unit indices; the planner checked the names)."""
        if not fixed.cuts:
            return None
        index = {u.path: i for i, u in enumerate(units)}
        return tuple(index[name] for name in fixed.cuts)

    def solved(tp: int, sp: bool, ept: int) -> bool:
        return (tp, sp, ept > 1) in variants if variants is not None else ept == 1

    def eps(tp: int, pp: int, dp: int) -> list[tuple[int, int]]:
        """The (ep, tp ranks in an ep group) pairs a (tp, pp, dp) shape is tried with: ep folded
        over dp (ep divides dp; 1: no ep), and where a folded MIP was solved at tp, ep folded over
        tp and dp as well (ep = tp x k, k dividing dp)."""
        out = []
        for ept in dict.fromkeys((1, tp) if tp > 1 else (1,)):
            if not any(solved(tp, sp, ept) for sp in sp_options.get(tp, (False,))):
                continue
            tried = [fixed.ep] if fixed.ep else [1, *ep_options] if ept == 1 else list(ep_options)
            out += [(e, ept) for e in tried if e % ept == 0 and dp % (e // ept) == 0]
        return out

    dp_prefixes: dict[tuple, list[float]] = {}  # (tp, sp, mbs, zero, dp, m, ep, cp, ep_tp) -> _dp_comm_prefix

    def dp_prefix(tp: int, sp: bool, mbs: int, zero: int, dp: int, m: int, ep: int, cp: int, ept: int) -> list[float]:
        key = (tp, sp, mbs, zero, dp, m, ep, cp, ept)
        if key not in dp_prefixes:
            replicas, replica_link = replica_group(cluster, dp=dp, tp=tp, ep=ep // ept)
            dp_prefixes[key] = _dp_comm_prefix(units_at(tp, mbs, sp, ep, cp, ept), zero=zero, dp=dp,
                                               link=cluster.link_for_group(dp, stride=tp), microbatches=m,
                                               precision=precision, replicas=replicas, replica_link=replica_link)
        return dp_prefixes[key]

    shapes = []  # (bound, tp, sp, pp, dp, mbs, m, ep, cp, ep_tp)
    work: dict[tuple, dict[str, float]] = {}  # (tp, sp, mbs, ep, cp, ep_tp) -> recompute -> compute of one micro-batch
    chain: dict[tuple, dict[str, float]] = {}  # the same -> one micro-batch's F and B chain (:func:`_chain_s`)
    loads: dict[tuple, dict[str, list[float]]] = {}  # the same -> the layers' loads, largest first
    busiest_load = functools.cache(lambda key, recompute, pp: _busiest_load_s(loads[key][recompute], pp))
    params: dict[tuple, float] = {}  # (tp, sp, mbs, ep, cp, ep_tp) -> parameters per tp rank
    for tp in tp_options:
        for pp, dp, cp, mbs, m in mesh_shapes(world, tp, global_batch=global_batch, fixed=fixed, n_units=n_units,
                                              cps=cps):
            if not eps(tp, pp, dp):  # ep folds over the dp ranks
                continue
            if mbs is None:
                skipped_batch += 1
                continue
            for sp, ep, ept in ((sp, ep, ept) for sp in sp_options.get(tp, (False,))
                                for ep, ept in eps(tp, pp, dp) if solved(tp, sp, ept)):
                key = (tp, sp, mbs, ep, cp, ept)
                if key not in work:
                    t0 = time.perf_counter()
                    units = units_at(tp, mbs, sp, ep, cp, ept)
                    work[key] = {r: _work_s(units, r) for r in dict.fromkeys((*RECOMPUTE, *recomputes))}
                    chain[key] = {r: _chain_s(units, r) for r in work[key]}
                    loads[key] = {r: _unit_loads(units, r) for r in work[key]}
                    params[key] = sum(u.n_params for u in units)
                    clock["units_s"] += time.perf_counter() - t0
                link = cluster.link_for_group(dp, stride=tp)
                bound = min(_config_bound_s(work[key][r], params[key], zero=z, m=m,
                                            pp=pp, dp=dp, link=link, precision=precision, cluster=cluster,
                                            dp_comm_s=dp_prefix(tp, sp, mbs, z, dp, m, ep, cp, ept)[-1],
                                            virtual_stages=2 if pp > 1 else 1, chain_s=chain[key][r],
                                            load_s=busiest_load(key, r, pp))
                            for r in policies(pp) for z in zeros(dp))
                shapes.append((bound, tp, sp, pp, dp, mbs, m, ep, cp, ept))
    shapes.sort(key=lambda x: (float(f"{x[0]:.6g}"), x[1:]))
    counts["shapes"] = len(shapes)
    top: list[Candidate] = []
    pipelines: dict[tuple, SimResult] = {}  # one simulation serves every ZeRO stage with the same cuts
    infeasible = []  # (cfg, units, per_param, inflight): the 'smallest need' message, if nothing fits

    def beaten(bound_s: float) -> bool:
        """No configuration whose lower bound is this can enter the best ``keep``."""
        return len(top) >= keep and bound_s > top[-1].step_time_s * (1 + 1e-5)

    rank = _rank_key(lambda c: c.step_time_s)
    # Best first over one queue of lower bounds: a mesh shape, when popped, queues its
    # configurations (schedule, chunks, ZeRO, recompute) under their bounds before cutting; a
    # configuration, when popped, is partitioned and queued under the compute bound of its
    # cuts; popped, that adds the dp link's bound (which reads the schedule's action lists:
    # left for the few that get this far) and queues it as a candidate; a candidate, when
    # popped, gets the bare pipeline's bound, and then is simulated. The first entry whose
    # bound is beaten ends the search: every entry left has a bound at least as large. Each
    # entry's bound is at least its parent's, so nothing is lost.
    SHAPE, CONFIG, LINK, CANDIDATE, SIMULATE = 0, 1, 2, 3, 4
    bare: dict[tuple, tuple[float, ...]] = {}  # bare pipeline simulations -> per-rank end of compute
    queue = [(bound, SHAPE, k) for k, (bound, *_) in enumerate(shapes)]
    heapq.heapify(queue)
    pending: dict[int, object] = {}
    cut_memo: dict[tuple, list | None] = {}
    prefixes: dict[tuple, tuple] = {}  # (tp, sp, mbs, recompute) -> _prefix_sums
    while queue:
        bound, level, k = heapq.heappop(queue)
        if beaten(bound):
            left = [e[1] for e in queue] + [level]
            counts["shapes_pruned"] = left.count(SHAPE)
            counts["cuts_pruned"] = sum(left.count(x) for x in (CONFIG, LINK, CANDIDATE, SIMULATE))
            break
        if level == CANDIDATE and pending[k][2].pp > 1:
            # Sharpen the bound with the bare pipeline (no collectives, no pieces: far cheaper than the
            # step program, and shared by every ZeRO stage with these cuts) and queue it again.
            t0 = time.perf_counter()
            units, cuts, cfg, inflight = pending.pop(k)
            cand = _estimate(units, cuts, cfg, cluster, precision, inflight)
            spec = step_spec(cand, cluster)
            pending[k] = (cand, spec)
            heapq.heappush(queue, (max(bound, _pipeline_bound_s(cand, spec, bare)), SIMULATE, k))
            clock["pipeline_bound_s"] += time.perf_counter() - t0
        elif level in (CANDIDATE, SIMULATE):
            t0 = time.perf_counter()
            if level == CANDIDATE:
                units, cuts, cfg, inflight = pending.pop(k)
                cand, spec = _estimate(units, cuts, cfg, cluster, precision, inflight), None
            else:
                cand, spec = pending.pop(k)
            # (after the equal keys, as appending and a stable sort put it: a re-sort per candidate
            # read every key again, quadratic in an exhaustive search's thousands of candidates)
            bisect.insort(top, _simulate(cand, cluster, pipelines, spec=spec), key=rank)
            clock["simulate_s"] += time.perf_counter() - t0
            counts["simulated"] += 1
            del top[keep:]
        elif level == CONFIG:
            cfg, units, per_param = pending.pop(k)
            inflight = _inflight(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
            t0 = time.perf_counter()
            # a rank holds v stages: each gets 1/v of the memory (a conservative split)
            cuts = _partition(units, cfg, cap=cap / cfg.virtual_stages, state_per_param=per_param[0],
                              inflight=inflight, memo=cut_memo,
                              moments=zero_bubble_moments(cfg.schedule, cfg.pp, cfg.microbatches),
                              buffers=zero_buffers(cfg.zero, precision), expert_per_param=per_param[1],
                              starts=pinned_starts(units))
            clock["partition_s"] += time.perf_counter() - t0
            if cuts is None:
                if not top:
                    infeasible.append((cfg, units, per_param, inflight))
                continue
            counts["feasible"] += 1
            key = (cfg.tp, cfg.sp, cfg.microbatch_size, cfg.recompute, cfg.ep, cfg.cp, cfg.ep_tp)
            if key not in prefixes:
                prefixes[key] = _prefix_sums(units, cfg.recompute)
            pending[k] = (units, cuts, cfg, inflight)
            cut_bound = _cuts_bound_s(prefixes[key], cuts, cfg, cluster=cluster, precision=precision)
            heapq.heappush(queue, (max(bound, cut_bound), LINK, k))
        elif level == LINK:
            units, cuts, cfg, inflight = pending[k]
            link_bound = _cuts_bound_s(prefixes[cfg.tp, cfg.sp, cfg.microbatch_size, cfg.recompute, cfg.ep, cfg.cp,
                                                cfg.ep_tp],
                                       cuts, cfg, cluster=cluster, precision=precision,
                                       dp_prefix=dp_prefix(cfg.tp, cfg.sp, cfg.microbatch_size, cfg.zero, cfg.dp,
                                                           cfg.microbatches, cfg.ep, cfg.cp, cfg.ep_tp))
            heapq.heappush(queue, (max(bound, link_bound), CANDIDATE, k))
        else:
            _, tp, sp, pp, dp, mbs, m, ep, cp, ept = shapes[k]
            units = units_at(tp, mbs, sp, ep, cp, ept)
            dp_link = cluster.link_for_group(dp, stride=tp)
            for kind in _schedules(fixed, pp):
                for v in _virtual_options(kind, fixed, pp, m, n_units):
                    if fixed.cuts and pp * v != fixed.n_stages:
                        continue  # not the pinned layout's stage count
                    for zero in zeros(dp):
                        per_param = state_per_param(zero, dp, ep // ept, precision)
                        for recompute in policies(pp):
                            cfg = Config(tp=tp, pp=pp, dp=dp, microbatch_size=mbs, microbatches=m, zero=zero,
                                         recompute=recompute, schedule=kind, virtual_stages=v, sp=sp, ep=ep,
                                         ep_tp=ept, cp=cp)
                            counts["configurations"] += 1
                            key = len(shapes) + counts["configurations"]
                            pending[key] = (cfg, units, per_param)
                            heapq.heappush(queue, (max(bound, _config_bound_s(
                                work[tp, sp, mbs, ep, cp, ept][recompute], params[tp, sp, mbs, ep, cp, ept],
                                zero=zero, m=m,
                                pp=pp, dp=dp, link=dp_link, precision=precision, cluster=cluster,
                                dp_comm_s=dp_prefix(tp, sp, mbs, zero, dp, m, ep, cp, ept)[-1], virtual_stages=v,
                                chain_s=chain[tp, sp, mbs, ep, cp, ept][recompute],
                                load_s=busiest_load((tp, sp, mbs, ep, cp, ept), recompute, pp))),
                                CONFIG, key))
    if not top:
        least = min(((_min_memory(u, c, pp_, inf, zero_buffers(c.zero, precision), pinned_starts(u)), c,
                      _largest_op(u))
                     for c, u, pp_, inf in infeasible),
                    key=lambda x: x[0], default=(math.inf, None, None))
        raise _infeasible(least, cluster, fixed, skipped_batch, global_batch, world)
    stats = {**counts, **clock, "wall_s": time.perf_counter() - start}
    return top, stats


def _rank_key(time_of):
    def key(c: Candidate):
        cfg = c.config
        return (float(f"{time_of(c):.6g}"), cfg.zero, RECOMPUTE_POLICIES.index(cfg.recompute), -cfg.dp, cfg.pp,
                cfg.tp, cfg.ep, float(f"{c.peak_memory_bytes:.6g}"),  # equal times: the schedule holding less (1F1B, not GPipe)
                SCHEDULES.index(cfg.schedule) if cfg.schedule in SCHEDULES else 0, cfg.microbatch_size)
    return key


def _estimate(units: list[Unit], cuts, cfg: Config, cluster: Cluster, precision: str,
              inflight: tuple[int, ...]) -> Candidate:
    stages = []
    dp_link = cluster.link_for_group(cfg.dp, stride=cfg.tp)
    replicas, replica_link = replica_group(cluster, dp=cfg.dp, tp=cfg.tp, ep=cfg.ep_dp)
    grad_elem = _grad_elem_bytes(precision)
    owners = {u.path: s for s, (i, j) in enumerate(cuts) for u in units[i:j]}
    moments = zero_bubble_moments(cfg.schedule, cfg.pp, cfg.microbatches)
    for s, (i, j) in enumerate(cuts):
        chunk = units[i:j]
        f = b = w = c = 0.0
        groups = []
        copies = {}  # a parameter another stage owns, read here: held (and reduced) here too
        for u in chunk:
            uf, ub, uw, _ = _unit_times(u, cfg.recompute)
            f, b, w, c = f + uf, b + ub, w + uw, c + u.comm_s
            mine = {fqn: (u.path, owner, n) for fqn, owner, n in u.shared_params if owners.get(owner) != s}
            copies.update({fqn: v for fqn, v in mine.items() if fqn not in copies})
            held = u.n_params + sum(v[2] for v in copies.values() if v[0] == u.path)
            groups.append(GroupCost(name=u.path, f_s=uf, b_s=ub, w_s=uw, tp_comm_s=u.comm_s,
                                    bucket_bytes=held * grad_elem, expert_bytes=u.expert_params * grad_elem))
        n_params = sum(u.n_params for u in chunk) + sum(v[2] for v in copies.values())
        experts = sum(u.expert_params for u in chunk)
        state = _state(n_params, experts, cfg, precision)
        sync = sum(group_dp_s(g.bucket_bytes, zero=cfg.zero, dp=cfg.dp, link=dp_link, microbatches=cfg.microbatches,
                              expert_bytes=g.expert_bytes, replicas=replicas, replica_link=replica_link)
                   for g in groups)
        opt_s = _optimizer_s((n_params - experts) / zero_def.state_shards(cfg.zero, cfg.dp)[2]
                             + experts / zero_def.state_shards(cfg.zero, cfg.dp // cfg.ep_dp)[2], cluster)
        stages.append(StagePlan(
            layers=tuple(u.path for u in chunk), f_s=f, b_s=b, w_s=w, comm_s=c, inflight=inflight[s],
            params_bytes=state.params, grads_bytes=state.grads, optimizer_bytes=state.optimizer,
            activations_bytes=stage_activation_bytes(chunk, cfg.recompute, inflight[s], moments and moments[s]),
            grad_sync_s=sync, optimizer_s=opt_s,
            zero_buffers_bytes=zero_buffer_bytes(chunk, zero_buffers(cfg.zero, precision)),
            **_sends(chunk[-1], last=s == len(cuts) - 1),
            groups=tuple(groups),
            copies=tuple(sorted((fqn, reader, owner, n * grad_elem) for fqn, (reader, owner, n) in copies.items()))))
    m, p, v = cfg.microbatches, cfg.pp, cfg.virtual_stages
    if v > 1:  # a rank's stages do not peak together: each gets its share of the rank's fullest state
        for r, states in enumerate(rank_states(p, m, v)):
            mine = range(r, len(cuts), p)
            acts = rank_activation_shares([units[i:j] for i, j in (cuts[s] for s in mine)], cfg.recompute, states)
            for s, a in zip(mine, acts):
                stages[s] = replace(stages[s], activations_bytes=a)
    # and the messages each rank has received and not yet read (pipeline_states.held_messages)
    msgs = [message_bytes(u) for u in units]
    for r, vectors in enumerate(held_messages(cfg.schedule, p, m, v)):
        mine = range(r, len(cuts), p)
        held = held_message_shares([stage_cut_bytes(msgs, *cuts[s]) for s in mine], vectors)
        for s, extra in zip(mine, held):
            stages[s] = replace(stages[s], activations_bytes=stages[s].activations_bytes + extra)
    slowest = max(s.f_s + s.b_s + s.w_s for s in stages)
    critical = max(s.f_s + s.b_s for s in stages)
    if cfg.schedule in ("zb-h1", "zb-h2"):
        pipe = m * slowest + (p - 1) * critical
    elif v > 1:  # each rank runs v chunks per micro-batch; the bubble shrinks by v
        pipe = (m * v + p - 1) * slowest
    else:
        pipe = (m + p - 1) * slowest
    per_rank = [0.0] * p
    for s, st in enumerate(stages):
        per_rank[s % p] += st.optimizer_s + estimate_exposed_s(
            StageCost(groups=st.groups, optimizer_s=st.optimizer_s), zero=cfg.zero, dp=cfg.dp, link=dp_link,
            microbatches=m, replicas=replicas, replica_link=replica_link)
    tail = max(per_rank)
    return Candidate(config=cfg, step_time_s=pipe + tail, estimate_s=pipe + tail, bubble_fraction=0.0,
                     stages=tuple(stages))


def _sends(u: Unit, *, last: bool) -> dict:
    """A stage's p2p messages per micro-batch: across the cut after its last unit ``u``."""
    if last:
        return {"send_messages": (), "back_messages": ()}
    fwd = u.send_forward if u.send_forward is not None else (("", u.boundary_bytes, u.boundary_bytes, 0.0),)
    back = u.send_backward if u.send_backward is not None else (("", u.boundary_bytes, u.boundary_bytes, 0.0),)
    return {"send_messages": tuple(fwd), "back_messages": tuple(back)}

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
3. The step time comes from the schedule simulator
   (:func:`autopar.cost.simulate.simulate`) with per-stage F, B, W times and
   the p2p time of the activations crossing each cut, over that cut's own link
   (NVLink or network, from the ranks on either side:
   :meth:`autopar.cluster.Cluster.pipeline_links`), plus the data-parallel
   gradient synchronisation and the optimizer step (not overlapped: a
   conservative choice). A rank syncs and steps every stage it holds (two under
   the interleaved schedule), one after the other: the tail is summed per rank,
   and the slowest rank counts. A cheap estimate ranks all configurations and the best
   ``SIMULATE_TOP`` are simulated; the reported times are all simulated.

Ties (equal simulated time) go to the simpler plan: lower ZeRO stage, no
recompute, larger dp; then to the one that needs less memory.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from autopar.cluster import Cluster
from autopar.cost import comm
from autopar.cost.memory import training_state_bytes
from autopar.cost.schedule import make_schedule
from autopar.cost.simulate import SimResult, simulate
from autopar.errors import InfeasibleError, PlanError

log = logging.getLogger(__name__)

__all__ = ["Fixed", "Config", "Unit", "StagePlan", "Candidate", "search", "simulate_stages", "tail_s", "cut_times",
           "MEMORY_RESERVE"]

MEMORY_RESERVE = 0.10
"""Fraction of HBM kept free for the CUDA context, NCCL buffers and allocator
fragmentation (PyTorch's caching allocator typically leaves 5-10% unusable;
Megatron and torchtitan memory estimates leave similar headroom)."""

SIMULATE_TOP = 24
"""How many configurations, best estimate first, get a full schedule simulation."""

ADAM_BYTES_PER_PARAM = 28
"""HBM traffic of one fused mixed-precision AdamW update per parameter: read fp32
master, bf16 grad, m, v (4+2+4+4) and write master, m, v, bf16 param (4+4+4+2)."""

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
VIRTUAL_STAGES = 2
"""Model chunks per rank under the interleaved schedule (Megatron-LM's usual choice)."""
FUSED_BACKWARD = ("gpipe", "1f1b", "interleaved")
"""Schedules that run B and W as one fused backward (BW) action."""
RECOMPUTE = ("none", "selective", "full")
FIXED_KEYS = ("tp", "pp", "dp", "zero", "schedule", "microbatch_size", "microbatches", "recompute")


@dataclass(frozen=True, kw_only=True)
class Fixed:
    """Decisions the user pins (``fixed={"tp": 8, "pp": 2, ...}``); None = free."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    zero: int | None = None
    schedule: str | None = None
    microbatch_size: int | None = None
    microbatches: int | None = None
    recompute: str | None = None

    @classmethod
    def from_dict(cls, fixed: dict | None) -> Fixed:
        fixed = dict(fixed or {})
        problems = []
        for key in sorted(set(fixed) - set(FIXED_KEYS)):
            problems.append(f"unknown key {key!r}")
        values = {}
        for key in FIXED_KEYS:
            if key not in fixed or fixed[key] is None:
                continue
            value = fixed[key]
            if key in ("schedule", "recompute"):
                allowed = SCHEDULES if key == "schedule" else RECOMPUTE
                if value not in allowed:
                    problems.append(f"{key}={value!r} is not one of {', '.join(allowed)}")
                values[key] = value
                continue
            try:
                number = int(value)
            except (TypeError, ValueError):
                problems.append(f"{key}={value!r} is not an integer")
                continue
            low = 0 if key == "zero" else 1
            if number < low or (key == "zero" and number > 3) or str(number) != str(value).strip():
                problems.append(f"{key}={value!r} must be an integer {'in 0..3' if key == 'zero' else '>= 1'}")
            values[key] = number
        if problems:
            raise PlanError(f"bad fixed decisions: {'; '.join(problems)}; accepted keys: {', '.join(FIXED_KEYS)}")
        return cls(**values)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in FIXED_KEYS if getattr(self, k) is not None}


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
    n_params: float
    """Parameters held per device under tensor parallelism (before ZeRO)."""
    transient_bytes: float = 0.0
    """Largest single-op working set beyond saved activations (``ilp.LayerCost.transient_bytes``)."""
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
    send_bytes: float
    """Activation bytes sent to the next stage per micro-batch (0 on the last stage)."""

    @property
    def memory_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes


@dataclass(frozen=True, kw_only=True)
class Candidate:
    config: Config
    step_time_s: float
    estimate_s: float
    bubble_fraction: float
    stages: tuple[StagePlan, ...]
    sim: SimResult | None = field(default=None, compare=False)
    p2p_s: float = 0.0
    """Time of one activation (or gradient) transfer across the slowest cut, as simulated."""
    p2p_cut_s: tuple[float, ...] = ()
    """Per cut (stage c -> c + 1), the time of one transfer over that cut's link, as simulated."""

    @property
    def peak_memory_bytes(self) -> float:
        """The fullest rank: the sum of its stages (one, or several when interleaved)."""
        per_rank = [0.0] * self.config.pp
        for s, st in enumerate(self.stages):
            per_rank[s % self.config.pp] += st.memory_bytes
        return max(per_rank)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@lru_cache(maxsize=4096)
def _inflight(kind: str, pp: int, m: int, v: int = 1) -> tuple[int, ...]:
    """Per stage, the peak number of its micro-batches whose activations it holds
    (from its F to its W), read off the action lists."""
    sched = make_schedule(kind, n_stages=pp, n_micro=m, n_virtual=v)
    live = [0] * (pp * v)
    peaks = [0] * (pp * v)
    for rank in range(pp):
        for a in sched[rank]:
            if a.kind == "F":
                live[a.stage] += 1
                peaks[a.stage] = max(peaks[a.stage], live[a.stage])
            elif a.kind in ("W", "BW"):
                live[a.stage] -= 1
    return tuple(peaks)


def _unit_times(u: Unit, recompute: str) -> tuple[float, float, float, float]:
    """(F, B, W, activation bytes) of a unit under a recompute policy."""
    if recompute == "full":
        return u.f_s, u.b_s + u.f_s, u.w_s, u.boundary_bytes
    if recompute == "selective":
        return u.f_s, u.b_s + u.cheap_f_s, u.w_s, u.act_bytes - u.cheap_act_bytes
    return u.f_s, u.b_s, u.w_s, u.act_bytes


def _partition(units: list[Unit], cfg: Config, *, cap: float, state_per_param: float,
               inflight: tuple[int, ...]) -> list[tuple[int, int]] | None:
    """Contiguous cuts minimising the slowest stage under the memory cap (None if none fits)."""
    times, acts, work = [], [], []
    for u in units:
        f, b, w, a = _unit_times(u, cfg.recompute)
        times.append(f + b + w)
        acts.append(a)
        work.append(u.act_bytes if cfg.recompute == "full" else 0.0)
    n, pp = len(units), cfg.n_stages
    if pp > n:
        return None
    pre_t, pre_a, pre_p = [0.0], [0.0], [0.0]
    for t, a, u in zip(times, acts, units):
        pre_t.append(pre_t[-1] + t)
        pre_a.append(pre_a[-1] + a)
        pre_p.append(pre_p[-1] + u.n_params)

    def fits(i: int, j: int, s: int) -> bool:
        mem = state_per_param * (pre_p[j] - pre_p[i]) + inflight[s] * (pre_a[j] - pre_a[i])
        return mem + (max(work[i:j]) if cfg.recompute == "full" else 0.0) <= cap

    def greedy(bound: float) -> list[tuple[int, int]] | None:
        cuts, i = [], 0
        for s in range(pp):
            if i == n:
                break
            j = i
            while j < n and pre_t[j + 1] - pre_t[i] <= bound and fits(i, j + 1, s):
                j += 1
            if j == i:
                return None
            cuts.append((i, j))
            i = j
        return cuts if i == n else None

    lo, hi = max(times), pre_t[-1]
    best = greedy(hi * (1 + 1e-9))
    if best is None:
        return None
    for _ in range(60):
        if hi - lo <= 1e-9 * max(hi, 1e-12):
            break
        mid = (lo + hi) / 2
        cuts = greedy(mid)
        if cuts is None:
            lo = mid
        else:
            best, hi = cuts, mid
    while len(best) < pp:  # use every stage: split the largest stage in two
        k = max(range(len(best)), key=lambda x: (best[x][1] - best[x][0], -x))
        i, j = best[k]
        if j - i < 2:
            return None
        mid = min(range(i + 1, j), key=lambda c: abs((pre_t[c] - pre_t[i]) - (pre_t[j] - pre_t[c])))
        best[k:k + 1] = [(i, mid), (mid, j)]
    best = _smooth(best, pre_t, fits)
    if not all(fits(i, j, s) for s, (i, j) in enumerate(best)):
        return None
    return best


def _smooth(cuts: list[tuple[int, int]], pre_t: list[float], fits) -> list[tuple[int, int]]:
    """Even out the stages without raising the slowest one: the greedy packs the front
    stages full, so re-cut aiming each stage at an equal share of the remaining time,
    within the optimal bound; keep the greedy's cuts if that does not fit."""
    n, pp = len(pre_t) - 1, len(cuts)
    bound = max(pre_t[j] - pre_t[i] for i, j in cuts) * (1 + 1e-9)
    out, i = [], 0
    for s in range(pp):
        left = pp - s
        if left == 1:
            j = n
        else:
            target = pre_t[i] + (pre_t[n] - pre_t[i]) / left
            j = i + 1
            while j < n - (left - 1) and pre_t[j + 1] - pre_t[i] <= bound and fits(i, j + 1, s) \
                    and abs(pre_t[j + 1] - target) <= abs(pre_t[j] - target):
                j += 1
        out.append((i, j))
        i = j
    if all(pre_t[j] - pre_t[i] <= bound and fits(i, j, s) for s, (i, j) in enumerate(out)):
        return out
    return cuts


def search(*, units_for, n_units: int, global_batch: int, cluster: Cluster, fixed: Fixed,
           precision: str, tp_options: list[int]) -> tuple[list[Candidate], dict]:
    """All feasible configurations, best first (the first is the plan), and search statistics.

    ``units_for(tp, microbatch_size) -> list[Unit]`` gives per-layer costs.
    Raises :class:`InfeasibleError` with the smallest memory any configuration needs.
    """
    start = time.perf_counter()
    world = cluster.world_size
    cap = cluster.device.hbm_bytes * (1 - MEMORY_RESERVE)
    estimates: list[Candidate] = []
    tried = skipped_batch = 0
    least = (math.inf, None)  # smallest peak memory seen among infeasible configs
    for tp in tp_options:
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            if (fixed.pp and pp != fixed.pp) or (fixed.dp and dp != fixed.dp) or pp > n_units:
                continue
            if global_batch % dp:
                skipped_batch += 1
                continue
            local = global_batch // dp
            for mbs in _divisors(local):
                m = local // mbs
                if (fixed.microbatch_size and mbs != fixed.microbatch_size) or \
                        (fixed.microbatches and m != fixed.microbatches):
                    continue
                units = units_for(tp, mbs)
                for kind in ([fixed.schedule] if fixed.schedule else SCHEDULES if pp > 1 else ("1f1b",)):
                    v = VIRTUAL_STAGES if kind == "interleaved" else 1
                    if kind == "interleaved" and (pp == 1 or m % pp or pp * v > n_units):
                        continue  # (Megatron's interleaving needs micro-batches in groups of pp)
                    inflight = _inflight(kind, pp, m, v)
                    found = False
                    for zero in ([fixed.zero] if fixed.zero is not None else range(4) if dp > 1 else (0,)):
                        for recompute in ([fixed.recompute] if fixed.recompute else RECOMPUTE):
                            cfg = Config(tp=tp, pp=pp, dp=dp, microbatch_size=mbs, microbatches=m, zero=zero,
                                         recompute=recompute, schedule=kind, virtual_stages=v)
                            tried += 1
                            per_param = training_state_bytes(n_params=1, zero_stage=zero, dp=dp,
                                                             precision=precision).total
                            # a rank holds v stages: each gets 1/v of the memory (a conservative split)
                            cuts = _partition(units, cfg, cap=cap / v, state_per_param=per_param,
                                              inflight=inflight)
                            if cuts is None:
                                need = _min_memory(units, cfg, per_param, inflight)
                                if need < least[0]:
                                    least = (need, cfg)
                                continue
                            estimates.append(_estimate(units, cuts, cfg, cluster, precision, inflight))
                            found = True
                        if found and fixed.zero is None:
                            break  # a higher ZeRO stage is never faster once this one fits
    if not estimates:
        raise _infeasible(least, cluster, fixed, skipped_batch, global_batch, world)
    estimates.sort(key=_rank_key(lambda c: c.estimate_s))
    simulated = [_simulate(c, cluster) for c in estimates[:SIMULATE_TOP]]
    simulated.sort(key=_rank_key(lambda c: c.step_time_s))
    stats = {"configurations": tried, "feasible": len(estimates), "simulated": len(simulated),
             "wall_s": time.perf_counter() - start}
    return simulated, stats


def _rank_key(time_of):
    def key(c: Candidate):
        cfg = c.config
        return (float(f"{time_of(c):.6g}"), cfg.zero, RECOMPUTE.index(cfg.recompute), -cfg.dp, cfg.pp,
                cfg.tp, float(f"{c.peak_memory_bytes:.6g}"),  # equal times: the schedule holding less (1F1B, not GPipe)
                SCHEDULES.index(cfg.schedule) if cfg.schedule in SCHEDULES else 0, cfg.microbatch_size)
    return key


def _min_memory(units: list[Unit], cfg: Config, per_param: float, inflight: tuple[int, ...]) -> float:
    """Peak stage memory of an even split (for the 'smallest device that would fit' message)."""
    n, pp = len(units), cfg.pp
    size = math.ceil(n / pp) if pp <= n else 1
    worst = 0.0
    for s in range(min(pp, n)):
        chunk = units[s * size:(s + 1) * size]
        acts = sum(_unit_times(u, cfg.recompute)[3] for u in chunk)
        worst = max(worst, per_param * sum(u.n_params for u in chunk) + inflight[s] * acts)
    return worst


def _estimate(units: list[Unit], cuts, cfg: Config, cluster: Cluster, precision: str,
              inflight: tuple[int, ...]) -> Candidate:
    stages = []
    dp_link = cluster.link_for_group(cfg.dp, stride=cfg.tp)
    grad_elem = 2 if precision == "mixed" else 4
    for s, (i, j) in enumerate(cuts):
        chunk = units[i:j]
        f = b = w = c = acts = 0.0
        for u in chunk:
            uf, ub, uw, ua = _unit_times(u, cfg.recompute)
            f, b, w, c, acts = f + uf, b + ub, w + uw, c + u.comm_s, acts + ua
        if cfg.recompute == "full":
            acts += max(u.act_bytes for u in chunk)
        n_params = sum(u.n_params for u in chunk)
        paths = {u.path for u in chunk}
        copies = {fqn: n for u in chunk for fqn, owner, n in u.shared_params if owner not in paths}
        n_params += sum(copies.values())
        state = training_state_bytes(n_params=n_params, zero_stage=cfg.zero, dp=cfg.dp, precision=precision)
        grad_bytes = n_params * grad_elem
        if cfg.zero == 0:
            sync = comm.all_reduce_s(grad_bytes, cfg.dp, dp_link)
        else:
            sync = comm.reduce_scatter_s(grad_bytes, cfg.dp, dp_link) + comm.all_gather_s(grad_bytes, cfg.dp, dp_link)
        if cfg.zero == 3:  # parameters gathered for forward and again for backward, every micro-batch
            sync += 2 * cfg.microbatches * comm.all_gather_s(grad_bytes, cfg.dp, dp_link)
        shard = cfg.dp if cfg.zero >= 1 else 1
        opt_s = ADAM_BYTES_PER_PARAM * n_params / shard / (cluster.device.hbm_bytes_per_s * 0.8)
        stages.append(StagePlan(
            layers=tuple(u.path for u in chunk), f_s=f, b_s=b, w_s=w, comm_s=c, inflight=inflight[s],
            params_bytes=state.params, grads_bytes=state.grads, optimizer_bytes=state.optimizer,
            activations_bytes=(inflight[s] * acts if cfg.recompute != "full" else
                               inflight[s] * (acts - max(u.act_bytes for u in chunk)) + max(u.act_bytes for u in chunk))
            + max(u.transient_bytes for u in chunk),  # the largest op's working set, once
            grad_sync_s=sync, optimizer_s=opt_s,
            send_bytes=chunk[-1].boundary_bytes if s < len(cuts) - 1 else 0.0))
    m, p, v = cfg.microbatches, cfg.pp, cfg.virtual_stages
    slowest = max(s.f_s + s.b_s + s.w_s for s in stages)
    critical = max(s.f_s + s.b_s for s in stages)
    if cfg.schedule in ("zb-h1", "zb-h2"):
        pipe = m * slowest + (p - 1) * critical
    elif v > 1:  # each rank runs v chunks per micro-batch; the bubble shrinks by v
        pipe = (m * v + p - 1) * slowest
    else:
        pipe = (m + p - 1) * slowest
    tail = tail_s(stages, p)
    return Candidate(config=cfg, step_time_s=pipe + tail, estimate_s=pipe + tail, bubble_fraction=0.0,
                     stages=tuple(stages))


def tail_s(stages: Sequence[StagePlan], pp: int) -> float:
    """Time after the pipeline drains: each rank syncs gradients over dp and steps the
    optimizer for every stage it holds (stage s on pipeline rank s % pp), one after the
    other; the slowest rank sets the step. (The max over stages would drop the second
    chunk of an interleaved rank and favour interleaving.)"""
    per_rank = [0.0] * pp
    for s, st in enumerate(stages):
        per_rank[s % pp] += st.grad_sync_s + st.optimizer_s
    return max(per_rank)


def simulate_stages(kind: str, *, microbatches: int, f_s: list[float], b_s: list[float], w_s: list[float],
                    p2p_s: float | Sequence[float], pp: int | None = None) -> SimResult:
    """The pipeline part of a step: ``kind``'s action lists for ``len(f_s)`` stages on ``pp``
    ranks (default: one stage per rank), timed; ``p2p_s`` is one transfer time for every
    cut or one per cut.

    The plan stores each stage's F, B, W and the p2p time, so a report can redraw
    exactly the timeline the search ranked by (``autopar.report``)."""
    pp = pp or len(f_s)
    sched = make_schedule(kind, n_stages=pp, n_micro=microbatches, n_virtual=len(f_s) // pp)
    fused = kind in FUSED_BACKWARD
    return simulate(sched, f_s=list(f_s), b_s=[b + (w if fused else 0.0) for b, w in zip(b_s, w_s)],
                    w_s=[0.0 if fused else w for w in w_s], p2p_s=p2p_s)


def cut_times(stages: Sequence[StagePlan], links: Sequence[comm.Link]) -> tuple[float, ...]:
    """Per cut, one transfer of the activations the stage before it sends, over the cut's link."""
    return tuple(comm.p2p_s(st.send_bytes, link) for st, link in zip(stages, links))


def _simulate(c: Candidate, cluster: Cluster) -> Candidate:
    cfg = c.config
    links = cluster.pipeline_links(pp=cfg.pp, dp=cfg.dp, tp=cfg.tp, n_stages=len(c.stages))
    cuts = cut_times(c.stages, links)
    sim = simulate_stages(cfg.schedule, microbatches=cfg.microbatches, f_s=[s.f_s for s in c.stages],
                          b_s=[s.b_s for s in c.stages], w_s=[s.w_s for s in c.stages], p2p_s=cuts, pp=cfg.pp)
    return replace(c, step_time_s=sim.step_time_s + tail_s(c.stages, cfg.pp), bubble_fraction=sim.bubble_fraction,
                   sim=sim, p2p_s=max(cuts, default=0.0), p2p_cut_s=cuts)


def _infeasible(least, cluster: Cluster, fixed: Fixed, skipped_batch: int, batch: int, world: int) -> Exception:
    need, cfg = least
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
    return InfeasibleError(
        f"the model fits no configuration on {cluster.spec}: the smallest need is {need / 1e9:.1f} GB per "
        f"device (tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} zero={cfg.zero} recompute={cfg.recompute} "
        f"microbatch_size={cfg.microbatch_size} {cfg.schedule}) but a {cluster.device.name} offers "
        f"{have / 1e9:.1f} GB after a {MEMORY_RESERVE:.0%} reserve; use more devices, a device with more "
        f"memory, or a smaller batch or sequence")

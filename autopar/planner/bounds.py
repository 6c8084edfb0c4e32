"""Lower bounds on a configuration's step time, for the outer search's branch and bound.

:func:`autopar.planner.search.search` visits mesh shapes, configurations and cut candidates
best bound first, and stops at the first whose bound exceeds the ``keep``-th best simulated
time; each bound here is checked against the simulation on every configuration of an
exhaustive search (``tests/test_search.py``). Also the cost primitives the bounds and the
search's estimate share (a unit's times under a recompute policy, the optimizer step, the
schedules' action lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from autopar.cluster import Cluster
from autopar.cost import comm
from autopar.cost.schedule import cached_schedule, timing_order
from autopar.cost.step import OVERLAP_SLOWDOWN, group_dp_s
from autopar import zero_def

if TYPE_CHECKING:
    from autopar.cost.step import StepSpec
    from autopar.planner.search import Candidate, Config, StagePlan, Unit

__all__ = ["lower_bound_s", "bare_pipeline_ends"]


ADAM_BYTES_PER_PARAM = 28
"""HBM traffic of one fused AdamW update per parameter under the precision policies
(:mod:`autopar.precision`; gradients land in fp32 buffers under bf16-mixed as under fp32):
read fp32 master, fp32 grad, m, v (4+4+4+4) and write master, m, v (4+4+4). The bf16
compute copy is a separate cast (read 4, write 2: once per step at ZeRO 0-2, before each
gather at ZeRO 3), not counted here."""


def _schedule(kind: str, pp: int, m: int, v: int = 1):
    """The action lists of ``kind`` (:func:`autopar.cost.schedule.cached_schedule`: the search reads
    them for memory and simulates them for time, and nothing changes them)."""
    return cached_schedule(kind, pp, m, v)


def _unit_times(u: Unit, recompute: str) -> tuple[float, float, float, float]:
    """(F, B, W, activation bytes) of a unit under a recompute policy."""
    if recompute == "full":
        return u.f_s, u.b_s + u.f_s, u.w_s, u.full_kept_bytes
    if recompute == "selective":
        return u.f_s, u.b_s + u.cheap_f_s, u.w_s, u.act_bytes - u.cheap_act_bytes
    if recompute == "sac":
        return u.f_s, u.b_s + u.cheap_f_s + u.sac_f_s, u.w_s, u.act_bytes - u.cheap_act_bytes - u.sac_act_bytes
    if recompute == "moe":
        return u.f_s, u.b_s + u.cheap_f_s + u.moe_f_s, u.w_s, u.act_bytes - u.cheap_act_bytes - u.moe_act_bytes
    return u.f_s, u.b_s, u.w_s, u.act_bytes


_REMADE = {"selective": 0, "sac": 1, "moe": 2, "full": 3}  # the policy's place in Unit.remade_extra_bytes


def running_bytes(u: Unit, recompute: str) -> float:
    """What a micro-batch holds for unit ``u`` while ``u``'s backward runs, beside what the units
    before it keep: the unit's largest op's working set, plus under a recompute policy what it
    kept and what the copies its backward makes again add at their peak
    (:attr:`Unit.remade_extra_bytes`; in a program that makes them all again at once,
    :attr:`Unit.whole_layer_remade`, all its activations), and without recompute its activations."""
    remade = _REMADE.get(recompute)
    if remade is not None and not u.whole_layer_remade:
        return _unit_times(u, recompute)[3] + u.transient_bytes + u.remade_extra_bytes[remade]
    return u.act_bytes + u.transient_bytes


def w_held_bytes(u: Unit) -> float:
    """What a micro-batch holds for unit ``u`` between its B and its W (:attr:`Unit.w_held_bytes`)."""
    return u.act_bytes if u.w_held_bytes is None else u.w_held_bytes


def stage_activation_bytes(chunk: Sequence[Unit], recompute: str, inflight: int,
                           moments: tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]] | None = None
                           ) -> float:
    """Activation bytes a stage of units ``chunk`` holds at its peak, ``inflight`` micro-batches in
    flight: what each keeps for its backward, plus the largest op's working set once.

    Under recompute a micro-batch keeps what the policy keeps of each unit (under full what its
    forward reads from outside it, or in a program that re-runs layers whole its boundary:
    :attr:`Unit.full_kept_bytes`) and, while one unit's backward runs, what :func:`running_bytes`
    counts for that unit (:mod:`autopar.passes.recompute` re-runs the dropped ops there); the units
    after it have freed theirs, those before it still hold what they kept. So the peak is the
    other micro-batches' kept bytes plus the largest, over units k, of what the units before k
    keep and k's running bytes. (Until 2026-12-06 every unit's input, the largest unit's
    activations and the largest working set were added, each from any unit: 38% over the measured
    peak for Llama tiny under full, ``tests/dist/test_recompute.py``. Until the twenty-third
    session selective and sac counted every unit's kept bytes and the largest working set, nothing
    made again: ``python bench/recompute.py --pp 1f1b`` measured the first of two stages 9.8%
    (selective) and 19.4% (sac) over that count; +2.7% and -6.3% under this one.)

    Zero-bubble schedules run a micro-batch's W passes apart from its B, and ``moments`` (from
    :func:`autopar.planner.pipeline_states.zero_bubble_moments`) say how many micro-batches a stage holds
    at once in each state: (between F and B, between B and W) while no B runs, and the same
    besides the micro-batch in its B while one does. Between B and W a micro-batch holds what its
    weight gradients read (:func:`w_held_bytes`; under recompute what B made again for them too,
    so the policy saves nothing there); in its B, the units before the running one keep what
    their forward kept, the running one its running bytes, and the units after it what their W
    will read. (Until 2026-12-06 these schedules were counted as 1F1B's, every micro-batch keeping
    what its forward kept until its W: ZB-H1's last stage under full recompute measured 3.1 times
    that count, ``bench/recompute.py --pp zb-h1``.)"""
    if moments is not None:
        kept = [_unit_times(u, recompute)[3] for u in chunk]
        held = [w_held_bytes(u) for u in chunk]
        total_kept, total_held = sum(kept), sum(held)
        in_b = before = 0.0
        after = total_held
        for k, u in enumerate(chunk):  # before: kept by the units before k; after: held by those after it
            after -= held[k]
            in_b = max(in_b, before + running_bytes(u, recompute) + after)
            before += kept[k]
        largest = max(u.transient_bytes for u in chunk)
        idle, running = moments
        return max([a * total_kept + b * total_held + largest for a, b in idle]
                   + [a * total_kept + b * total_held + in_b for a, b in running])
    if recompute == "none":
        return inflight * sum(u.act_bytes for u in chunk) + max(u.transient_bytes for u in chunk)
    kept = worst = 0.0
    for u in chunk:
        worst = max(worst, kept + running_bytes(u, recompute))
        kept += _unit_times(u, recompute)[3]
    return (inflight - 1) * kept + worst


def rank_activation_shares(chunks: Sequence[Sequence[Unit]], recompute: str,
                           states: Sequence[tuple[tuple[int, ...], int]]) -> list[float]:
    """Activation bytes of each of an interleaved rank's stages (its units ``chunks``) in the
    rank's fullest state (:func:`autopar.planner.pipeline_states.rank_states`: micro-batches in flight
    per stage, and the stage whose backward runs). A stage keeps what each of its micro-batches
    keeps; the one whose backward runs also holds what :func:`stage_activation_bytes` adds for a
    micro-batch in its backward, and otherwise the rank's largest op's working set counts once,
    on the stage that has it. The shares add up to the rank's peak."""
    kept = [sum(_unit_times(u, recompute)[3] for u in chunk) for chunk in chunks]
    extra = [stage_activation_bytes(chunk, recompute, 1) - k for chunk, k in zip(chunks, kept)]
    largest = [max(u.transient_bytes for u in chunk) for chunk in chunks]
    top = max(range(len(chunks)), key=lambda k: largest[k])

    def shares(counts, running):
        out = [n * k for n, k in zip(counts, kept)]
        if running >= 0:
            out[running] += extra[running]
        else:
            out[top] += largest[top]
        return out
    return max((shares(c, r) for c, r in states), key=sum)


def message_bytes(u: Unit) -> float:
    """Per micro-batch, the larger of the two messages across a cut right after unit ``u``
    (its activations forward, their gradients back; replicated values counted whole)."""
    fwd = u.boundary_bytes if u.send_forward is None else sum(msg[1] for msg in u.send_forward)
    back = u.boundary_bytes if u.send_backward is None else sum(msg[1] for msg in u.send_backward)
    return max(fwd, back)


def held_message_shares(cut_bytes: Sequence[float], vectors: Sequence[tuple[int, ...]]) -> list[float]:
    """Bytes of each of a rank's stages' received and unread messages in the rank's fullest
    count (``vectors``: :func:`autopar.planner.pipeline_states.held_messages`), each weighed by
    the larger message at the stage's cuts (``cut_bytes``: :func:`stage_cut_bytes`)."""
    best = max(vectors, key=lambda c: sum(n * b for n, b in zip(c, cut_bytes)))
    return [n * b for n, b in zip(best, cut_bytes)]


def stage_cut_bytes(msgs: Sequence[float], i: int, j: int) -> float:
    """The larger message at the cuts of the stage of units ``[i, j)``: into it (after unit
    ``i - 1``) and out of it (after unit ``j - 1``; none after the last). ``msgs``: per unit,
    :func:`message_bytes`."""
    return max(msgs[i - 1] if i > 0 else 0.0, msgs[j - 1] if j < len(msgs) else 0.0)


# Lower bounds on a configuration's step time, for pruning. They must never exceed what
# _simulate returns (tests/test_search.py checks this on every configuration of a small
# search): a bound that did would prune the optimum. They read the same terms as the time
# function (the step program of autopar.cost.step): each rank's pipeline actions one after
# the other, then its optimizer steps. The gradient collectives overlap the backward in the
# step program; what they cost is bounded through the link (_comm_bound_s) and through the
# compute they slow (_overlap_bound_s).


def _overlap_bound_s(work_s: float, comm_s: float, head_s: float = 0.0) -> float:
    """A lower bound on a rank's step time from the slowdown of compute under collectives.

    The rank's compute stream has ``work_s`` of work at full speed (every F, B, W and optimizer
    step); its collectives take ``comm_s`` each alone on the link. In the step program
    (:func:`autopar.cost.simulate.simulate_program`) compute runs at ``1 / s`` (s =
    ``OVERLAP_SLOWDOWN``) while any collective of the rank is in flight, and the collectives,
    sharing the link, are in flight ``X >= comm_s`` together. Say the first starts at ``t1``,
    when ``D`` of the work is done; compute starts no earlier than ``head_s`` and runs at most
    at full speed, so ``t1 >= head_s + D``. In ``X`` at most ``X / s`` of work gets done, the rest
    outside it after ``t1``: ``T >= head_s + D + X + max(0, work_s - D - X / s)``, which grows in
    D and in X; at ``D = 0, X = comm_s`` it is the bound. (It is convex in ``(work_s, comm_s)``,
    so the bound at a rank average is below the busiest rank's.)"""
    return head_s + comm_s + max(0.0, work_s - comm_s / OVERLAP_SLOWDOWN)


def _work_s(units: Sequence[Unit], recompute: str) -> float:
    """Time of one micro-batch's F + B + W through every layer (recompute included)."""
    total = 0.0
    for u in units:
        f, b, w, _ = _unit_times(u, recompute)
        total += f + b + w
    return total


def _chain_s(units: Sequence[Unit], recompute: str) -> float:
    """One micro-batch's F through every layer and then its B back through them (W left out)."""
    return sum(sum(_unit_times(u, recompute)[:2]) for u in units)


def _unit_loads(units: Sequence[Unit], recompute: str) -> list[float]:
    """Each layer's F + B + W for one micro-batch, largest first (:func:`_busiest_load_s`)."""
    return sorted((sum(_unit_times(u, recompute)[:3]) for u in units), reverse=True)


def _busiest_load_s(loads: Sequence[float], ranks: int) -> float:
    """A lower bound on the largest per-micro-batch load any split of the layers ``loads`` (largest
    first) over ``ranks`` ranks gives one rank: the average, and by pigeonhole, for every ``k``,
    one rank holds ``k + 1`` of the ``k * ranks + 1`` largest layers, so at least the ``k + 1``
    smallest of them (``k = 0``: the largest layer). Contiguous or not, interleaved or not: any
    split. (80 equal blocks on 32 ranks: 3 blocks, against the average's 2.5.)"""
    best = sum(loads) / ranks
    k = 0
    while k * ranks + 1 <= len(loads):
        best = max(best, sum(loads[k * ranks - k:k * ranks + 1]))
        k += 1
    return best


def _config_bound_s(work_s: float, n_params: float, *, zero: int, m: int, pp: int, dp: int, link: comm.Link,
                    precision: str, cluster: Cluster, dp_comm_s: float = 0.0, virtual_stages: int = 1,
                    chain_s: float = 0.0, load_s: float = 0.0) -> float:
    """A lower bound for any cut of a configuration, before partitioning: the busiest rank
    runs at least the average share of the F, B and W actions (``m * work / pp``), then at
    least the average share of the tail (collectives and optimizer step over ``n_params /
    pp`` parameters: their times grow with size, and a rank's several stages cost at least
    one stage of their total size, message latency being per message).

    ``dp_comm_s`` is every layer group's dp collectives of a step, each alone on the link
    (:func:`_dp_comm_prefix`'s total): the busiest rank's link carries at least the average
    share of them (:func:`_comm_bound_s`), and with one stage per rank its optimizer step
    follows them; and the compute they slow (:func:`_overlap_bound_s` at the rank averages,
    below the busiest rank's by convexity).

    ``load_s``: the busiest rank's F + B + W of one micro-batch counted in whole layers
    (:func:`_busiest_load_s`), above the average where the layers do not split evenly over
    ``pp`` (80 blocks on 32 or 64 ranks). ``chain_s``: one micro-batch's F through every
    stage and its B back (:func:`_chain_s`), which no schedule overlaps with itself: with
    fewer micro-batches than about ``pp``, above ``m * work / pp``. (Both were added when the
    Llama 70B search on 64x8xH100 partitioned 12,872 configurations to find a pp=1 plan; it now
    partitions 5,024, and the same plan.)"""
    share = n_params / pp
    opt = _optimizer_s(share / zero_def.state_shards(zero, dp)[2], cluster)
    compute = m * max(work_s / pp, load_s)
    return max(compute + opt, dp_comm_s / pp + (opt if virtual_stages == 1 else 0.0),
               _overlap_bound_s(m * work_s / pp + opt, dp_comm_s / pp), chain_s)


def replica_group(cluster: Cluster, *, dp: int, tp: int, ep: int) -> tuple[int, comm.Link | None]:
    """(ranks, link) of the experts' replica group under ``ep`` > 1 (the dp ranks ``ep`` apart, so
    ``tp * ep`` apart in the world: :mod:`autopar.runtime.expert`); (0, None) without ep."""
    if ep <= 1:
        return 0, None
    return dp // ep, cluster.link_for_group(dp // ep, stride=tp * ep)


def _dp_comm_prefix(units: Sequence[Unit], *, zero: int, dp: int, link: comm.Link, microbatches: int,
                    precision: str, replicas: int = 0, replica_link: comm.Link | None = None) -> list[float]:
    """Running sums over the layers of their dp collectives' time in a step (each unit one
    gradient bucket of its own parameters; a stage's copies of tied parameters only add)."""
    elem = _grad_elem_bytes(precision)
    seen: dict[tuple[float, float], float] = {}
    pre = [0.0]
    for u in units:
        key = (u.n_params * elem, u.expert_params * elem)
        if key not in seen:
            seen[key] = group_dp_s(key[0], zero=zero, dp=dp, link=link, microbatches=microbatches,
                                   expert_bytes=key[1], replicas=replicas, replica_link=replica_link)
        pre.append(pre[-1] + seen[key])
    return pre


@lru_cache(maxsize=4096)
def _before_first_reduce(kind: str, pp: int, m: int, v: int, zero: int) -> tuple[tuple[tuple, ...], ...]:
    """Per rank, the compute that must end before the rank can issue its first dp collective:
    for each action that may issue it (ZeRO 0/1: each stage's last W or BW; ZeRO 2: the first
    W or BW), the actions before it in the rank's list, as counts ``((stage, n_F, n_B, n_W),
    ...)`` (a BW counts as one B and one W). ZeRO 3 gathers before the first forward: ``()``
    (no such compute)."""
    if zero == 3:
        return tuple(() for _ in range(pp))
    sched = _schedule(kind, pp, m, v)
    out = []
    for rank in range(pp):
        acts = sched[rank]
        grads = [i for i, a in enumerate(acts) if a.kind in ("W", "BW")]
        if zero == 2:
            issuers = grads[:1]
        else:
            last = {}
            for i in grads:
                last[acts[i].stage] = i
            issuers = sorted(last.values())
        options = []
        wanted = set(issuers)
        counts: dict[int, list[int]] = {}  # running counts of the actions before index i, one pass
        for i, a in enumerate(acts):
            if i in wanted:
                options.append(tuple((st, *c) for st, c in sorted(counts.items())))
            c = counts.setdefault(a.stage, [0, 0, 0])
            c[0] += a.kind == "F"
            c[1] += a.kind in ("B", "BW")
            c[2] += a.kind in ("W", "BW")
        out.append(tuple(options))
    return tuple(out)


def _comm_bound_s(cfg: Config, *, f_s: Sequence[float], b_s: Sequence[float], w_s: Sequence[float],
                  dp_s: Sequence[float], opt_s: Sequence[float]) -> float:
    """A lower bound on the step time from the dp link (per stage: F, B, W, dp collectives of a
    step each alone on the link, optimizer step).

    On a rank, the dp collectives share its dp link and together progress at most at the rate
    of one alone (:func:`autopar.cost.simulate.simulate_program`: ``k`` in flight each move at
    ``1/k``), so from the first one's start they take at least the sum of their times. The
    first cannot start before the rank's compute reaches the action that issues it
    (:func:`_before_first_reduce`; compute runs in list order at full speed at best, from
    ``head``, the first micro-batch's forward through the stages before). After the last:
    with one stage per rank, its optimizer step (it waits for the reductions; ZeRO 1/2 gather
    only after it, so the link idles meanwhile); with several, under ZeRO 0/3 the optimizer
    step of the stage whose reduction ended last, at least the rank's shortest. Also the
    compute the collectives slow on each rank (:func:`_overlap_bound_s`: every F, B, W and
    optimizer step of its stages, after ``head`` unless ZeRO 3 gathers meanwhile)."""
    pp, v = cfg.pp, cfg.virtual_stages
    if cfg.dp == 1:
        return 0.0
    starts = _before_first_reduce(cfg.schedule, pp, cfg.microbatches, v, max(cfg.zero, 1))  # 0 and 1: the same issuers
    best = 0.0
    head = 0.0
    for r in range(pp):
        mine = range(r, len(f_s), pp)
        start = min((sum(nf * f_s[s] + nb * b_s[s] + nw * w_s[s] for s, nf, nb, nw in option)
                     for option in starts[r]), default=0.0)
        if v == 1:
            tail = opt_s[r]
        elif cfg.zero in (0, 3):
            tail = min(opt_s[s] for s in mine)
        else:
            tail = 0.0
        wait = head if cfg.zero != 3 else 0.0
        comm_s = sum(dp_s[s] for s in mine)
        work_s = sum(cfg.microbatches * (f_s[s] + b_s[s] + w_s[s]) + opt_s[s] for s in mine)
        best = max(best, wait + start + comm_s + tail, _overlap_bound_s(work_s, comm_s, wait))
        head += f_s[r]
    return best


def _prefix_sums(units: Sequence[Unit], recompute: str) -> tuple[list[float], ...]:
    """Running sums over the layers of (F, F + B + W, parameters, B, W), for stage sums in O(1)."""
    pre_f, pre_t, pre_p, pre_b, pre_w = [0.0], [0.0], [0.0], [0.0], [0.0]
    for u in units:
        f, b, w, _ = _unit_times(u, recompute)
        pre_f.append(pre_f[-1] + f)
        pre_t.append(pre_t[-1] + f + b + w)
        pre_p.append(pre_p[-1] + u.n_params)
        pre_b.append(pre_b[-1] + b)
        pre_w.append(pre_w[-1] + w)
    return pre_f, pre_t, pre_p, pre_b, pre_w


def _cuts_bound_s(prefix, cuts, cfg: Config, *, cluster: Cluster, precision: str,
                  dp_prefix: Sequence[float] | None = None) -> float:
    """:func:`lower_bound_s` from the cuts alone, before the candidate is built: the same
    terms, with each stage's parameters counted without the copies of tied parameters it
    holds (a copy only adds time). ``dp_prefix`` (:func:`_dp_comm_prefix` for the
    configuration's ZeRO stage, dp and micro-batches) adds the dp link's bound."""
    pre_f, pre_t, pre_p, pre_b, pre_w = prefix
    pp, m = cfg.pp, cfg.microbatches
    shard = zero_def.state_shards(cfg.zero, cfg.dp)[2]
    pipe, tail = [0.0] * pp, [0.0] * pp
    opts = []
    for s, (i, j) in enumerate(cuts):
        n = pre_p[j] - pre_p[i]
        pipe[s % pp] += m * (pre_t[j] - pre_t[i])
        opts.append(_optimizer_s(n / shard, cluster))
        tail[s % pp] += opts[-1]
    head = 0.0
    for r in range(min(pp, len(cuts))):
        pipe[r] += head
        head += pre_f[cuts[r][1]] - pre_f[cuts[r][0]]
    bound = max(p + t for p, t in zip(pipe, tail))
    if dp_prefix is None or cfg.dp == 1 or len(cuts) != cfg.n_stages:
        return bound
    return max(bound, _comm_bound_s(cfg, f_s=[pre_f[j] - pre_f[i] for i, j in cuts],
                                    b_s=[pre_b[j] - pre_b[i] for i, j in cuts],
                                    w_s=[pre_w[j] - pre_w[i] for i, j in cuts],
                                    dp_s=[dp_prefix[j] - dp_prefix[i] for i, j in cuts], opt_s=opts))


def lower_bound_s(c: Candidate, cluster: Cluster | None = None) -> float:
    """A lower bound on ``c``'s simulated step time, from its cuts: each rank ``r`` waits for the
    first micro-batch's forward through the stages before its first (stage ``r``), then runs
    its stages' F, B and W for every micro-batch one after the other; the tail follows.
    With ``cluster``, also the bound of the dp link (:func:`_comm_bound_s`)."""
    pp, m = c.config.pp, c.config.microbatches
    per_rank = [0.0] * pp
    for s, st in enumerate(c.stages):
        per_rank[s % pp] += m * (st.f_s + st.b_s + st.w_s)
    head = 0.0
    for r in range(pp):
        per_rank[r] += head
        head += c.stages[r].f_s
    bound = max(p + t for p, t in zip(per_rank, _tail_bound_s(c.stages, pp)))
    if cluster is None:
        return bound
    cfg = c.config
    link = cluster.link_for_group(cfg.dp, stride=cfg.tp)
    replicas, replica_link = replica_group(cluster, dp=cfg.dp, tp=cfg.tp, ep=cfg.ep_dp)
    dp_s = [sum(group_dp_s(g.bucket_bytes, zero=cfg.zero, dp=cfg.dp, link=link, microbatches=m,
                           expert_bytes=g.expert_bytes, replicas=replicas, replica_link=replica_link)
                for g in st.groups) for st in c.stages]
    return max(bound, _comm_bound_s(cfg, f_s=[st.f_s for st in c.stages], b_s=[st.b_s for st in c.stages],
                                    w_s=[st.w_s for st in c.stages], dp_s=dp_s,
                                    opt_s=[st.optimizer_s for st in c.stages]))


def _grad_elem_bytes(precision: str) -> int:
    """Bytes per gradient element as the dp collectives reduce it (the bounds and the estimate must agree)."""
    return 2 if precision in ("mixed", "bf16-mixed-bf16-reduce") else 4


def _optimizer_s(n_params: float, cluster: Cluster) -> float:
    """One fused AdamW step over ``n_params`` (memory bound; 80% of HBM bandwidth)."""
    return ADAM_BYTES_PER_PARAM * n_params / (cluster.device.hbm_bytes_per_s * 0.8)


def _tail_bound_s(stages: Sequence[StagePlan], pp: int) -> list[float]:
    """Per pipeline rank, the optimizer steps of the stages it holds (stage s on rank s % pp):
    what follows its last compute at the least. Its gradient collectives are left out: the
    step program overlaps them with the backward, so they may cost nothing."""
    per_rank = [0.0] * pp
    for s, st in enumerate(stages):
        per_rank[s % pp] += st.optimizer_s
    return per_rank


FUSED_BACKWARD = ("gpipe", "1f1b", "interleaved")
"""Schedules that run B and W as one fused backward (BW) action."""

_CODES = {"F": 0, "B": 1, "W": 2, "BW": 3}


@lru_cache(maxsize=64)
def _bare_program(kind: str, pp: int, m: int, v: int) -> tuple[tuple, ...]:
    """:func:`autopar.cost.schedule.timing_order` as ``(rank, stage, kind code, waits)`` tuples
    for :func:`bare_pipeline_ends` (built once per shape: the search's memo reuses it for every
    cut and ZeRO stage of that shape), so that timing one pipeline is a single pass over plain
    tuples."""
    return tuple((r, a.stage, _CODES[a.kind], waits) for r, a, waits in timing_order(kind, pp, m, v))


def bare_pipeline_ends(kind: str, *, pp: int, microbatches: int, f_s: Sequence[float], b_s: Sequence[float],
                       w_s: Sequence[float], p2p_s: Sequence[float],
                       p2p_back_s: Sequence[float] | None = None) -> tuple[float, ...]:
    """Per rank, when its last compute action of ``kind``'s schedule ends, with per stage
    ``f_s``, ``b_s``, ``w_s`` and per cut ``p2p_s`` (activations forward) and ``p2p_back_s``
    (gradients back; default ``p2p_s``) and nothing else: the timing
    :func:`autopar.cost.simulate.simulate` gives (an action starts when its rank is free
    and its inputs have arrived, a cut's transfer time after they end; a fused BW lasts
    B + W), computed in one pass over the compiled order instead of the event engine
    (no validation, no timeline: tests/test_search.py checks the two agree)."""
    program = _bare_program(kind, pp, microbatches, len(f_s) // pp)
    if kind in FUSED_BACKWARD:
        b_s, w_s = [b + w for b, w in zip(b_s, w_s)], [0.0] * len(w_s)
    dur = (f_s, b_s, w_s, [b + w for b, w in zip(b_s, w_s)])
    cut_s = (p2p_s, p2p_s if p2p_back_s is None else p2p_back_s)
    end = [0.0] * len(program)
    free = [0.0] * pp
    for i, (r, s, code, waits) in enumerate(program):
        t = free[r]
        for j, cut, back in waits:
            e = end[j] if cut < 0 else end[j] + cut_s[back][cut]
            if e > t:
                t = e
        t += dur[code][s]
        end[i] = free[r] = t
    return tuple(free)


def _pipeline_bound_s(c: Candidate, spec: StepSpec, memo: dict | None = None) -> float:
    """A lower bound on ``c``'s simulated step time: its bare pipeline (:func:`bare_pipeline_ends`,
    the stages' F, B, W and each cut's p2p time of ``spec``, nothing else), then on each rank
    its stages' optimizer steps.

    The step program runs the same actions in the same order per rank with the same p2p
    delays; it only adds (pieces that sum to the action, waits for ZeRO-3 gathers, compute
    slowed under overlapped collectives), and start times in fixed-order lists only grow
    when durations and waits grow, so each rank's compute ends no earlier; its optimizer
    steps follow its last compute. ``memo`` shares one pipeline among the ZeRO stages with
    the same cuts."""
    cfg = c.config
    sends = tuple(st.send_s for st in spec.stages[:-1])
    backs = tuple(st.back_s for st in spec.stages[:-1])
    key = (cfg.schedule, cfg.pp, cfg.microbatches, tuple((st.f_s, st.b_s, st.w_s) for st in c.stages), sends, backs)
    ends = memo.get(key) if memo is not None else None
    if ends is None:
        ends = bare_pipeline_ends(cfg.schedule, pp=cfg.pp, microbatches=cfg.microbatches,
                                  f_s=[st.f_s for st in c.stages], b_s=[st.b_s for st in c.stages],
                                  w_s=[st.w_s for st in c.stages], p2p_s=sends, p2p_back_s=backs)
        if memo is not None:
            memo[key] = ends
    return max(ends[r] + sum(st.optimizer_s for st in c.stages[r::cfg.pp]) for r in range(cfg.pp))

"""Pipeline cuts: contiguous stages of layers that minimise the slowest stage (or, interleaved,
the busiest rank) while each stage fits the device's memory.

:func:`_partition` is the outer search's step 1 (:mod:`autopar.planner.search`): binary search
on the time bound with a greedy packing (exact for contiguous min-max partitions with additive,
monotone constraints), one :class:`_Layers` of running sums per (units, recompute) so a stage's
time, activations and parameters are O(1), a memo that cuts once without memory and reuses the
cut for every ZeRO stage and schedule it fits, then for interleaved plans a local search that
balances each rank's stages (:func:`_balance_ranks`) and a smoothing pass (:func:`_smooth`).
What a stage holds under each schedule (micro-batches in flight, zero-bubble and interleaved
states) comes from :mod:`autopar.planner.pipeline_states`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autopar.planner.bounds import _unit_times, message_bytes, running_bytes, stage_cut_bytes, w_held_bytes
from autopar.planner.pipeline_states import (_inflight, _least_counts, _upper_right_hull, held_counts,  # noqa: F401
                                             held_messages, inflight_of, moments_of, rank_states, states_of,
                                             zero_bubble_moments)
from autopar.zero_def import MAX_INFLIGHT_REDUCES, PREFETCH_GROUPS

if TYPE_CHECKING:
    from autopar.planner.search import Config, Unit

__all__ = []  # internal to the planner


class _Layers:
    """A unit list's running sums under one recompute policy, for stage sums and the memory
    rule in O(1): time, activation bytes, parameters, and range maxima (sparse tables) of
    the working set (the largest op's; under recompute with what a unit holds in its backward,
    :func:`~autopar.planner.bounds.running_bytes`). Built once per (units, recompute) in a search
    (:func:`_partition`'s memo) instead of per cut."""

    def __init__(self, units: Sequence[Unit], recompute: str):
        self.n, self.remakes = len(units), recompute != "none"
        self.units = units
        self.times, pre_t, pre_a, pre_p, pre_e = [], [0.0], [0.0], [0.0], [0.0]
        for u in units:
            f, b, w, a = _unit_times(u, recompute)
            t = f + b + w
            self.times.append(t)
            pre_t.append(pre_t[-1] + t)  # the unit's total, then the running sum: ties fall as they always did
            pre_a.append(pre_a[-1] + a)
            pre_p.append(pre_p[-1] + u.n_params)
            pre_e.append(pre_e[-1] + u.expert_params)
        self.pre_t, self.pre_a, self.pre_p, self.pre_e = pre_t, pre_a, pre_p, pre_e
        # the working set: the largest op's; under recompute, the peak over units k of what the units before k
        # keep (pre_a: what the policy keeps of each, bounds._unit_times) + what k holds in its backward
        # (bounds.running_bytes: what it kept and the copies alive at their peak, or in a program that makes
        # them again at once its activations) (bounds.stage_activation_bytes; the stage's pre_a[i] is taken off)
        self.transient = _sparse_max([pre_a[k] + running_bytes(u, recompute) if self.remakes else u.transient_bytes
                                      for k, u in enumerate(units)])
        self.recompute = recompute
        self.windows = {w: _sparse_max(window_sums([u.n_params for u in units], w))
                        for w in {1 + PREFETCH_GROUPS, MAX_INFLIGHT_REDUCES}}
        # the messages a stage has received and not yet read (pipeline_states.held_messages), each
        # counted at the largest cut of the stage (its two and those inside it: a bound that grows
        # with the stage, as the packing needs) from position i - 1 to j - 1
        self.msgs = [message_bytes(u) for u in units]
        self.msg_max = _sparse_max(self.msgs[:-1] + [0.0])
        self._zero_bubble = None
        self._largest_op = None

    @property
    def largest_op(self) -> list[list[float]]:
        """Range maxima of the units' largest op's working set (sparse table, built on first use)."""
        if self._largest_op is None:
            self._largest_op = _sparse_max([u.transient_bytes for u in self.units])
        return self._largest_op

    def zero_bubble(self) -> tuple[list[float], list[list[float]], list[list[float]], float]:
        """For zero-bubble schedules' memory rule (:func:`~autopar.planner.bounds.stage_activation_bytes`
        with moments), built on first use: running sums of what a micro-batch holds between B and
        W; per unit k, what a micro-batch in k's B holds with the stage's ends taken off (the
        inputs kept before k, k's own, the W inputs after k: ``pre_a[k] + x_k - pre_h[k + 1]``, to
        which a stage [i, j) adds ``pre_h[j] - pre_a[i]``); the largest op's working set; and the
        sum over units of the smaller of what a micro-batch keeps and holds for W."""
        if self._zero_bubble is None:
            pre_h = [0.0]
            for u in self.units:
                pre_h.append(pre_h[-1] + w_held_bytes(u))
            kept = [a1 - a0 for a0, a1 in zip(self.pre_a, self.pre_a[1:])]
            in_b = [self.pre_a[k] + running_bytes(u, self.recompute) - pre_h[k + 1]
                    for k, u in enumerate(self.units)]
            self._zero_bubble = (pre_h, _sparse_max(in_b), self.largest_op,
                                 sum(min(k, h1 - h0) for k, h0, h1 in zip(kept, pre_h, pre_h[1:])))
        return self._zero_bubble

    def fits(self, i: int, j: int, s: int, *, cap: float, state_per_param: float, inflight: Sequence[int],
             buffers: tuple[float, float] = (0.0, 0.0), expert_per_param: float = 0.0, moments=None,
             held: Sequence[int] | None = None) -> bool:
        """Stage ``s`` = layers ``[i, j)`` within ``cap``: training state (``expert_per_param``: what
        an expert parameter's state holds beyond ``state_per_param``, ZeRO sharding it over fewer
        ranks, :func:`autopar.planner.state_memory.state_per_param`) + activations of the
        micro-batches in flight + the largest op's working set (under recompute: the micro-batch
        whose backward runs holds what the units before one unit keep and that unit's running
        bytes, :func:`~autopar.planner.bounds.stage_activation_bytes`) + ZeRO's collective buffers
        (``buffers``: bytes per parameter of the fullest window of gathered groups and of gradient
        buckets in flight,
        :func:`autopar.zero_def.buffer_bytes_per_param`). Zero-bubble schedules (``moments``, per
        stage :func:`zero_bubble_moments`) count activations by their states instead of ``inflight``;
        ``held`` (per stage, :func:`held_counts`) adds the messages received and not yet read."""
        return self.rule(cap=cap, state_per_param=state_per_param, inflight=inflight, buffers=buffers,
                         expert_per_param=expert_per_param, moments=moments, held=held)(i, j, s)

    def rule(self, *, cap: float, state_per_param: float, inflight: Sequence[int],
             buffers: tuple[float, float] = (0.0, 0.0), expert_per_param: float = 0.0, moments=None,
             held: Sequence[int] | None = None):
        """:meth:`fits` with the memory rule bound: ``(i, j, s) -> bool``. The search asks it
        about a million times for Llama 70B; as a closure over local names it takes half the
        time of the method call with keywords."""
        if cap == math.inf:  # (the search's cuts without memory: 30% of its checks, all true)
            return _fits_any
        pre_p, pre_a, pre_e = self.pre_p, self.pre_a, self.pre_e
        transient, remakes = self.transient, self.remakes
        gathered, sends = buffers
        gathered_w, sends_w = self.windows[1 + PREFETCH_GROUPS], self.windows[MAX_INFLIGHT_REDUCES]
        zero_bubble = moments or (None,) * len(inflight)
        msg_max = self.msg_max
        received = held if held is not None and any(held) else None
        if moments is not None:
            pre_h, in_b, largest, _ = self.zero_bubble()

        def fits(i: int, j: int, s: int) -> bool:
            mem = state_per_param * (pre_p[j] - pre_p[i])
            if expert_per_param:
                mem += expert_per_param * (pre_e[j] - pre_e[i])
            states = zero_bubble[s]
            if states is None:
                mem += inflight[s] * (pre_a[j] - pre_a[i])
                if remakes:  # the micro-batch in its backward: counted in the working set below
                    mem -= pre_a[j]
            if j > i:  # _range_max(transient, i, j), inlined
                k = (j - i).bit_length() - 1
                if states is None:
                    level = transient[k]
                    a, b = level[i], level[j - (1 << k)]
                    mem += a if a >= b else b
                else:  # zero-bubble: the fullest of the stage's states (bounds.stage_activation_bytes)
                    kept, held = pre_a[j] - pre_a[i], pre_h[j] - pre_h[i]
                    level = largest[k]
                    a, b = level[i], level[j - (1 << k)]
                    idle = a if a >= b else b  # the largest op's working set
                    level = in_b[k]
                    a, b = level[i], level[j - (1 << k)]
                    running = (a if a >= b else b) + pre_h[j] - pre_a[i]  # the micro-batch in its B
                    most = 0.0
                    for a, b in states[0]:
                        v = a * kept + b * held + idle
                        if v > most:
                            most = v
                    for a, b in states[1]:
                        v = a * kept + b * held + running
                        if v > most:
                            most = v
                    mem += most
                if gathered:
                    level = gathered_w[k]
                    a, b = level[i], level[j - (1 << k)]
                    mem += gathered * (a if a >= b else b)
                if sends:
                    level = sends_w[k]
                    a, b = level[i], level[j - (1 << k)]
                    mem += sends * (a if a >= b else b)
                if received is not None and received[s] and mem <= cap:
                    lo = i - 1 if i else 0  # (the cuts i - 1 .. j - 1)
                    k = (j - lo).bit_length() - 1
                    level = msg_max[k]
                    a, b = level[lo], level[j - (1 << k)]
                    mem += received[s] * (a if a >= b else b)
            return mem <= cap
        return fits


def _fits_any(i: int, j: int, s: int) -> bool:
    return True


def window_sums(values: Sequence[float], w: int) -> list[float]:
    """Per position u, the sum of ``values[u:u + w]`` (shorter at the end). ZeRO's buffers are
    counted over windows of consecutive layer groups; a window that runs past a stage's last
    group into the next stage's counts those too (a bound, never short)."""
    return [sum(values[u:u + w]) for u in range(len(values))]


def _sparse_max(values: list[float]) -> list[list[float]]:
    """Sparse table: level k holds the max of every 2**k consecutive values."""
    table = [values]
    k = 1
    while 2 * k <= len(values):
        prev = table[-1]
        table.append([max(prev[i], prev[i + k]) for i in range(len(values) - 2 * k + 1)])
        k *= 2
    return table


def _range_max(table: list[list[float]], i: int, j: int) -> float:
    """max(values[i:j]) (0.0 when empty) from a :func:`_sparse_max` table."""
    if j <= i:
        return 0.0
    k = (j - i).bit_length() - 1
    level = table[k]
    a, b = level[i], level[j - (1 << k)]
    return a if a >= b else b


def _partition(units: list[Unit], cfg: Config, *, cap: float, state_per_param: float,
               inflight: tuple[int, ...], memo: dict | None = None,
               buffers: tuple[float, float] = (0.0, 0.0),
               expert_per_param: float = 0.0, starts: tuple[int, ...] | None = None,
               moments=None) -> list[tuple[int, int]] | None:
    """Contiguous cuts minimising the slowest stage under the memory cap (None if none fits).
    ``starts`` (the user's pinned layout: the unit each stage after the first begins with) gives
    the cuts instead, None if a stage of it exceeds the cap.

    With ``memo`` (one dict per search; units are keyed by tp, sp, micro-batch size and ep) the
    cuts that ignore memory are made once per (units, recompute, stages) and reused by every
    ZeRO stage and schedule whose memory they fit: no cut under a memory cap can have a
    faster slowest stage (or, interleaved, better balanced ranks) than the best cut without
    one, so when that one fits it is optimal (interleaved: the rank balancing is the same local
    search from the same start). Only configurations it does not fit are cut again under
    their cap, starting the bisection at the uncapped one's bound (a cap only lowers what
    fits, so no capped cut has a faster slowest stage). ``moments``: a zero-bubble schedule's
    states per stage (:func:`zero_bubble_moments`), which count its activations."""
    # an interleaved rank's stages peak at different moments: a layout whose stages do not each fit
    # 1/v of the device at their own peaks may still fit the rank at its fullest state
    joint = dict(cap=cap * cfg.virtual_stages, state_per_param=state_per_param, buffers=buffers,
                 expert_per_param=expert_per_param)
    held = held_counts(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
    if memo is None and starts is None:
        layers = _Layers(units, cfg.recompute)
        if cfg.virtual_stages > 1:  # (as the memo's way below: the cut without a cap, if the ranks hold it)
            free = _cut(layers, cfg, cap=math.inf, state_per_param=0.0, inflight=(0,) * cfg.n_stages)[0]
            if free is not None and _ranks_fit(layers, free, cfg, **joint):
                return free
        return _cut(layers, cfg, cap=cap, state_per_param=state_per_param, inflight=inflight, buffers=buffers,
                    expert_per_param=expert_per_param, moments=moments, held=held)[0]
    layers_key = (cfg.tp, cfg.sp, cfg.microbatch_size, cfg.recompute, cfg.ep, cfg.cp, cfg.ep_tp)
    layers = memo.get(layers_key) if memo is not None else None
    if layers is None:
        layers = _Layers(units, cfg.recompute)
        if memo is not None:
            memo[layers_key] = layers
    if starts is not None:
        points = [0, *starts, len(units)]
        fits = layers.rule(cap=cap, state_per_param=state_per_param, inflight=inflight, buffers=buffers,
                           expert_per_param=expert_per_param, moments=moments, held=held)
        cuts = list(zip(points, points[1:]))
        if all(fits(i, j, s) for s, (i, j) in enumerate(cuts)) or _ranks_fit(layers, cuts, cfg, **joint):
            return cuts
        return None
    key = layers_key + (cfg.pp, cfg.virtual_stages)
    if key not in memo:
        memo[key] = _cut(layers, cfg, cap=math.inf, state_per_param=0.0, inflight=(0,) * cfg.n_stages)
    free, infeasible_below = memo[key]
    if free is None:
        return None  # too few layers for the stages: no cap changes that
    rule = dict(cap=cap, state_per_param=state_per_param, inflight=inflight, buffers=buffers,
                expert_per_param=expert_per_param, moments=moments, held=held)
    fits = layers.rule(**rule)
    if all(fits(i, j, s) for s, (i, j) in enumerate(free)) or _ranks_fit(layers, free, cfg, **joint):
        return list(free)
    # Every stage within the cap: their sum too, so state + the fewest in flight's activations
    # of the whole model must fit in n_stages caps (a quick no for most configurations that fit
    # no cut at all). Under a zero-bubble schedule, the fewest any stage keeps from their forward
    # (or holds between B and W) in its fullest such state.
    if moments is None:
        least = min(inflight) * layers.pre_a[-1]
    else:
        kept, held, both = _least_counts(moments, tuple(inflight))
        pre_h, _, _, smaller = layers.zero_bubble()
        least = max(kept * layers.pre_a[-1], held * pre_h[-1], both * smaller)
    if state_per_param * layers.pre_p[-1] + expert_per_param * layers.pre_e[-1] + least > cfg.n_stages * cap:
        return None
    return _cut(layers, cfg, **rule, lo=infeasible_below)[0]


def _ranks_fit(layers: _Layers, cuts: Sequence[tuple[int, int]], cfg: Config, *, cap: float, state_per_param: float,
               buffers: tuple[float, float], expert_per_param: float) -> bool:
    """Interleaved cuts (False for others): every rank within the device's ``cap`` with its
    stages' activations at the rank's fullest state (:func:`rank_states`; as
    :func:`~autopar.planner.bounds.rank_activation_shares` counts them for the plan), plus each
    stage's training state and ZeRO buffers as :meth:`_Layers.rule` counts them. The partitioner
    itself cuts under the per-stage rule (1/v of the device at each stage's own peak: a joint
    rule is not per stage), which can reject a layout that fits; the search's cut without a
    memory cap, the fastest, is taken when this admits it (and a pinned layout is)."""
    v, pp = cfg.virtual_stages, cfg.pp
    if v < 2:
        return False
    gathered, sends = buffers
    gathered_w, sends_w = layers.windows[1 + PREFETCH_GROUPS], layers.windows[MAX_INFLIGHT_REDUCES]
    pre_p, pre_e, pre_a = layers.pre_p, layers.pre_e, layers.pre_a
    received, msgs = held_messages(cfg.schedule, pp, cfg.microbatches, v), layers.msgs
    for r, states in enumerate(rank_states(pp, cfg.microbatches, v)):
        mine = cuts[r::pp]
        mem = 0.0
        for i, j in mine:
            mem += state_per_param * (pre_p[j] - pre_p[i]) + expert_per_param * (pre_e[j] - pre_e[i])
            mem += gathered * _range_max(gathered_w, i, j) + sends * _range_max(sends_w, i, j)
        # rank_activation_shares' sum from the running sums (the 1T search asks this 27k times, 0.6 s
        # in all; summing each stage's units per call would cost seconds; tests/test_search.py holds
        # the two equal): what each stage keeps per micro-batch; beyond that, a stage in its backward
        # holds its working set (under recompute what its unit makes again too), else the
        # rank's largest op's working set counts once
        kept = [pre_a[j] - pre_a[i] for i, j in mine]
        extra = [_range_max(layers.transient, i, j) - (pre_a[j] if layers.remakes else 0.0) for i, j in mine]
        idle = max(_range_max(layers.largest_op, i, j) for i, j in mine)
        mem += max(sum(n * k for n, k in zip(counts, kept)) + (extra[running] if running >= 0 else idle)
                   for counts, running in states)
        cut_bytes = [stage_cut_bytes(msgs, i, j) for i, j in mine]  # (held_message_shares' sum, inlined)
        mem += max(sum(n * b for n, b in zip(c, cut_bytes)) for c in received[r])
        if mem > cap:
            return False
    return True


def _cut(layers: _Layers, cfg: Config, *, cap: float, state_per_param: float, inflight: tuple[int, ...],
         lo: float = 0.0, buffers: tuple[float, float] = (0.0, 0.0),
         expert_per_param: float = 0.0, moments=None,
         held: Sequence[int] | None = None) -> tuple[list[tuple[int, int]] | None, float]:
    """:func:`_partition` without the memo; also a time bound below which no cut fits (``lo``,
    if given, is one already known)."""
    times, pre_t = layers.times, layers.pre_t
    n, pp = layers.n, cfg.n_stages
    if pp > n:
        return None, math.inf

    fits = layers.rule(cap=cap, state_per_param=state_per_param, inflight=inflight, buffers=buffers,
                       expert_per_param=expert_per_param, moments=moments, held=held)

    def greedy(bound: float) -> tuple[list[tuple[int, int]] | None, float]:
        """(the cuts, or None), and the smallest stage time above ``bound`` that the packing
        met: every bound below that one packs the same way (memory does not depend on it)."""
        cuts, i, nxt, last = [], 0, math.inf, 1
        for s in range(pp):
            if i == n:
                break
            # the longest stage from i within the bound and the memory (both monotone in j),
            # found by bisection: the same j as stepping one layer at a time, in O(log n)
            j = bisect.bisect_right(pre_t, pre_t[i] + bound, i + 1) - 1
            while j < n and pre_t[j + 1] - pre_t[i] <= bound:
                j += 1
            while j > i and pre_t[j] - pre_t[i] > bound:
                j -= 1
            if j < n:
                nxt = min(nxt, pre_t[j + 1] - pre_t[i])
            if j > i and not fits(i, j, s):
                lo_j, hi_j = i, j  # fits(i, lo_j) (empty) holds, fits(i, hi_j) does not
                guess = i + last  # stages run about as long as the one before: try its length and one
                if lo_j < guess < hi_j:  # more first (two checks where the bisection takes about six)
                    if fits(i, guess, s):
                        lo_j = guess
                        if guess + 1 < hi_j:
                            lo_j, hi_j = (guess + 1, hi_j) if fits(i, guess + 1, s) else (lo_j, guess + 1)
                    else:
                        hi_j = guess
                while hi_j - lo_j > 1:
                    mid_j = (lo_j + hi_j) // 2
                    lo_j, hi_j = (mid_j, hi_j) if fits(i, mid_j, s) else (lo_j, mid_j)
                j = lo_j
            if j == i:
                return None, nxt
            cuts.append((i, j))
            i, last = j, j - i
        return (cuts if i == n else None), nxt

    lo, hi = max(max(times), lo), pre_t[-1]
    best, _ = greedy(hi * (1 + 1e-9))
    if best is None:
        return None, math.inf
    # Bisection on the bound, with two jumps that keep it exact and shorten it (Llama 70B's
    # search cut 900 times, about 60 packings each): a packing that fits has a slowest stage
    # at most the bound tried, and that is the new upper end (the same packing again); one
    # that does not fit raises the lower end to the smallest stage time it met above the
    # bound, since every bound below that packs the same way.
    for _ in range(60):
        if hi - lo <= 1e-9 * max(hi, 1e-12):
            break
        mid = (lo + hi) / 2
        cuts, nxt = greedy(mid)
        if cuts is None:
            lo = max(mid, min(nxt, hi))
        else:
            best, hi = cuts, max(pre_t[j] - pre_t[i] for i, j in cuts)
    infeasible_below = lo
    while len(best) < pp:  # use every stage: split the largest stage in two
        k = max(range(len(best)), key=lambda x: (best[x][1] - best[x][0], -x))
        i, j = best[k]
        if j - i < 2:
            return None, math.inf
        mid = min(range(i + 1, j), key=lambda c: abs((pre_t[c] - pre_t[i]) - (pre_t[j] - pre_t[c])))
        best[k:k + 1] = [(i, mid), (mid, j)]
    best = _smooth(best, pre_t, fits)
    if cfg.virtual_stages > 1:
        best = _balance_ranks(best, pre_t, fits, cfg.pp)
    if not all(fits(i, j, s) for s, (i, j) in enumerate(best)):
        return None, math.inf
    return best, infeasible_below


def _balance_ranks(cuts: list[tuple[int, int]], pre_t: list[float], fits, pp: int) -> list[tuple[int, int]]:
    """Interleaved cuts balanced per rank, not per stage: rank r runs stages r, r + pp, ...,
    so its load is the sum of its chunks, and stage-balanced cuts of a layer count that does
    not divide evenly can give one rank a long chunk in every round (6 layers on 2 ranks x 2
    chunks: stage sizes 2,1,2,1 load the ranks 4:2; 2,1,1,2 load them 3:3).

    Local search from the stage-balanced cuts: move one cut point by one layer while that
    lowers the rank loads (sorted heaviest first, compared in that order; then the slowest
    stage) and both stages it touches still fit. Each move strictly improves a finite
    order, so it ends. Written here because it is a dozen lines over the partitioner's
    own prefix sums and memory check; an exact min-max over ranks would be an ILP per
    configuration."""
    points = [i for i, _ in cuts] + [cuts[-1][1]]
    n_stages = len(cuts)

    memo: dict[float, float] = {}  # the moves revisit the same sums: formatting each was a third of this

    def rounded(t: float) -> float:
        r = memo.get(t)
        if r is None:
            r = memo[t] = float(f"{t:.9g}")
        return r

    def rank_sum(times: list[float], r: int) -> float:
        total = 0.0  # in stage order, so a rank's sum is the same float however it is reached
        for s in range(r, n_stages, pp):
            total += times[s]
        return total

    def key(times: list[float], loads: list[float]) -> tuple:
        return tuple(sorted(loads, reverse=True)) + (rounded(max(times)),)

    times = [pre_t[points[s + 1]] - pre_t[points[s]] for s in range(n_stages)]
    loads = [rounded(rank_sum(times, r)) for r in range(pp)]
    current = key(times, loads)
    while True:
        best_move, best_key = None, current
        for c in range(1, len(points) - 1):  # cut point c ends stage c - 1 and starts stage c
            for step in (-1, 1):
                at = points[c] + step
                if not points[c - 1] < at < points[c + 1] or not (fits(points[c - 1], at, c - 1)
                                                                   and fits(at, points[c + 1], c)):
                    continue
                trial_t = times.copy()
                trial_t[c - 1] = pre_t[at] - pre_t[points[c - 1]]
                trial_t[c] = pre_t[points[c + 1]] - pre_t[at]
                trial_l = loads.copy()  # only the two ranks of the stages it touches change
                for r in {(c - 1) % pp, c % pp}:
                    trial_l[r] = rounded(rank_sum(trial_t, r))
                k = key(trial_t, trial_l)
                if k < best_key:
                    best_move, best_key = (c, at, trial_t, trial_l), k
        if best_move is None:
            return [(points[s], points[s + 1]) for s in range(len(points) - 1)]
        c, at, times, loads = best_move
        points = points[:c] + [at] + points[c + 1:]
        current = best_key


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

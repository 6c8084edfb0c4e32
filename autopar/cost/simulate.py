"""Time a training step: the step program of a plan, or a bare pipeline schedule.

:func:`simulate_program` is the one timing engine: per rank a compute stream that runs
its list in order and FIFO collective streams, with overlap, link sharing and the compute
slowdown under overlap (rules in its docstring). :func:`simulate_step` lowers a
:class:`autopar.cost.step.StepSpec` (the planner's, or one stored in a plan) and times it;
the planner's step time and the plan's ``predicted`` come from it. The search calls it with
``timeline=False``: each rank's actions before its first collective are timed in one pass
(:func:`autopar.cost.step.time_prefix`) and only the rest goes through the event engine, with
the same figures and no timeline.

:func:`simulate` times a bare pipeline schedule on the same engine: an action starts at
``max(rank free, inputs done (+ p2p_s when an input comes from another rank))``,
where ``p2p_s`` is one time for every cut or one per cut (stage c -> c + 1: a
pipeline whose neighbours sit on one node for some cuts and on two for others), for
the activations forward and, unless ``p2p_back_s`` gives their own, the gradients back,
and lasts ``f_s``, ``b_s``, ``w_s`` or ``b_s + w_s`` (fused BW) of its stage.
Activations: a micro-batch is in flight on a stage from its F until the action
that frees it, W for a split backward, BW for a fused one (Qi et al. 2024 free
part of it after B already; counting it until W is the conservative reading).

Bubble fraction = compute-stream idle time / (ranks * step time). With equal stage
times and no p2p cost this gives 1F1B's (p - 1) / (m + p - 1) (Narayanan et al. 2021,
eq. 1 rewritten as a fraction of the step rather than of the ideal time).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from autopar.cost.schedule import Action, _lockstep, _needs, _provides, validate_schedule
from autopar.cost.step import COMPUTE_KINDS, Op, StepSpec, lower_step, time_prefix

__all__ = ["SimResult", "StepResult", "simulate", "simulate_program", "simulate_step"]

_EPS = 1e-12
"""Relative slack when comparing simulated times (sums of floats)."""


@dataclass(frozen=True)
class SimResult:
    """Timing of one training step under a pipeline schedule."""

    step_time_s: float
    """Time from the first action's start (0) to the last action's end."""
    bubble_fraction: float
    """Idle time over ranks * step_time_s."""
    busy_s: tuple[float, ...]
    """Compute time per rank."""
    peak_inflight: tuple[int, ...]
    """Per rank, the most (stage, micro-batch) activations held at once, over all its chunks."""
    peak_activation_bytes: tuple[float, ...] | None
    """Per rank, the most activation bytes held at once (``act_bytes`` weights); None without it."""
    timeline: list[tuple[int, Action, float, float]]
    """(rank, action, start_s, end_s), sorted by start then rank: a Gantt chart."""


def _check_times(name: str, values: list[float] | None, n_stages: int) -> None:
    if values is None:
        return
    if len(values) != n_stages:
        raise ValueError(f"{name} has {len(values)} entries but f_s has {n_stages} (one per stage)")
    bad = [(s, v) for s, v in enumerate(values) if not v >= 0]
    if bad:
        raise ValueError(f"{name} must be >= 0 per stage; got {bad[:5]}")


def simulate(
    schedule: dict[int, list[Action]],
    *,
    f_s: list[float],
    b_s: list[float],
    w_s: list[float],
    p2p_s: float | list[float] | tuple[float, ...] = 0.0,
    act_bytes: list[float] | None = None,
    p2p_back_s: float | list[float] | tuple[float, ...] | None = None,
) -> SimResult:
    """Run ``schedule`` with the given per-stage times (``len(f_s)`` stages; stage s on rank s % ranks).

    ``p2p_s`` is the time of one transfer across any cut, or a list with one time per
    cut (``len(f_s) - 1`` entries, entry c for stage c <-> c + 1), both directions
    unless ``p2p_back_s`` (same forms) gives the gradients' transfers back their own.
    The pipeline alone: no collectives, no optimizer (:func:`simulate_step` times a whole step).

    Raises ValueError when the schedule is invalid (see ``validate_schedule``) or
    deadlocks, naming each rank's stuck action and the inputs it waits for.
    """
    n_stages = len(f_s)
    if n_stages == 0:
        raise ValueError("f_s is empty: give one forward time per stage")
    for name, values in (("b_s", b_s), ("w_s", w_s), ("act_bytes", act_bytes), ("f_s", f_s)):
        _check_times(name, values, n_stages)
    cut_s = _per_cut("p2p_s", p2p_s, n_stages)
    back_s = cut_s if p2p_back_s is None else _per_cut("p2p_back_s", p2p_back_s, n_stages)
    n_micro = 1 + max((a.microbatch for acts in schedule.values() for a in acts), default=0)
    validate_schedule(schedule, n_stages, n_micro)
    n_ranks = len(schedule)
    duration = {"F": f_s, "B": b_s, "W": w_s}
    provider = {key: str(a) for acts in schedule.values() for a in acts for key in _provides(a)}
    program: dict[int, list[Op]] = {rank: [] for rank in range(n_ranks)}
    for rank in range(n_ranks):
        for a in schedule[rank]:
            waits = []
            for key in _needs(a, n_stages):  # an input from another rank crosses the cut between the two stages
                s = key[1]
                cut = (cut_s if key[0] == "F" else back_s)[min(s, a.stage)] if s % n_ranks != rank else 0.0
                waits.append((provider[key], cut))
            dur = b_s[a.stage] + w_s[a.stage] if a.kind == "BW" else duration[a.kind][a.stage]
            program[rank].append(Op(str(a), a.kind, dur, tuple(waits), stage=a.stage, microbatch=a.microbatch,
                                    action=a))
    try:
        run = simulate_program(program)
    except ValueError:
        _lockstep(schedule, n_stages)  # a deadlock is a matter of order alone: name the stuck actions
        raise
    timeline = [(r, op.action, t0, t1) for r, op, t0, t1 in run.timeline if op.action is not None]
    peak_n, peak_bytes = zip(*(_peak_memory(schedule[rank], act_bytes) for rank in range(n_ranks)))
    return SimResult(
        step_time_s=run.step_time_s,
        bubble_fraction=run.bubble_fraction,
        busy_s=run.busy_s,
        peak_inflight=tuple(peak_n),
        peak_activation_bytes=tuple(peak_bytes) if act_bytes is not None else None,
        timeline=timeline,
    )


def _per_cut(name: str, value, n_stages: int) -> list[float]:
    cuts = [value] * max(0, n_stages - 1) if isinstance(value, (int, float)) else list(value)
    if len(cuts) != max(0, n_stages - 1) or not all(t >= 0 for t in cuts):
        raise ValueError(f"{name} must be >= 0, one time or one per cut ({max(0, n_stages - 1)}), got {value}")
    return cuts


def _peak_memory(acts: list[Action], act_bytes: list[float] | None) -> tuple[int, float]:
    """Peak in-flight count and bytes on one rank; its actions run in list order."""
    count, held, peak_count, peak_held = 0, 0.0, 0, 0.0
    for a in acts:
        weight = act_bytes[a.stage] if act_bytes is not None else 0.0
        if a.kind == "F":
            count, held = count + 1, held + weight
            peak_count, peak_held = max(peak_count, count), max(peak_held, held)
        elif a.kind in ("W", "BW"):
            count, held = count - 1, held - weight
    return peak_count, peak_held


@dataclass(frozen=True)
class StepResult:
    """Timing of one training step's program (:func:`simulate_program`), per pipeline rank."""

    step_time_s: float
    bubble_fraction: float
    """Compute-stream idle time over ranks * step_time_s."""
    busy_s: tuple[float, ...]
    """Compute-stream busy time (with the overlap slowdown)."""
    comm_s: tuple[float, ...]
    """Time during which at least one collective of the rank is in flight."""
    hidden_s: tuple[float, ...]
    """Of ``comm_s``, the time the compute stream was busy meanwhile."""
    exposed_s: tuple[float, ...]
    """``comm_s - hidden_s``: collectives in flight while the compute stream idles."""
    timeline: list[tuple[int, Op, float, float]]
    """(rank, op, start_s, end_s) of every op, sorted by start then rank."""


def simulate_step(spec: StepSpec, *, timeline: bool = True) -> StepResult:
    """Lower ``spec`` into its step program (:func:`autopar.cost.step.lower_step`) and time it.

    ``timeline=False`` (the search: thousands of micro-batches on a hundred ranks) gives the same
    times, busy, hidden and exposed seconds with an empty ``timeline``: the ops before each
    rank's first collective are timed in one pass (:func:`autopar.cost.step.time_prefix`) and
    only the rest is lowered and run through the event engine."""
    prefix = None if timeline else time_prefix(spec)
    if prefix is None:
        return simulate_program(lower_step(spec), overlap_slowdown=spec.overlap_slowdown, timeline=timeline)
    # (time_prefix checked the spec, overlap_slowdown >= 1 included)
    res = _Engine(lower_step(spec, prefix=prefix), spec.overlap_slowdown, known=prefix.ends, free=prefix.free,
                  ordered=False).run()
    step_time_s = max(res.step_time_s, *prefix.free)
    busy = tuple(b + p for b, p in zip(res.busy_s, prefix.busy))
    capacity = len(busy) * step_time_s
    return replace(res, step_time_s=step_time_s, busy_s=busy, timeline=[],
                   bubble_fraction=(capacity - sum(busy)) / capacity if capacity > 0 else 0.0)


def simulate_program(program: dict[int, list[Op]], *, overlap_slowdown: float = 1.0,
                     timeline: bool = True) -> StepResult:
    """Time per-rank op lists with one compute stream and FIFO collective streams per rank.

    Rules (the module :mod:`autopar.cost.step` says what the ops are):

    - A rank issues its list in order. A compute op is issued when it starts: it waits for
      the compute stream and its ``waits`` (each an op's end plus a delay). Any other op is
      issued as soon as the list reaches it, so a collective placed after a compute piece is
      issued when that piece starts (prefetch) and runs once its own ``waits`` are met.
    - ``SEND`` lasts its transfer time from its waits' end; ``RECV`` and other zero-length
      markers end when their waits end. p2p does not share bandwidth with collectives.
    - A collective runs when it heads its stream on every rank that takes part (``op.ranks``,
      or just the owner) and its waits are met on each. Collectives of one rank in flight at
      once on the same link share its bandwidth equally (each progresses at 1/k); one that
      spans ranks progresses at its slowest participant's rate.
    - Compute progresses at ``1 / overlap_slowdown`` while any collective of its rank is in
      flight (the collective kernels take SMs and memory bandwidth).

    ``timeline=False`` leaves the result's timeline empty (faster; the search drops it).

    Raises ValueError naming each rank's blocked op when the lists deadlock.
    """
    if not overlap_slowdown >= 1:
        raise ValueError(f"overlap_slowdown must be >= 1, got {overlap_slowdown!r}")
    return _Engine(program, overlap_slowdown, ordered=timeline).run()


class _Engine:
    """The event loop of :func:`simulate_program`. Ops are numbered; each knows how many of its
    waits are still open and the earliest time they allow, and a finished op updates the ops
    that wait for it, so per event only the list heads and stream heads (a few per rank) are
    looked at. ``known``: ends of ops timed before (waits may name them); ``free``: per rank, when
    its compute stream is free (its first compute op starts no earlier); ``ordered=False``: the
    caller drops the timeline, so it is left unsorted (the sort was a quarter of the result's time)."""

    def __init__(self, program: dict[int, list[Op]], slowdown: float, *, known: dict[str, float] | None = None,
                 free: Sequence[float] | None = None, ordered: bool = True):
        known = known or {}
        self.ordered = ordered
        self.ranks = sorted(program)
        self.program, self.slowdown = program, slowdown
        self.flat: list[tuple[int, Op]] = [(r, op) for r in self.ranks for op in program[r]]
        names = {op.name for _, op in self.flat}
        self.open = [len(op.waits) for _, op in self.flat]
        self.ready = [0.0] * len(self.flat)
        self.dependents: dict[str, list[tuple[int, float]]] = {}
        for i, (r, op) in enumerate(self.flat):
            for name, delay in op.waits:
                if name in known:
                    self.open[i] -= 1
                    self.ready[i] = max(self.ready[i], known[name] + delay)
                    continue
                if name not in names:
                    raise ValueError(f"{op} waits for {name}, which no rank's list holds")
                self.dependents.setdefault(name, []).append((i, delay))
        if free is not None:  # each rank's first compute op waits for its stream
            seen: set[int] = set()
            for i, (r, op) in enumerate(self.flat):
                if op.kind in COMPUTE_KINDS and r not in seen:
                    seen.add(r)
                    self.ready[i] = max(self.ready[i], free[r])
        self.start_of: dict[int, int] = {}
        first = 0
        for r in self.ranks:
            self.start_of[r] = first
            first += len(program[r])
        links: dict = {}
        self.link_key = [links.setdefault((op.link.bytes_per_s, op.link.latency_s) if op.link else None, len(links))
                         for _, op in self.flat]
        self.end: dict[str, float] = {}
        self.issued = [False] * len(self.flat)
        self.timed: list[tuple[float, int]] = []  # heap: (end, op) of running p2p ops and markers
        # heap: (time, op) at which an op's waits open (ops with known waits or a busy stream: from the start)
        self.wake: list[tuple[float, int]] = [(self.ready[i], i) for i in range(len(self.flat)) if self.open[i] == 0 and self.ready[i] > 0]
        heapq.heapify(self.wake)

    def _launch(self, i: int, t: float) -> None:
        """A p2p op or marker whose waits are all met ends ``seconds`` after it can start."""
        heapq.heappush(self.timed, (max(self.ready[i], t) + self.flat[i][1].seconds, i))

    def _finish(self, i: int, start: float, at: float) -> None:
        r, op = self.flat[i]
        if self.ordered:
            self.timeline.append((r, op, start, at))
        spans = self.spans[i]  # the rank's compute or collective intervals, for _result
        if spans is not None:
            spans.append((start, at))
        if at > self.last:
            self.last = at
        self.finished += 1
        if op.name in self.end:  # a collective spanning ranks: its other copies
            return
        self.end[op.name] = at
        open_, ready = self.open, self.ready
        for j, delay in self.dependents.get(op.name, ()):
            open_[j] -= 1
            when = at + delay
            if when > ready[j]:
                ready[j] = when
            if open_[j] == 0:
                self._touch(j)
                if ready[j] > at:
                    heapq.heappush(self.wake, (ready[j], j))
                other = self.flat[j][1]
                if self.issued[j] and not other.stream and other.kind not in COMPUTE_KINDS:
                    self._launch(j, at)

    def _touch(self, j: int) -> None:
        """Op ``j`` may be able to start: look at its rank's list head or its stream head."""
        r, op = self.flat[j]
        if op.stream:
            self.check.add((r, op.stream))
        else:
            self.dirty.add(r)

    def run(self) -> StepResult:
        ranks, flat, program, slowdown = self.ranks, self.flat, self.program, self.slowdown
        pos = dict.fromkeys(ranks, 0)
        # rank -> [op, work left at `since`, since, start, factor] of its running compute; its end,
        # since + left * factor, sits in `ends` (stale entries carry an older version)
        compute: dict[int, list] = {}
        ends: list[tuple[float, int, int]] = []
        version = dict.fromkeys(ranks, 0)
        streams: dict[tuple[int, str], deque[int]] = {}
        active: dict[str, list] = {}  # name -> [ops (one per rank), work left, start, ranks, rate, link]
        in_comm = dict.fromkeys(ranks, 0)  # collectives in flight per rank
        sharing: dict[tuple[int, int], int] = {}  # (rank, link) -> collectives in flight on it
        self.timeline: list[tuple[int, Op, float, float]] = []
        self.work: dict[int, list[tuple[float, float]]] = {r: [] for r in ranks}
        self.comm: dict[int, list[tuple[float, float]]] = {r: [] for r in ranks}
        self.spans = [self.work[r] if op.kind in COMPUTE_KINDS else self.comm[r] if op.stream else None
                      for r, op in flat]
        self.last = 0.0  # the latest end so far
        self.finished = 0
        self.dirty, self.check = set(ranks), set()
        total, t = len(flat), 0.0
        open_, ready, timed, wake = self.open, self.ready, self.timed, self.wake

        def rebase(r: int) -> None:
            """Rank ``r``'s collectives in flight changed: its compute continues at the new speed."""
            run = compute.get(r)
            factor = slowdown if in_comm[r] else 1.0
            if run is None or run[4] == factor:
                return
            run[1] = max(0.0, run[1] - (t - run[2]) / run[4])
            run[2], run[4] = t, factor
            version[r] += 1
            heapq.heappush(ends, (t + run[1] * factor, version[r], r))

        done = False  # some collective in `active` has no work left (scanning for one each pass cost 8%)

        def start_collective(op: Op, heads: list[int], members: tuple[int, ...]) -> None:
            nonlocal done
            key = self.link_key[heads[0]]
            active[op.name] = [heads, op.seconds, t, members, 1.0, key]
            done = done or op.seconds <= 0
            for x in members:
                in_comm[x] += 1
                sharing[x, key] = sharing.get((x, key), 0) + 1
                rebase(x)

        while True:
            slack = _EPS * (t if t > 1.0 else 1.0)
            while wake and wake[0][0] <= t + slack:
                self._touch(heapq.heappop(wake)[1])
            changed = True
            while changed:  # start everything that can start at time t
                changed = False
                while self.dirty:
                    r = self.dirty.pop()
                    ops = program[r]
                    while pos[r] < len(ops):
                        i = self.start_of[r] + pos[r]
                        op = ops[pos[r]]
                        if op.kind in COMPUTE_KINDS:
                            if r in compute or open_[i] or ready[i] > t + slack:
                                break
                            factor = slowdown if in_comm[r] else 1.0
                            compute[r] = [i, op.seconds, t, t, factor]
                            version[r] += 1
                            heapq.heappush(ends, (t + op.seconds * factor, version[r], r))
                        elif op.stream:
                            streams.setdefault((r, op.stream), deque()).append(i)
                            self.check.add((r, op.stream))
                        elif open_[i] == 0:
                            self._launch(i, t)
                        self.issued[i] = True
                        pos[r] += 1
                while self.check:
                    r, stream = self.check.pop()
                    queue = streams.get((r, stream))
                    if not queue or flat[queue[0]][1].name in active:
                        continue
                    op = flat[queue[0]][1]
                    members = op.ranks or (r,)
                    heads = [streams.get((x, stream)) for x in members]
                    if all(h and flat[h[0]][1].name == op.name and not open_[h[0]] and ready[h[0]] <= t + slack
                           for h in heads):
                        start_collective(op, [h[0] for h in heads], members)
                        changed = True
                while timed and timed[0][0] <= t + slack:
                    at, i = heapq.heappop(timed)
                    self._finish(i, at - flat[i][1].seconds, at)
                    changed = True
                while ends and ends[0][0] <= t + slack:  # compute that is done ends now
                    _, v, r = heapq.heappop(ends)
                    if v != version[r] or r not in compute:
                        continue
                    run = compute.pop(r)
                    self.dirty.add(r)
                    self._finish(run[0], run[3], t)
                    changed = True
                for name in [n for n, run in active.items() if run[1] <= 0] if done else ():
                    run = active.pop(name)
                    for i, x in zip(run[0], run[3]):
                        streams[x, flat[i][1].stream].popleft()
                        self.check.add((x, flat[i][1].stream))
                        in_comm[x] -= 1
                        sharing[x, run[5]] -= 1
                        rebase(x)
                        self._finish(i, run[2], t)
                    changed = True
                done = False
                changed = changed or bool(self.dirty or self.check)
            if self.finished == total and not active:
                break
            step = math.inf
            for run in active.values():  # dp collectives have one member: no max over ranks
                members = run[3]
                run[4] = 1.0 / (sharing[members[0], run[5]] if len(members) == 1 else
                                max(sharing[x, run[5]] for x in members))
                left = run[1] / run[4]
                if left < step:
                    step = left
            while ends and (ends[0][1] != version[ends[0][2]] or ends[0][2] not in compute):
                heapq.heappop(ends)
            if ends:
                step = min(step, ends[0][0] - t)
            if timed:
                step = min(step, timed[0][0] - t)
            if wake:
                step = min(step, wake[0][0] - t)
            if step == math.inf:
                raise ValueError(self._stuck(pos, streams))
            if step < 0.0:
                step = 0.0
            t += step
            slack = _EPS * (t if t > 1.0 else 1.0)
            for run in active.values():
                run[1] -= step * run[4]
                if run[1] <= slack:
                    run[1] = 0.0
                    done = True
        return self._result()

    def _result(self) -> StepResult:
        """Step time, and per rank the compute busy time and the collectives' time in flight,
        split by whether compute ran meanwhile (interval sweeps over the timeline)."""
        timeline, work, comm = self.timeline, self.work, self.comm
        step_time_s = self.last
        busy, flight, hidden = [], [], []
        for r in self.ranks:
            busy.append(sum(e - s for s, e in work[r]))
            merged = _union(comm[r])
            flight.append(sum(e - s for s, e in merged))
            hidden.append(_overlap(merged, sorted(work[r])))
        capacity = len(self.ranks) * step_time_s
        bubble = (capacity - sum(busy)) / capacity if capacity > 0 else 0.0
        if self.ordered:
            timeline.sort(key=lambda x: (x[2], x[0]))
        return StepResult(step_time_s=step_time_s, bubble_fraction=bubble, busy_s=tuple(busy), comm_s=tuple(flight),
                          hidden_s=tuple(hidden), exposed_s=tuple(f - h for f, h in zip(flight, hidden)),
                          timeline=timeline)

    def _stuck(self, pos, streams) -> str:
        def missing(op: Op) -> str:
            return ", ".join(n for n, _ in op.waits if n not in self.end) or "its peers on the stream"

        stuck = []
        for r in self.ranks:
            if pos[r] < len(self.program[r]):
                op = self.program[r][pos[r]]
                stuck.append(f"rank {r} at {op} waits for {missing(op)}")
        for (r, stream), queue in sorted(streams.items()):
            if queue:
                op = self.flat[queue[0]][1]
                stuck.append(f"rank {r} stream {stream} at {op} waits for {missing(op)}")
        return "step program deadlocks: " + "; ".join(stuck)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted lists of disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total

"""Time a pipeline schedule from per-stage F, B, W times: step time, bubble, memory.

Each rank runs its list (``autopar.cost.schedule``) in order. An action starts at
``max(rank free, inputs done (+ p2p_s when an input comes from another rank))``,
where ``p2p_s`` is one time for every cut or one per cut (stage c -> c + 1: a
pipeline whose neighbours sit on one node for some cuts and on two for others),
and lasts ``f_s``, ``b_s``, ``w_s`` or ``b_s + w_s`` (fused BW) of its stage.
Activations: a micro-batch is in flight on a stage from its F until the action
that frees it, W for a split backward, BW for a fused one (Qi et al. 2024 free
part of it after B already; counting it until W is the conservative reading).

Bubble fraction = idle / (ranks * step time). With equal stage times and no
p2p cost this gives 1F1B's (p - 1) / (m + p - 1) (Narayanan et al. 2021, eq. 1
rewritten as a fraction of the step rather than of the ideal time).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from autopar.cost.schedule import Action, _lockstep, _needs, _provides, validate_schedule
from autopar.cost.step import COMPUTE_KINDS, Op, StepSpec, lower_step

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
) -> SimResult:
    """Run ``schedule`` with the given per-stage times (``len(f_s)`` stages; stage s on rank s % ranks).

    ``p2p_s`` is the time of one transfer across any cut, or a list with one time per
    cut (``len(f_s) - 1`` entries, entry c for stage c <-> c + 1, both directions).
    The pipeline alone: no collectives, no optimizer (:func:`simulate_step` times a whole step).

    Raises ValueError when the schedule is invalid (see ``validate_schedule``) or
    deadlocks, naming each rank's stuck action and the inputs it waits for.
    """
    n_stages = len(f_s)
    if n_stages == 0:
        raise ValueError("f_s is empty: give one forward time per stage")
    for name, values in (("b_s", b_s), ("w_s", w_s), ("act_bytes", act_bytes), ("f_s", f_s)):
        _check_times(name, values, n_stages)
    cut_s = [p2p_s] * max(0, n_stages - 1) if isinstance(p2p_s, (int, float)) else list(p2p_s)
    if len(cut_s) != max(0, n_stages - 1) or not all(t >= 0 for t in cut_s):
        raise ValueError(f"p2p_s must be >= 0, one time or one per cut ({max(0, n_stages - 1)}), got {p2p_s}")
    n_micro = 1 + max((a.microbatch for acts in schedule.values() for a in acts), default=0)
    validate_schedule(schedule, n_stages, n_micro)
    n_ranks = len(schedule)
    duration = {"F": f_s, "B": b_s, "W": w_s}
    program: dict[int, list[Op]] = {rank: [] for rank in range(n_ranks)}
    for rank in range(n_ranks):
        for a in schedule[rank]:
            waits = []
            for kind, s, i in _needs(a, n_stages):
                if s % n_ranks == rank:
                    waits.append((f"{kind}{s}.{i}", 0.0))
                else:  # an input from another rank crosses the cut between the two stages
                    waits.append((f"{kind}{s}.{i}", cut_s[min(s, a.stage)]))
            dur = b_s[a.stage] + w_s[a.stage] if a.kind == "BW" else duration[a.kind][a.stage]
            program[rank].append(Op(str(a), a.kind, dur, tuple(waits), stage=a.stage, microbatch=a.microbatch,
                                    action=a))
            for kind, s, i in _provides(a):  # zero-time markers the consumers wait for
                program[rank].append(Op(f"{kind}{s}.{i}", "RECV", 0.0, ((str(a), 0.0),), stage=s, microbatch=i))
    _lockstep(schedule, n_stages)  # a deadlock is a matter of order alone: name the stuck actions
    run = simulate_program(program)
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


def simulate_step(spec: StepSpec) -> StepResult:
    """Lower ``spec`` into its step program (:func:`autopar.cost.step.lower_step`) and time it."""
    return simulate_program(lower_step(spec), overlap_slowdown=spec.overlap_slowdown)


class _Running:
    """A compute piece or collective in progress: ``left`` seconds of work at full speed."""

    __slots__ = ("op", "left", "start", "ranks")

    def __init__(self, op: Op, start: float, ranks: tuple[int, ...]):
        self.op, self.left, self.start, self.ranks = op, op.seconds, start, ranks


def simulate_program(program: dict[int, list[Op]], *, overlap_slowdown: float = 1.0) -> StepResult:
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

    Raises ValueError naming each rank's blocked op when the lists deadlock.
    """
    if not overlap_slowdown >= 1:
        raise ValueError(f"overlap_slowdown must be >= 1, got {overlap_slowdown!r}")
    ranks = sorted(program)
    end: dict[str, float] = {}
    pos = {r: 0 for r in ranks}
    compute: dict[int, _Running | None] = {r: None for r in ranks}
    streams: dict[tuple[int, str], deque[Op]] = {}
    pending: list[tuple[int, Op]] = []  # issued p2p ops and markers waiting for their inputs
    timed: list[tuple[float, int, Op]] = []  # (end, rank, op) of running p2p ops
    active: dict[str, _Running] = {}  # running collectives by name
    timeline: list[tuple[int, Op, float, float]] = []
    busy = {r: 0.0 for r in ranks}
    comm = {r: 0.0 for r in ranks}
    hidden = {r: 0.0 for r in ranks}
    total = sum(len(v) for v in program.values())
    finished = 0
    t = 0.0

    def ready_at(op: Op) -> float | None:
        """When ``op``'s waits are all met, or None while one of them has not ended."""
        at = 0.0
        for name, delay in op.waits:
            if name not in end:
                return None
            at = max(at, end[name] + delay)
        return at

    def due(at: float | None) -> bool:
        return at is not None and at <= t + _EPS * max(1.0, t)

    def finish(rank: int, op: Op, start: float) -> None:
        nonlocal finished
        end[op.name] = t
        timeline.append((rank, op, start, t))
        finished += 1

    while True:
        changed = True
        while changed:  # start everything that can start at time t
            changed = False
            for r in ranks:
                ops = program[r]
                while pos[r] < len(ops):
                    op = ops[pos[r]]
                    if op.kind in COMPUTE_KINDS:
                        if compute[r] is not None or not due(ready_at(op)):
                            break
                        compute[r] = _Running(op, t, (r,))
                    elif op.stream:
                        streams.setdefault((r, op.stream), deque()).append(op)
                    else:
                        pending.append((r, op))
                    pos[r] += 1
                    changed = True
            for item in list(pending):
                r, op = item
                if due(ready_at(op)):
                    pending.remove(item)
                    if op.seconds > 0:
                        timed.append((t + op.seconds, r, op))
                    else:
                        finish(r, op, t)
                    changed = True
            for (r, _), queue in streams.items():
                if not queue or queue[0].name in active:
                    continue
                op = queue[0]
                members = op.ranks or (r,)
                heads = [streams.get((x, op.stream)) for x in members]
                if all(h and h[0].name == op.name for h in heads) and \
                        all(due(ready_at(h[0])) for h in heads):
                    active[op.name] = _Running(op, t, members)
                    changed = True
            for r in ranks:  # zero-length work ends at once
                run = compute[r]
                if run is not None and run.left <= 0:
                    compute[r] = None
                    finish(r, run.op, run.start)
                    changed = True
            for name, run in list(active.items()):
                if run.left <= 0:
                    _end_collective(run, streams, finish)
                    del active[name]
                    changed = True
        if finished == total and not active:
            break
        in_comm = {r: False for r in ranks}
        sharing: dict[tuple[int, object], int] = {}
        for run in active.values():
            for r in run.ranks:
                in_comm[r] = True
                sharing[r, run.op.link] = sharing.get((r, run.op.link), 0) + 1
        rate = {name: min(1.0 / sharing[r, run.op.link] for r in run.ranks) for name, run in active.items()}
        speed = {r: 1.0 / overlap_slowdown if in_comm[r] else 1.0 for r in ranks}
        step = math.inf
        for r, run in compute.items():
            if run is not None:
                step = min(step, run.left / speed[r])
        for name, run in active.items():
            step = min(step, run.left / rate[name])
        for at, _, _ in timed:
            step = min(step, at - t)
        for at in _future_starts(program, pos, compute, pending, streams, ready_at):
            if at > t:
                step = min(step, at - t)
        if step == math.inf:
            raise ValueError(_program_stuck(program, pos, pending, streams, end))
        step = max(step, 0.0)
        for r in ranks:
            if in_comm[r]:
                comm[r] += step
                if compute[r] is not None:
                    hidden[r] += step
            if compute[r] is not None:
                busy[r] += step
        t += step
        slack = _EPS * max(1.0, t)
        for r, run in compute.items():
            if run is not None:
                run.left -= step * speed[r]
                if run.left <= slack:
                    run.left = 0.0
        for name, run in active.items():
            run.left -= step * rate[name]
            if run.left <= slack:
                run.left = 0.0
        for item in [x for x in timed if x[0] <= t + slack]:
            timed.remove(item)
            at, r, op = item
            finish(r, op, at - op.seconds)
    step_time_s = max((e for _, _, _, e in timeline), default=0.0)
    capacity = len(ranks) * step_time_s
    bubble = (capacity - sum(busy.values())) / capacity if capacity > 0 else 0.0
    timeline.sort(key=lambda x: (x[2], x[0]))
    return StepResult(step_time_s=step_time_s, bubble_fraction=bubble, busy_s=tuple(busy[r] for r in ranks),
                      comm_s=tuple(comm[r] for r in ranks), hidden_s=tuple(hidden[r] for r in ranks),
                      exposed_s=tuple(comm[r] - hidden[r] for r in ranks), timeline=timeline)


def _end_collective(run: _Running, streams, finish) -> None:
    for r in run.ranks:
        streams[r, run.op.stream].popleft()
        finish(r, run.op, run.start)


def _future_starts(program, pos, compute, pending, streams, ready_at):
    """Times at which a blocked op's waits will be met (a p2p delay still running)."""
    for r, ops in program.items():
        if pos[r] < len(ops) and compute[r] is None and ops[pos[r]].kind in COMPUTE_KINDS:
            at = ready_at(ops[pos[r]])
            if at is not None:
                yield at
    for _, op in pending:
        at = ready_at(op)
        if at is not None:
            yield at
    for queue in streams.values():
        if queue:
            at = ready_at(queue[0])
            if at is not None:
                yield at


def _program_stuck(program, pos, pending, streams, end) -> str:
    def missing(op: Op) -> str:
        return ", ".join(n for n, _ in op.waits if n not in end) or "its peers on the stream"

    stuck = []
    for r in sorted(program):
        if pos[r] < len(program[r]):
            op = program[r][pos[r]]
            stuck.append(f"rank {r} at {op} waits for {missing(op)}")
    for (r, stream), queue in sorted(streams.items()):
        if queue:
            stuck.append(f"rank {r} stream {stream} at {queue[0]} waits for {missing(queue[0])}")
    stuck += [f"rank {r} {op} waits for {missing(op)}" for r, op in pending]
    return "step program deadlocks: " + "; ".join(stuck)

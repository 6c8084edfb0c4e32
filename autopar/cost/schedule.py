"""Pipeline schedules as data: actions, generators, validation, send/recv lowering.

A schedule is ``dict[rank, list[Action]]``: each pipeline rank's compute actions in
the order it runs them, in the notation of ``torch.distributed.pipelining``
(``0F3`` = stage 0 forward of micro-batch 3, ``1B0`` = backward w.r.t. the input,
``0W2`` = weight gradient, ``2BW1`` = fused full backward). Stage ``s`` lives on
rank ``s % n_ranks`` (Megatron's interleaved layout: stage = chunk * n_ranks + rank;
with one chunk per rank, stage == rank). Sends and receives are implicit:

- ``F(s, i)`` needs ``F(s-1, i)``;
- ``B(s, i)`` / ``BW(s, i)`` need ``F(s, i)`` and the backward of ``(s+1, i)``;
- ``W(s, i)`` needs ``B(s, i)``; a fused ``BW`` is a B for its consumers.

``with_comm`` lowers a schedule into explicit per-rank SEND/RECV lists, and
``autopar.cost.simulate`` times one (bubble, peak in-flight micro-batches).

References:
- GPipe: Huang et al. 2019, https://arxiv.org/abs/1811.06965
- 1F1B (PipeDream-Flush): Narayanan et al. 2021, https://arxiv.org/abs/2006.09503
- Interleaved 1F1B: Narayanan et al. 2021 (Megatron-LM), https://arxiv.org/abs/2104.04473,
  and Megatron-LM ``forward_backward_pipelining_with_interleaving``
- Zero Bubble PP (ZB-H1, ZB-H2): Qi et al. 2024, https://arxiv.org/abs/2401.10241,
  and torch ``ScheduleInterleavedZeroBubble`` (ZB1P)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "KINDS",
    "SCHEDULE_KINDS",
    "Action",
    "cached_schedule",
    "format_grid",
    "gpipe",
    "interleaved_1f1b",
    "make_schedule",
    "one_f_one_b",
    "parse_action",
    "timing_order",
    "validate_schedule",
    "with_comm",
    "zb_h1",
    "zb_h2",
    "zero_bubble_order",
]

KINDS = ("F", "B", "W", "BW")
"""Compute kinds: forward, backward w.r.t. input, weight gradient, fused full backward."""

Schedule = dict[int, list["Action"]]


@dataclass(frozen=True, order=True)
class Action:
    """One compute action: ``kind`` of ``stage`` on ``microbatch``; prints as ``0F3``."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind must be one of {KINDS}, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action stage and microbatch must be >= 0, got {self.stage}, {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)``: ``"1BW3"`` -> ``Action(1, "BW", 3)``."""
    for kind in ("BW", "F", "B", "W"):  # "BW" before "B"
        stage, sep, mb = text.partition(kind)
        if sep and stage.isdigit() and mb.isdigit():
            return Action(int(stage), kind, int(mb))
    raise ValueError(f"cannot parse action {text!r}; expected e.g. '0F3', '1B0', '0W2', '2BW1'")


# Dependency keys: ("F" | "B" | "W", stage, microbatch). A fused BW provides "B" and "W".
_Key = tuple[str, int, int]


def _provides(a: Action) -> tuple[_Key, ...]:
    if a.kind == "BW":
        return (("B", a.stage, a.microbatch), ("W", a.stage, a.microbatch))
    return ((a.kind, a.stage, a.microbatch),)


def _needs(a: Action, n_stages: int) -> tuple[_Key, ...]:
    s, i = a.stage, a.microbatch
    if a.kind == "F":
        return (("F", s - 1, i),) if s > 0 else ()
    if a.kind == "W":
        return (("B", s, i),)
    return (("F", s, i),) + ((("B", s + 1, i),) if s + 1 < n_stages else ())


def _check_args(n_stages: int, n_micro: int, what: str = "n_stages") -> None:
    for name, value in ((what, n_stages), ("n_micro", n_micro)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


# ---------------------------------------------------------------- generators


def gpipe(n_stages: int, n_micro: int) -> Schedule:
    """All forwards, then all fused backwards (ascending micro-batch, as torch's ScheduleGPipe)."""
    _check_args(n_stages, n_micro)
    return {
        s: [Action(s, "F", i) for i in range(n_micro)] + [Action(s, "BW", i) for i in range(n_micro)]
        for s in range(n_stages)
    }


def one_f_one_b(n_stages: int, n_micro: int) -> Schedule:
    """1F1B: ``p - s - 1`` warm-up forwards on stage s, steady F/BW pairs, BW cool-down."""
    _check_args(n_stages, n_micro)
    sched: Schedule = {}
    for s in range(n_stages):
        warmup = min(n_stages - s - 1, n_micro)
        acts = [Action(s, "F", i) for i in range(warmup)]
        for j in range(n_micro - warmup):
            acts += [Action(s, "F", warmup + j), Action(s, "BW", j)]
        acts += [Action(s, "BW", i) for i in range(n_micro - warmup, n_micro)]
        sched[s] = acts
    return sched


def interleaved_1f1b(n_ranks: int, n_micro: int, n_virtual: int) -> Schedule:
    """Megatron's interleaved 1F1B: ``n_virtual`` model chunks per rank, stage = chunk * n_ranks + rank.

    Micro-batches go round in groups of ``n_ranks`` per chunk ("depth first"); rank r
    warms up with ``2 (p - r - 1) + (v - 1) p`` forwards (capped at ``v m``), then
    alternates F and fused BW, then cools down. Needs ``n_micro % n_ranks == 0``.
    """
    _check_args(n_ranks, n_micro, "n_ranks")
    if isinstance(n_virtual, bool) or not isinstance(n_virtual, int) or n_virtual < 2:
        raise ValueError(
            f"interleaved_1f1b needs n_virtual (model chunks per rank) >= 2, got {n_virtual!r}; "
            "use one_f_one_b for one chunk per rank"
        )
    p, m, v = n_ranks, n_micro, n_virtual
    if m % p:
        raise ValueError(
            f"interleaved 1F1B needs n_micro divisible by n_ranks, got n_micro={m}, n_ranks={p}; "
            f"try n_micro={m + p - m % p} or {max(p, m - m % p)}"
        )
    total = m * v  # (chunk, micro-batch) pairs per rank

    def stage(k: int, rank: int, forward: bool) -> int:
        chunk = (k % (p * v)) // p
        return (chunk if forward else v - 1 - chunk) * p + rank

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    sched: Schedule = {}
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        acts = [Action(stage(k, r, True), "F", micro(k)) for k in range(warmup)]
        for j in range(total - warmup):
            k = warmup + j
            acts += [Action(stage(k, r, True), "F", micro(k)), Action(stage(j, r, False), "BW", micro(j))]
        acts += [Action(stage(k, r, False), "BW", micro(k)) for k in range(total - warmup, total)]
        sched[r] = acts
    return sched


def zb_h1(n_stages: int, n_micro: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, sec. 2.1; torch's ZB1P): 1F1B with B split from W, W deferred.

    Stage s warms up with 1F1B's ``p - s - 1`` forwards and runs each B as soon as
    its gradient arrives; its W's trail by ``s`` micro-batches and fill the drain.
    Every stage then holds up to ``p`` micro-batches in flight: the paper's memory
    claim is that the *maximum over stages* (stage 0's ``p``) equals 1F1B's, not
    that each stage matches 1F1B's ``p - s``. With T_F = T_B = T_W the step is
    ``3m + (p - 1)`` slots against 1F1B's ``3(m + p - 1)``: a third of the bubble.
    """
    return _actions(zero_bubble_order("zb-h1", n_stages, n_micro), n_stages)


def zb_h2(n_stages: int, n_micro: int) -> Schedule:
    """ZB-H2 (Qi et al. 2024, sec. 2.2): up to ``2p - 1`` micro-batches in flight, no inner bubble.

    Built by running the unit-time (T_F = T_B = T_W) pipeline greedily: each free
    stage runs a ready B first (the critical path), else its next F while it
    holds fewer than ``2p - 1`` micro-batches, else its oldest pending W. With
    ``m >= 2p - 1`` stage s is then busy without a gap from slot s to ``s + 3m``
    (the paper's parallelogram). One step only: the optimizer post-validation that lets
    consecutive steps overlap is out of scope, so with T_F = T_B = T_W the step
    time equals ZB-H1's; ZB-H2 wins when T_W < T_B, where ZB-H1's bubble
    ``(p - 1)(T_F + T_B - T_W)`` grows.
    """
    return _actions(zero_bubble_order("zb-h2", n_stages, n_micro), n_stages)


def _actions(order, n_stages: int) -> Schedule:
    sched: Schedule = {s: [] for s in range(n_stages)}
    for s, kind, mb in order:
        sched[s].append(Action(s, kind, mb))
    return sched


def zero_bubble_order(kind: str, p: int, m: int):
    """The zero-bubble schedules' actions as (stage, kind, micro-batch), each stage's in its order,
    without building :class:`Action` objects: the planner walks them for every pipeline shape it
    weighs (:func:`autopar.planner.pipeline_states.zero_bubble_moments`)."""
    _check_args(p, m)
    if kind == "zb-h1":
        for s in range(p):
            warmup = min(p - s - 1, m)
            yield from ((s, "F", i) for i in range(warmup))
            for j in range(m):  # steady F, B (, W) then cool-down B (, W)
                if warmup + j < m:
                    yield s, "F", warmup + j
                yield s, "B", j
                if j >= s:  # W of micro-batch j - s trails its B by s micro-batches
                    yield s, "W", j - s
            yield from ((s, "W", i) for i in range(max(0, m - s), m))
        return
    # zb-h2: one unit-time slot per round; a stage sees what the others finished in earlier rounds
    cap = 2 * p - 1
    n_f, n_b, n_w = [0] * p, [0] * p, [0] * p
    while any(n < m for n in n_w):
        f_done, b_done = n_f[:], n_b[:]
        for s in range(p):
            if n_b[s] < n_f[s] and (s + 1 == p or n_b[s] < b_done[s + 1]):
                yield s, "B", n_b[s]
                n_b[s] += 1
            elif n_f[s] < m and n_f[s] - n_w[s] < cap and (s == 0 or n_f[s] < f_done[s - 1]):
                yield s, "F", n_f[s]
                n_f[s] += 1
            elif n_w[s] < n_b[s]:
                yield s, "W", n_w[s]
                n_w[s] += 1


SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")


def make_schedule(kind: str, *, n_stages: int, n_micro: int, n_virtual: int = 1) -> Schedule:
    """Build a schedule by name. ``n_stages`` is the pipeline degree (ranks); with
    ``kind="interleaved"`` each rank holds ``n_virtual`` chunks, so there are
    ``n_stages * n_virtual`` stages; every other kind needs ``n_virtual == 1``."""
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; expected one of {', '.join(SCHEDULE_KINDS)}")
    if kind == "interleaved":
        return interleaved_1f1b(n_stages, n_micro, n_virtual)
    if n_virtual != 1:
        raise ValueError(
            f"schedule {kind!r} has one chunk per rank; got n_virtual={n_virtual}, use 'interleaved'"
        )
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-h2": zb_h2}[kind](n_stages, n_micro)


@lru_cache(maxsize=256)
def cached_schedule(kind: str, n_stages: int, n_micro: int, n_virtual: int = 1) -> Schedule:
    """:func:`make_schedule`, built once per shape: the planner reads the same lists for memory,
    bounds and timing thousands of times. Callers must not change the lists."""
    return make_schedule(kind, n_stages=n_stages, n_micro=n_micro, n_virtual=n_virtual)


Wait = tuple[int, int, int]
"""(index of the needed action in the order, cut its input crosses or -1 on the same rank,
1 for a gradient sent back / 0 for an activation)."""


@lru_cache(maxsize=32)  # (a deep pipeline's order holds ~10^5 entries: keep few)
def timing_order(kind: str, n_ranks: int, n_micro: int, n_virtual: int = 1) -> tuple[tuple[int, Action, tuple[Wait, ...]], ...]:
    """Every action of ``kind``'s schedule once, as ``(rank, action, waits)``, in an order where
    each comes after the actions it needs and after the one before it on its rank. The actions
    are those of :func:`cached_schedule` (the same objects).

    Timing passes walk this instead of running an event loop: an action's start is its rank's
    free time or an input's end (plus the cut's transfer), whichever is later, and both are
    known when it is reached (``autopar.planner.bounds.bare_pipeline_ends``,
    ``autopar.cost.step.time_prefix``)."""
    sched = cached_schedule(kind, n_ranks, n_micro, n_virtual)
    n_stages = n_ranks * n_virtual
    # Where each (stage, micro-batch)'s F and B landed in the order (-1: not yet), in flat lists
    # rather than a dict of key tuples: deep pipelines reach ~10^5 actions, and building 16 such
    # orders was most of the Llama 405B search's bare-pipeline bounds on 1024x8xH100 (6.4 s of a
    # 20.8 s plan; 2.2 s with the lists). The sweep is the same: each rank in turn runs forward as
    # far as its inputs allow.
    done_f = [-1] * (n_stages * n_micro)
    done_b = [-1] * (n_stages * n_micro)
    out: list[tuple[int, Action, tuple[Wait, ...]]] = []
    pos = [0] * n_ranks
    left = sum(len(sched[r]) for r in range(n_ranks))
    while left:
        moved = False
        for r in range(n_ranks):
            acts = sched[r]
            p = pos[r]
            while p < len(acts):
                a = acts[p]
                s, k = a.stage, a.stage * n_micro + a.microbatch
                if a.kind == "F":  # after the stage before's F (an activation across a cut)
                    if s:
                        j = done_f[k - n_micro]
                        if j < 0:
                            break
                        waits = ((j, -1 if (s - 1) % n_ranks == r else s - 1, 0),)
                    else:
                        waits = ()
                    done_f[k] = len(out)
                elif a.kind == "W":  # after its own B, on this rank
                    j = done_b[k]
                    if j < 0:
                        break
                    waits = ((j, -1, 1),)
                else:  # B or BW: after its own F, and the stage after's B (a gradient across a cut)
                    j = done_f[k]
                    if j < 0:
                        break
                    if s + 1 < n_stages:
                        j2 = done_b[k + n_micro]
                        if j2 < 0:
                            break
                        waits = ((j, -1, 0), (j2, -1 if (s + 1) % n_ranks == r else s, 1))
                    else:
                        waits = ((j, -1, 0),)
                    done_b[k] = len(out)
                out.append((r, a, waits))
                p += 1
                left -= 1
                moved = True
            pos[r] = p
        if not moved:  # make_schedule's lists are validated: this is a bug, not an input error
            raise RuntimeError(f"{kind} schedule for {n_ranks} ranks, {n_micro} micro-batches, v={n_virtual} "
                               f"deadlocks")
    return tuple(out)


# ---------------------------------------------------------------- validation


def _n_ranks(schedule: Schedule, n_stages: int) -> int:
    n_ranks = len(schedule)
    if sorted(schedule) != list(range(n_ranks)) or n_ranks == 0:
        raise ValueError(f"schedule ranks must be 0..n-1, got {sorted(schedule)}")
    if n_stages % n_ranks:
        raise ValueError(f"n_stages={n_stages} is not a multiple of the {n_ranks} ranks in the schedule")
    return n_ranks


def validate_schedule(schedule: Schedule, n_stages: int, n_micro: int) -> None:
    """Check completeness and same-rank order; raise one ValueError listing every problem.

    Each (stage, micro-batch) needs exactly one F and either one fused BW or one B
    and one W, all on rank ``stage % n_ranks``; on that rank B/BW come after the F
    and W after the B. Cross-rank order (deadlock) is the simulator's job.
    """
    _check_args(n_stages, n_micro)
    n_ranks = _n_ranks(schedule, n_stages)
    problems: list[str] = []
    seen: dict[Action, int] = {}
    for rank in range(n_ranks):
        done: set[_Key] = set()
        for a in schedule[rank]:
            if not isinstance(a, Action):
                problems.append(f"rank {rank}: {a!r} is not an Action")
                continue
            if a.stage >= n_stages or a.microbatch >= n_micro:
                problems.append(f"rank {rank}: {a} is outside {n_stages} stages x {n_micro} micro-batches")
                continue
            if a.stage % n_ranks != rank:
                problems.append(f"rank {rank}: {a} belongs on rank {a.stage % n_ranks}")
            if a in seen:
                problems.append(f"rank {rank}: {a} appears more than once")
            seen[a] = rank
            local = [k for k in _needs(a, n_stages) if k[1] == a.stage]
            for key in local:
                if key not in done:
                    problems.append(f"rank {rank}: {a} runs before {key[1]}{key[0]}{key[2]}")
            done.update(_provides(a))
    for s in range(n_stages):
        for i in range(n_micro):
            have = {k for k in KINDS if Action(s, k, i) in seen}
            if "F" not in have:
                problems.append(f"missing {Action(s, 'F', i)}")
            if "BW" in have and have & {"B", "W"}:
                problems.append(f"{s}BW{i} and split {s}B{i}/{s}W{i} both present")
            elif "BW" not in have:
                problems += [f"missing {Action(s, k, i)}" for k in ("B", "W") if k not in have]
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise ValueError("invalid pipeline schedule:\n  " + "\n  ".join(shown))


# ---------------------------------------------------------------- lowering and display


def _stuck_message(schedule: Schedule, pos: dict[int, int], done: set[_Key], n_stages: int) -> str:
    stuck = []
    for rank in sorted(schedule):
        if pos[rank] < len(schedule[rank]):
            a = schedule[rank][pos[rank]]
            waits = ", ".join(f"{k[1]}{k[0]}{k[2]}" for k in _needs(a, n_stages) if k not in done)
            stuck.append(f"rank {rank} at {a} waits for {waits}")
    return "schedule deadlocks: " + "; ".join(stuck)


def _lockstep(schedule: Schedule, n_stages: int) -> list[list[tuple[int, Action]]]:
    """Unit-time execution: each step, every rank whose next action's inputs finished
    in earlier steps runs it. Returns the (rank, action) pairs of each step."""
    pos = {rank: 0 for rank in schedule}
    done: set[_Key] = set()
    steps: list[list[tuple[int, Action]]] = []
    while any(pos[r] < len(acts) for r, acts in schedule.items()):
        step = []
        for rank in sorted(schedule):
            if pos[rank] < len(schedule[rank]):
                a = schedule[rank][pos[rank]]
                if all(k in done for k in _needs(a, n_stages)):
                    step.append((rank, a))
        if not step:
            raise ValueError(_stuck_message(schedule, pos, done, n_stages))
        for rank, a in step:
            pos[rank] += 1
            done.update(_provides(a))
        steps.append(step)
    return steps


def _n_stages_of(schedule: Schedule) -> int:
    return 1 + max((a.stage for acts in schedule.values() for a in acts), default=0)


def with_comm(schedule: Schedule, n_stages: int) -> dict[int, list[str]]:
    """Per-rank action lists with explicit ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``.

    A compute action whose output crosses ranks is followed by its SEND; the peer's
    RECV is appended to the peer's list at that same moment of a unit-time lockstep
    run (as torch's ``_add_send_recv``). All lists are thus subsequences of one
    global order in which every RECV sits at its SEND, so neither batched
    isend/irecv nor blocking rendezvous p2p can deadlock, and the SENDs from a to b
    are posted in the order b posts the RECVs (NCCL matches p2p in order).
    """
    n_ranks = _n_ranks(schedule, n_stages)
    out: dict[int, list[str]] = {rank: [] for rank in range(n_ranks)}
    for step in _lockstep(schedule, n_stages):
        for rank, a in step:
            out[rank].append(str(a))
            if a.kind == "F" and a.stage + 1 < n_stages:
                peer_stage, tag = a.stage + 1, "F"
            elif a.kind in ("B", "BW") and a.stage > 0:
                peer_stage, tag = a.stage - 1, "B"
            else:
                continue
            peer = peer_stage % n_ranks
            if peer != rank:
                out[rank].append(f"{a.stage}SEND_{tag}{a.microbatch}")
                out[peer].append(f"{peer_stage}RECV_{tag}{a.microbatch}")
    return out


def format_grid(schedule: Schedule) -> str:
    """Step x rank grid of a unit-time run (every action one step, ``.`` = idle).

    For a timed Gantt chart use ``simulate(...).timeline``.
    """
    steps = _lockstep(schedule, _n_stages_of(schedule))
    ranks = sorted(schedule)
    cells = [["step"] + [f"rank{r}" for r in ranks]]
    for t, step in enumerate(steps):
        row = dict(step)
        cells.append([str(t)] + [str(row[r]) if r in row else "." for r in ranks])
    widths = [max(len(row[c]) for row in cells) for c in range(len(cells[0]))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in cells)

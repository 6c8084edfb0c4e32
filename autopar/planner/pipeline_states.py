"""What a pipeline stage holds under each schedule, read off the schedules' actions: the peak
micro-batches in flight per stage (:func:`_inflight`), a zero-bubble stage's states (micro-batches
between F and B, and between B and W, which hold different bytes: :func:`zero_bubble_moments`),
an interleaved rank's states (micro-batches in flight on each of its stages:
:func:`rank_states`), and the messages a stage has received and not yet read
(:func:`held_messages`). The partitioner's memory rule (:mod:`autopar.planner.partition`) and the
plan's stage memory (:func:`autopar.planner.bounds.stage_activation_bytes`) weigh them.
"""

from __future__ import annotations

from functools import lru_cache

from autopar.cost.schedule import _lockstep, zero_bubble_order
from autopar.planner.bounds import _schedule

__all__ = []  # internal to the planner


@lru_cache(maxsize=4096)
def _inflight(kind: str, pp: int, m: int, v: int = 1) -> tuple[int, ...]:
    """Per stage, the peak number of its micro-batches whose activations it holds (from its F
    to its W or BW).

    The search asks this of every configuration, most of which are never timed, so the
    schedules' own warm-up depths give it without building their action lists
    (:mod:`autopar.cost.schedule`): GPipe holds all ``m``; 1F1B runs ``p - s - 1`` forwards
    before stage s's first backward, so it holds ``min(p - s, m)``; ZB-H1 adds its W's lag of
    ``s`` micro-batches, ``min(p, m)`` on every stage; ZB-H2 fills every stage to its cap of
    ``2p - 1``. The interleaved schedule's count is read off its lists, built at ``min(m, 2p)``
    micro-batches: its warm-up (at most ``2(p - 1) + (v - 1) p`` forwards) ends within the first
    ``2p`` micro-batches of each chunk and the steady state repeats it. tests/test_search.py
    checks every form against the lists over a range of shapes."""
    if kind == "gpipe":
        return (m,) * pp
    if kind == "1f1b":
        return tuple(min(pp - s, m) for s in range(pp))
    if kind == "zb-h1":
        return (min(pp, m),) * pp
    if kind == "zb-h2":
        return (min(2 * pp - 1, m),) * pp
    return inflight_of(_schedule(kind, pp, min(m, 2 * pp) if kind == "interleaved" else m, v), pp * v)


Counts = tuple[tuple[int, int], ...]


def zero_bubble_moments(kind: str, pp: int, m: int) -> tuple[tuple[Counts, Counts] | None, ...] | None:
    """Per stage of a zero-bubble schedule after the first (None for the others, which run each
    micro-batch's B and W together, and for the first stage), the states in which it can peak,
    as two lists of counts: while no B runs, (micro-batches between their F and their B,
    micro-batches between their B and their W); while one runs its B, (the others between F and
    B, those between B and W). Each list keeps only the counts some weighing of the two kinds is
    largest at (:func:`_upper_right_hull`; :func:`autopar.planner.bounds.stage_activation_bytes`
    weighs them). Read off the actions at ``min(m, 3 * pp)`` micro-batches, after which no new
    state appears (``tests/test_search.py`` checks them against the actions at full length over a
    range of shapes, up to pp = 32; at ``2 * pp + 1`` ZB-H2 still misses some)."""
    if kind not in ("zb-h1", "zb-h2"):
        return None
    return _zero_bubble_moments(kind, pp, min(m, 3 * pp))


@lru_cache(maxsize=4096)
def _zero_bubble_moments(kind: str, pp: int, m: int) -> tuple[tuple[Counts, Counts] | None, ...]:
    # (the first stage sends no input gradient back, so its B is empty and its W the whole
    # backward: it holds what 1F1B's stages do, counted by ``_inflight``)
    return (None,) + moments_of(zero_bubble_order(kind, pp, m), pp)[1:]


def moments_of(order, pp: int) -> tuple[tuple[Counts, Counts], ...]:
    """:func:`zero_bubble_moments` of a schedule's actions, (stage, kind, micro-batch), each
    stage's in its order (one stage per rank)."""
    idle: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    running: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    before, after = [0] * pp, [0] * pp
    for s, kind, _ in order:
        if kind == "F":
            before[s] += 1
            idle[s].add((before[s], after[s]))
        elif kind == "B":
            running[s].add((before[s] - 1, after[s]))
            before[s], after[s] = before[s] - 1, after[s] + 1
        else:  # W
            idle[s].add((before[s], after[s]))
            after[s] -= 1
    return tuple((_upper_right_hull(i), _upper_right_hull(r)) for i, r in zip(idle, running))


@lru_cache(maxsize=4096)
def _least_counts(moments: tuple, inflight: tuple[int, ...]) -> tuple[int, int, int]:
    """For :func:`_partition`'s quick no, counts every stage holds at its peak at least: micro-batches
    keeping what their forward kept, micro-batches holding their W's inputs, and the two together
    (each then holds at least the smaller of the two per unit)."""
    counts = [x[0] + x[1] if x else ((n - 1, 0),) for x, n in zip(moments, inflight)]
    return (min(max(a for a, _ in c) for c in counts), min(max(b for _, b in c) for c in counts),
            min(max(a + b for a, b in c) for c in counts))


def _upper_right_hull(points) -> Counts:
    """The counts some ``a * K + b * H`` with K, H >= 0 is largest at (the rest never is: a
    stage's memory is such a sum, so they need not be weighed): the upper hull of the counts
    that no other has at least as many of both kinds in, by Andrew's monotone chain."""
    most: dict[int, int] = {}
    for a, b in points:  # per count of the first kind, the most of the second
        most[a] = max(b, most.get(a, b))
    front, highest = [], -1
    for a in sorted(most, reverse=True):  # then only those above every count to their right
        if most[a] > highest:
            front.append((a, most[a]))
            highest = most[a]
    front.reverse()
    hull: list[tuple[int, int]] = []
    for p in front:  # a ascending, so b descending
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])) >= 0:
            hull.pop()  # (hull[-1] lies on or under the chord from hull[-2] to p)
        hull.append(p)
    return tuple(hull)


def rank_states(pp: int, m: int, v: int) -> tuple[tuple[tuple[tuple[int, ...], int], ...], ...]:
    """Interleaved 1F1B: per rank, the states it can peak in, as (micro-batches in flight of each
    of its stages r, r + pp, ..., the one of those whose backward runs or -1), only those no other
    state with the same one running holds at least as many of on every stage. A rank's stages
    peak at different moments (stage 0 with the warm-up's forwards, its later stages later), so
    its activations are the fullest of these states, not the sum of each stage's own peak
    (:func:`_inflight`), which over-counted a rank's by 15-51% (``bench/recompute.py --pp
    interleaved --virtual 2``). Read off the lists at ``min(m, 2 * pp)`` micro-batches as
    :func:`_inflight` is (``tests/test_search.py`` checks them against the lists at full length)."""
    return _rank_states(pp, min(m, 2 * pp), v)


@lru_cache(maxsize=1024)
def _rank_states(pp: int, m: int, v: int) -> tuple[tuple[tuple[tuple[int, ...], int], ...], ...]:
    return states_of(_schedule("interleaved", pp, m, v), pp, v)


def states_of(sched, pp: int, v: int) -> tuple[tuple[tuple[tuple[int, ...], int], ...], ...]:
    """:func:`rank_states` of the action lists ``sched`` (``v`` stages per rank)."""
    out = []
    for r in range(pp):
        live, seen = [0] * v, set()
        for a in sched[r]:
            k = a.stage // pp
            if a.kind == "F":
                live[k] += 1
                seen.add((tuple(live), -1))
            elif a.kind in ("W", "BW"):
                seen.add((tuple(live), k))
                live[k] -= 1
        out.append(tuple(sorted(_undominated(seen))))
    return tuple(out)


def _undominated(states) -> list[tuple[tuple[int, ...], int]]:
    """The states (counts, running) that no other with the same running holds at least as many
    of on every count. Taken in decreasing total, each is checked against those kept so far
    only: one that dominates another has a larger total, and whatever dominates a state, some
    kept one does (O(states x kept) instead of the pairwise O(states^2), which was most of the
    search's time for 1T-class pipelines once every interleaved layout was checked by rank)."""
    kept: list[tuple[tuple[int, ...], int]] = []
    for x in sorted(states, key=lambda st: -sum(st[0])):
        counts, running = x
        if not any(y[1] == running and all(a >= b for a, b in zip(y[0], counts)) for y in kept):
            kept.append(x)
    return kept


def inflight_of(sched, n_stages: int) -> tuple[int, ...]:
    """Per stage, the peak number of micro-batches between its F and its W or BW in ``sched``'s lists."""
    live = [0] * n_stages
    peaks = [0] * n_stages
    for acts in sched.values():
        for a in acts:
            if a.kind == "F":
                live[a.stage] += 1
                peaks[a.stage] = max(peaks[a.stage], live[a.stage])
            elif a.kind in ("W", "BW"):
                live[a.stage] -= 1
    return tuple(peaks)


def held_messages(kind: str, pp: int, m: int, v: int = 1) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, the most messages each of its stages holds received and not yet read: the
    runtime (:mod:`autopar.runtime.pipeline`) posts a receive where its action list has it, at
    the peer's send (:func:`autopar.cost.schedule.with_comm`), and its buffer lives until the
    piece that reads it, so a stage after the first holds the next micro-batch's input while it
    runs its backward (1F1B), and an interleaved rank several inputs and gradients at once (up
    to ``pp / 2`` on one of its stages). Each rank's counts (activations and gradients together,
    per stage: ``v`` numbers) at every moment one of its pieces runs, the message that piece
    reads taken as read, only those no other moment holds at least as many of on every stage.
    The plan weighs them with the larger message at the stage's two cuts
    (:func:`autopar.planner.bounds.held_message_shares`) and adds the fullest to the rank's peak
    (a bound: the moment with the most messages need not be the one with the most activations).

    Interleaved: read off the lists at ``min(m, 2 * pp)`` micro-batches, as :func:`rank_states`.
    The schedules with one stage per rank, which the search sizes by the hundreds, by rule
    (their lists give the same or, for ZB-H2 below ``2 pp`` micro-batches, up to one message
    fewer on some stages): a stage after the first holds one input received ahead (ZB-H2: two, its
    forwards run further ahead) once there are two micro-batches, and ZB-H1's first stage one
    gradient once ``m > pp``. ``tests/test_search.py`` checks both against the full lists."""
    if pp == 1:
        return (((0,) * v,),)
    if v == 1 and kind in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        later = min(2 if kind == "zb-h2" else 1, m - 1)
        return tuple(((int(kind == "zb-h1" and m > pp) if r == 0 else later,),) for r in range(pp))
    return _held_messages(kind, pp, min(m, 2 * pp), v)


@lru_cache(maxsize=4096)
def held_counts(kind: str, pp: int, m: int, v: int = 1) -> tuple[int, ...]:
    """Per stage, the most messages it holds received and not yet read at once (:func:`held_messages`)."""
    out = [0] * (pp * v)
    for r, vectors in enumerate(held_messages(kind, pp, m, v)):
        for k in range(v):
            out[r + k * pp] = max(c[k] for c in vectors)
    return tuple(out)


@lru_cache(maxsize=1024)
def _held_messages(kind: str, pp: int, m: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return messages_of(_schedule(kind, pp, m, v), pp, v)


def messages_of(sched, pp: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """:func:`held_messages` of the action lists ``sched``: a receive is posted at the unit-time
    lockstep step of its send, after the actions of lower ranks in that step, as
    :func:`autopar.cost.schedule.with_comm` places it."""
    n = pp * v
    events: dict[int, list[tuple[int, int, int, bool]]] = {r: [] for r in range(pp)}  # (compute?, stage, reads)
    for step in _lockstep(sched, n):
        for r, a in step:
            s = a.stage
            events[r].append((1, s // pp, s > 0 if a.kind == "F" else a.kind in ("B", "BW") and s < n - 1))
            peer = s + 1 if a.kind == "F" and s + 1 < n else s - 1 if a.kind in ("B", "BW") and s > 0 else None
            if peer is not None and peer % pp != r:
                events[peer % pp].append((0, peer // pp, True))
    out = []
    for r in range(pp):
        held, seen = [0] * v, set()
        for compute, k, reads in events[r]:
            if not compute:
                held[k] += 1
                continue
            held[k] -= reads
            seen.add(tuple(held))
        out.append(tuple(sorted(c for c, _ in _undominated((c, -1) for c in seen))))
    return tuple(out)

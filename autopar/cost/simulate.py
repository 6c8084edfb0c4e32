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

from dataclasses import dataclass

from autopar.cost.schedule import Action, _needs, _provides, _stuck_message, validate_schedule

__all__ = ["SimResult", "simulate"]


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
    end_s: dict[tuple[str, int, int], float] = {}
    free_s = [0.0] * n_ranks
    pos = {rank: 0 for rank in range(n_ranks)}
    timeline: list[tuple[int, Action, float, float]] = []
    remaining = sum(len(acts) for acts in schedule.values())
    while remaining:
        progress = False
        for rank in range(n_ranks):
            acts = schedule[rank]
            while pos[rank] < len(acts):
                a = acts[pos[rank]]
                needs = _needs(a, n_stages)
                if any(k not in end_s for k in needs):
                    break
                start = free_s[rank]
                for k in needs:  # an input from another rank crosses the cut between the two stages
                    start = max(start, end_s[k] + (cut_s[min(k[1], a.stage)] if k[1] % n_ranks != rank else 0.0))
                if a.kind == "BW":
                    dur = b_s[a.stage] + w_s[a.stage]
                else:
                    dur = duration[a.kind][a.stage]
                end = start + dur
                for k in _provides(a):
                    end_s[k] = end
                free_s[rank] = end
                timeline.append((rank, a, start, end))
                pos[rank] += 1
                remaining -= 1
                progress = True
        if not progress:
            raise ValueError(_stuck_message(schedule, pos, set(end_s), n_stages))

    step_time_s = max(free_s)
    busy_s = tuple(sum(e - s for r, _, s, e in timeline if r == rank) for rank in range(n_ranks))
    capacity_s = n_ranks * step_time_s
    bubble = (capacity_s - sum(busy_s)) / capacity_s if capacity_s > 0 else 0.0
    peak_n, peak_bytes = zip(*(_peak_memory(schedule[rank], act_bytes) for rank in range(n_ranks)))
    timeline.sort(key=lambda t: (t[2], t[0]))
    return SimResult(
        step_time_s=step_time_s,
        bubble_fraction=bubble,
        busy_s=busy_s,
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

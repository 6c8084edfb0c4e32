"""Timing a search candidate: its step program's inputs (:func:`step_spec`), the simulation the
search ranks by (:func:`_simulate`), and the pipeline-only timing and dp pricing the report and
tests read. Split from :mod:`autopar.planner.search`, which re-exports these names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from autopar import zero_def
from autopar.cluster import Cluster
from autopar.cost import comm
from autopar.cost.simulate import SimResult, simulate, simulate_step
from autopar.cost.step import StageCost, StepSpec, TiedCost
from autopar.planner.bounds import FUSED_BACKWARD, _COLLECTIVE_S, _pipeline_bound_s, _schedule

if TYPE_CHECKING:
    from autopar.planner.search import Candidate, StagePlan

__all__ = ["grad_sync_s", "simulate_stages", "cut_times", "step_spec", "pipeline_bound_s"]


def grad_sync_s(grad_bytes: float, *, zero: int, dp: int, microbatches: int, link: comm.Link) -> float:
    """Data-parallel collectives of one stage's gradient bucket in one step, as
    :mod:`autopar.zero_def` defines them for ZeRO stage ``zero``: stage 0 all-reduces once,
    stage 1 reduce-scatters once and gathers the updated parameters, stage 2 reduce-scatters
    every micro-batch, stage 3 also gathers the parameters twice per micro-batch."""
    if dp == 1:
        return 0.0
    counts = zero_def.step_collective_counts(zero, n_micro=microbatches)
    return sum(n * _COLLECTIVE_S[kind](grad_bytes, dp, link) for kind, n in counts.items())


def simulate_stages(kind: str, *, microbatches: int, f_s: list[float], b_s: list[float], w_s: list[float],
                    p2p_s: float | Sequence[float], pp: int | None = None,
                    p2p_back_s: float | Sequence[float] | None = None) -> SimResult:
    """The pipeline part of a step: ``kind``'s action lists for ``len(f_s)`` stages on ``pp``
    ranks (default: one stage per rank), timed; ``p2p_s`` is one transfer time for every
    cut or one per cut, ``p2p_back_s`` the same for the gradients sent back (default ``p2p_s``).

    The plan stores each stage's F, B, W and the p2p time, so a report can redraw
    exactly the timeline the search ranked by (``autopar.report``)."""
    pp = pp or len(f_s)
    sched = _schedule(kind, pp, microbatches, len(f_s) // pp)
    fused = kind in FUSED_BACKWARD
    return simulate(sched, f_s=list(f_s), b_s=[b + (w if fused else 0.0) for b, w in zip(b_s, w_s)],
                    w_s=[0.0 if fused else w for w in w_s], p2p_s=p2p_s, p2p_back_s=p2p_back_s)


def cut_times(stages: Sequence[StagePlan], links: Sequence[comm.Link]) -> tuple[tuple[float, float], ...]:
    """Per cut, (the activation messages the stage before it sends, the gradient messages sent
    back) for one micro-batch over the cut's link: each message (one per dtype) a transfer."""
    return tuple((sum(comm.p2p_s(b, link) for _, b in st.send_messages),
                  sum(comm.p2p_s(b, link) for _, b in st.back_messages)) for st, link in zip(stages, links))


def step_spec(c: Candidate, cluster: Cluster) -> StepSpec:
    """The step program's inputs for a candidate: per stage its layer groups, optimizer time and
    p2p time over its cut's link; the dp link; the parameters two pipeline ranks share."""
    cfg = c.config
    links = cluster.pipeline_links(pp=cfg.pp, dp=cfg.dp, tp=cfg.tp, n_stages=len(c.stages))
    cuts = cut_times(c.stages, links)
    stages = tuple(StageCost(groups=st.groups, optimizer_s=st.optimizer_s,
                             send_s=cuts[s][0] if s < len(cuts) else 0.0,
                             send_back_s=cuts[s][1] if s < len(cuts) else 0.0) for s, st in enumerate(c.stages))
    index = {u: (s, g) for s, st in enumerate(c.stages) for g, u in enumerate(st.layers)}
    shared: dict[str, list] = {}  # parameter -> [(stage, group)], its owner first, and its bytes
    for s, st in enumerate(c.stages):
        for fqn, reader, owner, nbytes in st.copies:
            if owner not in index:  # an owner the units do not name (no layer instance holds it): no pair
                continue
            shared.setdefault(fqn, [[index[owner]], nbytes])[0].append(index[reader])
    tied = []
    for fqn, (where, nbytes) in sorted(shared.items()):
        pp_ranks = tuple(sorted({s % cfg.pp for s, _ in where}))
        link = comm.stage_group_link(pp_ranks, dp=cfg.dp, tp=cfg.tp, devices_per_node=cluster.devices_per_node,
                                     device=cluster.device)
        tied.append(TiedCost(name=fqn, stages=tuple(s for s, _ in where), groups=tuple(g for _, g in where),
                             nbytes=nbytes, link=link))
    return StepSpec(schedule=cfg.schedule, pp=cfg.pp, microbatches=cfg.microbatches, zero=cfg.zero, dp=cfg.dp,
                    stages=stages, dp_link=cluster.link_for_group(cfg.dp, stride=cfg.tp), tied=tuple(tied))


def pipeline_bound_s(c: Candidate, cluster: Cluster) -> float:
    """:func:`_pipeline_bound_s` of a candidate (for tests and reports)."""
    return _pipeline_bound_s(c, step_spec(c, cluster))


def _simulate(c: Candidate, cluster: Cluster, memo: dict | None = None, *, spec: StepSpec | None = None) -> Candidate:
    """``c`` with its simulated step time; ``memo`` (one dict per search) shares a simulation
    between candidates whose step programs are equal; ``spec`` is ``step_spec(c, cluster)`` if
    already built."""
    spec = spec or step_spec(c, cluster)
    res = memo.get(spec) if memo is not None else None
    if res is None:
        res = simulate_step(spec, timeline=False)  # the report redraws the timeline from the plan
        if memo is not None:
            memo[spec] = res
    cuts = tuple(st.send_s for st in spec.stages[:-1])
    backs = tuple(st.back_s for st in spec.stages[:-1])
    return replace(c, step_time_s=res.step_time_s, bubble_fraction=res.bubble_fraction, spec=spec, step=res,
                   p2p_s=max(cuts + backs, default=0.0), p2p_cut_s=cuts, p2p_back_cut_s=backs)

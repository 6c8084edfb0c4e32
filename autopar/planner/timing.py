"""Timing a search candidate: its step program's inputs (:func:`step_spec`), the simulation the
search ranks by (:func:`_simulate`), and the pipeline-only timing and dp pricing the report and
tests read. Split from :mod:`autopar.planner.search`, which re-exports these names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from autopar.cluster import Cluster
from autopar.cost import comm
from autopar.cost.simulate import SimResult, simulate, simulate_step
from autopar.cost.step import StageCost, StepSpec, TiedCost, group_dp_s
from autopar.planner.bounds import FUSED_BACKWARD, _pipeline_bound_s, _schedule, replica_group

if TYPE_CHECKING:
    from autopar.planner.search import Candidate, StagePlan

__all__ = ["grad_sync_s", "simulate_stages", "message_send", "cut_sends", "candidate_cut_sends", "cut_times",
           "step_spec", "pipeline_bound_s"]


def grad_sync_s(grad_bytes: float, *, zero: int, dp: int, microbatches: int, link: comm.Link) -> float:
    """Data-parallel collectives of one stage's gradient bucket in one step, as
    :mod:`autopar.zero_def` defines them for ZeRO stage ``zero``: stage 0 all-reduces once,
    stage 1 reduce-scatters once and gathers the updated parameters, stage 2 reduce-scatters
    every micro-batch, stage 3 also gathers the parameters twice per micro-batch
    (:func:`autopar.cost.step.group_dp_s`, which the search and the step program price with)."""
    return group_dp_s(grad_bytes, zero=zero, dp=dp, link=link, microbatches=microbatches)


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


def message_send(message: tuple[str, float, float, float], link: comm.Link, tp: int,
                 tp_link: comm.Link | None) -> tuple[float, float, float]:
    """How the runtime sends one pipeline message (:class:`autopar.planner.cuts.Messages`) over
    ``link``: (bytes one rank sends, bytes its receiver's tp group all-gathers, seconds).
    Its values replicated on tp go as tp pieces gathered on ``tp_link`` after the transfer
    (Megatron-LM's scatter/gather) where that is faster than sending them whole: across
    nodes for large messages; not on NVLink or for small ones, where the gather's latency
    outweighs the bytes saved."""
    _, whole, pieces, gathered = message
    plain_s = comm.p2p_s(whole, link)
    if gathered and tp > 1:
        split_s = comm.p2p_s(pieces, link) + comm.all_gather_s(gathered, tp, tp_link)
        if split_s < plain_s:
            return pieces, gathered, split_s
    return whole, 0.0, plain_s


def cut_sends(stages: Sequence[StagePlan], links: Sequence[comm.Link], *, tp: int = 1,
              tp_link: comm.Link | None = None) -> tuple[tuple[tuple, tuple], ...]:
    """Per cut, (the activation messages the stage before it sends, the gradient messages sent
    back) for one micro-batch over the cut's link, each message (one per dtype) as
    (dtype, :func:`message_send`'s bytes, gathered bytes and seconds)."""
    def sends(messages, link):
        return tuple((m[0], *message_send(m, link, tp, tp_link)) for m in messages)

    return tuple((sends(st.send_messages, link), sends(st.back_messages, link)) for st, link in zip(stages, links))


def cut_times(stages: Sequence[StagePlan], links: Sequence[comm.Link], *, tp: int = 1,
              tp_link: comm.Link | None = None) -> tuple[tuple[float, float], ...]:
    """Per cut, the seconds of (the activation messages, the gradient messages sent back) per
    micro-batch: :func:`cut_sends`' transfers, one after another."""
    return tuple((sum(m[3] for m in fwd), sum(m[3] for m in back))
                 for fwd, back in cut_sends(stages, links, tp=tp, tp_link=tp_link))


def candidate_cut_sends(c: Candidate, cluster: Cluster) -> tuple[tuple[tuple, tuple], ...]:
    """:func:`cut_sends` of a candidate's cuts on ``cluster``'s links."""
    cfg = c.config
    links = cluster.pipeline_links(pp=cfg.pp, dp=cfg.dp, tp=cfg.tp, n_stages=len(c.stages))
    return cut_sends(c.stages, links, tp=cfg.tp, tp_link=cluster.link_for_group(cfg.tp, stride=1))


def step_spec(c: Candidate, cluster: Cluster) -> StepSpec:
    """The step program's inputs for a candidate: per stage its layer groups, optimizer time and
    p2p time over its cut's link; the dp link; the parameters two pipeline ranks share."""
    cfg = c.config
    cuts = [(sum(m[3] for m in fwd), sum(m[3] for m in back)) for fwd, back in candidate_cut_sends(c, cluster)]
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
    replicas, replica_link = replica_group(cluster, dp=cfg.dp, tp=cfg.tp, ep=cfg.ep_dp)
    return StepSpec(schedule=cfg.schedule, pp=cfg.pp, microbatches=cfg.microbatches, zero=cfg.zero, dp=cfg.dp,
                    stages=stages, dp_link=cluster.link_for_group(cfg.dp, stride=cfg.tp), tied=tuple(tied),
                    replicas=replicas, replica_link=replica_link)


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

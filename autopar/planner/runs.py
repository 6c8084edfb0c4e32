"""Runs of ops eliminated before the sharding MIP (:mod:`autopar.planner.ilp`).

About 40% of a transformer's ops (Llama tiny at tp=2: 196 of 497) read one tensor that no
other op reads, and make one that only the next op reads (norm -> cast -> mul -> ...). Such an
op only links its neighbours' placements: for every placement p its producer may emit and q
its consumer may need, the cheapest way through a run of them (the reshards into, between and
out of them, plus their own costs) is a small dynamic program. So the MIP keeps one pairwise
edge per run, priced ``cost[p, q]``, and the run's ops are chosen after solving by following
the argmins back (:func:`fill_runs`). Exact (variable elimination on a path): the optimum is
the same, and the MIP has fewer variables and a relaxation at least as tight (the LP can no
longer mix the run's ops' candidates fractionally). Ties inside a run go to the lowest
candidate index. Prices come in as functions, so this module knows graphs, not costs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from autopar.passes.strategies import SEdge, Strategy, StrategyGraph

__all__ = ["Run", "find_runs", "fill_runs"]


@dataclass(frozen=True)
class Run:
    ops: tuple[int, ...]
    """The eliminated ops, in order."""
    edges: tuple[SEdge, ...]
    """producer -> ops[0], ops[0] -> ops[1], ..., ops[-1] -> consumer."""
    cost: dict
    """(p, q) -> the run's cheapest cost."""
    back: dict
    """(p, q) -> the run's candidate indices that reach it."""


def find_runs(g: StrategyGraph, groups: list[list[SEdge]], restricted: set[int],
              edge_cost: Callable[[SEdge, str, str], float], own_cost: Callable[[int, Strategy], float]) -> list[Run]:
    """The maximal runs of ``g`` and their prices. ``groups``: the MIP's edges by tensor (an edge
    alone in its group is its tensor's only reader); ``restricted``: ops with forbidden candidates
    (kept in the MIP); ``edge_cost(e, p, q)`` and ``own_cost(v, s)`` in the MIP's units."""
    ins, outs = defaultdict(list), defaultdict(list)
    for e in g.edges:
        ins[e.dst].append(e)
        outs[e.src].append(e)
    alone = {id(group[0]) for group in groups if len(group) == 1}

    def inner(v: int) -> bool:
        return (g.nodes[v].kind == "op" and v not in restricted and len(ins[v]) == 1 and len(outs[v]) == 1
                and id(ins[v][0]) in alone and id(outs[v][0]) in alone)

    runs = []
    for v in range(len(g.nodes)):
        if not inner(v) or inner(ins[v][0].src):
            continue  # not an op of a run, or not the first of its run
        ops, edges = [v], [ins[v][0]]
        while inner(outs[ops[-1]][0].dst):
            edges.append(outs[ops[-1]][0])
            ops.append(edges[-1].dst)
        edges.append(outs[ops[-1]][0])
        runs.append(_priced(g, tuple(ops), tuple(edges), edge_cost, own_cost))
    return runs


def _priced(g: StrategyGraph, ops: tuple[int, ...], edges: tuple[SEdge, ...], edge_cost, own_cost) -> Run:
    first, last = edges[0], edges[-1]
    ps = dict.fromkeys(s.outs[first.src_out] for s in g.nodes[first.src].candidates)
    qs = dict.fromkeys(s.ins[last.dst_in] for s in g.nodes[last.dst].candidates)
    cost, back = {}, {}
    for p in ps:
        cands = g.nodes[ops[0]].candidates
        best = [edge_cost(first, p, s.ins[first.dst_in]) + own_cost(ops[0], s) for s in cands]
        paths = [(j,) for j in range(len(cands))]
        for e, v in zip(edges[1:], ops[1:]):
            prev, cands = g.nodes[e.src].candidates, g.nodes[v].candidates
            nxt, nxt_paths = [], []
            for s in cands:
                via = [best[i] + edge_cost(e, prev[i].outs[e.src_out], s.ins[e.dst_in]) for i in range(len(prev))]
                i = min(range(len(via)), key=via.__getitem__)
                nxt.append(via[i] + own_cost(v, s))
                nxt_paths.append(paths[i] + (len(nxt_paths),))
            best, paths = nxt, nxt_paths
        last_cands = g.nodes[ops[-1]].candidates
        for q in qs:
            through = [best[j] + edge_cost(last, last_cands[j].outs[last.src_out], q) for j in range(len(best))]
            j = min(range(len(through)), key=through.__getitem__)
            cost[p, q], back[p, q] = through[j], paths[j]
    return Run(ops=ops, edges=edges, cost=cost, back=back)


def fill_runs(choice: tuple[int, ...], runs: list[Run], g: StrategyGraph) -> tuple[int, ...]:
    """``choice`` with each run's ops set from its ends' chosen placements."""
    out = list(choice)
    for run in runs:
        first, last = run.edges[0], run.edges[-1]
        p = g.nodes[first.src].candidates[out[first.src]].outs[first.src_out]
        q = g.nodes[last.dst].candidates[out[last.dst]].ins[last.dst_in]
        for v, j in zip(run.ops, run.back[p, q]):
            out[v] = j
    return tuple(out)

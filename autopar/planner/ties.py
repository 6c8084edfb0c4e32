"""Tying the iterations of unrolled loops in the sharding MIP (:func:`tie_loops`).

A Python loop in ``forward`` is unrolled by the trace into one copy of its body per pass;
:func:`autopar.planner.ilp.solve` merges the copies into one MIP op before building the MIP,
so they share a strategy, and prices the merged problem with :class:`TiedPrices` so that its
objective is still what the answer costs in the whole problem."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from autopar.cost.comm import Link
from autopar.passes.strategies import SEdge, Strategy, StrategyGraph
from autopar.planner.ilp import _UNIT_S, Problem, _edge_link, _own_cost, _Prices, _tensor_groups, reshard_s

__all__ = ["TIE_MIN", "TiedPrices", "tie_loops"]


class TiedPrices(_Prices):
    """The costs of a tied problem (:func:`tie_loops`), each the sum of the costs of what
    it stands for in the whole problem: an op's over its loop's iterations (whose sizes may
    differ, as in a chunked scan's triangular loop), a merged edge's over the tensors behind
    it, a merged tensor group's over its tensors."""

    def __init__(self, whole: Problem, members: dict[int, list[int]], parts: dict[int, list],
                 cover_parts: list[dict[str, list]]):
        self.whole, self.members, self.parts, self.cover_parts = whole, members, parts, cover_parts
        self._memo: dict[tuple, float] = {}

    def own(self, v: int, s: Strategy) -> float:
        return sum(_own_cost(self.whole, u, s) for u in self.members[v])

    def _sum(self, parts, p: str, q: str) -> float:
        g = self.whole.graph
        return sum(w * reshard_s(p, q, nbytes, g.axis_size, link)[0] for w, nbytes, link in parts) / _UNIT_S

    def edge(self, e, p: str, q: str) -> float:
        key = (id(e), p, q)
        if key not in self._memo:
            self._memo[key] = self._sum(self.parts[id(e)], p, q)
        return self._memo[key]

    def cover(self, k: int, group: list, p: str, q: str, weight: int) -> float:
        return self._sum(self.cover_parts[k][q], p, q)


TIE_MIN = 4
"""Ops that one source line makes at least this many times in one layer are tied
(:func:`tie_loops`); fewer are left apart (two calls of a helper on one line)."""


def tie_loops(problem: Problem) -> tuple[Problem, list[int], list[list], TiedPrices] | None:
    """The problem with each unrolled loop's iterations merged into one op, or None if there are none.

    A Python loop in ``forward`` (a state-space or linear-attention model's scan over time steps
    or over a chunk's rows, an RNN, a loop over experts) is unrolled by the trace: Mamba's and
    Kimi-Linear's two traced layers make 2,600-6,300 ops, and their MIPs took most of a plan's
    60+ CPU seconds; so is the loop over a hybrid stack's layers, which are not all alike and
    so are traced one by one (OLMo hybrid: 24 layers, 15,368 ops). Ops of one phase and weight
    with the same ``SNode.tie`` (target, call stack, layer signature), candidates and forbidden
    candidates differ only in their sizes and layers; so do ops of one call with the same
    ``SNode.tie_line`` and the same sizes (a scan's per-step slices, which ``tie`` keeps apart by
    their place in the call). Each such class of at least ``TIE_MIN`` ops ties, and classes of the
    two likenesses that share an op join (union-find); smaller ones never add up. Merged,
    such a class is one op whose cost for a strategy is the sum of its members' costs, and
    edges merge too (an edge from iteration t to t+1 becomes a self-edge: the reshard the
    class's own strategy implies, paid by every step). The tied problem prices each answer
    exactly as the whole problem does (:class:`TiedPrices`): a merged edge costs the reshards
    of the tensors behind it, each at the largest weight among its consumers in the class; a
    merged tensor group holds the tensors of one producer class whose consumers fall in the
    same classes (the last iteration's output may have other readers), and pays, per
    placement its consumers need, one reshard of each of its tensors.

    Returns the smaller problem, the node each original node became, its tensor groups and
    their prices."""
    g = problem.graph
    forbidden: dict[int, frozenset] = defaultdict(frozenset)
    for v, i in problem.forbidden:
        forbidden[v] = forbidden[v] | {i}
    parent = list(range(len(g.nodes)))  # union-find over the two likenesses

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    likes: dict[tuple, list[int]] = defaultdict(list)  # each likeness's classes
    for v, n in enumerate(g.nodes):
        if n.kind == "op" and n.tie:
            same = (n.phase, n.weight, n.candidates, forbidden[v])
            likes[("tie", n.tie, *same)].append(v)
            if n.tie_line:
                likes[("line", n.tie_line, n.flops, n.bytes_moved, n.out_bytes, *same)].append(v)
    for members in likes.values():
        if len(members) >= TIE_MIN:  # (a loop; two smaller classes do not add up to one)
            for v in members[1:]:
                parent[find(v)] = find(members[0])
    classes: dict[int, list[int]] = defaultdict(list)
    for v in range(len(g.nodes)):
        classes[find(v)].append(v)
    head = {v: members[0] for members in classes.values() if len(members) > 1 for v in members}
    if not head:
        return None
    index, nodes, members = {}, [], defaultdict(list)
    for v, n in enumerate(g.nodes):
        if head.get(v, v) == v:
            index[v] = len(nodes)
            nodes.append(n)
    rep = [index[head.get(v, v)] for v in range(len(g.nodes))]
    for v in range(len(g.nodes)):
        members[rep[v]].append(v)
    merged: dict[tuple, tuple[dict, dict]] = {}  # group key -> (edge key -> parts, q -> parts)
    for group in _tensor_groups(g):
        e0 = group[0]
        nbytes = g.nodes[e0.src].out_bytes[e0.src_out](problem.batch)
        most: dict[tuple, tuple[int, Link]] = {}
        needs: dict[str, tuple[int, Link]] = {}
        for e in group:
            key = (rep[e.src], e.src_out, rep[e.dst], e.dst_in, e.virtual)
            link = _edge_link(problem, g.nodes[e.dst].kind)
            most[key] = (max(most.get(key, (0,))[0], e.weight), link)
            for q in {s.ins[e.dst_in] for s in g.nodes[e.dst].candidates}:
                needs[q] = (max(needs.get(q, (0,))[0], e.weight), link)
        pattern = (rep[e0.src], e0.src_out, e0.virtual, g.nodes[e0.dst].kind == "param", frozenset(most))
        edge_parts, cover_parts = merged.setdefault(pattern, ({}, defaultdict(list)))
        for key, (w, link) in most.items():
            edge_parts.setdefault(key, []).append((w, nbytes, link))
        for q, (w, link) in needs.items():
            cover_parts[q].append((w, nbytes, link))
    groups, parts = [], {}
    for edge_parts, _ in merged.values():
        group = []
        for (a, o, d, i, virt), ps in edge_parts.items():
            e = SEdge(src=a, src_out=o, dst=d, dst_in=i, weight=sum(w for w, _, _ in ps), virtual=virt)
            parts[id(e)] = ps
            group.append(e)
        groups.append(group)
    small = StrategyGraph(nodes=tuple(nodes), edges=tuple(e for group in groups for e in group),
                          axis_size=g.axis_size, global_batch=g.global_batch)
    small_problem = replace(problem, graph=small, forbidden=frozenset((rep[v], i) for v, i in problem.forbidden))
    prices = TiedPrices(problem, dict(members), parts, [dict(c) for _, c in merged.values()])
    return small_problem, rep, groups, prices

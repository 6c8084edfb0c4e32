r"""The intra-layer sharding ILP: one placement strategy per op on the tensor-parallel axis.

Given the strategy graph (ops V, tensor edges E, candidates S_v per op) of the
model's distinct layers and a mesh axis of n devices:

    variables   x[v,s] in {0,1}        op v runs strategy s
                y[e,p,q] in [0,1]      edge e = (u -> v), the only consumer of its tensor,
                                       turns u's output placement p into v's input placement q
                r[k,p,q] in [0,1]      tensor k, read by several consumers, is resharded
                                       once from p to q (p != q)
    minimise    sum_v w_v sum_s C_v(s) x[v,s]  +  sum_e w_e sum_{p,q} R_e(p,q) y[e,p,q]
                                               +  sum_k sum_{p,q} w_k(q) R_k(p,q) r[k,p,q]
    subject to  sum_s x[v,s] = 1                                    (one_strategy[v])
                x[v,s] = 0 for a forbidden (v, s)                   (variable bound)
                sum_q y[e,p,q] = sum_{s: out_u(s)=p} x[u,s]         (reshard_out[e,p])
                sum_p y[e,p,q] = sum_{t: in_v(t)=q} x[v,t]          (reshard_in[e,q])
                r[k,p,q] <= sum_{s: out_u(s)=p} x[u,s]              (reshard_from[k,p->q])
                sum_{t: in_v(t)=q} x[v,t] <= sum_{s: out_u(s)=q} x[u,s]
                                             + sum_{p != q} r[k,p,q]  (covered[k,v,q])

C_v(s) is the roofline time of v with its work split n ways when s shards any
operand (:func:`node_cost_s`), plus the all-reduces a loss-parallel strategy runs inside
its op (``Strategy.reduces``: one fp32 value per token each); R_e(p, q) and R_k(p, q) the alpha-beta time of
turning the tensor's placement p into q (:func:`reshard_s`: Partial->Replicate
is an all-reduce, Partial->Shard a reduce-scatter, Shard->Replicate an
all-gather, Shard->Shard an all-to-all, Replicate->anything free); w is how many identical layers a node stands for,
and w_k(q) the largest weight among the consumers of k that need q.
Gradients return to their parameter's layout through ordinary edges (a
replicated weight with partial gradients pays an all-reduce), and the loss
must leave replicated. A single-consumer edge uses the marginal
(transportation) form, whose y is integral once x is, so y stays continuous;
a tensor with several consumers uses the coverage form, so that a placement
made once serves every consumer that needs it. Either way an edge has at most
|P_u| x |Q_v| <= 25 placement-pair variables (placement classes, not strategy
pairs; the pairing itself is Alpa's, Zheng et al. 2022, sec. 4.2).

Before the MIP is built, runs of ops that each read one tensor read by no other op
and make one read only by the next op are eliminated (variable elimination on a
path): a run u -> v_1 -> ... -> v_k -> w becomes one single-consumer edge from u to
w whose R(p, q) is the run's cheapest cost (its reshards and its ops' own C) from
u's placement p to w's placement q, and v_1..v_k are set after solving by following
the argmins back from the chosen p and q. (:mod:`autopar.planner.runs`);
``solve(..., eliminate=False)`` keeps every op in the MIP.

Before that, the iterations of an unrolled Python loop (ops of one layer and phase that one
target and call stack make at least ``TIE_MIN`` times, with equal candidates and costs) are
merged into one op, so they share a strategy (:func:`autopar.planner.ties.tie_loops`; ``solve(..., tie=False)``
keeps them apart). That restricts the problem, but its objective is still the plan's cost.

Solver: SCIP through OR-tools' pywraplp (docs/design-notes.md says why not
CP-SAT); single-threaded, with a node limit and no time limit, so the same model
gives the same plan on a quiet or a loaded machine. Costs are in units of 1 us
to keep the MIP well scaled.

``build_problem`` makes the plain-data :class:`Problem` (functions of the
micro-batch size), ``solve`` returns a :class:`Solution`, and ``evaluate``
recomputes its cost split from scratch, independently of the solver.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, replace

from ortools.linear_solver import pywraplp

from autopar.cost import comm
from autopar.cost.comm import Link
from autopar.cost.compute import kernel_time_s
from autopar.cost.devices import DeviceSpec
from autopar.errors import InfeasibleError
from autopar.passes.strategies import StrategyGraph, Strategy
from autopar.planner import solve_cache
from autopar.planner.runs import Run, fill_runs, find_runs

__all__ = ["Problem", "Solution", "build_problem", "solve", "reshard_s", "node_cost_s", "inner_reduce_s"]

_UNIT_S = 1e-6  # objective unit: 1 us (keeps the MIP well scaled)
SOLVER_BACKEND = "SCIP"


@dataclass(frozen=True, kw_only=True)
class Problem:
    graph: StrategyGraph
    batch: float
    """Micro-batch size the costs are evaluated at."""
    device: DeviceSpec
    link: Link
    compute_dtype: str | None = None
    forbidden: frozenset[tuple[int, int]] = frozenset()
    """(node, candidate) pairs the solution may not use (a pinned decision, e.g. sequence
    parallelism on or off): their x is fixed to 0."""
    async_tp: bool = False
    """Price a solution's tp all-gathers into GEMMs and reduce-scatters out of them as async TP
    overlaps them (:func:`autopar.planner.evaluation.evaluate`; the MIP itself prices them exposed)."""


@dataclass(frozen=True, kw_only=True)
class Solution:
    choice: tuple[int, ...]
    """Chosen candidate index per node."""
    status: str
    objective_s: float
    bound_s: float
    nodes: int = 0
    """Branch-and-bound nodes SCIP processed."""
    node_limit: int = 0
    gap_limit: float = 0.0
    """The relative gap at which the search was told to stop (:data:`MIP_GAP`)."""
    limit: str | None = None
    """The work limit that stopped the search before it proved optimality ("nodes"), else None."""
    wall_s: float
    tied: int = 0
    """Ops the MIP did not decide on their own: each took the strategy of the loop iteration
    it was tied to (:func:`autopar.planner.ties.tie_loops`)."""

    @property
    def gap(self) -> float:
        return 0.0 if self.objective_s <= 0 else max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


def reshard_s(p: str, q: str, nbytes: float, n: int, link: Link) -> tuple[float, str]:
    """Time and collective that turn placement ``p`` into ``q`` for a tensor of ``nbytes``.

    Each collective call also pays one link latency for its launch and synchronisation,
    on top of the ring's (n-1) steps: two calls (reduce-scatter + all-gather) then cost
    more than one all-reduce of the same volume, as they do on NCCL and gloo.

    A collective along a tensor dim other than 0 also copies the tensor once, at the link's
    ``copy_bytes_per_s`` (read and write): NCCL gathers and scatters along dim 0 of a
    contiguous buffer, so ``torch.distributed._functional_collectives`` (DTensor's
    redistribute, autopar's runtime and torchtitan alike) concatenates an all-gather's
    chunks along the dim (``all_gather_tensor``), makes a reduce-scatter's chunks contiguous
    before it (``reduce_scatter_tensor``), and an all-to-all does both on its 1/n pieces.
    Sequence parallelism's gathers and scatters of (batch, sequence, hidden) activations
    along the sequence (dim 1) pay it; on flattened (tokens, hidden) ones (dim 0) they do not.
    """
    if p == q or n == 1 or p is None:
        return 0.0, ""
    if p == "R":
        return 0.0, ""  # take the local slice (R -> P keeps one copy and zeroes the rest)
    copied = 0.0  # bytes read and written by the local copy of a collective along dim d > 0
    if p == "P":
        if q == "R":
            t, kind = comm.all_reduce_s(nbytes, n, link), "all_reduce"
        else:
            t, kind = comm.reduce_scatter_s(nbytes, n, link), "reduce_scatter"
            copied = 2 * nbytes if q != "S0" else 0.0
    elif q[0] == "S":  # shard -> shard on another dim
        t, kind = comm.all_to_all_s(nbytes / n, n, link), "all_to_all"
        copied = 4 * nbytes / n if "S0" not in (p, q) else 2 * nbytes / n
    else:
        t, kind = comm.all_gather_s(nbytes, n, link), "all_gather"  # shard -> replicate or partial
        copied = 2 * nbytes if p != "S0" else 0.0
    if link.copy_bytes_per_s:
        t += copied / link.copy_bytes_per_s
    return t + link.latency_s, kind


def _edge_link(problem: Problem, dst_kind: str) -> Link:
    """Gradients return to their parameters in buckets (as DDP/FSDP do), so a
    parameter's gradient reduction pays bandwidth but not a collective latency of its own."""
    if dst_kind == "param":  # (flat buckets: no copy along a dim either)
        return replace(problem.link, latency_s=0.0, base_latency_s=0.0, copy_bytes_per_s=0.0)
    return problem.link


def _splits(s: Strategy) -> bool:
    return any(p is not None and p.startswith("S") for p in s.outs + s.ins)


def node_cost_s(problem: Problem, v: int, s: Strategy) -> float:
    node = problem.graph.nodes[v]
    if node.kind != "op":
        return 0.0
    n = problem.graph.axis_size if _splits(s) else 1
    b = problem.batch
    own = kernel_time_s(kind=node.kernel, flops=node.flops(b) / n, bytes_moved=node.bytes_moved(b) / n,
                        device=problem.device, dtype=problem.compute_dtype or node.dtype,
                        gemm=_local_gemm(node, s, b, n))
    return own + inner_reduce_s(problem, v, s)


def inner_reduce_s(problem: Problem, v: int, s: Strategy) -> float:
    """The all-reduces op ``v`` runs inside under ``s`` (loss parallel: ``s.reduces`` of one fp32
    value per row, over the tp axis), on the op's critical path; 0 for every other strategy."""
    n = problem.graph.axis_size
    if not s.reduces or n <= 1:
        return 0.0
    return s.reduces * comm.all_reduce_s(4 * problem.graph.nodes[v].rows(problem.batch), n, problem.link)


def _local_gemm(node, s: Strategy, b: float, n: int) -> tuple[float, float, float] | None:
    """The per-device (m, n, k) of a GEMM under strategy ``s``: the dim its operands'
    placements split is divided by the axis size (batch dims of a bmm count as m; a
    split seen on neither operand, e.g. of the output only, is charged to m)."""
    if node.gemm is None:
        return None
    m_a, n_a, k_a, ia, ib, rank_a, rank_b = node.gemm
    dims = [m_a(b), n_a(b), k_a(b)]
    if n > 1:
        pa = s.ins[ia] if ia < len(s.ins) else "R"
        pb = s.ins[ib] if ib < len(s.ins) else "R"
        if pa and pa[0] == "S":
            dims[2 if int(pa[1:]) == rank_a - 1 else 0] /= n
        elif pb and pb[0] == "S":
            d = int(pb[1:])
            dims[1 if d == rank_b - 1 else 2 if d == rank_b - 2 else 0] /= n
        else:
            dims[0] /= n
    return tuple(dims)


def _param_bytes(problem: Problem, v: int, s: Strategy) -> float:
    node = problem.graph.nodes[v]
    full = node.out_bytes[0](0)
    return full / problem.graph.axis_size if s.outs[0].startswith("S") else full


def build_problem(graph: StrategyGraph, *, batch: float, device: DeviceSpec, link: Link,
                  compute_dtype: str | None = None, forbidden: frozenset[tuple[int, int]] = frozenset(),
                  async_tp: bool = False) -> Problem:
    """The ILP of ``graph`` with costs at micro-batch ``batch`` (plain data; nothing solved)."""
    return Problem(graph=graph, batch=batch, device=device, link=link, compute_dtype=compute_dtype,
                   forbidden=frozenset(forbidden), async_tp=async_tp)


def _tensor_groups(g: StrategyGraph) -> list[list]:
    """Edges grouped by the tensor they carry: a tensor resharded to a placement once
    serves every consumer that needs that placement. Chain edges (copy i -> copy i+1)
    and gradient -> parameter edges carry different tensors and stay apart."""
    groups: dict[tuple, list] = {}
    for e in g.edges:
        groups.setdefault((e.src, e.src_out, e.virtual, g.nodes[e.dst].kind == "param"), []).append(e)
    return list(groups.values())


class _Prices:
    """The MIP's costs in objective units: an op running a strategy, an edge turning placement
    p into q, and a tensor read by several consumers resharded from p to q once (``weight``:
    the largest weight among the consumers that may need q)."""

    def __init__(self, problem: Problem):
        self.problem = problem

    def own(self, v: int, s: Strategy) -> float:
        return _own_cost(self.problem, v, s)

    def edge(self, e, p: str, q: str) -> float:
        return _edge_cost(self.problem, e, p, q)

    def cover(self, k: int, group: list, p: str, q: str, weight: int) -> float:
        g, e0 = self.problem.graph, group[0]
        nbytes = g.nodes[e0.src].out_bytes[e0.src_out](self.problem.batch)
        link = _edge_link(self.problem, g.nodes[e0.dst].kind)
        return weight * reshard_s(p, q, nbytes, g.axis_size, link)[0] / _UNIT_S


# The rows are written through pywraplp's low-level API (Constraint(lb, ub) + SetCoefficient)
# rather than its algebraic one (solver.Add(sum(...) == ...)), for speed: building the tp=8 MIP
# of HF T5 tiny (1227 ops, 11.9k rows) takes 0.15 s of CPU instead of 0.37 s (Llama 70B's:
# 0.08 s instead of 0.17 s), and its fewer Python objects trigger fewer of the full garbage
# collections (0.3 s each with a traced model in memory). Each row keeps the terms, order,
# name and bounds the algebraic form gives (_add_row; tests/test_ilp_rows.py), so SCIP
# solves the same model and planning gives the same plan.


def _add_row(solver, lb: float, ub: float, name: str, terms) -> None:
    """The row ``lb <= sum(c * var) <= ub`` from (var, c) pairs in the order the algebraic
    form lists them; a repeated variable gets the sum of its coefficients (a zero sum adds
    nothing), as pywraplp's expression extraction does."""
    row = solver.Constraint(lb, ub, name)
    coeffs: dict = {}
    for var, c in terms:
        coeffs[var] = coeffs.get(var, 0.0) + c
    for var, c in coeffs.items():
        row.SetCoefficient(var, c)


def _terms(variables, c: float) -> list:
    """Each of ``variables`` with coefficient ``c``."""
    return [(v, c) for v in variables]


def _edge_cost(problem: Problem, e, p: str, q: str) -> float:
    """Edge ``e`` turning placement p into q, in objective units (its weight included)."""
    g = problem.graph
    nbytes = g.nodes[e.src].out_bytes[e.src_out](problem.batch)
    return e.weight * reshard_s(p, q, nbytes, g.axis_size, _edge_link(problem, g.nodes[e.dst].kind))[0] / _UNIT_S


def _own_cost(problem: Problem, v: int, s: Strategy) -> float:
    """Op ``v`` running strategy ``s``, in objective units (its weight included)."""
    return problem.graph.nodes[v].weight * node_cost_s(problem, v, s) / _UNIT_S


def _single_consumer(solver, k, e, g, x, by_p, obj, prices: _Prices):
    """Marginal (transportation) form: y is integral once x is, so y stays continuous.
    Adds the edge's rows, appends its (y, cost) objective terms to ``obj`` and returns its
    fixed cost (nonzero when both ends have one placement only)."""
    src, dst = g.nodes[e.src], g.nodes[e.dst]
    by_q = defaultdict(list)
    for j, s in enumerate(dst.candidates):
        by_q[s.ins[e.dst_in]].append(x[e.dst][j])
    return _pairwise(solver, k, f"{k}:{src.name}->{dst.name}", by_p, by_q, obj, lambda p, q: prices.edge(e, p, q))


def _pairwise(solver, k, edge: str, by_p, by_q, obj, cost) -> float:
    """The rows of one producer placement -> consumer placement choice priced ``cost(p, q)``
    (objective units); its fixed cost when each side has one placement only."""
    if len(by_p) == 1 and len(by_q) == 1:  # nothing to choose on this edge
        return cost(next(iter(by_p)), next(iter(by_q)))
    pair = {}
    for p in by_p:
        for q in by_q:
            pair[p, q] = y = solver.NumVar(0.0, 1.0, f"y[{k},{p},{q}]")
            c = cost(p, q)
            if c:
                obj.append((y, c))
    for p, lp in by_p.items():  # sum_q y[p,q] == sum(lp)
        _add_row(solver, 0.0, 0.0, f"reshard_out[{edge},{p}]",
                 [(pair[p, q], 1.0) for q in by_q] + _terms(lp, -1.0))
    for q, lq in by_q.items():  # sum_p y[p,q] == sum(lq)
        _add_row(solver, 0.0, 0.0, f"reshard_in[{edge},{q}]",
                 [(pair[p, q], 1.0) for p in by_p] + _terms(lq, -1.0))
    return 0.0


def _many_consumers(solver, k, group, g, x, by_p, obj, prices: _Prices):
    """Coverage form: r[p,q] reshards the tensor from p (only if p is chosen) to q, paid once;
    every consumer that needs q is covered by the producer emitting q or by some r[., q].
    Adds the rows, appends the (r, cost) objective terms to ``obj``; no fixed cost."""
    src = g.nodes[group[0].src]
    wants: dict[str, list] = defaultdict(list)  # q -> (consumer name, its x literals that need q)
    weight = defaultdict(int)
    for e in group:
        dst = g.nodes[e.dst]
        by_q = defaultdict(list)
        for j, s in enumerate(dst.candidates):
            by_q[s.ins[e.dst_in]].append(x[e.dst][j])
        for q, lq in by_q.items():
            wants[q].append((dst.name, lq))
            weight[q] = max(weight[q], e.weight)
    r = defaultdict(list)
    minus_inf = -solver.infinity()
    for p, lp in by_p.items():
        for q in wants:
            if p == q:
                continue
            y = solver.NumVar(0.0, 1.0, f"r[{k},{p},{q}]")
            _add_row(solver, minus_inf, 0.0, f"reshard_from[{k}:{src.name},{p}->{q}]",  # y <= sum(lp)
                     [(y, 1.0)] + _terms(lp, -1.0))
            r[q].append(y)
            c = prices.cover(k, group, p, q, weight[q])
            if c:
                obj.append((y, c))
    for q, consumers in wants.items():
        supply = _terms(by_p.get(q, []), -1.0) + _terms(r[q], -1.0)
        for name, lq in consumers:  # sum(lq) <= sum(by_p[q]) + sum(r[., q])
            _add_row(solver, minus_inf, 0.0, f"covered[{k}:{src.name}->{name},{q}]", _terms(lq, 1.0) + supply)
    return 0.0




def _add_run(solver, i: int, run: Run, g: StrategyGraph, x, obj) -> float:
    """The run's pairwise edge between its producer's and its consumer's placements."""
    first, last = run.edges[0], run.edges[-1]
    by_p, by_q = defaultdict(list), defaultdict(list)
    for j, s in enumerate(g.nodes[first.src].candidates):
        by_p[s.outs[first.src_out]].append(x[first.src][j])
    for j, s in enumerate(g.nodes[last.dst].candidates):
        by_q[s.ins[last.dst_in]].append(x[last.dst][j])
    edge = f"run{i}:{g.nodes[first.src].name}->{g.nodes[last.dst].name}"
    return _pairwise(solver, f"run{i}", edge, by_p, by_q, obj, lambda p, q: run.cost[p, q])


# No time limit: with one, the answer depends on how busy the machine is (issue 17: T5's tp=8
# MIP ran out of 20 s on a loaded machine). A node limit stops SCIP after the same work anywhere.
NODE_LIMIT = 1000
"""Branch-and-bound nodes SCIP may process, over all restarts (its ``limits/totalnodes``),
before it stops and returns its best solution (status FEASIBLE, with its gap)."""
_SCIP_SETTINGS = {
    # Presolve probing tentatively fixes each binary and propagates; on these models it finds
    # nothing (no fixings, few aggregations) yet took 3.3 s of T5 tiny's 4.4 s at tp=8.
    "propagating/probing/maxprerounds": 0,
    # Cutting planes: at most 3 rounds at the root, none below it. With SCIP's defaults
    # (unlimited root rounds until they stall) Llama 70B's tp=2 and tp=8 MIPs spent 23 and 18
    # CPU-s in root separation, each round adding about one cut and moving the bound by 1e-5
    # (the log shows it); with 3 rounds they take 5.1 and 4.2 CPU-s and end at the same
    # objective. Rounds are counted, not timed, so the answer does not depend on the machine.
    "separating/maxroundsroot": 3,
    "separating/maxrounds": 0,
    # Branch on pseudocosts from the first node, without strong branching: most of these MIPs
    # close the 1% gap at the root, and where they branch (linear-attention and hybrid models)
    # strong branching spent most of the time for little bound. Measured on the MIPs of 15
    # Hugging Face tiny models (bench/hf_coverage.py rows, 73 MIPs, CPU-s each): Qwen3.5 tp=8
    # 8.3 -> 4.2 (30 -> 326 nodes), Qwen4-exp tp=8 12.2 -> 5.8 and 8.2 -> 3.0, Zamba2 2.5 ->
    # 1.0; the root-solved rest unchanged; every objective equal but one (+0.1%, within the gap).
    "branching/relpscost/minreliable": 0,
    "branching/relpscost/maxreliable": 0,
}
MIP_GAP = 0.01
"""Relative gap at which SCIP stops: the answer costs at most 1% more than the optimum of the MIP
(its recorded bound says how much at most). The MIP prices an estimate whose own error is larger
(issue 16 measures 8-40% against published runs), and proving the last percent costs minutes on
the graphs of state-space and linear-attention models, whose unrolled scans give 2,600-6,300 ops
for two layers: Mamba's tp=4 MIP found its optimum after 8 of its 172 CPU-s (the rest went to
proving it, in strong branching at the root); at 1% it stops after 7 CPU-s with a solution
0.14% dearer, and Qwen3-Next's tp=2 MIP after 19 CPU-s instead of 111, at the same optimum.
A gap is counted, not timed, so the answer still does not depend on the machine. ``solve(...,
gap=0)`` proves optimality (tests of exactness use it)."""


_SOLVED: OrderedDict[bytes, Solution] = OrderedDict()
"""Solutions of the last MIPs solved in this process, by a digest of the model as built (every
variable, bound, row and coefficient, with the solver settings). Planning the same graph again
(another cluster whose tensor-parallel groups see the same links and micro-batch, a re-plan,
the test suite's many plans of one tiny model) rebuilds the MIP, which takes little, but does not
re-solve it, which took 20-50 CPU-s for Llama tiny at tp=2. Same model, same answer: SCIP is
deterministic under a node limit, so the memo changes no plan. Other processes find what this one
solved on disk (:mod:`autopar.planner.solve_cache`)."""
_SOLVED_MAX = 64
_SOLVED_LOCK = threading.Lock()  # the planner solves several MIPs at once in threads (planner.make._solve_all)


def solve(problem: Problem, *, node_limit: int = NODE_LIMIT, gap: float = MIP_GAP, backend: str = SOLVER_BACKEND,
          eliminate: bool = True, tie: bool = True) -> Solution:
    """Solve the ILP (deterministic: same problem, same answer, however loaded the machine).

    With ``eliminate`` (the default) runs of single-reader ops leave the MIP and are chosen
    after it (:mod:`autopar.planner.runs`: exact, same optimum); False keeps every op in the MIP.

    With ``tie`` (the default) the iterations of an unrolled loop get one strategy
    (:func:`autopar.planner.ties.tie_loops`): the MIP of a restriction, so the answer may cost more than the
    optimum (``bound_s`` bounds the restricted problem) and ``tied`` says how many ops it tied.

    The search stops once its best solution is within ``gap`` (relative) of the proven bound
    (status OPTIMAL, as solvers call an answer within their tolerance; ``bound_s`` and ``gap``
    record what was proven), or after ``node_limit`` branch-and-bound nodes: then the best
    solution found is returned with status FEASIBLE, its gap and ``limit="nodes"``. Raises
    :class:`InfeasibleError` when the problem has no solution, or when the limit is hit
    before any was found.
    """
    from autopar.planner.ties import tie_loops  # (ties prices with this module's costs: imported late)

    tied = tie_loops(problem) if tie else None
    if tied is None:
        return _solve(problem, node_limit=node_limit, gap=gap, backend=backend, eliminate=eliminate)
    small, rep, groups, prices = tied
    sol = _solve(small, node_limit=node_limit, gap=gap, backend=backend, eliminate=eliminate, groups=groups,
                 prices=prices)
    return replace(sol, choice=tuple(sol.choice[r] for r in rep),
                   tied=len(problem.graph.nodes) - len(small.graph.nodes))


def _solve(problem: Problem, *, node_limit: int, gap: float, backend: str, eliminate: bool,
           groups: list[list] | None = None, prices: _Prices | None = None) -> Solution:
    """:func:`solve` without tying. ``groups``: the edges by tensor group, when not
    :func:`_tensor_groups`'s; ``prices``: the costs, when not the problem's own (a tied
    problem's ops and edges stand for several: :func:`autopar.planner.ties.tie_loops`)."""
    start = time.perf_counter()
    g = problem.graph
    solver = pywraplp.Solver.CreateSolver(backend)
    if solver is None:
        raise RuntimeError(f"OR-tools has no {backend} backend here; try backend='CBC'")
    settings = {**_SCIP_SETTINGS, "limits/gap": gap, "limits/totalnodes": node_limit} if backend == "SCIP" else {}
    text = "\n".join(f"{k} = {v}" for k, v in settings.items())
    if settings and not solver.SetSolverSpecificParametersAsString(text):
        raise RuntimeError(f"{backend} rejected the settings {settings}")
    groups = groups if groups is not None else _tensor_groups(g)
    prices = prices or _Prices(problem)
    runs = find_runs(g, groups, {v for v, _ in problem.forbidden}, prices.edge, prices.own) if eliminate else []
    gone = {v for run in runs for v in run.ops}
    x: list = []
    obj = []  # (variable, coefficient) of the objective, in the order the variables are made
    fixed_cost = 0.0
    for v, node in enumerate(g.nodes):
        if v in gone:
            x.append(None)
            continue
        lits = [solver.IntVar(0.0, 0.0 if (v, i) in problem.forbidden else 1.0, f"x[{node.name},{i}]")
                for i in range(len(node.candidates))]
        _add_row(solver, 1.0, 1.0, f"one_strategy[{node.name}]", _terms(lits, 1.0))
        x.append(lits)
        for i, s in enumerate(node.candidates):
            c = prices.own(v, s)
            if c:
                obj.append((lits[i], c))
    for k, group in enumerate(groups):
        e0 = group[0]
        if e0.src in gone or e0.dst in gone:
            continue  # (a run's edge: priced by the run)
        src = g.nodes[e0.src]
        by_p = defaultdict(list)
        for i, s in enumerate(src.candidates):
            by_p[s.outs[e0.src_out]].append(x[e0.src][i])
        if len(group) == 1:
            fixed_cost += _single_consumer(solver, k, e0, g, x, by_p, obj, prices)
        else:
            fixed_cost += _many_consumers(solver, k, group, g, x, by_p, obj, prices)
    for i, run in enumerate(runs):
        fixed_cost += _add_run(solver, i, run, g, x, obj)
    objective = solver.Objective()
    objective.SetMinimization()
    for var, c in obj:  # each variable once
        objective.SetCoefficient(var, c)
    from ortools.linear_solver import linear_solver_pb2  # (here: bench/gpu_check.py stubs pywraplp alone)

    model = linear_solver_pb2.MPModelProto()
    solver.ExportModelToProto(model)
    key = hashlib.sha256(model.SerializeToString(deterministic=True) + f"{backend}\n{text}\n{fixed_cost!r}\n".encode()
                         + solve_cache.salt()).digest()
    # The key is the reduced MIP's: a run's ops are set again from its ends on every answer, memo
    # and disk included (two problems may share a reduced MIP and differ inside a run).
    with _SOLVED_LOCK:
        found = _SOLVED.get(key)
        if found is not None:
            _SOLVED.move_to_end(key)
    if found is not None:
        return replace(found, choice=fill_runs(found.choice, runs, g), wall_s=time.perf_counter() - start)
    stored = solve_cache.load(key.hex(), [len(n.candidates) for n in g.nodes])
    if stored is not None:
        solution = Solution(**stored, wall_s=time.perf_counter() - start)
        return _remember(key, replace(solution, choice=fill_runs(solution.choice, runs, g)))
    status = solver.Solve()
    names = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
             pywraplp.Solver.INFEASIBLE: "INFEASIBLE", pywraplp.Solver.UNBOUNDED: "UNBOUNDED"}
    name = names.get(status, "NOT_SOLVED")
    nodes = solver.nodes()
    limit = "nodes" if backend == "SCIP" and nodes >= node_limit and name in ("FEASIBLE", "NOT_SOLVED") else None
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        why = (f"found no solution within its limit of {node_limit} branch-and-bound nodes; try a larger "
               f"node_limit, or" if limit else f"is {name} after {nodes} branch-and-bound nodes; try")
        raise InfeasibleError(f"sharding ILP on an axis of {g.axis_size} ({len(g.nodes)} graph nodes) {why} "
                              f"another tensor-parallel degree (fixed={{'tp': ...}})")
    choice = fill_runs(tuple(0 if lits is None else max(range(len(lits)), key=lambda i: lits[i].solution_value())
                                for lits in x), runs, g)
    objective = solver.Objective().Value() + fixed_cost
    # (SCIP's bound, also when OPTIMAL: within the gap tolerance it may lie below the objective)
    bound = min(objective, solver.Objective().BestBound() + fixed_cost)
    solution = Solution(choice=choice, status=name, objective_s=objective * _UNIT_S, bound_s=bound * _UNIT_S,
                        nodes=nodes, node_limit=node_limit, gap_limit=gap, limit=limit,
                        wall_s=time.perf_counter() - start)
    solve_cache.store(key.hex(), solution.__dict__)
    return _remember(key, solution)


def _remember(key: bytes, solution: Solution) -> Solution:
    with _SOLVED_LOCK:
        _SOLVED[key] = solution
        if len(_SOLVED) > _SOLVED_MAX:
            _SOLVED.popitem(last=False)
    return solution

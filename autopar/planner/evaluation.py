"""What a solution of the sharding MIP costs, recomputed from the whole problem (:func:`evaluate`).

Independent of the MIP's own bookkeeping (its eliminated runs, tied loops and linearised
edges): per layer instance, compute and resharding time by phase, parameter, activation and
working-set bytes, and totals and collectives over all copies. The planner prices layers for
the outer search with it, and tests check each MIP's objective against it."""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field, replace

from autopar.cost.compute import GEMM_KINDS
from autopar.cost.step import OVERLAP_SLOWDOWN
from autopar.planner.ilp import (Problem, Solution, _edge_link, _param_bytes, _tensor_groups, inner_reduce_s, node_cost_s,
                                 reshard_s)
from autopar.planner.recompute_keep import (kept_bytes, moe_recomputed_ops, remade_extra_bytes,
                                            sac_recomputed_matmuls)

# fx names of autopar's experts ops (autopar.experts: moe_experts, moe_experts_backward, and their
# numbered repeats), whose batch-independent outputs are the experts' weight gradients
EXPERTS_OP_NAMES = ("moe_experts",)

__all__ = ["CostBreakdown", "LayerCost", "evaluate"]


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One instance of a layer under a solution, at the problem's micro-batch size."""

    compute_s: dict[str, float] = field(default_factory=dict)
    """By phase: "F", "B", "W"."""
    comm_s: dict[str, float] = field(default_factory=dict)
    """Resharding time by phase of the consuming op ("W" holds tensor-parallel gradient reductions)."""
    param_bytes: float = 0.0
    """Parameter bytes held per device."""
    n_params_local: float = 0.0
    activation_bytes: float = 0.0
    """Saved activation bytes per device for one micro-batch."""
    cheap_activation_bytes: float = 0.0
    """What selective recompute frees of ``activation_bytes``: the saved outputs of FLOP-free ops,
    less the values they are recomputed from (:mod:`autopar.planner.recompute_keep`)."""
    cheap_forward_s: float = 0.0
    """Forward time of the FLOP-free ops (what selective recompute re-runs)."""
    sac_forward_s: float = 0.0
    """Forward time of every second matmul of the layer, in forward order (the 2nd, 4th, ...:
    Llama's wk, wo and w3), which op-level SAC also recomputes (torchtitan's
    ``_apply_op_sac``: its policy saves the outputs of matmuls, attention and reduce-scatters,
    "except every second mm")."""
    sac_activation_bytes: float = 0.0
    """What op-level SAC frees beyond selective recompute: selective's kept bytes less what
    SAC keeps as autopar's runtime runs it (:mod:`autopar.planner.recompute_keep`)."""
    torch_sac_activation_bytes: float = 0.0
    """The same for what torchtitan's policy stores (``torch_sac``), for pricing its runs."""
    moe_forward_s: float = 0.0
    """Forward time of the layer's MoE-layer ops with FLOPs (router, experts) and of the collectives
    into any MoE-layer op (tp gathers): what "moe" recomputes beyond selective's FLOP-free ops
    (:func:`autopar.planner.recompute_keep.moe_recomputed_ops`)."""
    moe_activation_bytes: float = 0.0
    """What "moe" frees beyond selective recompute: selective's kept bytes less what "moe" keeps."""
    full_kept_bytes: float = 0.0
    """What full recompute keeps (:func:`autopar.planner.recompute_keep.kept_bytes`): the layer's inputs
    and what other layers' backward reads of it."""
    remade_extra_bytes: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """(selective, sac, moe, full): what the copies the layer's backward makes again add, at their peak, to
    ``transient_bytes`` (:func:`autopar.planner.recompute_keep.remade_extra_bytes`)."""
    weight_gradient_input_bytes: float = 0.0
    """What a micro-batch holds between this layer's B and W passes (zero-bubble schedules):
    the values its weight-gradient ops read (:func:`_weight_gradient_inputs`)."""
    transient_bytes: float = 0.0
    """Largest working set of one op per device for one micro-batch: its outputs plus the inputs
    it reads that nothing saves (e.g. the loss's fp32 logits gradient and its input), on top of
    the saved activations and the training state while that op runs."""
    expert_transient: tuple[float, tuple[tuple[float, float], ...]] = (0.0, ())
    """(largest working set of the layer's other ops, and per op on the experts' weight-gradient
    path (the experts ops and the slices, transposes and casts of those gradients after them) its
    working set less its batch-independent part, and that part): expert parallelism cuts the
    experts' weight gradients to 1/ep (:func:`autopar.planner.experts.apply_ep`), and with them
    those ops' working sets (the gradients of all E experts, whole, outweigh the token rows many
    times: DeepSeek-V3's 256 experts at 4096 tokens, 45 GB against 1 GB)."""


@dataclass(frozen=True, kw_only=True)
class CostBreakdown:
    total_s: float
    compute_s: float
    comm_s: float
    layers: dict[str, LayerCost]
    collectives: dict[str, dict[str, float]]
    """Collective kind -> {"count": per step, "bytes": per step, "time_s": ...} (all layer copies)."""


def _local_out_bytes(problem: Problem, solution: Solution, v: int, o: int) -> float:
    node = problem.graph.nodes[v]
    placement = node.candidates[solution.choice[v]].outs[o]
    if placement is None:
        return 0.0
    full = node.out_bytes[o](problem.batch)
    return full / problem.graph.axis_size if placement.startswith("S") else full


def _expert_grad_ops(g) -> set[int]:
    """autopar's experts ops and the ops their weight gradients pass through on the way out (the
    backward's gradients of the stacked weights sliced, transposed, cast: ops all of whose outputs
    do not grow with the batch, downstream of an experts op's batch-independent outputs)."""
    start = {v for v, n in enumerate(g.nodes) if n.kind == "op" and n.name.startswith(EXPERTS_OP_NAMES)}
    if not start:  # (most models: no edge map to build on every evaluation)
        return set()
    readers: dict[tuple[int, int], list[int]] = defaultdict(list)
    for e in g.edges:
        if not e.virtual:
            readers[e.src, e.src_out].append(e.dst)
    out = set(start)
    frontier = [(v, o) for v in start for o, b in enumerate(g.nodes[v].out_bytes) if b.per_sample == 0]
    while frontier:
        for d in readers[frontier.pop()]:
            node = g.nodes[d]
            if d in out or node.kind != "op" or any(b.per_sample for b in node.out_bytes):
                continue
            out.add(d)
            frontier.extend((d, o) for o in range(len(node.out_bytes)))
    return out


def _aliases(problem: Problem):
    """The ops that hold nothing of their own (a view, ``t``, ``detach``: no FLOPs, no bytes moved;
    they alias their first input), and ``source(v, o)``: the value an output really is, through
    any chain of them."""
    g = problem.graph
    batch = problem.batch
    alias = {v for v, node in enumerate(g.nodes)
             if node.kind == "op" and node.flops(batch) == 0 and node.bytes_moved(batch) == 0}
    first_in: dict[int, tuple[int, int]] = {}
    for e in g.edges:
        if e.dst in alias and e.dst_in == 0 and not e.virtual:
            first_in[e.dst] = (e.src, e.src_out)

    def source(v: int, o: int) -> tuple[int, int]:
        for _ in range(len(g.nodes)):  # (a chain of views; bounded, never a cycle in a DAG)
            if v not in alias or v not in first_in:
                return v, o
            v, o = first_in[v]
        return v, o
    return alias, source


def _weight_gradient_inputs(problem: Problem, solution: Solution, aliases=None) -> dict[str, float]:
    """Per layer, what one micro-batch holds between its input-gradient (B) and weight-gradient
    (W) passes when a zero-bubble schedule runs them apart: the distinct values the layer's W ops
    read that forward or B ops made. That is each weight GEMM's input activation (kept since the
    forward, or made again by the B pass under recompute, :mod:`autopar.passes.recompute`) and
    its output gradient; everything else the backward reads is freed when B ends
    (:mod:`autopar.runtime.pipeline` drops a value at its last reader). ``aliases``: :func:`_aliases`
    of the problem, if the caller has it."""
    g = problem.graph
    _, source = aliases or _aliases(problem)
    held: dict[str, float] = defaultdict(float)
    seen = set()
    for e in g.edges:
        dst = g.nodes[e.dst]
        if e.virtual or dst.kind != "op" or dst.phase != "W":
            continue
        v, o = source(e.src, e.src_out)
        if g.nodes[v].kind != "op" or g.nodes[v].phase == "W" or (dst.layer, v, o) in seen:
            continue
        seen.add((dst.layer, v, o))
        held[dst.layer] += _local_out_bytes(problem, solution, v, o)
    return held


def _working_sets(problem: Problem, solution: Solution, split: set[int] = frozenset(),
                  aliases=None) -> dict[int, float] | tuple[dict[int, float], dict[int, float]]:
    """Per op, the bytes live while it runs beyond what memory already counts: its outputs
    that are not saved activations, plus the distinct op-produced inputs it reads that are not
    saved either (a gradient handed from the op before). Parameters, and saved activations,
    are counted elsewhere (training state, activations).

    An op that neither computes nor moves a byte (a view, ``t``, ``detach``: it aliases its first
    input) holds nothing of its own, and an op reading through it reads its source: the loss's
    log-softmax backward reads its saved output through a ``detach``, which is not a second copy
    (counted as one, it priced that op's working set for Llama 3.1 8B at 32k tokens at 50.4 GB,
    where 33.6 GB are live).

    With ``split`` (ops), also the part of each of those ops' working sets that does not grow
    with the batch (outputs and inputs alike), as a second dict. ``aliases``: :func:`_aliases` of
    the problem, if the caller has it."""
    g = problem.graph
    alias, source = aliases or _aliases(problem)
    ws = {v: 0.0 if v in alias else
          sum(_local_out_bytes(problem, solution, v, o) for o, saved in enumerate(node.saved) if not saved)
          for v, node in enumerate(g.nodes) if node.kind == "op"}
    fixed = {v: 0.0 if v in alias else
             sum(_local_out_bytes(problem, solution, v, o) for o, saved in enumerate(g.nodes[v].saved)
                 if not saved and not g.nodes[v].out_bytes[o].per_sample) for v in split}
    seen = set()
    for e in g.edges:
        if e.virtual or e.dst not in ws or e.dst in alias:
            continue
        v, o = source(e.src, e.src_out)
        src = g.nodes[v]
        if src.kind != "op" or src.saved[o] or (v, o, e.dst) in seen:
            continue
        seen.add((v, o, e.dst))
        ws[e.dst] += _local_out_bytes(problem, solution, v, o)
        if e.dst in fixed and not src.out_bytes[o].per_sample:
            fixed[e.dst] += _local_out_bytes(problem, solution, v, o)
    return (ws, fixed) if split else ws


def evaluate(problem: Problem, solution: Solution) -> CostBreakdown:
    """Recompute a solution's costs from scratch: per layer instance, and totals over all copies."""
    g = problem.graph
    comp: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    com: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    params = defaultdict(float)
    nparams = defaultdict(float)
    acts = defaultdict(float)
    cheap_f = defaultdict(float)
    sac_f = defaultdict(float)
    moe_f = defaultdict(float)
    recomputed = sac_recomputed_matmuls(g)
    moe_ops = moe_recomputed_ops(g)
    transient = defaultdict(float)
    collectives: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    total_comp = total_comm = 0.0
    for v, node in enumerate(g.nodes):
        s = node.candidates[solution.choice[v]]
        t = node_cost_s(problem, v, s)
        cheap = node.kind == "op" and node.flops(problem.batch) == 0
        if cheap and node.phase == "F":
            cheap_f[node.layer] += t
        inner = inner_reduce_s(problem, v, s)  # (collectives inside the op: loss parallel)
        if inner:
            com[node.layer][node.phase or "F"] += inner
            total_comm += node.weight * inner
            collectives["all_reduce"]["count"] += node.weight * s.reduces
            collectives["all_reduce"]["bytes"] += node.weight * s.reduces * 4 * node.rows(problem.batch)
            collectives["all_reduce"]["time_s"] += node.weight * inner
        comp[node.layer][node.phase or "F"] += t - inner
        total_comp += node.weight * (t - inner)
        if v in recomputed:
            sac_f[node.layer] += t
        if v in moe_ops and not cheap:
            moe_f[node.layer] += t
        if node.kind == "param":
            pb = _param_bytes(problem, v, s)
            params[node.layer] += pb
            elem = max(1, {"fp32": 4, "bf16": 2, "fp16": 2}.get(node.dtype, 4))
            nparams[node.layer] += pb / elem
        for o, is_saved in enumerate(node.saved):
            if is_saved and s.outs[o] is not None:
                full = node.out_bytes[o](problem.batch)
                local = full / g.axis_size if s.outs[o].startswith("S") else full
                acts[node.layer] += local
    grad_ops = _expert_grad_ops(g)
    aliases = _aliases(problem)  # (both walks below read it)
    sets, fixed = (_working_sets(problem, solution, grad_ops, aliases) if grad_ops
                   else (_working_sets(problem, solution, aliases=aliases), {}))
    other: dict[str, float] = defaultdict(float)
    expert_ws: dict[str, set[tuple[float, float]]] = defaultdict(set)
    for v, ws in sets.items():
        node = g.nodes[v]
        transient[node.layer] = max(transient[node.layer], ws)
        if v in fixed:  # (rows and other batch-sized values, the experts' weight gradients)
            expert_ws[node.layer].add((ws - fixed[v], fixed[v]))
        else:
            other[node.layer] = max(other[node.layer], ws)
    float8 = any(n.kernel == "fp8_gemm" for n in g.nodes)
    adjacency = _adjacency(g) if problem.async_tp or float8 else None
    for group in _tensor_groups(g):
        src = g.nodes[group[0].src]
        p = src.candidates[solution.choice[group[0].src]].outs[group[0].src_out]
        nbytes = src.out_bytes[group[0].src_out](problem.batch)
        needed: dict[str, tuple[int, object]] = {}
        for e in group:  # each placement is made once, for the heaviest consumer that needs it
            q = g.nodes[e.dst].candidates[solution.choice[e.dst]].ins[e.dst_in]
            if q not in needed or e.weight > needed[q][0]:
                needed[q] = (e.weight, e)
        for q, (weight, e) in needed.items():
            dst = g.nodes[e.dst]
            t, kind = reshard_s(p, q, nbytes, g.axis_size, _edge_link(problem, dst.kind))
            if not t:
                continue
            sent = nbytes
            if (float8 and kind == "all_gather" and src.kind != "param" and src.dtype in ("bf16", "fp16")
                    and _feeds_float8_only(problem, solution, group, q, adjacency)):
                sent = nbytes / 2  # float8 all-gather (see _feeds_float8_only)
                t = reshard_s(p, q, sent, g.axis_size, _edge_link(problem, dst.kind))[0]
            if problem.async_tp and kind in ("all_gather", "reduce_scatter"):
                link = _edge_link(problem, dst.kind)  # the transfer alone: no launch, no local copy
                moved = reshard_s(p, q, sent, g.axis_size, replace(link, copy_bytes_per_s=0.0))[0] - link.latency_s
                t -= _async_tp_hidden_s(problem, solution, moved, kind, group, q, adjacency, sent)
            phase = "W" if dst.kind == "param" else (dst.phase or src.phase or "F")
            com[dst.layer][phase] += t * weight / dst.weight  # per instance, chain edges amortised
            if e.dst in moe_ops:  # (a collective into an MoE layer's op: "moe" runs it again in the backward)
                moe_f[dst.layer] += t * weight / dst.weight
            total_comm += weight * t
            collectives[kind]["count"] += weight
            collectives[kind]["bytes"] += weight * sent
            collectives[kind]["time_s"] += weight * t
    local = functools.cache(functools.partial(_local_out_bytes, problem, solution))  # (asked many times a value)
    keep = kept_bytes(problem, solution, local, aliases[1], moe_ops)
    remade = remade_extra_bytes(problem, local, sets, aliases[1], moe_ops)
    w_inputs = _weight_gradient_inputs(problem, solution, aliases)
    layers = {name: LayerCost(compute_s=dict(comp[name]), comm_s=dict(com[name]), param_bytes=params[name],
                              n_params_local=nparams[name], activation_bytes=acts[name],
                              cheap_activation_bytes=acts[name] - keep[name]["selective"],
                              cheap_forward_s=cheap_f[name],
                              sac_forward_s=sac_f[name],
                              sac_activation_bytes=keep[name]["selective"] - keep[name]["sac"],
                              torch_sac_activation_bytes=keep[name]["selective"] - keep[name]["torch_sac"],
                              moe_forward_s=moe_f[name],
                              moe_activation_bytes=keep[name]["selective"] - keep[name]["moe"],
                              full_kept_bytes=keep[name]["full"],
                              transient_bytes=transient[name], remade_extra_bytes=remade.get(name, (0.0,) * 4),
                              weight_gradient_input_bytes=w_inputs[name],
                              expert_transient=(other[name], tuple(sorted(expert_ws[name]))))
              for name in dict.fromkeys(n.layer for n in g.nodes)}
    return CostBreakdown(total_s=total_comp + total_comm, compute_s=total_comp, comm_s=total_comm,
                         layers=layers, collectives={k: dict(v) for k, v in collectives.items()})


def _adjacency(g) -> tuple[dict[int, list], dict[int, list]]:
    """(edges out of each node, edges into each node), virtual edges left out."""
    outs: dict[int, list] = defaultdict(list)
    ins: dict[int, list] = defaultdict(list)
    for e in g.edges:
        if not e.virtual:
            outs[e.src].append(e)
            ins[e.dst].append(e)
    return outs, ins


_VIEW_HOPS = 4
"""How many FLOP-free ops (views, reshapes, casts) may stand between a tp collective and the GEMM it
overlaps under async TP."""


def _through_views(problem: Problem, starts, step) -> tuple[set[int], bool]:
    """The nodes reached from ``starts`` through at most :data:`_VIEW_HOPS` FLOP-free ops (each hop
    by ``step(v) -> next nodes``), not counting those FLOP-free ops: GEMMs, ops that compute, and
    nodes that are not ops; and whether the walk stopped with FLOP-free ops still to follow."""
    g, ends, frontier = problem.graph, set(), set(starts)
    for _ in range(_VIEW_HOPS + 1):
        nxt = set()
        for v in frontier:
            node = g.nodes[v]
            if node.kind == "op" and node.kernel not in GEMM_KINDS and node.flops(problem.batch) == 0:
                nxt.update(step(v))
            else:
                ends.add(v)
        frontier = nxt
    return ends, bool(frontier)


def _gemms(problem: Problem, starts, step, phases=("F", "B", "W")) -> set[int]:
    """The GEMM ops of ``phases`` that :func:`_through_views` reaches from ``starts``."""
    g = problem.graph
    return {v for v in _through_views(problem, starts, step)[0]
            if g.nodes[v].kind == "op" and g.nodes[v].kernel in GEMM_KINDS and g.nodes[v].phase in phases}


def _feeds_float8_only(problem: Problem, solution: Solution, group, q: str, adjacency) -> bool:
    """Does the tensor of ``group``, resharded to placement ``q``, feed only Float8 GEMMs (through
    FLOP-free ops)? Then its tp all-gather moves float8, a byte per element: torchao's float8 tensor
    parallel styles (``Float8ColwiseParallel``, ``Float8RowwiseParallel``, ``PrepareFloat8ModuleInput``
    in ``torchao/float8/float8_tensor_parallel.py``, which torchtitan applies with tensorwise Float8)
    cast a linear's input to float8 before its all-gather, and its output's gradient to float8 in
    the backward (``_NoopFwToFloat8BwDynamic``), before the all-gather that undoes the forward's
    reduce-scatter. Reduce-scatters stay in the high precision (partial sums), and so do parameters'
    gathers (FSDP's float8 all-gather is an option torchtitan leaves off by default).

    Only the consumers that need ``q`` in the solution count: a block output's gradient feeds its
    GEMMs gathered and the residual stream sharded, and torchao casts only the GEMMs' copy. The
    sharding MIP prices these gathers in bf16, as it prices async TP's collectives blocking: which
    consumers need ``q`` is the MIP's own choice, and pricing every all-gather of a Float8-fed
    tensor at a byte per element (tried) led it to layouts torchao's styles do not run (backward
    GEMMs gathering their inputs instead of reduce-scattering partial sums)."""
    g = problem.graph
    outs, _ = adjacency
    starts = {e.dst for e in group if g.nodes[e.dst].candidates[solution.choice[e.dst]].ins[e.dst_in] == q}
    ends, cut_short = _through_views(problem, starts, lambda v: [e.dst for e in outs[v]])
    if cut_short:  # a chain of views longer than the walk: not known to end in Float8 GEMMs
        return False
    return bool(ends) and all(g.nodes[v].kernel == "fp8_gemm" for v in ends)


def _async_tp_hidden_s(problem: Problem, solution: Solution, comm_s: float, kind: str, group, q: str,
                       adjacency, nbytes: float) -> float:
    """What async TP saves on one tp collective of ``nbytes`` (global) against running it blocking:
    the part of its transfer (``comm_s``: not its launch latency, nor the local copy of a collective
    along a dim other than 0, which stay on the compute stream) hidden behind the GEMM(s) next to
    it, less the local work the fused op adds.

    Async TP (torch's micro-pipelined TP, ``torch._inductor.fx_passes.micro_pipeline_tp``, which
    torchtitan's ``enable_async_tensor_parallel`` turns on under ``torch.compile``) splits an
    all-gather that feeds GEMMs, and a reduce-scatter of a GEMM's partial sums, into tp - 1
    peer-to-peer steps, each overlapped with the GEMM of one chunk. What it can hide: the GEMMs'
    time but one chunk's (the local chunk's GEMM runs under the first transfer, the last under
    none), and compute runs :data:`autopar.cost.step.OVERLAP_SLOWDOWN` times slower while a
    transfer is in flight, so a collective of ``c`` seconds costs ``c / slowdown`` of compute
    time it cannot hide: the hidden part is ``min(c / slowdown, gemms x (tp - 1) / tp)`` (the
    simulator's own overlap rule, :func:`autopar.cost.simulate.simulate_program`).

    Which GEMMs: an all-gather's are its consumers that need placement ``q``, through views,
    but only those that take the gathered tensor as their left operand with the gathered dim
    uncontracted (``_find_consumer_matmuls``: a direct ``mm`` user, or reshape-mm-reshape), so
    never a weight-gradient GEMM (phase "W"), which contracts the tokens the sequence-parallel
    all-gather gathers; a reduce-scatter's is its producer, through views.

    What the fused ops add on the compute stream, from ``torch.distributed._symmetric_memory``:
    ``fused_all_gather_matmul`` first copies the local shard into its symmetric-memory buffer,
    a read and a write of ``nbytes / tp`` (``_pipelined_multi_all_gather_and_consume``: not
    overlapped, by the comment there); ``fused_matmul_reduce_scatter`` writes each chunk's
    partial sums into a stacked (tp, m / tp, n) buffer and then sums it (``reduce_fn`` in
    ``_fused_matmul_reduce_scatter_impl``), a read of ``nbytes`` and a write of ``nbytes / tp``,
    a reduction NCCL's blocking reduce-scatter does inside its own kernel. Both are priced at the
    link's ``copy_bytes_per_s``, the rate of the other local copies of a collective."""
    g = problem.graph
    outs, ins = adjacency
    n = g.axis_size
    if kind == "all_gather":
        starts = [e.dst for e in group if g.nodes[e.dst].candidates[solution.choice[e.dst]].ins[e.dst_in] == q]
        gemms = _gemms(problem, starts, lambda v: [e.dst for e in outs[v]], phases=("F", "B"))
        local_bytes = 2 * nbytes / n
    else:
        gemms = _gemms(problem, [group[0].src], lambda v: [e.src for e in ins[v]])
        local_bytes = nbytes * (1 + 1 / n)
    if not gemms:
        return 0.0
    gemm_s = sum(node_cost_s(problem, v, g.nodes[v].candidates[solution.choice[v]]) for v in gemms)
    rate = problem.link.copy_bytes_per_s
    return min(comm_s / OVERLAP_SLOWDOWN, gemm_s * (n - 1) / n) - (local_bytes / rate if rate else 0.0)

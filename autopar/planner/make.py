"""Plan a model: trace twice, solve the sharding MIP per tp degree, search, write the Plan.

The steps, in order (each one only reads what the previous produced):

1. ``trace_pair``: the joint graph at the example batch and at twice it,
   annotated and grouped into layers (repeated blocks traced once).
2. For each tensor-parallel degree: the strategy graph (DTensor's rules, batch
   dims left to the dp axis) and its MIP solution at a reference micro-batch.
3. ``search``: mesh, cuts, micro-batching, ZeRO, recompute, schedule.
4. The Plan: the chosen configuration, its per-stage and per-op details, the
   runners-up.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import time
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import fx, nn

import autopar
from autopar.cluster import Cluster, parse_cluster
from autopar.passes import meta_keys as mk
from autopar.passes.layers import graph_hash
from autopar.passes.strategies import StrategyGraph, build_strategy_graph
from autopar.plan import Plan
from autopar.precision import Precision, plan_precision, resolve_precision
from autopar.planner.cuts import CutTable
from autopar.planner.context import apply_cp, check_cp, context_record, cp_costs, cp_decision, cp_options, \
    find_attention, repeat_savings, sequence_length
from autopar.planner.experts import apply_ep, check_ep, ep_options, experts_record, find_experts, runnable_sites
from autopar.planner.frontend import trace_pair
from autopar.planner.ilp import Solution, build_problem, evaluate, solve
from autopar.planner.search import Candidate, Fixed, Unit, search
from autopar.progress import progress
from autopar.zero_def import step_collective_counts

log = logging.getLogger(__name__)

__all__ = ["make_plan", "plan_graphs"]

RUNNERS_UP = 5


def make_plan(model: nn.Module, example_inputs: Any, *, cluster: str | Cluster, loss_fn: Callable | None = None,
              example_target: Any = None, fixed: dict | None = None, precision: str | None = None,
              compiled_layers: Callable[[str], bool] | None = None, runnable: bool = False) -> Plan:
    """Plan ``model`` for ``cluster``; see :func:`autopar.plan`.

    ``runnable``: only plans :func:`autopar.parallelize` can run today (expert parallelism
    only with pp = 1); planning for a cluster (``autopar plan``) weighs everything priced.

    ``compiled_layers`` (a predicate on layer paths) prices those layers' memory-bound ops as
    ``torch.compile`` fuses them (:mod:`autopar.passes.fuse`): for predicting runs of programs
    compiled that way (``bench/fidelity.py``), not what autopar's own runtime executes."""
    cluster = parse_cluster(cluster)
    fixed_ = Fixed.from_dict(fixed)
    policy, why = resolve_precision(precision, model=model, gpu_cluster=cluster.device.name.lower() != "cpu")
    _tp_options(cluster, fixed_)  # a tp that cannot fit the cluster fails now, not after tracing
    check_batch_split(_first_batch(example_inputs), fixed_)
    t0 = time.perf_counter()
    gm, gm2 = trace_pair(model, example_inputs, cluster=cluster, loss_fn=loss_fn, example_target=example_target,
                         param_dtype=policy.param_dtype)
    if compiled_layers is not None:
        from autopar.passes.fuse import fuse_memory_bound

        for g in (gm, gm2):
            fuse_memory_bound(g, device=cluster.device, compiled=compiled_layers)
    t1 = time.perf_counter()
    with _frozen_heap():
        plan = plan_graphs(gm, gm2, cluster=cluster, fixed=fixed_, precision=policy, precision_source=why,
                           ep_flat_only=runnable)
    timings = {"trace_s": t1 - t0, **plan.timings}
    return Plan(**{k: getattr(plan, k) for k in plan.__dataclass_fields__ if k != "timings"}, timings=timings)


def _first_batch(x: Any) -> int | None:
    """Dim 0 of the first tensor of at least one dim in ``x`` (a tensor, dict or sequence)."""
    if isinstance(x, torch.Tensor):
        return x.shape[0] if x.dim() else None
    values = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    return next((b for b in map(_first_batch, values) if b is not None), None)


def check_batch_split(batch: int | None, fixed: Fixed) -> None:
    """Pinned micro-batching must divide the global batch: say so before tracing."""
    if batch is None:
        return
    for key in ("microbatches", "microbatch_size"):
        n = getattr(fixed, key)
        if n is None:
            continue
        groups = fixed.dp // (fixed.cp or 1) if fixed.dp and fixed.dp % (fixed.cp or 1) == 0 else fixed.dp
        parts = n * (groups if groups and key == "microbatches" else 1)  # (cp ranks share their sequences)
        if batch % parts:
            divisors = [d for d in range(1, batch + 1) if batch % d == 0]
            over = f"dp={fixed.dp}" if groups == fixed.dp else f"dp/cp={fixed.dp}/{fixed.cp}"
            what = f"{key}={n}" + (f" x {over} = {parts}" if parts != n else "")
            raise autopar.PlanError(
                f"the global batch of {batch} is not divisible by fixed {what}; every micro-batch "
                f"must hold the same number of samples: pin {key} to a divisor of {batch} "
                f"({', '.join(map(str, divisors))}), or pass a batch that is a multiple of {parts}")


@contextlib.contextmanager
def _frozen_heap():
    """Keep the objects alive now (traced graphs, model, torch's own state) out of the garbage
    collector's full passes while planning: each pass re-walked them, 0.3 s apiece, and
    the MIPs and the schedule simulations allocate enough to trigger a dozen; this took
    planning Llama 70B on 64x8xH100 from 2.2 s to 0.8 s of collection (10.0 s -> 8.6 s).
    A caller that froze objects or disabled the collector itself is left alone."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _tp_options(cluster: Cluster, fixed: Fixed) -> list[int]:
    if fixed.tp is not None:
        if cluster.devices_per_node % fixed.tp or cluster.world_size % fixed.tp:
            raise autopar.PlanError(
                f"tp={fixed.tp} must divide the {cluster.devices_per_node} devices of a node (tensor "
                f"parallelism stays inside a node) and the world size {cluster.world_size}")
        return [fixed.tp]
    # A mesh is pp x dp x tp = the world: pinned pp and dp leave tp fewer values (both pinned:
    # one), and a tp no mesh can use is not worth its sharding MIP (the costliest part of
    # planning a small model: 20-50 CPU-s for Llama tiny at tp=2).
    rest = (fixed.pp or 1) * (fixed.dp or 1)
    options = [t for t in range(1, cluster.devices_per_node + 1)
               if cluster.devices_per_node % t == 0 and cluster.world_size % (t * rest) == 0
               and (not (fixed.pp and fixed.dp) or t * rest == cluster.world_size)]
    if not options:
        pinned = " x ".join(f"{k}={v}" for k, v in (("pp", fixed.pp), ("dp", fixed.dp)) if v)
        raise autopar.PlanError(
            f"fixed {pinned} leaves no tensor-parallel degree for the {cluster.world_size} devices: pp x dp x tp "
            f"must equal the world size, with tp dividing the {cluster.devices_per_node} devices of a node; "
            f"pin values whose product divides {cluster.world_size}")
    return options


def plan_graphs(gm: fx.GraphModule, gm2: fx.GraphModule, *, cluster: Cluster, fixed: Fixed,
                precision: Precision | None = None, precision_source: str = "", ep_flat_only: bool = False) -> Plan:
    """Plan the traced pair. ``precision`` is the policy the graphs were traced under (None:
    read off the parameters' dtype, as plans did before policies: "fp32", else "bf16-mixed").
    A model with experts is searched over the ep degrees they allow (:func:`ep_options`) unless
    ``fixed.ep`` pins one; ``ep_flat_only`` as in :func:`search`."""
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    layers: tuple[mk.LayerInfo, ...] = gm.meta[mk.LAYERS]
    batch = info.global_batch
    if precision is None:
        precision = plan_precision({"precision": "fp32" if _param_dtype(gm) == "fp32" else "bf16-mixed"})
    policy, precision = precision, precision.name
    experts = find_experts(gm)
    check_ep(fixed.ep, experts, cluster=cluster, dp=fixed.dp, tp=fixed.tp, zero=fixed.zero)
    eps = ep_options(experts)
    check_cp(fixed.cp, gm, cluster=cluster, dp=fixed.dp, ep=fixed.ep)
    # cp is weighed where sequences are long (unless pinned)
    cps = () if fixed.cp or fixed.ep else cp_options(gm, cluster.world_size)
    attention = find_attention(gm) if (fixed.cp and fixed.cp > 1) or cps else []
    if ep_flat_only and not runnable_sites(experts):  # grouped-matmul experts: planned, not run, under ep
        if fixed.ep and fixed.ep > 1:
            grouped = next(s for s in experts if s.op != "autopar::moe_experts")
            raise autopar.PlanError(
                f"ep={fixed.ep}: the experts of {grouped.module} run as a grouped matmul ({grouped.op}), which "
                f"autopar.parallelize does not run under expert parallelism yet; plan it with autopar.plan or "
                f"`autopar plan`, or drop ep")
        eps = ()
    t0 = time.perf_counter()
    solved: dict[tuple[int, bool], tuple[StrategyGraph, Solution]] = {}
    with progress("solving the sharding MIP"):
        for tp in _tp_options(cluster, fixed):
            sg = build_strategy_graph(gm, axis_size=tp, gm_double=gm2, shard_batch=False)
            ref = max(1, batch // max(1, cluster.world_size // tp))
            for sp, sol in _solve_sp(gm, sg, tp, fixed.sp, batch=ref, cluster=cluster).items():
                solved[tp, sp] = (sg, sol)
                if sol.limit:  # the plan records this for the chosen tp only; the others rank by it too
                    log.warning("sharding MIP at tp=%d (sp=%s) stopped at its limit of %d branch-and-bound nodes "
                                "with a %.2f%% gap; its best solution is used", tp, sp, sol.node_limit,
                                100 * sol.gap)
    if not solved:
        raise autopar.PlanError(f"sp={fixed.sp} needs tensor parallelism over a sequence: pin tp > 1 (tp options "
                                f"here: {_tp_options(cluster, fixed)}), or leave sp free")
    t1 = time.perf_counter()
    names = _expanded_names(layers, info)
    shared = _shared_params(gm)
    cut_table = CutTable(gm)
    cache: dict[tuple[int, int, bool, int, int], list[Unit]] = {}

    def units_for(tp: int, mbs: int, sp: bool = False, ep: int = 1, cp: int = 1) -> list[Unit]:
        if (tp, mbs, sp, ep, cp) not in cache:
            sg, sol = solved[tp, sp]
            # under cp a rank holds 1/cp of each sequence: it costs what mbs / cp sequences cost
            # (every cost is affine in the batch; autopar.planner.context)
            tokens = mbs / cp
            problem = build_problem(sg, batch=tokens, device=cluster.device, link=cluster.link_for_group(tp, stride=1))
            ev = evaluate(problem, sol)
            units = []
            local = _local_param_counts(sg, sol, tp)
            for layer in layers:
                lc = ev.layers.get(layer.path)
                scale = tokens / batch
                after = cut_table.messages(*cut_table.crossings(layer.path), sg, sol.choice, tokens)
                inside = (cut_table.messages(*cut_table.crossings(layer.path, layer.path), sg, sol.choice, tokens)
                          if layer.path in cut_table.first_of_run else after)
                for i in range(layer.count):
                    sends = inside if i + 1 < layer.count else after  # a cut inside a run, or after it
                    c = lc.compute_s if lc else {}
                    k = lc.comm_s if lc else {}
                    units.append(Unit(
                        path=names[layer.path][i],
                        f_s=c.get("F", 0.0) + k.get("F", 0.0), b_s=c.get("B", 0.0) + k.get("B", 0.0),
                        w_s=c.get("W", 0.0) + k.get("W", 0.0), comm_s=sum(k.values()),
                        cheap_f_s=lc.cheap_forward_s if lc else 0.0,
                        act_bytes=lc.activation_bytes if lc else 0.0,
                        cheap_act_bytes=lc.cheap_activation_bytes if lc else 0.0,
                        transient_bytes=lc.transient_bytes if lc else 0.0,
                        boundary_bytes=layer.boundary_bytes * scale,
                        send_forward=sends.forward, send_backward=sends.backward,
                        n_params=lc.n_params_local if lc else 0.0,
                        shared_params=tuple((fqn, owner, local.get(fqn, 0.0))
                                            for fqn, owner in shared.get(layer.path, ()))))
            if ep > 1:
                units = apply_ep(units, names=names, sites=experts, ep=ep, tp=tp, microbatch_size=mbs,
                                 global_batch=batch, cluster=cluster, imbalance=fixed.moe_imbalance or 1.0,
                                 local_params=local)
            if cp > 1:
                units = apply_cp(units, cp_costs(attention, problem, sg, sol, cp=cp, tp=tp, mbs=mbs, batch=batch,
                                                  cluster=cluster, variant=fixed.cp_variant), names,
                                 repeat_savings(attention, sg, sol, cp=cp, tp=tp, mbs=mbs, batch=batch))
            cache[tp, mbs, sp, ep, cp] = units
        return cache[tp, mbs, sp, ep, cp]

    with progress("searching meshes, cuts and schedules"):
        sp_options: dict[int, tuple[bool, ...]] = defaultdict(tuple)
        for tp, sp in sorted(solved):
            sp_options[tp] += (sp,)
        run = functools.partial(search, units_for=units_for, n_units=sum(x.count for x in layers),
                                global_batch=batch, cluster=cluster, fixed=fixed, precision=precision,
                                tp_options=sorted(sp_options), sp_options=dict(sp_options), ep_options=eps,
                                ep_flat_only=ep_flat_only)
        ranked, stats = run(keep=RUNNERS_UP + 1, cp_options=(1, *cps))
        other = None
        if cps:  # the best plan on the other side of the cp decision: the reason the summary gives
            try:
                other = run(keep=1, cp_options=cps if ranked[0].config.cp == 1 else (1,))[0][0]
            except autopar.PlanError:
                other = None  # nothing fits there
    t2 = time.perf_counter()
    best = ranked[0]
    sg, sol = solved[best.config.tp, best.config.sp]
    plan = _to_plan(gm, best, ranked[1:RUNNERS_UP + 1], sg, sol, cluster, fixed, stats, policy, precision_source,
                    timings={"solve_s": t1 - t0, "search_s": t2 - t1})
    if cps:
        plan.context.update(cp_decision(best, other, cps, seq=sequence_length(gm)))
    return plan


def _norm_nodes(gm: fx.GraphModule, sg: StrategyGraph) -> dict[int, int]:
    """Strategy-graph node -> output rank, for normalisation modules' forward ops on tensors
    of rank >= 2: the ops that run on token shards under sequence parallelism."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = {}
    for v, n in enumerate(sg.nodes):
        node = nodes.get(n.name)
        if n.kind != "op" or n.phase != "F" or node is None or mk.TRACE not in node.meta:
            continue
        val = _first_value(node)
        if "Norm" in node.meta[mk.TRACE].module_class and hasattr(val, "dim") and val.dim() >= 2:
            out[v] = val.dim()
    return out


def _first_value(node: fx.Node):
    """The op's (first) output value: ``native_layer_norm`` returns (out, mean, rstd)."""
    val = node.meta.get("val")
    return val[0] if isinstance(val, (tuple, list)) and val else val


def _token_sharded(placement: str | None, rank: int) -> bool:
    """A placement that splits a tensor of ``rank`` dims on a dim other than the last (hidden)
    one; with batch dims left to dp (``shard_batch=False``) that is a sequence shard."""
    return bool(placement) and placement.startswith("S") and int(placement[1:]) < rank - 1


def _solve_sp(gm: fx.GraphModule, sg: StrategyGraph, tp: int, pinned: bool | None, *, batch: int,
              cluster: Cluster) -> dict[bool, Solution]:
    """The sharding MIP at ``tp`` with sequence parallelism on and off: sp -> solution.

    The MIP prices time only, and sequence parallelism mostly saves memory (activations
    of norms and pointwise ops split over tp, Korthikanti et al. 2022) at the price of a
    reduce-scatter + all-gather pair (two collective latencies) where an all-reduce was
    (one). So the MIP alone rarely picks it (GPT blocks: never), although the memory it
    frees buys a larger micro-batch or less recompute. Both solutions go to the outer
    search, which prices memory. The MIP is solved free first; the norm ops' placements
    say which side it landed on, and the other side is solved with the norms' candidates
    restricted (token-sharded outputs required, or forbidden). A pinned ``sp`` solves only
    that side; a side with no solution is left out unless pinned (then the MIP's
    InfeasibleError stands). Without tp (tp=1) or without norm ops there is no sequence
    parallelism to choose: sp is False, and a pinned sp=True gets no solution here."""
    link = cluster.link_for_group(tp, stride=1)
    norms = _norm_nodes(gm, sg)
    if tp == 1 or not norms:
        if pinned:
            return {}
        return {False: solve(build_problem(sg, batch=batch, device=cluster.device, link=link))}

    def on(sol: Solution) -> bool:
        return any(_token_sharded(sg.nodes[v].candidates[sol.choice[v]].outs[0], rank) for v, rank in norms.items())

    def solve_side(sp: bool) -> Solution | None:
        forbidden = frozenset((v, i) for v, rank in norms.items() for i, s in enumerate(sg.nodes[v].candidates)
                              if _token_sharded(s.outs[0], rank) != sp)
        try:
            return solve(build_problem(sg, batch=batch, device=cluster.device, link=link, forbidden=forbidden))
        except autopar.InfeasibleError:
            if pinned is not None:
                raise
            return None

    if pinned is not None:
        return {pinned: solve_side(pinned)}
    free = solve(build_problem(sg, batch=batch, device=cluster.device, link=link))
    other = solve_side(not on(free))
    return {on(free): free, **({not on(free): other} if other is not None else {})}


def _shared_params(gm: fx.GraphModule) -> dict[str, list[tuple[str, str]]]:
    """Layer -> (parameter, owning layer) for parameters it reads that another layer owns
    (the layer of a parameter is its first reader: GPT's output head reads the embedding)."""
    out: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for node in gm.graph.find_nodes(op="placeholder"):
        trace = node.meta[mk.TRACE]
        if trace.role is not mk.Role.PARAM:
            continue
        owner = node.meta[mk.LAYER]
        readers = {u.meta[mk.LAYER] for u in node.users if u.meta[mk.TRACE].role is mk.Role.FORWARD}
        for layer in sorted(readers - {owner}):
            out[layer].append((trace.fqn, owner))
    return out


def _dp_buckets(gm: fx.GraphModule, stages: list[dict], layer_dict: dict, *, zero: int, dp: int,
                tp: int, reduce_dtype: torch.dtype | None = None) -> list[dict]:
    """The dp gradient buckets of a step: one per (stage, layer group, dtype), as ``runtime/zero.py`` makes them.

    A bucket holds the trainable parameters a layer owns (its first reader), and a stage that
    reads a parameter another stage's layer owns (a tied head) holds that owner's bucket too.
    Stage layer lists name every instance of a collapsed block ("h.7"); its parameters are
    those of the block that stood for it ("h.1"), renamed. ``bytes`` is what one collective of
    the bucket moves: each parameter's tp shard (tp rank 0's piece) padded to a multiple of
    dp at ZeRO >= 1, whole at ZeRO-0 (the runtime pads only what it slices), in ``reduce_dtype``
    (a mixed-precision policy's; default the parameter's own dtype).
    """
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    itemsize = {}
    for n in gm.graph.find_nodes(op="placeholder"):
        if n.meta[mk.TRACE].role is mk.Role.PARAM:
            dtype = reduce_dtype or n.meta["val"].dtype
            itemsize[n.meta[mk.TRACE].fqn] = (str(dtype).removeprefix("torch."), dtype.itemsize)
    owned = {}  # layer instance -> [(fqn of the instance, fqn in the plan's layer, plan layer)]
    for path in (p for st in stages for p in st["layers"]):
        src = _stand_in(path, layer_dict)
        owned[path] = [(path + f[len(src):] if f.startswith(src + ".") else f, f, src)
                       for f in layer_dict[src]["params"]] if src else []
    owner_of = {f: path for path, items in owned.items() for f, _, _ in items}
    shared = _shared_params(gm)
    read_in_backward = _read_in_backward(gm)
    out = []
    for s, st in enumerate(stages):
        groups: dict[str, list] = {path: list(owned[path]) for path in st["layers"]}
        for path in st["layers"]:
            for fqn, owner in shared.get(_stand_in(path, layer_dict) or path, []):
                owner = owner_of.get(fqn, owner)
                if owner not in groups:
                    groups[owner] = [item for item in owned.get(owner, []) if item[0] == fqn]
        for path, items in groups.items():
            by_dtype: dict[str, int] = defaultdict(int)
            for _, fqn, src in items:
                if fqn not in info.grad_outputs:
                    continue
                local = list(layer_dict[src]["param_shapes"][fqn])
                placement = layer_dict[src]["params"][fqn]
                if placement.startswith("S"):
                    d = int(placement[1:])
                    local[d] = -(-local[d] // tp)
                numel = math.prod(local)
                dtype, size = itemsize[fqn]
                by_dtype[dtype] += (-(-numel // dp) * dp if zero else numel) * size
            readers = {_stand_in(layer, layer_dict) or layer for layer in st["layers"]}
            backward = any(read_in_backward.get(f, set()) & readers for _, f, _ in items)
            for dtype, nbytes in by_dtype.items():
                out.append({"stage": s, "layer": path, "dtype": dtype, "bytes": nbytes,
                            "read_in_backward": backward})
    return out


def _read_in_backward(gm: fx.GraphModule) -> dict[str, set[str]]:
    """Parameter -> the layers whose backward reads it, directly or through views of it."""
    out: dict[str, set[str]] = defaultdict(set)
    for p in gm.graph.find_nodes(op="placeholder"):
        if p.meta[mk.TRACE].role is not mk.Role.PARAM:
            continue
        stack = list(p.users)
        while stack:
            u = stack.pop()
            if u.op == "call_function" and (getattr(u.target, "is_view", False) or "view" in str(u.target)
                                            or "reshape" in str(u.target)):
                stack.extend(u.users)
            elif u.op != "output" and u.meta[mk.TRACE].role is mk.Role.BACKWARD:
                out[p.meta[mk.TRACE].fqn].add(u.meta[mk.LAYER])
    return out


def _stand_in(path: str, layer_dict: dict) -> str | None:
    """The plan's layer for an instance: itself, or the block that stood for it (h.7 -> h.1)."""
    if path in layer_dict:
        return path
    container, _, index = path.rpartition(".")
    if index.isdigit() and f"{container}.1" in layer_dict and int(index) >= 1:
        return f"{container}.1"
    return None


def _local_param_counts(sg: StrategyGraph, sol: Solution, tp: int) -> dict[str, float]:
    """Parameter -> elements held per device on tp (a shard is 1/tp of it)."""
    out = {}
    for v, n in enumerate(sg.nodes):
        if n.kind == "param":
            numel = math.prod(n.shape)
            out[n.fqn] = numel / tp if n.candidates[sol.choice[v]].outs[0].startswith("S") else numel
    return out


def _param_dtype(gm: fx.GraphModule) -> str:
    for n in gm.graph.find_nodes(op="placeholder"):
        if n.meta[mk.TRACE].role is mk.Role.PARAM:
            return {"torch.float32": "fp32"}.get(str(n.meta["val"].dtype), "bf16")
    return "fp32"


def _expanded_names(layers, info: mk.GraphTrace) -> dict[str, list[str]]:
    """Layer path -> the names of the instances it stands for ("layers.0" -> layers.0..layers.79)."""
    out = {}
    stand_ins = {r.traced[1]: r for r in info.repeats}
    for layer in layers:
        r = stand_ins.get(layer.path)
        out[layer.path] = [f"{r.container}.{i}" for i in range(1, r.count)] if r else [layer.path]
    return out


def _cut_tensors(gm: fx.GraphModule, stage_layers: list[list[str]], microbatch: int, sg: StrategyGraph,
                 sol: Solution) -> list[dict]:
    """Per cut (stage s -> s + 1), the tensors sent forward and the gradients sent back, as the
    runtime sends them (:mod:`autopar.planner.cuts`): each with the module that makes it and
    the one that reads it, its shape per micro-batch, dtype and bytes, its placement on tp and
    the bytes one rank sends (its tp shard)."""
    layers: tuple[mk.LayerInfo, ...] = gm.meta[mk.LAYERS]
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    rep = {name: path for path, names in _expanded_names(layers, info).items() for name in names}
    table = CutTable(gm)
    vals = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"}
    out = []
    for s in range(len(stage_layers) - 1):
        crossings, placed_as = table.crossings(rep[stage_layers[s][-1]], rep[stage_layers[s + 1][0]])
        sends: dict[str, list[dict]] = {"forward": [], "backward": []}
        for c, (whole, placement, rank_bytes) in zip(crossings, table.placed(crossings, placed_as, sg, sol.choice,
                                                                              microbatch)):
            shape = [microbatch if i == 0 and d == info.global_batch else int(d)
                     for i, d in enumerate(vals[c.tensor].shape)]
            sends[c.side].append({"tensor": c.tensor, "from": c.source, "to": c.reader, "shape": shape,
                                  "dtype": str(c.dtype).removeprefix("torch."), "bytes": whole,
                                  "placement": placement, "rank_bytes": rank_bytes})
        out.append(sends)
    return out


def _tokens(gm: fx.GraphModule) -> int:
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta.get("val")
        if n.meta[mk.TRACE].role is mk.Role.INPUT and v is not None and v.dim() == 2 and not v.dtype.is_floating_point:
            return int(v.shape[0] * v.shape[1])
    return 0


def _token_sharded_norms(gm: fx.GraphModule, sg: StrategyGraph, chosen: dict) -> dict[str, list[str]]:
    """Layer path -> its normalisation modules whose forward runs on tokens split over tp
    (output sharded on a dim other than the last, the hidden one): Megatron's sequence
    parallelism (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198). Batch dims are
    left to dp (``shard_batch=False``), so a non-last shard on tp is a sequence shard."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out: dict[str, set[str]] = defaultdict(set)
    for n in sg.nodes:
        node = nodes.get(n.name)
        if n.kind != "op" or n.phase != "F" or node is None or mk.TRACE not in node.meta:
            continue
        trace = node.meta[mk.TRACE]
        val = _first_value(node)
        placement = chosen[n.name].outs[0] if chosen[n.name].outs else None
        if "Norm" not in trace.module_class or not hasattr(val, "dim") or not placement \
                or not placement.startswith("S"):
            continue
        if int(placement[1:]) < val.dim() - 1:
            out[n.layer].add(trace.module_path)
    return {layer: sorted(paths) for layer, paths in out.items()}


def _config_dict(c: Candidate) -> dict[str, Any]:
    cfg = c.config
    out = {"tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "zero": cfg.zero, "recompute": cfg.recompute,
           "schedule": cfg.schedule, "microbatch_size": cfg.microbatch_size, "microbatches": cfg.microbatches}
    if cfg.virtual_stages > 1:
        out["virtual_stages"] = cfg.virtual_stages
    if cfg.sp:
        out["sp"] = True
    if cfg.ep > 1:
        out["ep"] = cfg.ep
    if cfg.cp > 1:
        out["cp"] = cfg.cp
    return out


def _overlap(best: Candidate, cp_exposed: dict[str, float]) -> list[dict[str, float]]:
    """Per pipeline rank: seconds with a dp/tied collective in flight, how much of that the
    compute stream hid, how much it waited on, and the collectives inside the layers (on the
    compute stream): the tp ones and, under cp, what the K/V exchange leaves exposed
    (``cp_exposed``: per layer instance and micro-batch; the units carry it with their tp time)."""
    out = []
    spec, res = best.spec, best.step
    for r in range(spec.pp):
        groups = [g for st in spec.stages[r::spec.pp] for g in st.groups]
        cp_s = sum(cp_exposed.get(g.name, 0.0) for g in groups) * spec.microbatches
        tp_s = sum(g.tp_comm_s for g in groups) * spec.microbatches - cp_s
        row = {"pp_rank": r, "collectives_s": res.comm_s[r], "hidden_s": res.hidden_s[r],
               "exposed_s": res.exposed_s[r], "tp_exposed_s": max(tp_s, 0.0)}
        if cp_exposed:
            row["cp_exposed_s"] = cp_s
        out.append(row)
    return out


def _p2p_record(best: Candidate) -> dict:
    """One pipeline's p2p messages in a step (every dp x tp pipeline sends the same): per cut,
    the messages of one micro-batch each way (one per dtype, the bytes one rank sends) and how
    often each is sent (once per micro-batch), priced on the cut's link; and the totals."""
    m = best.config.microbatches
    cuts = []
    for s, st in enumerate(best.stages[:-1]):
        cuts.append({"stages": [s, s + 1],
                     "forward": [{"dtype": d, "bytes": b, "count": m} for d, b in st.send_messages],
                     "backward": [{"dtype": d, "bytes": b, "count": m} for d, b in st.back_messages],
                     "forward_s": best.p2p_cut_s[s], "backward_s": best.p2p_back_cut_s[s]})
    messages = [x for c in cuts for x in c["forward"] + c["backward"]]
    return {"count": sum(x["count"] for x in messages), "bytes": sum(x["bytes"] * x["count"] for x in messages),
            "time_s": m * sum(c["forward_s"] + c["backward_s"] for c in cuts), "cuts": cuts}


def _to_plan(gm, best: Candidate, runners: list[Candidate], sg: StrategyGraph, sol: Solution, cluster: Cluster,
             fixed: Fixed, stats: dict, policy: Precision, precision_source: str, timings: dict) -> Plan:
    precision = policy.name
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    layers: tuple[mk.LayerInfo, ...] = gm.meta[mk.LAYERS]
    cfg = best.config
    per_stage = cfg.dp * cfg.tp
    stages = []
    for s, st in enumerate(best.stages):
        stages.append({
            "layers": list(st.layers),
            "devices": list(range((s % cfg.pp) * per_stage, (s % cfg.pp + 1) * per_stage)),
            "predicted": {
                "compute_s": (st.f_s + st.b_s + st.w_s - st.comm_s) * cfg.microbatches,
                "comm_s": st.comm_s * cfg.microbatches + st.grad_sync_s,
                "f_s": st.f_s, "b_s": st.b_s, "w_s": st.w_s,
                "grad_sync_s": st.grad_sync_s, "optimizer_s": st.optimizer_s,
                "inflight_microbatches": st.inflight,
                "send_bytes": st.send_bytes,
                **({"back_bytes": sum(b for _, b in st.back_messages), "p2p_s": best.p2p_cut_s[s],
                    "p2p_back_s": best.p2p_back_cut_s[s]} if s < len(best.p2p_cut_s) else {}),
                "memory_bytes": {"params": st.params_bytes, "grads": st.grads_bytes,
                                 "optimizer": st.optimizer_bytes, "activations": st.activations_bytes,
                                 "total": st.memory_bytes},
            }})
    for s, sends in enumerate(_cut_tensors(gm, [st["layers"] for st in stages], cfg.microbatch_size / cfg.cp, sg,
                                           sol)):
        stages[s]["sends"] = sends
    chosen = {sg.nodes[v].name: sg.nodes[v].candidates[sol.choice[v]] for v in range(len(sg.nodes))}
    token_sharded = _token_sharded_norms(gm, sg, chosen)
    layer_dict = {}
    for layer in layers:
        params, shapes, classes = {}, {}, {}
        for n in sg.nodes:
            if n.kind == "param" and n.layer == layer.path:
                params[n.fqn] = chosen[n.name].outs[0]
                shapes[n.fqn] = list(n.shape)
                classes[n.fqn] = info.module_classes.get(n.fqn.rpartition(".")[0], "")
        layer_dict[layer.path] = {"class": layer.class_name, "count": layer.count, "signature": layer.signature,
                                  "params": params, "param_shapes": shapes, "param_classes": classes,
                                  "sequence_parallel": token_sharded.get(layer.path, []),
                                  "n_params": layer.n_params}
    ops = {}
    position: dict[str, int] = defaultdict(int)
    for n in sg.nodes:
        if n.kind != "op":
            continue
        s = chosen[n.name]
        ops[n.name] = {"layer": n.layer, "index": position[n.layer], "phase": n.phase,
                       "out": list(s.outs), "in": list(s.ins)}
        position[n.layer] += 1
    ev = evaluate(build_problem(sg, batch=cfg.microbatch_size / cfg.cp, device=cluster.device,
                                link=cluster.link_for_group(cfg.tp, stride=1)), sol)
    communication: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for kind, c in ev.collectives.items():
        communication[kind]["tp"] = {"count": c["count"] * cfg.microbatches, "bytes": c["bytes"] * cfg.microbatches,
                                     "time_s": c["time_s"] * cfg.microbatches}
    if cfg.dp > 1:
        per_rank = [0.0] * cfg.pp  # a rank syncs the stages it holds one after the other
        for s, st in enumerate(best.stages):
            per_rank[s % cfg.pp] += st.grad_sync_s
        buckets = _dp_buckets(gm, stages, layer_dict, zero=cfg.zero, dp=cfg.dp, tp=cfg.tp,
                              reduce_dtype=policy.reduce_dtype)
        counts = step_collective_counts(cfg.zero, n_micro=cfg.microbatches)
        # a mixed policy gathers bf16 weights at stage 3 and fp32 masters after the step at stages 1-2
        gather_dtype = policy.param_dtype if cfg.zero == 3 else policy.master_dtype
        for kind, k in counts.items():  # zero_def: how often each bucket's collectives run in a step
            # stage 3 gathers a group for backward only when the backward reads it (the embedding's
            # gradient needs no weight): zero_def's 2 x n_micro is forward + backward
            rows = [{**b, "count": k // 2 if kind == "all_gather" and cfg.zero == 3 and not b["read_in_backward"]
                     else k} for b in buckets]
            if kind == "all_gather" and gather_dtype is not None and policy.reduce_dtype is not None:
                scale = gather_dtype.itemsize / policy.reduce_dtype.itemsize
                rows = [{**r, "bytes": r["bytes"] * scale,
                         "dtype": str(gather_dtype).removeprefix("torch.")} for r in rows]
            communication[kind]["dp"] = {"count": sum(r["count"] for r in rows),
                                         "bytes": sum(r["bytes"] * r["count"] for r in rows),
                                         "time_s": max(per_rank) / len(counts), "buckets": rows}
    if cfg.pp > 1:
        communication["p2p"]["pp"] = _p2p_record(best)
    experts = {}
    if cfg.ep > 1:
        experts = experts_record(find_experts(gm), ep=cfg.ep, dp=cfg.dp, tp=cfg.tp,
                                 microbatch_size=cfg.microbatch_size, microbatches=cfg.microbatches,
                                 global_batch=info.global_batch, counts={x.path: x.count for x in layers},
                                 cluster=cluster, imbalance=fixed.moe_imbalance or 1.0)
        a2a = experts["all_to_all"]
        communication["all_to_all"]["ep"] = {"count": a2a["count"], "bytes": a2a["bytes"], "time_s": a2a["time_s"]}
    context = {}
    cp_exposed: dict[str, float] = {}  # layer instance -> its K/V exchange's exposed seconds per micro-batch
    if cfg.cp > 1:
        tokens = cfg.microbatch_size / cfg.cp
        problem = build_problem(sg, batch=tokens, device=cluster.device, link=cluster.link_for_group(cfg.tp, stride=1))
        costs = cp_costs(find_attention(gm), problem, sg, sol, cp=cfg.cp, tp=cfg.tp, mbs=cfg.microbatch_size,
                          batch=info.global_batch, cluster=cluster, variant=fixed.cp_variant)
        context = context_record(costs, cp=cfg.cp, seq=sequence_length(gm), counts={x.path: x.count for x in layers},
                                 microbatches=cfg.microbatches)
        communication["p2p"]["cp"] = dict(context["kv_exchange"])
        names = _expanded_names(layers, info)
        cp_exposed = {name: sum(c.exposed_s for c in cs) for layer, cs in costs.items()
                      for name in names.get(layer, [layer])}
    model_flops = sum((x.flops_fwd + x.flops_bwd) * x.count for x in layers)
    recompute_flops = 0.0
    if cfg.recompute == "full":
        recompute_flops = sum(x.flops_fwd * x.count for x in layers)
    peak = cluster.device.peak("fp32" if precision == "fp32" else "bf16")
    step = best.step_time_s
    tokens = _tokens(gm)
    predicted = {
        "step_time_s": step, "bubble_fraction": best.bubble_fraction, "p2p_s": best.p2p_s,
        "model_flops_per_step": model_flops, "hardware_flops_per_step": model_flops + recompute_flops,
        "mfu": model_flops / (step * cluster.world_size * peak) if step > 0 else 0.0,
        "peak_memory_bytes": best.peak_memory_bytes,
        "tokens_per_s": tokens / step if tokens and step > 0 else None,
        "overlap": _overlap(best, cp_exposed),
        "step": best.spec.to_dict(),
    }
    solver = {
        "backend": "SCIP (OR-tools pywraplp)", "status": sol.status, "objective": sol.objective_s,
        "bound": sol.bound_s, "gap": sol.gap, "nodes": sol.nodes, "node_limit": sol.node_limit,
        "limit": sol.limit,  # the work limit that stopped the MIP before it proved optimality, or None
        "search": {k: v for k, v in stats.items() if not k.endswith("_s")},  # counts; times go to timings
        "candidates": [{"config": _config_dict(c), "step_time_s": c.step_time_s} for c in runners],
    }
    return Plan(
        mesh={"pp": cfg.pp, "dp": cfg.dp, "tp": cfg.tp},
        schedule={"kind": cfg.schedule, "microbatches": cfg.microbatches, "microbatch_size": cfg.microbatch_size},
        zero=cfg.zero, recompute=cfg.recompute, sequence_parallel=cfg.sp, stages=tuple(stages), layers=layer_dict, ops=ops,
        predicted=predicted, solver=solver, communication=dict(communication),
        cluster={"spec": cluster.spec, **cluster.to_dict()},
        model={"name": info.model_name, "n_params": info.n_params, "graph_hash": graph_hash(gm),
               "global_batch": info.global_batch, "precision": precision,
               **({"precision_source": precision_source} if precision_source else {})},
        fixed=fixed.to_dict(), experts=experts, context=context, autopar_version=autopar.__version__,
        timings={**timings, "sharding_mip_s": sol.wall_s, "search_wall_s": stats["wall_s"],
                 **{f"search_{k}": v for k, v in stats.items() if k.endswith("_s") and k != "wall_s"}})

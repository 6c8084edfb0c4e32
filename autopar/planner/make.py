"""Plan a model: trace twice, solve the sharding MIP per tp degree, search, write the Plan.

The steps, in order (each one only reads what the previous produced):

1. ``trace_and_twin``: the joint graph at the example batch, annotated and grouped into
   layers (repeated blocks traced once), and the numbers the planner reads of the same
   graph at twice the batch (traced side by side in a forked child where that is safe).
2. For each tensor-parallel degree: the strategy graph (DTensor's rules, batch
   dims left to the dp axis) and its MIP solution at a reference micro-batch.
3. ``search``: mesh, cuts, micro-batching, ZeRO, recompute, schedule.
4. The Plan: the chosen configuration, its per-stage and per-op details, the
   runners-up (:mod:`autopar.planner.record`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import threading
import time
from collections import defaultdict
from typing import Any, Callable

from torch import fx, nn

import autopar
from autopar.cluster import Cluster, parse_cluster
from autopar.passes import meta_keys as mk
from autopar.passes.strategies import StrategyGraph, TwinFacts, build_strategy_graph, strategy_skeleton
from autopar.plan import Plan
from autopar.precision import Precision, plan_precision, resolve_precision
from autopar.planner.cuts import CutTable
from autopar.planner.context import apply_cp, check_cp, cp_costs, cp_decision, cp_weighing, \
    cp_working_sets, find_attention, repeat_savings, sequence_length
from autopar.planner.experts import apply_ep, check_dispatch, check_ep, ep_options, find_experts, runnable_sites
from autopar.planner.frontend import leading_batch, trace_and_twin
from autopar.planner.evaluation import evaluate
from autopar.planner.expert_folding import fold_experts
from autopar.planner.ilp import Solution, build_problem, solve
from autopar.planner.record import expanded_names, first_value, shared_params, to_plan, token_sharded
from autopar.planner.search import Fixed, Unit, search
from autopar.planner.side_by_side import cpus as _cores, may_fork, run_tasks
from autopar.planner.fixed import check_cuts, mesh_shapes
from autopar.progress import progress

log = logging.getLogger(__name__)

__all__ = ["make_plan", "plan_graphs"]

RUNNERS_UP = 5


def make_plan(model: nn.Module, example_inputs: Any, *, cluster: str | Cluster, loss_fn: Callable | None = None,
              example_target: Any = None, fixed: dict | None = None, precision: str | None = None,
              compiled_layers: Callable[[str], bool] | None = None, float8_linears: Callable[[str], bool] | None = None,
              async_tp: bool = False, whole_layer_recompute: bool = False, runnable: bool = False,
              replicated: Callable[[fx.GraphModule], set[str]] | None = None) -> Plan:
    """Plan ``model`` for ``cluster``; see :func:`autopar.plan`.

    ``runnable``: only plans :func:`autopar.parallelize` can run today (expert parallelism
    only over autopar's experts op, not grouped matmuls); planning for a cluster (``autopar plan``)
    weighs everything priced.

    ``compiled_layers`` (a predicate on layer paths) prices those layers' memory-bound ops as
    ``torch.compile`` fuses them (:mod:`autopar.passes.fuse`): for predicting runs of programs
    compiled that way (``bench/fidelity.py``), not what autopar's own runtime executes.

    ``float8_linears`` (a predicate on module paths) prices those ``nn.Linear`` modules' GEMMs as
    torchao's Float8 training runs them (:mod:`autopar.passes.float8`), for the same purpose: the
    plan is priced so, autopar's runtime does not convert the linears.

    ``async_tp`` prices the tp all-gathers into GEMMs and reduce-scatters out of them as torch's
    async TP overlaps them with those GEMMs (:func:`autopar.planner.evaluation._async_tp_hidden_s`),
    for the same purpose: autopar's runtime runs them blocking, and the sharding MIP, which picks
    the layout, prices them so too.

    ``whole_layer_recompute`` prices activation recompute's memory as ``torch.utils.checkpoint``
    (torchtitan's full and op-level selective AC) and Megatron-LM run it, for the same purpose: what a
    layer dropped is made again at once as its backward begins, all its activations alive then, and
    ``recompute="sac"`` keeps what torchtitan's policy stores; autopar's runtime makes each op again
    right before its first backward reader and keeps what the backward reads, and the plan counts
    that by default.

    ``replicated`` (traced graph -> names of its ops) keeps those ops' outputs whole on every tp
    rank (the MIP may not shard them): for pricing a published program that does so
    (``bench/fidelity.py``: torchtitan's Qwen3 TP plan gathers q and k after their norms), not
    a layout autopar chooses. An op with no replicated strategy is left free."""
    cluster = parse_cluster(cluster)
    fixed_ = Fixed.from_dict(fixed)
    policy, why = resolve_precision(precision, model=model, gpu_cluster=cluster.device.name.lower() != "cpu")
    _tp_options(cluster, fixed_)  # a tp that cannot fit the cluster fails now, not after tracing
    check_batch_split(leading_batch(example_inputs), fixed_)
    t0 = time.perf_counter()

    def prepare(g: fx.GraphModule) -> None:
        if compiled_layers is not None:
            from autopar.passes.fuse import fuse_memory_bound

            fuse_memory_bound(g, device=cluster.device, compiled=compiled_layers)
        if float8_linears is not None:
            from autopar.passes.float8 import mark_float8_linears

            mark_float8_linears(g, device=cluster.device, linears=float8_linears)

    with _fewer_collections():
        gm, gm2 = trace_and_twin(model, example_inputs, cluster=cluster, loss_fn=loss_fn,
                                 example_target=example_target, param_dtype=policy.param_dtype, prepare=prepare)
    t1 = time.perf_counter()
    with _frozen_heap():
        plan = plan_graphs(gm, gm2, cluster=cluster, fixed=fixed_, precision=policy, precision_source=why,
                           ep_runnable_only=runnable,
                           replicated=frozenset(replicated(gm)) if replicated else frozenset(),
                           async_tp=async_tp, whole_layer_recompute=whole_layer_recompute)
    timings = {"trace_s": t1 - t0, **plan.timings}
    return Plan(**{k: getattr(plan, k) for k in plan.__dataclass_fields__ if k != "timings"}, timings=timings)


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
def _fewer_collections():
    """While tracing, collect young objects every 50,000 allocations instead of 700, and the old
    generation all but never (thresholds 50,000/50/1,000 instead of 700/10/10): TorchDynamo and
    AOTAutograd allocate millions of short-lived objects, and each collection that reaches the
    old generation re-walks the whole heap (torch, transformers, the model); what the trace
    leaves in cycles is collected after it, with the caller's thresholds back. Measured in
    forked children as bench/hf_coverage.py runs them, CPU-s of a plan, two runs each: Llama
    tiny 4.3/4.3 -> 3.8/3.5, T5 10.1/10.0 -> 9.0/9.4, Mamba 17.5/17.4 -> 14.8/15.7, BERT
    3.9/3.7 -> 3.2/3.6, Qwen2-MoE 5.7/5.8 -> 5.9/5.6. A caller that disabled the collector or
    set a larger threshold is left alone."""
    old = gc.get_threshold()
    if not gc.isenabled() or old[0] >= _TRACE_GC_THRESHOLDS[0]:
        yield
        return
    gc.set_threshold(*_TRACE_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)


_TRACE_GC_THRESHOLDS = (50_000, 50, 1_000)


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


@contextlib.contextmanager
def _collector_paused():
    """No cyclic garbage collection during the outer search. It builds millions of small,
    acyclic, mostly long-lived objects (action lists of every schedule shape, timing orders,
    candidates), which reference counting frees; each full pass of the collector walks all of
    them again (Llama 405B on 1024x8xH100: search 15.8 -> 10.9 CPU-s). Collection resumes
    after; a caller that disabled the collector itself is left alone."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


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


def plan_graphs(gm: fx.GraphModule, gm2: fx.GraphModule | tuple[TwinFacts, ...], *, cluster: Cluster, fixed: Fixed,
                precision: Precision | None = None, precision_source: str = "", ep_runnable_only: bool = False,
                replicated: frozenset[str] = frozenset(), async_tp: bool = False,
                whole_layer_recompute: bool = False) -> Plan:
    """Plan the traced pair (``gm2``: the double-batch graph or its
    :func:`~autopar.passes.strategies.twin_facts`). ``precision`` is the policy the graphs were traced under (None:
    read off the parameters' dtype, as plans did before policies: "fp32", else "bf16-mixed").
    A model with experts is searched over the ep degrees they allow (:func:`ep_options`) unless
    ``fixed.ep`` pins one; with ``ep_runnable_only`` (what :func:`autopar.parallelize` asks for) only
    where every experts site is autopar's experts op, which it runs under ep (a grouped matmul is
    planned without ep, and a pinned ep is one line); ``replicated``, ``async_tp`` and
    ``whole_layer_recompute`` as in :func:`make_plan`."""
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    layers: tuple[mk.LayerInfo, ...] = gm.meta[mk.LAYERS]
    batch = info.global_batch
    if precision is None:
        precision = plan_precision({"precision": "fp32" if _param_dtype(gm) == "fp32" else "bf16-mixed"})
    policy, precision = precision, precision.name
    names = expanded_names(layers, info)
    check_cuts(fixed, [n for layer in layers for n in names[layer.path]])  # before the MIP solves
    experts = find_experts(gm)
    check_ep(fixed.ep, experts, cluster=cluster, dp=fixed.dp, tp=fixed.tp, etp=fixed.etp)
    check_dispatch(fixed.ep_dispatch, experts)
    if fixed.recompute == "moe" and not experts:
        raise autopar.PlanError("recompute='moe' makes each MoE layer's forward again in its backward, and this model "
                                "has no expert layers (autopar.experts.moe_experts, or Hugging Face's experts); pin "
                                "recompute='selective', which is the same here")
    eps = ep_options(experts)
    check_cp(fixed.cp, gm, cluster=cluster, dp=fixed.dp)
    # cp is weighed where sequences are long (unless pinned)
    cps, not_weighed = ((), None) if fixed.cp else cp_weighing(gm, cluster.world_size)
    attention = find_attention(gm) if (fixed.cp and fixed.cp > 1) or cps else []
    if ep_runnable_only and not runnable_sites(experts):  # grouped-matmul experts: planned, not run, under ep
        if (fixed.ep and fixed.ep > 1) or fixed.etp == 1:
            grouped = next(s for s in experts if s.op != "autopar::moe_experts")
            raise autopar.PlanError(
                f"{f'ep={fixed.ep}' if fixed.ep and fixed.ep > 1 else 'etp=1'}: the experts of {grouped.module} run "
                f"as a grouped matmul ({grouped.op}), which "
                f"autopar.parallelize does not run under expert parallelism yet; plan it with autopar.plan or "
                f"`autopar plan`, or drop ep")
        eps = ()
    # ep folded over tp as well (experts whole): pinned (etp=1), or weighed beside the default where
    # the experts allow ep (autopar.planner.expert_folding)
    folds = (True,) if fixed.etp == 1 else (False, True) if fixed.etp is None and eps else (False,)
    solved: dict[tuple[int, bool, bool], tuple[StrategyGraph, Solution]] = {}
    shared = shared_params(gm)
    cut_table = CutTable(gm)
    cache: dict[tuple[int, int, bool, int, int, int], list[Unit]] = {}
    # (what does not depend on ep or cp, shared by every (ep, cp) and by micro-batch sizes with
    # the same tokens a rank: the search asks for every combination)
    bases: dict[tuple[int, bool, int, float], tuple[Any, list[Unit], dict[str, float]]] = {}
    cp_parts: dict[tuple[int, bool, int, int, int], tuple] = {}

    def base_units(tp: int, sp: bool, ep_tp: int, tokens: float) -> tuple[Any, list[Unit], dict[str, float]]:
        """(the cost problem, the units without ep and cp, the parameters per tp rank) at ``tokens``
        sequences a rank."""
        if (tp, sp, ep_tp, tokens) not in bases:
            sg, sol = solved[tp, sp, ep_tp > 1]
            problem = build_problem(sg, batch=tokens, device=cluster.device, link=cluster.link_for_group(tp, stride=1),
                                    async_tp=async_tp)
            ev = evaluate(problem, sol)
            units = []
            local = _local_param_counts(sg, sol, tp)
            for layer in layers:
                lc = ev.layers.get(layer.path)
                scale = tokens / batch
                after = cut_table.messages(*cut_table.crossings(layer.path), sg, sol.choice, tokens)
                inside = (cut_table.messages(*cut_table.crossings(layer.path, layer.path), sg, sol.choice, tokens)
                          if layer.path in cut_table.first_of_run else after)
                boundary = layer.boundary_bytes * scale * cut_table.forward_share(layer.path, sg, sol.choice, tokens)
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
                        sac_f_s=lc.sac_forward_s if lc else 0.0,
                        sac_act_bytes=(lc.torch_sac_activation_bytes if whole_layer_recompute else
                                       lc.sac_activation_bytes) if lc else 0.0,
                        transient_bytes=lc.transient_bytes if lc else 0.0,
                        moe_f_s=lc.moe_forward_s if lc else 0.0, moe_act_bytes=lc.moe_activation_bytes if lc else 0.0,
                        remade_extra_bytes=lc.remade_extra_bytes if lc else (0.0,) * 4,
                        full_kept_bytes=boundary if whole_layer_recompute else lc.full_kept_bytes if lc else 0.0,
                        whole_layer_remade=whole_layer_recompute,
                        w_held_bytes=lc.weight_gradient_input_bytes if lc else 0.0,
                        expert_transient=lc.expert_transient if lc else (0.0, ()),
                        boundary_bytes=boundary,
                        send_forward=sends.forward, send_backward=sends.backward,
                        n_params=lc.n_params_local if lc else 0.0,
                        shared_params=tuple((fqn, owner, local.get(fqn, 0.0))
                                            for fqn, owner in shared.get(layer.path, ()))))
            bases[tp, sp, ep_tp, tokens] = (problem, units, local)
        return bases[tp, sp, ep_tp, tokens]

    def units_for(tp: int, mbs: int, sp: bool = False, ep: int = 1, cp: int = 1, ep_tp: int = 1) -> list[Unit]:
        if (tp, mbs, sp, ep, cp, ep_tp) not in cache:
            # under cp a rank holds 1/cp of each sequence: it costs what mbs / cp sequences cost
            # (every cost is affine in the batch; autopar.planner.context)
            tokens = mbs / cp
            problem, units, local = base_units(tp, sp, ep_tp, tokens)
            if ep > 1:
                units = apply_ep(units, names=names, sites=experts, ep=ep, tp=tp, microbatch_size=tokens,
                                 global_batch=batch, cluster=cluster, imbalance=fixed.moe_imbalance or 1.0,
                                 local_params=local, ep_tp=ep_tp, dispatch=fixed.ep_dispatch or "autopar")
            if cp > 1:
                if (tp, sp, ep_tp, mbs, cp) not in cp_parts:
                    sg, sol = solved[tp, sp, ep_tp > 1]
                    costs = cp_costs(attention, problem, sg, sol, cp=cp, tp=tp, mbs=mbs, batch=batch, cluster=cluster,
                                     variant=fixed.cp_variant)
                    cp_parts[tp, sp, ep_tp, mbs, cp] = (
                        costs, repeat_savings(attention, sg, sol, cp=cp, tp=tp, mbs=mbs, batch=batch),
                        cp_working_sets(attention, costs, problem, sg, sol))
                costs, unsaved, working = cp_parts[tp, sp, ep_tp, mbs, cp]
                units = apply_cp(units, costs, names, unsaved, working)
            cache[tp, mbs, sp, ep, cp, ep_tp] = units
        return cache[tp, mbs, sp, ep, cp, ep_tp]

    def prefetch_units(tp: int, sp: bool, folded: bool, sg: StrategyGraph, sol: Solution) -> None:
        """While the other MIPs solve: the units the search will ask of this one without ep or cp
        (or at a pinned cp), one per micro-batch size it visits. SCIP releases the GIL and a
        forked child may solve MIPs too, so this thread would wait: this is the search's own
        work done then (Llama 70B on 64x8xH100: 61 units lists, 0.5 s, each a pure function of
        its MIP's answer). Not for models with experts, whose ep options pick the shapes."""
        if folded or eps:
            return
        solved[tp, sp, folded] = (sg, sol)
        cps_ = lambda dp: [c for c in (fixed.cp or 1,) if dp % c == 0]  # noqa: E731
        for _, _, cp, mbs, _ in mesh_shapes(cluster.world_size, tp, global_batch=batch, fixed=fixed,
                                            n_units=sum(x.count for x in layers), cps=cps_):
            if mbs is not None:
                base_units(tp, sp, 1, mbs / cp)

    t0 = time.perf_counter()
    with progress("solving the sharding MIP"):
        for (tp, sp, folded), (sg, sol) in _solve_all(gm, gm2, _tp_options(cluster, fixed), fixed.sp, batch=batch,
                                                      cluster=cluster, replicated=replicated, experts=experts,
                                                      folds=folds, on_solved=prefetch_units).items():
            solved[tp, sp, folded] = (sg, sol)
            if sol.limit:  # the plan records this for the chosen tp only; the others rank by it too
                log.warning("sharding MIP at tp=%d (sp=%s%s) stopped at its limit of %d branch-and-bound nodes "
                            "with a %.2f%% gap; its best solution is used", tp, sp, ", ep folded" if folded else "",
                            sol.node_limit, 100 * sol.gap)
    if not solved:
        raise autopar.PlanError(f"sp={fixed.sp} needs tensor parallelism over a sequence: pin tp > 1 (tp options "
                                f"here: {_tp_options(cluster, fixed)}), or leave sp free")
    t1 = time.perf_counter()
    with progress("searching meshes, cuts and schedules"), _collector_paused():
        sp_options: dict[int, tuple[bool, ...]] = defaultdict(tuple)
        for tp, sp in sorted({key[:2] for key in solved}):
            sp_options[tp] += (sp,)
        run = functools.partial(search, units_for=units_for, n_units=sum(x.count for x in layers),
                                global_batch=batch, cluster=cluster, fixed=fixed, precision=precision,
                                tp_options=sorted(sp_options), sp_options=dict(sp_options), ep_options=eps,
                                variants=frozenset(solved), moe_layers=bool(experts))
        ranked, stats = run(keep=RUNNERS_UP + 1, cp_options=(1, *cps))
        other = None
        if cps:  # the best plan on the other side of the cp decision: the reason the summary gives
            try:
                other = run(keep=1, cp_options=cps if ranked[0].config.cp == 1 else (1,))[0][0]
            except autopar.PlanError:
                other = None  # nothing fits there
    t2 = time.perf_counter()
    best = ranked[0]
    sg, sol = solved[best.config.tp, best.config.sp, best.config.ep_tp > 1]
    plan = to_plan(gm, best, ranked[1:RUNNERS_UP + 1], sg, sol, cluster, fixed, stats, policy, precision_source,
                    timings={"solve_s": t1 - t0, "search_s": t2 - t1}, async_tp=async_tp)
    if cps:
        plan.context.update(cp_decision(best, other, cps, seq=sequence_length(gm)))
    elif not_weighed:
        seq = sequence_length(gm)
        plan.context.update(cp=1, sequence=seq, tokens_per_rank=seq, considered=[], not_weighed=not_weighed)
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
        val = first_value(node)
        if "Norm" in node.meta[mk.TRACE].module_class and hasattr(val, "dim") and val.dim() >= 2:
            out[v] = val.dim()
    return out


def _solve_all(gm: fx.GraphModule, gm2: fx.GraphModule | tuple[TwinFacts, ...], tps: list[int],
               pinned_sp: bool | None, *, batch: int, cluster: Cluster, replicated: frozenset[str] = frozenset(),
               experts: list | None = None, folds: tuple[bool, ...] = (False,), on_solved: Callable | None = None
               ) -> dict[tuple[int, bool, bool], tuple[StrategyGraph, Solution]]:
    """The sharding MIPs of every tp degree, each side of the sp decision its own MIP
    (:func:`_sp_sides`, :func:`_solve_side`): (tp, sp, folded) -> (strategy graph, solution), in
    the order of ``tps`` (sp False first). ``folds``: at tp > 1, the graph as traced (False)
    and/or with the blocks of ``experts`` (expert sites) folded (True: ep over tp as well,
    :func:`autopar.planner.expert_folding.fold_experts`); a fold the experts do not allow at some
    tp (E not divisible by it) is left out there, unless it is the only one asked for (then its
    PlanError stands). At tp = 1 there is nothing to fold: one graph, folded False.

    The strategy graphs are built as the MIPs need them (with experts folded, all before);
    the MIPs run side by side (:func:`autopar.planner.side_by_side.run_tasks`): in threads, up to
    one per CPU, and where a fork is safe in a forked child as well, each process with half the
    CPUs' threads, all taking the next MIP from one queue, longest first as far as that is
    known. SCIP releases the GIL while it searches, but building a MIP is Python: on 2 cores
    Llama 70B's seven MIPs (64x8xH100) ended 1.5-1.8 s after they began with the child and
    2.0-2.5 s without it (two runs each, alternating). Each answer depends on its MIP alone (SCIP is
    deterministic under a node limit and a gap), not on where it ran, what ran beside it or
    how fast; errors are raised in the order of the tp degrees, as one at a time would.

    ``on_solved(tp, sp, folded, graph, solution)``, where given, is called in this thread for
    each MIP that finds a solution, as it finishes (here, or in the child: its answers stream
    back), while the rest still run (an unrestricted MIP's side labelled False): work that needs one
    MIP's answer can use the cores the solver leaves idle. Its order depends on timing; what
    it computes must not."""
    graphs: dict[tuple[int, bool], StrategyGraph] = {}  # (tp, folded) -> its strategy graph
    skeleton = strategy_skeleton(gm, gm2)  # (what every tp's graph shares: built once)

    norms: dict[int, dict[int, int]] = {}
    building = threading.Lock()

    def graph(tp: int, folded: bool) -> StrategyGraph:
        """The strategy graph at ``tp``, built on first use in whichever thread (or forked child)
        needs it first (an unfolded one: folded ones are built before the MIPs start)."""
        with building:
            if (tp, folded) not in graphs:
                graphs[tp, folded] = build_strategy_graph(gm, axis_size=tp, gm_double=gm2, shard_batch=False,
                                                          skeleton=skeleton)
            return graphs[tp, folded]

    def one(tp: int, folded: bool, sp: bool | None, pinned: bool = pinned_sp is not None) -> Solution | None:
        ref = max(1, batch // max(1, cluster.world_size // tp))  # (the batch of one tp group)
        return _solve_side(graph(tp, folded), tp, sp, norms=norms[tp], pinned=pinned, batch=ref, cluster=cluster,
                           replicated=replicated)

    order: list[tuple[int, bool, bool | None]] = []  # (the MIPs in the order their errors are raised)
    if folds == (False,):  # every MIP known from the skeleton (its norm ops are every graph's): graphs built as needed
        norms.update(dict.fromkeys(tps, _norm_nodes(gm, skeleton.graph)))
        order = [(tp, False, sp) for tp in sorted(tps, reverse=True) for sp in _sp_sides(norms[tp], tp, pinned_sp)]
    for tp in sorted(tps, reverse=True) if folds != (False,) else ():
        plain = build_strategy_graph(gm, axis_size=tp, gm_double=gm2, shard_batch=False, skeleton=skeleton)
        norms[tp] = _norm_nodes(gm, plain)
        for folded in dict.fromkeys(folds if tp > 1 else (False,)):
            if not folded:
                graphs[tp, False] = plain
            else:
                try:
                    graphs[tp, True] = fold_experts(plain, skeleton, experts or [])
                except autopar.PlanError:
                    if folds == (True,):
                        raise
                    continue  # (the experts do not split over this tp: no folded variant here)
            order += [(tp, folded, sp) for sp in _sp_sides(norms[tp], tp, pinned_sp)]
    # Longest first, as far as it is known: the widest tp's MIPs, and the sp=True sides, whose
    # norm ops' candidates are restricted, after every other (they took 0.10-0.34 s of SCIP where
    # the sp=False sides took 0.26-0.63 s: Llama 70B on 64x8xH100; 405B on 1024x8xH100 0.20-0.30
    # s against 0.27-0.49 s), so that the last MIPs to finish are short ones.
    queue = [key for key in order if not key[2]] + [key for key in order if key[2]]

    def done(i: int, sol) -> None:
        if on_solved is not None and isinstance(sol, Solution):
            tp, folded, sp = queue[i]
            on_solved(tp, bool(sp), folded, graph(tp, folded), sol)

    # Two processes where a fork is safe, each with half the CPUs' threads (building a MIP is
    # Python, SCIP releases the GIL: autopar.planner.side_by_side), else threads here alone.
    cpus = _cores()
    fork = len(queue) > 1 and cpus > 1 and may_fork()
    solutions = run_tasks(len(queue), lambda i: one(*queue[i]), fork=fork, on_done=done,
                          threads=max(1, cpus // 2) if fork else max(1, min(len(queue), cpus)))
    results = dict(zip(queue, solutions))
    for key in order:
        if isinstance(results[key], BaseException):
            raise results[key]
    for tp in tps if folds == (False,) else ():
        graph(tp, False)  # (those only a forked child needed)
    out = {}
    for tp, folded in sorted(graphs, key=lambda k: (tps.index(k[0]), k[1])):
        sides = {sp: sol for (t, f, sp), sol in results.items() if (t, f) == (tp, folded) and sol is not None}
        if None in sides:  # no norms, or tp=1: one MIP, and it has no sequence parallelism
            sides = {False: sides[None]}
        elif not sides and pinned_sp is None:  # neither pure side fits: the free MIP, labelled by its norms
            free = one(tp, folded, None, pinned=False)
            sides = {any(token_sharded(graphs[tp, folded].nodes[v].candidates[free.choice[v]].outs[0], rank)
                         for v, rank in norms[tp].items()): free}
        out.update({(tp, sp, folded): (graphs[tp, folded], sol) for sp, sol in sorted(sides.items())})
    return out


def _sp_sides(norms: dict[int, int], tp: int, pinned: bool | None) -> tuple[bool | None, ...]:
    """The MIPs to solve at ``tp`` for the sp decision, given the graph's norm ops
    (:func:`_norm_nodes`): (None,) for one unrestricted MIP where there is no sequence
    parallelism to choose (tp=1, or no norm ops), () where a pinned sp=True has none, else
    the pinned side or both.

    Sequence parallelism mostly saves memory (activations of norms and pointwise ops split over
    tp, Korthikanti et al. 2022) at the price of a reduce-scatter + all-gather pair (two
    collective latencies) where an all-reduce was (one), and the MIP prices time only: alone it
    rarely picks it (GPT blocks: never), although the memory it frees buys a larger
    micro-batch or less recompute. So each side is its own MIP, with the norm ops' candidates
    restricted (token-sharded outputs required, or forbidden), and both go to the outer
    search, which prices memory. A side is pure: sp=True puts every norm op on token shards,
    as Megatron-LM's ``--sequence-parallel`` and torchtitan's SequenceParallel do. Until
    2026-12 the planner solved the unrestricted MIP and then the side it did not land on;
    the unrestricted MIP is the union of both sides plus mixed layouts, and it is the
    slowest to prove: Llama 70B's tp=8 one took 23 nodes and 1.8 CPU-s against 2 nodes and
    0.4 CPU-s for its sp=False side, at an objective within the 1% gap. Across the sampled
    Hugging Face models (bench/hf_coverage.py, 150 MIPs) its mixed answers cost within 0.5% of
    the pure sp=False side (typically one norm of 45-127 on token shards at equal cost)."""
    if tp == 1 or not norms:
        return () if pinned else (None,)
    return (pinned,) if pinned is not None else (False, True)


def _solve_side(sg: StrategyGraph, tp: int, sp: bool | None, *, norms: dict[int, int], pinned: bool, batch: int,
                cluster: Cluster, replicated: frozenset[str] = frozenset()) -> Solution | None:
    """The sharding MIP at ``tp`` on one side of the sp decision (None: unrestricted), the norm
    ops ``norms`` restricted to it, and the ops named in ``replicated`` to their replicated
    strategies (:func:`make_plan`). A side with no solution is None unless pinned (then the
    MIP's InfeasibleError stands)."""
    link = cluster.link_for_group(tp, stride=1)
    whole = {v for v, node in enumerate(sg.nodes)
             if node.name in replicated and any(s.outs[:1] == ("R",) for s in node.candidates)}
    forbidden = frozenset((v, i) for v in whole for i, s in enumerate(sg.nodes[v].candidates) if s.outs[:1] != ("R",))
    if sp is not None:  # (a norm kept whole is not on the sp side's token shards)
        forbidden |= {(v, i) for v, rank in norms.items() if v not in whole
                      for i, s in enumerate(sg.nodes[v].candidates) if token_sharded(s.outs[0], rank) != sp}
    try:
        return solve(build_problem(sg, batch=batch, device=cluster.device, link=link, forbidden=forbidden))
    except autopar.InfeasibleError:
        if pinned or sp is None:
            raise
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

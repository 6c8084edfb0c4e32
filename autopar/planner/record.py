"""The Plan written from the search's choice: stages, per-layer and per-op placements,
communication records (tp collectives, dp buckets, pipeline messages, expert all-to-alls,
context-parallel K/V exchanges), predictions and the solver's report (step 4 of
:mod:`autopar.planner.make`), and the graph readings both share."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import fx

import autopar
from autopar.cluster import Cluster
from autopar.cost import comm
from autopar.cost.step import group_dp_s
from autopar.passes import meta_keys as mk
from autopar.passes.layers import graph_hash
from autopar.passes.strategies import StrategyGraph
from autopar.plan import Plan
from autopar.planner.bounds import replica_group
from autopar.planner.context import context_record, cp_costs, find_attention, sequence_length
from autopar.planner.cuts import CutTable, piece_bytes
from autopar.planner.experts import experts_record, find_experts
from autopar.planner.evaluation import evaluate
from autopar.planner.ilp import Solution, build_problem
from autopar.planner.recompute_keep import moe_recomputed_ops, sac_recomputed_matmuls
from autopar.planner.search import Candidate, Fixed
from autopar.planner.timing import candidate_cut_sends
from autopar.precision import Precision
from autopar.zero_def import step_collective_counts

__all__ = ["to_plan", "expanded_names", "shared_params", "first_value", "token_sharded"]


def first_value(node: fx.Node):
    """The op's (first) output value: ``native_layer_norm`` returns (out, mean, rstd)."""
    val = node.meta.get("val")
    return val[0] if isinstance(val, (tuple, list)) and val else val


def token_sharded(placement: str | None, rank: int) -> bool:
    """A placement that splits a tensor of ``rank`` dims on a dim other than the last (hidden)
    one; with batch dims left to dp (``shard_batch=False``) that is a sequence shard."""
    return bool(placement) and placement.startswith("S") and int(placement[1:]) < rank - 1


def shared_params(gm: fx.GraphModule) -> dict[str, list[tuple[str, str]]]:
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


def expanded_names(layers, info: mk.GraphTrace) -> dict[str, list[str]]:
    """Layer path -> the names of the instances it stands for ("layers.0" -> layers.0..layers.79)."""
    out = {}
    stand_ins = {r.traced[1]: r for r in info.repeats}
    for layer in layers:
        r = stand_ins.get(layer.path)
        out[layer.path] = [f"{r.container}.{i}" for i in range(1, r.count)] if r else [layer.path]
    return out


def _dp_buckets(gm: fx.GraphModule, stages: list[dict], layer_dict: dict, *, zero: int, dp: int,
                tp: int, reduce_dtype: torch.dtype | None = None, experts: frozenset[str] = frozenset(),
                ep: int = 1) -> list[dict]:
    """The dp gradient buckets of a step: one per (stage, layer group, dtype), as ``runtime/zero.py`` makes them.

    Under ``ep`` > 1 the stacked parameters in ``experts`` (the record's names) make buckets of
    their own, marked ``"replicas": dp // ep``: a rank holds ``1/ep`` of their rows and reduces
    (and at ZeRO >= 1 shards) them over the dp ranks that hold the same part, not over all of dp
    (:mod:`autopar.runtime.expert`); with ``ep == dp`` each part lives on one rank and has none.

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
    shared = shared_params(gm)
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
            by_dtype: dict[tuple[str, int], int] = defaultdict(int)
            for _, fqn, src in items:
                if fqn not in info.grad_outputs:
                    continue
                local = list(layer_dict[src]["param_shapes"][fqn])
                placement = layer_dict[src]["params"][fqn]
                if placement.startswith("S"):
                    d = int(placement[1:])
                    local[d] = -(-local[d] // tp)
                shards = dp
                if ep > 1 and fqn in experts:  # the rank's expert part, chunked over its replicas
                    local[0], shards = -(-local[0] // ep), dp // ep
                numel = math.prod(local)
                dtype, size = itemsize[fqn]
                by_dtype[dtype, shards] += (-(-numel // shards) * shards if zero else numel) * size
            readers = {_stand_in(layer, layer_dict) or layer for layer in st["layers"]}
            backward = any(read_in_backward.get(f, set()) & readers for _, f, _ in items)
            for (dtype, shards), nbytes in by_dtype.items():
                if shards == 1 and dp > 1:
                    continue  # (ep = dp: each expert part on one rank, nothing to reduce or gather)
                out.append({"stage": s, "layer": path, "dtype": dtype, "bytes": nbytes, "read_in_backward": backward,
                            **({"replicas": shards} if shards != dp else {})})
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


def _cut_tensors(gm: fx.GraphModule, stage_layers: list[list[str]], microbatch: int, sg: StrategyGraph,
                 sol: Solution, pieces: list[dict[str, set[str]]]) -> list[dict]:
    """Per cut (stage s -> s + 1), the tensors sent forward and the gradients sent back, as the
    runtime sends them (:mod:`autopar.planner.cuts`): each with the module that makes it and
    the one that reads it, its shape per micro-batch, dtype and bytes, its placement on tp and
    the bytes one rank sends: its tp shard, or its tp piece when replicated and its message
    (``pieces[cut][side]`` names their dtypes) goes as pieces."""
    layers: tuple[mk.LayerInfo, ...] = gm.meta[mk.LAYERS]
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    rep = {name: path for path, names in expanded_names(layers, info).items() for name in names}
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
            dtype = str(c.dtype).removeprefix("torch.")
            if placement == "R" and dtype in pieces[s][c.side]:
                rank_bytes = piece_bytes(rank_bytes, c.dtype, sg.axis_size)
            sends[c.side].append({"tensor": c.tensor, "from": c.source, "to": c.reader, "shape": shape,
                                  "dtype": dtype, "bytes": whole, "placement": placement, "rank_bytes": rank_bytes})
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
        val = first_value(node)
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
    if cfg.ep_tp > 1:
        out["etp"] = 1  # (ep folded over tp: the experts whole, Megatron-LM's expert tp size 1)
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


def _message(dtype: str, nbytes: float, gathered: float, count: int) -> dict:
    """A pipeline message of the plan; ``tp_gather_bytes``: what the receiving tp group
    all-gathers of it (the pieces of values replicated on tp), when anything."""
    return {"dtype": dtype, "bytes": nbytes, "count": count, **({"tp_gather_bytes": gathered} if gathered else {})}


def _p2p_record(best: Candidate, sends: tuple, cluster: Cluster) -> dict:
    """One pipeline's p2p messages in a step (every dp x tp pipeline sends the same): per cut,
    the messages of one micro-batch each way (one per dtype, the bytes one rank sends, and the
    bytes the receiving tp group all-gathers when its replicated values go as tp pieces: the
    runtime reads that choice here) and how often each is sent (once per micro-batch), priced
    on the cut's link (``sends``: :func:`autopar.planner.timing.candidate_cut_sends`); and the
    totals."""
    m = best.config.microbatches
    cuts = []
    for s, (fwd, back) in enumerate(sends):
        cuts.append({"stages": [s, s + 1],
                     "forward": [_message(d, b, g, m) for d, b, g, _ in fwd],
                     "backward": [_message(d, b, g, m) for d, b, g, _ in back],
                     "forward_s": best.p2p_cut_s[s], "backward_s": best.p2p_back_cut_s[s]})
    messages = [x for c in cuts for x in c["forward"] + c["backward"]]
    out = {"count": sum(x["count"] for x in messages), "bytes": sum(x["bytes"] * x["count"] for x in messages),
           "time_s": m * sum(c["forward_s"] + c["backward_s"] for c in cuts), "cuts": cuts}
    gathered = [x for x in messages if x.get("tp_gather_bytes")]
    if gathered:  # (their time is part of time_s above: a message's time is its transfer and its gather)
        tp, link = best.config.tp, cluster.link_for_group(best.config.tp, stride=1)
        out["tp_gathers"] = {"count": sum(x["count"] for x in gathered),
                             "bytes": sum(x["tp_gather_bytes"] * x["count"] for x in gathered),
                             "time_s": sum(comm.all_gather_s(x["tp_gather_bytes"], tp, link) * x["count"]
                                           for x in gathered)}
    return out


def to_plan(gm, best: Candidate, runners: list[Candidate], sg: StrategyGraph, sol: Solution, cluster: Cluster,
             fixed: Fixed, stats: dict, policy: Precision, precision_source: str, timings: dict,
             async_tp: bool = False) -> Plan:
    precision = policy.name
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    layers: tuple[mk.LayerInfo, ...] = gm.meta[mk.LAYERS]
    cfg = best.config
    per_stage = cfg.dp * cfg.tp
    stages = []
    sends = candidate_cut_sends(best, cluster)
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
                "send_bytes": sum(m[1] for m in sends[s][0]) if s < len(sends) else 0.0,
                **({"back_bytes": sum(m[1] for m in sends[s][1]), "p2p_s": best.p2p_cut_s[s],
                    "p2p_back_s": best.p2p_back_cut_s[s]} if s < len(best.p2p_cut_s) else {}),
                "memory_bytes": {"params": st.params_bytes, "grads": st.grads_bytes,
                                 "optimizer": st.optimizer_bytes, "activations": st.activations_bytes,
                                 "zero_buffers": st.zero_buffers_bytes, "total": st.memory_bytes},
            }})
    pieces = [{side: {d for d, _, g, _ in cut if g} for side, cut in zip(("forward", "backward"), fb)}
              for fb in sends]
    for s, tensors in enumerate(_cut_tensors(gm, [st["layers"] for st in stages], cfg.microbatch_size / cfg.cp, sg,
                                             sol, pieces)):
        stages[s]["sends"] = tensors
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
                                link=cluster.link_for_group(cfg.tp, stride=1), async_tp=async_tp), sol)
    communication: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for kind, c in ev.collectives.items():
        communication[kind]["tp"] = {"count": c["count"] * cfg.microbatches, "bytes": c["bytes"] * cfg.microbatches,
                                     "time_s": c["time_s"] * cfg.microbatches}
    expert_sites = find_experts(gm) if cfg.ep > 1 else []
    if cfg.dp > 1:
        per_rank = [0.0] * cfg.pp  # a rank syncs the stages it holds one after the other
        expert_rank = [0.0] * cfg.pp  # the part of it on the experts' replica groups (ep > 1)
        replicas, replica_link = replica_group(cluster, dp=cfg.dp, tp=cfg.tp, ep=cfg.ep_dp)
        dp_link = cluster.link_for_group(cfg.dp, stride=cfg.tp)
        for s, st in enumerate(best.stages):
            per_rank[s % cfg.pp] += st.grad_sync_s
            expert_rank[s % cfg.pp] += sum(
                group_dp_s(g.expert_bytes, zero=cfg.zero, dp=cfg.dp, link=dp_link, microbatches=cfg.microbatches,
                           expert_bytes=g.expert_bytes, replicas=replicas, replica_link=replica_link)
                for g in st.groups if g.expert_bytes)
        slowest = max(range(cfg.pp), key=per_rank.__getitem__)
        expert_names = frozenset(f for x in expert_sites for f in x.params)
        buckets = _dp_buckets(gm, stages, layer_dict, zero=cfg.zero, dp=cfg.dp, tp=cfg.tp,
                              reduce_dtype=policy.reduce_dtype, experts=expert_names, ep=cfg.ep_dp)
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
            # (per axis: the slowest pipeline rank's time, split between all of dp and the replica groups)
            for axis, mine, time_s in (("dp", [r for r in rows if "replicas" not in r],
                                        per_rank[slowest] - expert_rank[slowest]),
                                       ("dp/ep", [r for r in rows if "replicas" in r], expert_rank[slowest])):
                if mine:
                    communication[kind][axis] = {"count": sum(r["count"] for r in mine),
                                                 "bytes": sum(r["bytes"] * r["count"] for r in mine),
                                                 "time_s": max(0.0, time_s) / len(counts), "buckets": mine}
    if cfg.pp > 1:
        communication["p2p"]["pp"] = _p2p_record(best, sends, cluster)
    experts = {}
    if cfg.ep > 1:
        experts = experts_record(expert_sites, ep=cfg.ep, ep_tp=cfg.ep_tp, dp=cfg.dp, tp=cfg.tp,
                                 microbatch_size=cfg.microbatch_size / cfg.cp, microbatches=cfg.microbatches,
                                 global_batch=info.global_batch, counts={x.path: x.count for x in layers},
                                 cluster=cluster, imbalance=fixed.moe_imbalance or 1.0,
                                 dispatch=fixed.ep_dispatch or "autopar")
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
        names = expanded_names(layers, info)
        cp_exposed = {name: sum(c.exchange_exposed_s for c in cs) for layer, cs in costs.items()
                      for name in names.get(layer, [layer])}
    model_flops = sum((x.flops_fwd + x.flops_bwd) * x.count for x in layers)
    recompute_flops = 0.0
    if cfg.recompute == "full":
        recompute_flops = sum(x.flops_fwd * x.count for x in layers)
    elif cfg.recompute in ("sac", "moe"):  # (selective recomputes FLOP-free ops only)
        again = sac_recomputed_matmuls(sg) if cfg.recompute == "sac" else moe_recomputed_ops(sg)
        recompute_flops = sum(sg.nodes[v].flops(info.global_batch) * sg.nodes[v].weight for v in again)
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
        "gap_limit": sol.gap_limit,  # the relative gap the MIP was allowed to stop at
        "limit": sol.limit,  # the work limit that stopped the MIP before it proved optimality, or None
        **({"tied": sol.tied} if sol.tied else {}),  # ops given their loop iteration's strategy (ties.tie_loops)
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

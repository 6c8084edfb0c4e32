"""``Plan.summary()``: the plan as a person reads it.

The rows (mesh, stages, layer strategies in words, communication, runners-up)
are built once here as plain data; ``render_summary`` prints them as text and
:mod:`autopar.report` lays the same rows out as HTML.
"""

from __future__ import annotations

import math
import textwrap
from typing import TYPE_CHECKING, Any

from autopar.fmt import fmt_bytes, fmt_s

if TYPE_CHECKING:
    from autopar.plan import Plan

__all__ = ["MEMORY_PARTS", "OVERLAP_TITLE", "communication_rows", "overlap_rows", "config_words", "layer_strategies", "mesh_words", "render_summary",
           "solver_words", "stage_rows", "strategy_text"]

MEMORY_PARTS = (("params", "P"), ("grads", "G"), ("optimizer", "O"), ("activations", "A"), ("zero_buffers", "Z"))
"""Memory breakdown keys of a stage, with the letter the text bar uses for each (plan files written
before ``zero_buffers`` read it as 0)."""


def _bar(parts: list[float], total: float, width: int = 24) -> str:
    """Cumulative rounding, so a part shows once it ends past half a character and the
    bar's filled length always matches the sum (rounding each part alone loses small ones)."""
    out, filled, acc = "", 0, 0.0
    for (_, ch), part in zip(MEMORY_PARTS, parts):
        acc += part
        end = min(width, round(width * acc / total)) if total else 0
        out += ch * (end - filled)
        filled = max(filled, end)
    return out + "." * (width - filled)


def _span(devices: list[int]) -> str:
    return f"{devices[0]}-{devices[-1]}" if len(devices) > 1 else str(devices[0])


_RECOMPUTE_WORDS = {  # what each policy makes again in a layer's backward (autopar/passes/recompute.py)
    "none": "",
    "selective": " (norms, activations and other FLOP-free ops made again in the backward)",
    "sac": " (FLOP-free ops and every second matmul of a layer made again in the backward)",
    "moe": " (norms, activations and other FLOP-free ops, and each MoE layer's router, token exchange and "
           "experts, made again in the backward)",
    "full": " (each layer's whole forward made again in its backward)",
}


def mesh_words(plan: Plan) -> list[str]:
    """The mesh and the data-parallel treatment of the training state, in words."""
    m = plan.mesh
    world = math.prod(m.values())
    zero = {0: "parameters, gradients and optimizer state replicated over dp",
            1: "optimizer state sharded over dp (ZeRO-1)",
            2: "gradients and optimizer state sharded over dp (ZeRO-2)",
            3: "parameters, gradients and optimizer state sharded over dp (ZeRO-3)"}[plan.zero]
    if plan.experts and plan.zero == 0:  # the experts are cut over ep instead (expert_words)
        zero = "parameters, gradients and optimizer state replicated over dp except the experts' (cut over ep)"
    elif plan.experts:  # each expert part's state over the ranks holding that part
        zero = zero.replace(" (ZeRO-", f", the experts' over their {plan.experts.get('replicas', 1)} replicas (ZeRO-")
    sched = plan.schedule
    return [
        f"mesh pp={m['pp']} x dp={m['dp']} x tp={m['tp']} = {world} devices "
        f"(tp groups are consecutive ranks, then dp, then pp)",
        f"data parallel: dp={m['dp']}, {zero if m['dp'] > 1 else 'no data parallelism'}; "
        f"activation recompute: {plan.recompute}{_RECOMPUTE_WORDS[plan.recompute]}; "
        f"sequence parallelism: {'on' if plan.sequence_parallel else 'off'}",
        f"pipeline: {sched['kind']} over {len(plan.stages)} stage(s) on pp={m['pp']} rank(s)"
        + (f" ({len(plan.stages) // m['pp']} per rank, stage s on rank s mod {m['pp']})"
           if len(plan.stages) > m["pp"] else "")
        + f", {sched['microbatches']} micro-batch(es) of {sched['microbatch_size']} per dp rank"
        + (f" (sequences; under cp each of a group's {plan.context['cp']} ranks holds 1/{plan.context['cp']} of them)"
           if plan.context.get("cp", 1) > 1 else ""),
    ]


def stage_rows(plan: Plan) -> list[dict[str, Any]]:
    """Per stage: index, layer range, device range, predicted times and memory parts."""
    rows = []
    for i, st in enumerate(plan.stages):
        layers = st["layers"]
        pred = st["predicted"]
        mem = pred["memory_bytes"]
        rows.append({
            "stage": i, "n_layers": len(layers), "first": layers[0], "last": layers[-1],
            "devices": _span(st["devices"]), "compute_s": pred["compute_s"], "comm_s": pred["comm_s"],
            "fbw_s": (pred.get("f_s"), pred.get("b_s"), pred.get("w_s")),
            "memory": {key: mem.get(key, 0.0) for key, _ in MEMORY_PARTS}, "memory_total": mem["total"],
            "inflight": pred.get("inflight_microbatches")})
    return rows


OVERLAP_TITLE = ("communication hidden vs exposed per pipeline rank (dp and tied collectives on their own "
                 "streams, overlapping compute; tp collectives inside layers stay on the compute stream)")


def overlap_rows(plan: Plan) -> list[dict[str, Any]]:
    """Per pipeline rank, from the simulated step: seconds with a collective in flight, hidden
    behind compute, exposed (compute waiting), and the tp collectives (exposed). Empty for plan
    files from before the step program."""
    return [dict(r) for r in plan.predicted.get("overlap", ())]


SEQUENCE_PARALLEL = "sequence-parallel"
_ORDER = ("column-parallel", "row-parallel", "vocab-parallel", "embedding-dim-parallel", "hidden-dim-parallel",
          SEQUENCE_PARALLEL)


def _module_words(cls: str, placement: str, ndim: int) -> str:
    """Words for a module's weight placement on the tp axis."""
    if placement == "R":
        return "replicated"
    if not placement.startswith("S"):
        return placement
    dim = int(placement[1:])
    if cls == "Linear" and ndim == 2:  # weight is (out_features, in_features)
        return "column-parallel" if dim == 0 else "row-parallel"
    if cls == "Embedding" and ndim == 2:  # weight is (num_embeddings, embedding_dim)
        return "vocab-parallel" if dim == 0 else "embedding-dim-parallel"
    if "Norm" in cls and ndim == 1:  # a norm's weight is (hidden,)
        return "hidden-dim-parallel"
    return f"split on dim {dim}"


def _order(words: str) -> int:
    return _ORDER.index(words) if words in _ORDER else len(_ORDER) + (words == "replicated")


def layer_strategies(plan: Plan) -> list[dict[str, Any]]:
    """One row per layer class (layers with one signature): class, count, paths, and
    ``groups``: [(words, [module names relative to the layer])], column-parallel first,
    replicated last. Words name the placement on the tp axis ("column-parallel")."""
    position = {name: i for i, name in enumerate(n for st in plan.stages for n in st["layers"])}
    classes: dict[str, list[str]] = {}  # forward order (a loaded plan file has its keys sorted)
    for path, layer in sorted(plan.layers.items(), key=lambda kv: position.get(kv[0], len(position))):
        classes.setdefault(layer["signature"], []).append(path)
    rows = []
    for paths in classes.values():
        layer = plan.layers[paths[0]]
        prefix = paths[0] + "."
        shapes = layer.get("param_shapes", {})
        owners = layer.get("param_classes", {})
        seq = set(layer.get("sequence_parallel", []))
        modules: dict[str, str] = {}  # module -> words; its weight decides, else its first parameter
        for fqn, placement in layer.get("params", {}).items():
            module, _, leaf = fqn.rpartition(".")
            if module in modules and leaf != "weight":
                continue
            if module in seq:
                words = SEQUENCE_PARALLEL
            else:
                words = _module_words(owners.get(fqn, ""), placement, len(shapes.get(fqn, ())))
            modules[module] = words
        for module in seq - set(modules):  # a norm without parameters
            modules[module] = SEQUENCE_PARALLEL
        groups: dict[str, list[str]] = {}
        for module, words in modules.items():
            name = module[len(prefix):] if module.startswith(prefix) else module
            groups.setdefault(words, []).append(name or paths[0])
        rows.append({"class": layer["class"], "count": sum(plan.layers[p]["count"] for p in paths),
                     "paths": paths, "groups": sorted(groups.items(), key=lambda g: _order(g[0]))})
    return rows


def strategy_text(row: dict[str, Any]) -> str:
    """``column-parallel a, b; row-parallel c; replicated d`` (a lone module: just its words)."""
    groups = row["groups"]
    if not groups:
        return "no parameters"
    if len(groups) == 1 and len(groups[0][1]) == 1:
        return groups[0][0]
    return "; ".join(f"{words} {', '.join(names)}" for words, names in groups)


def communication_rows(plan: Plan) -> list[dict[str, Any]]:
    """Per (collective, mesh axis): calls, bytes and time per step, longest time first; and the tp
    all-gathers that rebuild the replicated values pipeline messages carry as tp pieces ("p2p
    gather"; their time is also in the p2p row's)."""
    rows = [{"kind": kind, "axis": axis, "count": c["count"], "bytes": c["bytes"], "time_s": c["time_s"]}
            for kind, axes in plan.communication.items() for axis, c in axes.items()]
    gathers = plan.communication.get("p2p", {}).get("pp", {}).get("tp_gathers")
    if gathers:
        rows.append({"kind": "p2p gather", "axis": "tp", **gathers})
    return sorted(rows, key=lambda r: (-r["time_s"], r["kind"], r["axis"]))


def config_words(config: dict[str, Any]) -> str:
    return (f"tp={config['tp']} pp={config['pp']} dp={config['dp']} zero={config['zero']} "
            f"recompute={config['recompute']} {config['schedule']} "
            f"{config['microbatches']}x{config['microbatch_size']}"
            + (f" v={config['virtual_stages']}" if config.get("virtual_stages", 1) > 1 else "")
            + (" sp" if config.get("sp") else "")
            + (f" ep={config['ep']}" if config.get("ep", 1) > 1 else "")
            + (" etp=1" if config.get("etp") == 1 else "")
            + (f" cp={config['cp']}" if config.get("cp", 1) > 1 else ""))


def solver_words(solver: dict[str, Any]) -> str:
    """How the sharding MIP ended, e.g. "sharding MIP FEASIBLE (gap 1.20%; stopped at its limit
    of 1000 branch-and-bound nodes)"; plan files from before the limit was recorded lack its keys."""
    words = f"sharding MIP {solver['status']} (gap {solver['gap']:.2%}"
    if solver.get("gap_limit") and solver.get("limit") is None:
        words += f", within its {100 * solver['gap_limit']:g}% tolerance"
    if solver.get("limit") == "nodes":
        words += f"; stopped at its limit of {solver['node_limit']} branch-and-bound nodes"
    if solver.get("tied"):
        words += f"; {solver['tied']} ops of unrolled loops took their iteration's strategy"
    return words + ")"


_PRECISION_WORDS = {
    "fp32": "fp32: weights, compute, gradients and optimizer state in fp32, no casts",
    "bf16-mixed": "bf16-mixed: bf16 compute and activations, fp32 master weights and AdamW state, "
                  "gradients reduced in fp32",
    "bf16-mixed-bf16-reduce": "bf16-mixed-bf16-reduce: bf16 compute and activations, fp32 master weights and "
                              "AdamW state, gradients reduced in bf16",
}


def precision_words(model: dict[str, Any]) -> str:
    """The plan's precision policy in words, and why it was chosen (plans before policies: the model's dtype)."""
    name = model.get("precision")
    words = _PRECISION_WORDS.get(name, f"{name or 'unrecorded'}: the model's own dtype, no casts")
    source = model.get("precision_source")
    if source and source != "asked":
        words += f" ({source}; pass precision='fp32' or --precision fp32 for fp32 compute)" \
            if name != "fp32" else f" ({source})"
    return f"precision {words}"


def expert_rows(plan: Plan) -> list[tuple[str, int, int, int, str, str]]:
    """Per MoE block under expert parallelism: (module, instances, experts, experts per rank,
    forward and backward all-to-all bytes per micro-batch on one rank)."""
    rows = []
    for module, x in (plan.experts or {}).get("layers", {}).items():
        a2a = x.get("all_to_all_bytes", {})
        rows.append((module, x["instances"], x["n_experts"], x["experts_per_rank"],
                     fmt_bytes(sum(a2a.get("forward", ()))), fmt_bytes(sum(a2a.get("backward", ())))))
    return rows


def expert_words(plan: Plan) -> list[str]:
    """Where the experts live under expert parallelism (nothing without it)."""
    x = plan.experts
    if not x:
        return []
    layers = list(x.get("layers", {}).values())
    n = layers[0]["n_experts"] if layers else 0
    a2a = x.get("all_to_all", {})
    replicas = f"{x['replicas']} replica(s) of each expert part"
    if plan.ep_over_tp:
        where = (f"ep={x['ep']} folded over tp={plan.mesh.get('tp')} and dp={plan.mesh.get('dp')} (etp=1: each tp "
                 f"rank routes its share of the tokens to experts kept whole; {replicas})")
    else:
        where = f"ep={x['ep']} folded over dp={plan.mesh.get('dp')} ({replicas})"
    blocks = sum(layer["instances"] for layer in layers)
    return [f"experts: {where}; {n // x['ep'] if n else 0} of {n} experts per rank in each of {blocks} MoE "
            f"layer(s), rank r holding part r mod ep; dispatch/combine all-to-all {fmt_bytes(a2a.get('bytes', 0))} "
            f"per step ({a2a.get('link', '?')}{_DISPATCH_WORDS.get(x.get('dispatch'), '')}), "
            f"{x.get('routing', '')}"]


_DISPATCH_WORDS = {"megatron": "; priced as Megatron-LM's all-to-all dispatcher, which autopar does not run",
                   "deepep": "; priced as DeepEP's normal kernels, which autopar does not run"}


def context_words(plan: Plan) -> list[str]:
    """How sequences are split under context parallelism (nothing without it)."""
    x = plan.context
    if not x:
        return []
    if x.get("not_weighed"):
        return [f"context: sequences of {x.get('sequence')} tokens not split; cp is not weighed: {x['not_weighed']}"]
    other = x.get("other_side", False)
    weighed = ", ".join(map(str, x.get("considered", ())))
    if x.get("cp", 1) == 1:
        why = ("no plan with cp fits" if other is None else
               f"the best plan with cp (cp={other['cp']}) takes {fmt_s(other['step_time_s'])} per step, "
               f"this one {fmt_s(plan.predicted['step_time_s'])}")
        return [f"context: sequences of {x.get('sequence')} tokens not split (cp {weighed} weighed): {why}"]
    kv = x.get("kv_exchange", {})
    reason = "" if other is False else (
        f"; chosen among cp {weighed} over the best plan without cp, "
        + ("which does not fit" if other is None else f"{fmt_s(other['step_time_s'])} per step "
           f"(peak {fmt_bytes(other['peak_memory_bytes'])} per device)"))
    return [f"context: cp={x['cp']} folded over dp={plan.mesh.get('dp')} (the batch split over "
            f"{plan.mesh.get('dp', 0) // x['cp']} group(s)); each sequence of {x.get('sequence')} tokens split "
            f"{x.get('layout', 'balanced')} over a group, {x.get('tokens_per_rank')} tokens per rank (chunks r and "
            f"2cp-1-r); {x.get('attention_ops', 0)} attention op(s) exchange K/V by "
            f"{'/'.join(x.get('variants', ())) or '?'}: {kv.get('time_s', 0) * 1e3:.1f} ms per step on the link"
            + (f" (summed over the {plan.mesh['pp']} pipeline stages, as what follows), "
               if plan.mesh.get("pp", 1) > 1 else ", ")
            + (f"{kv.get('exposed_s', 0) * 1e3:.1f} ms exposed with the eager merges of "
               f"{'torch' if 'torch' in x['variants'] else 'Transformer Engine'}'s program"
               if {"torch", "te"} & set(x.get("variants", ())) else
               _cp_added(kv)) + reason]


def _cp_added(kv: dict) -> str:
    """What autopar's cp op adds per step, split into its parts."""
    eager, kernel = kv.get("eager_s", 0.0), kv.get("kernel_s", 0.0)
    parts = [f"{fmt_s(max(0.0, kv.get('exposed_s', 0) - eager - kernel))} of the exchange not hidden behind attention"]
    if eager:
        parts.append(f"{fmt_s(eager)} the op's eager merges")
    if kernel:
        parts.append(f"{fmt_s(kernel)} its FlashAttention-2 blocks against the SDPA kernel priced")
    return f"{kv.get('exposed_s', 0) * 1e3:.1f} ms added ({', '.join(parts)})"


def render_summary(plan: Plan) -> str:
    p = plan.predicted
    cap = plan.cluster.get("device", {}).get("hbm_bytes", 0)
    lines = [
        f"autopar plan for {plan.model.get('name')} ({plan.model.get('n_params', 0) / 1e9:.3g}B params, "
        f"global batch {plan.model.get('global_batch')}) on {plan.cluster.get('spec')}",
        f"  predicted step {fmt_s(p['step_time_s'])}, bubble {p['bubble_fraction']:.1%}, MFU {p['mfu']:.1%}, "
        f"peak memory {fmt_bytes(p['peak_memory_bytes'])} of {fmt_bytes(cap)}"
        + (f", {p['tokens_per_s']:.4g} tokens/s" if p.get("tokens_per_s") else ""),
        f"  {precision_words(plan.model)}",
        *(f"  {w}" for w in mesh_words(plan)),
        *(f"  {w}" for w in expert_words(plan)),
        *(f"  {w}" for w in context_words(plan)),
        "",
        f"  {'stage':>5} {'layers':<40} {'devices':<9} {'compute':>9} {'comm':>9} {'memory':>9}  "
        f"of {fmt_bytes(cap)}: P=params G=grads O=optimizer A=activations Z=ZeRO buffers",
    ]
    for r in stage_rows(plan):
        names = r["first"] if r["n_layers"] == 1 else f"({r['n_layers']}) {r['first']} .. {r['last']}"
        parts = [r["memory"][key] for key, _ in MEMORY_PARTS]
        lines.append(f"  {r['stage']:>5} {names[:40]:<40} {r['devices']:<9} {fmt_s(r['compute_s']):>9} "
                     f"{fmt_s(r['comm_s']):>9} {fmt_bytes(r['memory_total']):>9}  "
                     f"[{_bar(parts, cap or r['memory_total'])}] "
                     + " ".join(f"{ch} {fmt_bytes(x)}" for (_, ch), x in zip(MEMORY_PARTS, parts)))
    tp = plan.mesh.get("tp", 1)
    lines += ["", f"  layer strategies on the tp axis (tp={tp}):" if tp > 1 else
              "  layer strategies: tp=1, every layer whole on each device:"]
    for row in layer_strategies(plan):
        paths = row["paths"]
        where = paths[0] if len(paths) == 1 else f"{paths[0]}, ..."
        lines += textwrap.wrap(f"{row['class']} x{row['count']} ({where}): {strategy_text(row)}", width=116,
                               initial_indent="    ", subsequent_indent="        ", break_on_hyphens=False)
    comm = communication_rows(plan)
    if comm:
        lines += ["", "  communication per step (tp and pp: summed over stages; dp: the slowest pipeline rank):",
                  f"    {'collective':<15} {'axis':<5} {'calls':>8} {'bytes':>9} {'time':>9}"]
        for r in comm:
            lines.append(f"    {r['kind']:<15} {r['axis']:<5} {r['count']:>8.4g} {fmt_bytes(r['bytes']):>9} "
                         f"{fmt_s(r['time_s']):>9}")
    overlap = overlap_rows(plan)
    if overlap:
        cp = "cp_exposed_s" in overlap[0]
        lines += ["", f"  {OVERLAP_TITLE}:",
                  f"    {'pp rank':>7} {'in flight':>9} {'hidden':>9} {'exposed':>9} {'tp':>9}"
                  + (f" {'cp K/V':>9}" if cp else "")]
        for r in overlap:
            lines.append(f"    {r['pp_rank']:>7} {fmt_s(r['collectives_s']):>9} {fmt_s(r['hidden_s']):>9} "
                         f"{fmt_s(r['exposed_s']):>9} {fmt_s(r['tp_exposed_s']):>9}"
                         + (f" {fmt_s(r['cp_exposed_s']):>9}" if cp else ""))
    s = plan.solver
    lines += ["", f"  solver: {solver_words(s)}; "
                  f"{s['search']['configurations']} configurations tried, {s['search']['feasible']} fit, "
                  f"{s['search']['simulated']} simulated"
                  + (f", {s['search']['shapes_pruned']} of {s['search']['shapes']} mesh shapes and "
                     f"{s['search']['cuts_pruned']} configurations pruned by the compute bound"
                     if "shapes" in s["search"] else "")]
    if plan.timings:
        lines.append("  planner time: " + ", ".join(f"{k} {v:.2f} s" for k, v in plan.timings.items()))
    if s.get("candidates"):
        lines.append("  runners-up:")
        for c in s["candidates"]:
            lines.append(f"    {fmt_s(c['step_time_s']):>9}  {config_words(c['config'])}")
    return "\n".join(lines)

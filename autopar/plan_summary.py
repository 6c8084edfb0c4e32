"""``Plan.summary()``: the plan as a person reads it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.fmt import fmt_bytes, fmt_s

if TYPE_CHECKING:
    from autopar.plan import Plan

__all__ = ["render_summary"]


def _bar(parts: list[float], total: float, width: int = 24) -> str:
    chars = "PGOA"  # params, grads, optimizer, activations
    out = ""
    for ch, part in zip(chars, parts):
        out += ch * round(width * part / total) if total else ""
    return (out + "." * width)[:width]


def _describe(placement: str, ndim: int) -> str:
    """Words for a parameter's placement on the tp axis (nn.Linear weights are (out, in))."""
    if placement == "R":
        return "replicated"
    if ndim == 2 and placement == "S0":
        return "column-parallel"
    if ndim == 2 and placement == "S1":
        return "row-parallel"
    return f"sharded on dim {placement[1:]}" if placement.startswith("S") else placement


def render_summary(plan: Plan) -> str:
    p = plan.predicted
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh.items())
    sched = plan.schedule
    cap = plan.cluster.get("device", {}).get("hbm_bytes", 0)
    lines = [
        f"autopar plan for {plan.model.get('name')} ({plan.model.get('n_params', 0) / 1e9:.3g}B params, "
        f"global batch {plan.model.get('global_batch')}) on {plan.cluster.get('spec')}",
        f"  mesh {mesh}; ZeRO-{plan.zero}; recompute {plan.recompute}; schedule {sched['kind']} with "
        f"{sched['microbatches']} micro-batches of {sched['microbatch_size']}",
        f"  predicted step {fmt_s(p['step_time_s'])}, bubble {p['bubble_fraction']:.1%}, MFU {p['mfu']:.1%}, "
        f"peak memory {fmt_bytes(p['peak_memory_bytes'])} of {fmt_bytes(cap)}"
        + (f", {p['tokens_per_s']:.4g} tokens/s" if p.get("tokens_per_s") else ""),
        "",
        f"  {'stage':>5} {'layers':<34} {'devices':<12} {'compute':>9} {'comm':>9} {'memory':>9}  P=params G=grads O=optim A=act",
    ]
    for i, st in enumerate(plan.stages):
        layers = st["layers"]
        names = layers[0] if len(layers) == 1 else f"({len(layers)}) {layers[0]} .. {layers[-1]}"
        devs = st["devices"]
        dev = f"{devs[0]}-{devs[-1]}" if len(devs) > 1 else str(devs[0])
        mem = st["predicted"]["memory_bytes"]
        parts = [mem["params"], mem["grads"], mem["optimizer"], mem["activations"]]
        lines.append(f"  {i:>5} {names[:34]:<34} {dev:<12} {fmt_s(st['predicted']['compute_s']):>9} "
                     f"{fmt_s(st['predicted']['comm_s']):>9} {fmt_bytes(mem['total']):>9}  "
                     f"[{_bar(parts, cap or mem['total'])}]")
    lines += ["", f"  layer strategies on tp={plan.mesh.get('tp', 1)}:"]
    classes: dict[str, list[str]] = {}
    for path, layer in plan.layers.items():
        classes.setdefault(layer["signature"], []).append(path)
    for paths in classes.values():
        layer = plan.layers[paths[0]]
        count = sum(plan.layers[p]["count"] for p in paths)
        shapes = layer.get("param_shapes", {})
        params = layer.get("params", {})
        if params and set(params.values()) == {"R"}:
            desc = "all parameters replicated"
        else:
            desc = ", ".join(f"{'.'.join(fqn.split('.')[-2:])}: {_describe(pl, len(shapes.get(fqn, ())))}"
                             for fqn, pl in params.items())
        where = paths[0] if len(paths) == 1 else f"{paths[0]}, ..."
        lines.append(f"    {layer['class']} x{count} ({where}): {desc or 'no parameters'}")
    if plan.communication:
        lines += ["", "  communication per step:"]
        for kind, axes in sorted(plan.communication.items()):
            for axis, c in sorted(axes.items()):
                lines.append(f"    {kind:<15} on {axis:<3} {c['count']:>8.4g} x, {fmt_bytes(c['bytes']):>9}, "
                             f"{fmt_s(c['time_s'])}")
    s = plan.solver
    lines += ["", f"  solver: sharding MIP {s['status']} (gap {s['gap']:.2%}); "
                  f"{s['search']['configurations']} configurations tried, {s['search']['feasible']} fit, "
                  f"{s['search']['simulated']} simulated"]
    if plan.timings:
        lines.append("  planner time: " + ", ".join(f"{k} {v:.2f} s" for k, v in plan.timings.items()))
    if s.get("candidates"):
        lines.append("  runners-up:")
        for c in s["candidates"]:
            lines.append(f"    {fmt_s(c['step_time_s']):>9}  {c['config']}")
    return "\n".join(lines)

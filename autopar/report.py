"""Pictures of a plan: the pipeline timeline (a Gantt chart) and a one-file HTML report.

    autopar plan examples/llama.py:build --arg size=70b --cluster 8x8xH100 \\
        --timeline timeline.png --html report.html

The timeline is the planner's own simulation, redone from the plan file: the step
program's inputs it stores (``plan.predicted["step"]``: per stage its layer groups' F, B, W
times and gradient-bucket bytes, the optimizer and p2p times, the ZeRO stage, dp and links)
through :func:`autopar.cost.simulate.simulate_step`, so its bubbles and its exposed
communication are the ones the search ranked by. Each pipeline rank's row shows its
compute stream (F, B, W pieces, the optimizer step) and, in a thin band under it, its
dp and tied collectives in flight (hidden where they run under compute). Plan files
from before the step program are redrawn from their per-stage times, with gradient
sync and optimizer after the drain.

The HTML page has no external resources (inline CSS, the timeline as inline SVG)
and no JavaScript. matplotlib is needed for the pictures: ``pip install 'autopar[report]'``.
"""

from __future__ import annotations

import html
import io
from typing import TYPE_CHECKING, Any

from autopar.fmt import fmt_bytes, fmt_s, fmt_si
from autopar.plan_summary import (MEMORY_PARTS, OVERLAP_TITLE, communication_rows, config_words, context_words,
                                  expert_rows,
                                  expert_words, layer_strategies, mesh_words, overlap_rows, solver_words, stage_rows,
                                  strategy_text)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from autopar.cost.simulate import SimResult, StepResult
    from autopar.plan import Plan

__all__ = ["resimulate", "timeline_figure", "save_timeline", "render_html", "save_html"]

COLOURS = {"F": "#4e79a7", "B": "#f28e2b", "W": "#59a14f", "BW": "#e15759", "sync": "#9c9c9c", "opt": "#6b6b6b"}
LABELS = {"F": "forward (F)", "B": "backward, input grad (B)", "W": "backward, weight grad (W)",
          "BW": "full backward (B+W)", "sync": "dp / tied collective in flight", "opt": "optimizer step"}
MEMORY_COLOURS = {"params": "#4e79a7", "grads": "#f28e2b", "optimizer": "#b07aa1", "activations": "#59a14f",
                  "zero_buffers": "#e15759"}


def resimulate(plan: Plan) -> SimResult | StepResult:
    """The plan's step, re-simulated from what it stores: the whole step program when the plan
    has ``predicted["step"]``, else (older plan files) the pipeline part from its stage times."""
    if "step" in plan.predicted:
        from autopar.cost.simulate import simulate_step
        from autopar.cost.step import StepSpec

        return simulate_step(StepSpec.from_dict(plan.predicted["step"]))
    from autopar.planner.search import simulate_stages

    preds = [st["predicted"] for st in plan.stages]
    missing = [s for s, p in enumerate(preds) if not {"f_s", "b_s", "w_s"} <= set(p)]
    if missing:
        raise ValueError(f"stages {missing} of this plan have no f_s/b_s/w_s times (a plan file from an older "
                         f"autopar?); re-plan to draw its timeline")
    cuts = [p.get("p2p_s") for p in preds[:-1]]  # per cut, over its own link; older plans: one time for all
    p2p = cuts if all(t is not None for t in cuts) else plan.predicted.get("p2p_s", 0.0)
    backs = [p.get("p2p_back_s") for p in preds[:-1]]  # the gradients' own times (plans before: p2p_s)
    return simulate_stages(plan.schedule["kind"], microbatches=plan.schedule["microbatches"],
                           f_s=[p["f_s"] for p in preds], b_s=[p["b_s"] for p in preds],
                           w_s=[p["w_s"] for p in preds], p2p_s=p2p, pp=plan.mesh["pp"],
                           p2p_back_s=backs if all(t is not None for t in backs) else None)


def _boxes(plan: Plan, sim) -> tuple[list[tuple[int, str, Any, float, float]], float]:
    """(rank, colour key, label source, start, end) per box, and the chart's end time."""
    from autopar.cost.simulate import StepResult

    if isinstance(sim, StepResult):
        out = []
        for rank, op, start, end in sim.timeline:
            if op.action is not None and op.kind in ("F", "B", "W", "BW"):
                out.append((rank, op.kind, op, start, end))
            elif op.kind == "OPT":
                out.append((rank, "opt", op, start, end))
            elif op.stream:
                out.append((rank, "sync", op, start, end))
        return out, max(sim.step_time_s, plan.predicted["step_time_s"])
    out = [(rank, a.kind, a, start, end) for rank, a, start, end in sim.timeline]
    preds, pp, pipe_s = [st["predicted"] for st in plan.stages], plan.mesh["pp"], sim.step_time_s
    end_s = pipe_s
    for rank in range(pp):  # older plans: gradient sync over dp, then the optimizer step, after the drain
        t = pipe_s
        for kind, key in (("sync", "grad_sync_s"), ("opt", "optimizer_s")):
            dur = sum(q.get(key, 0.0) for q in preds[rank::pp])
            if dur > 0:
                out.append((rank, kind, None, t, t + dur))
                t += dur
        end_s = max(end_s, t)
    return out, max(end_s, plan.predicted["step_time_s"])


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"drawing the pipeline timeline needs matplotlib ({e}); "
                          f"install it with: pip install 'autopar[report]'") from None
    return Figure


def _time_unit(step_s: float) -> tuple[float, str]:
    return (1.0, "s") if step_s >= 1 else (1e3, "ms") if step_s >= 1e-3 else (1e6, "us")


def timeline_figure(plan: Plan, *, width_in: float = 11.0) -> Figure:
    """A Gantt chart of one step: a row per pipeline stage, a box per action coloured
    by kind with its micro-batch number when it fits, idle time left as gaps."""
    Figure = _figure_class()
    from matplotlib.patches import Patch

    sim = resimulate(plan)
    boxes, end_s = _boxes(plan, sim)
    scale, unit = _time_unit(end_s)
    pp = plan.mesh["pp"]
    n_rows = pp  # one row per pipeline rank (several stages each under the interleaved schedule)
    interleaved = len(plan.stages) > pp
    fig = Figure(figsize=(width_in, 1.6 + 0.42 * n_rows), layout="constrained")
    ax = fig.add_subplot()
    axes_width_pt = width_in * 72 * 0.86  # the plot area, less the row labels
    fontsize = 7 if n_rows > 4 else 8
    kinds, drawn = set(), set()
    for rank, kind, what, start, end in boxes:
        width = end - start  # a zero-time action (a stage without weights has no W) draws nothing
        kinds.add(kind)
        band = (rank + 0.3, 0.12) if kind == "sync" else (rank - 0.4, 0.7)  # collectives: a band under the row
        action = getattr(what, "action", what) if kind in ("F", "B", "W", "BW") else None
        gid = None
        if action is not None and action not in drawn:  # SVG id of an action's first piece: action-0F3
            drawn.add(action)
            gid = f"action-{action}"
        ax.broken_barh([(start * scale, width * scale)], band, facecolors=COLOURS[kind], edgecolors="white",
                       linewidth=0.4, gid=gid)
        if action is None:
            continue
        label = f"{action.stage}.{action.microbatch}" if interleaved else str(action.microbatch)
        if axes_width_pt * width / end_s > 0.62 * fontsize * len(label) + 2:
            ax.text((start + width / 2) * scale, rank - 0.05, label, ha="center", va="center", fontsize=fontsize,
                    color="white")
    labels = []
    for r in range(pp):
        devs = plan.stages[r]["devices"]
        where = f"ranks {devs[0]}-{devs[-1]}" if len(devs) > 1 else f"rank {devs[0]}"
        stages = list(range(r, len(plan.stages), pp))
        labels.append(f"stages {', '.join(map(str, stages))}\n{where}" if interleaved else f"stage {r}\n{where}")
    ax.set_yticks(range(n_rows), labels, fontsize=8)
    ax.set_ylim(n_rows - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, end_s * scale)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    sched, m = plan.schedule, plan.mesh
    fig.suptitle(f"{plan.model.get('name')} on {plan.cluster.get('spec')}: {sched['kind']}, pp={m['pp']} dp={m['dp']} "
                 f"tp={m['tp']}, {sched['microbatches']} micro-batches of {sched['microbatch_size']}\n"
                 f"predicted step {fmt_s(plan.predicted['step_time_s'])}, "
                 f"bubble {plan.predicted['bubble_fraction']:.1%} (white gaps = idle)", fontsize=10)
    handles = [Patch(facecolor=COLOURS[k], label=LABELS[k]) for k in COLOURS if k in kinds]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    return fig


def save_timeline(plan: Plan, path, *, dpi: int = 110) -> None:
    """Write the timeline; the format follows the suffix (.png, .svg, .pdf)."""
    timeline_figure(plan).savefig(path, dpi=dpi)


def _timeline_svg(plan: Plan) -> str:
    import matplotlib

    buf = io.StringIO()
    # text stays text (smaller, searchable); a fixed id salt and no date: the same plan gives the
    # same report byte for byte, so reports can be diffed like plan files
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "autopar"}):
        timeline_figure(plan).savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]  # drop the XML declaration and DOCTYPE: it sits inside HTML


_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 24px auto;
       max-width: 1180px; padding: 0 16px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 26px 0 8px; }
p.sub { color: #555; margin: 0 0 12px; }
.kpi { display: flex; flex-wrap: wrap; gap: 10px; margin: 12px 0; }
.kpi div { border: 1px solid #ddd; border-radius: 6px; padding: 6px 12px; background: #fafafa; }
.kpi b { display: block; font-size: 17px; }
table { border-collapse: collapse; } th, td { padding: 4px 10px; border-bottom: 1px solid #e5e5e5;
  text-align: left; vertical-align: top; } th { background: #f3f3f3; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.bar { display: flex; width: 260px; height: 14px; border: 1px solid #bbb; background: #fff; }
.bar span { display: block; height: 100%; }
.legend span { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 10px; }
ul { margin: 4px 0; padding-left: 20px; } code { font-size: 13px; }
.timeline svg { max-width: 100%; height: auto; }
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _memory_bar(memory: dict[str, float], cap: float) -> str:
    spans = "".join(f'<span style="width:{100 * memory[k] / cap:.2f}%;background:{MEMORY_COLOURS[k]}" '
                    f'title="{k} {fmt_bytes(memory[k])}"></span>' for k, _ in MEMORY_PARTS if cap > 0)
    return f'<div class="bar">{spans}</div>'


def _experts_table(plan: Plan) -> list[str]:
    """Where the experts live (expert parallelism only): one row per MoE block."""
    rows = expert_rows(plan)
    if not rows:
        return []
    head = ("MoE block", "instances", "experts", "per rank", "all-to-all forward", "all-to-all backward")
    folded = ", folded over tp and dp: etp=1" if plan.ep_over_tp else ""
    return [f"<h2>Experts (ep={_e(plan.experts['ep'])}{folded}, {_e(plan.experts['replicas'])} replica(s))</h2>"
            "<table><tr>"
            + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows) + "</table>"
            + '<p class="legend">all-to-all bytes one rank sends per micro-batch and block (counts, dispatch, '
            f'combine) under balanced routing; times priced with: {_e(plan.experts.get("routing", ""))}</p>']


def _context_table(plan: Plan) -> list[str]:
    """How sequences are split (context parallelism, or the search's reason not to): the summary's
    words, then the K/V exchange per step."""
    x = plan.context
    if not x:
        return []
    out = [f"<h2>Context parallelism (cp={_e(x.get('cp', 1))})</h2>",
           "<ul>" + "".join(f"<li>{_e(w)}</li>" for w in context_words(plan)) + "</ul>"]
    kv = x.get("kv_exchange")
    if kv:
        head = ("sequence", "tokens per rank", "layout", "attention ops", "K/V exchange", "messages", "bytes sent",
                "time on the link", "added to the step", "of it eager merges", "of it the blocks' kernel")
        row = (x.get("sequence"), x.get("tokens_per_rank"), x.get("layout"), x.get("attention_ops"),
               "/".join(x.get("variants", ())), f"{kv.get('count', 0):.4g}", fmt_bytes(kv.get("bytes", 0)),
               fmt_s(kv.get("time_s", 0)), fmt_s(kv.get("exposed_s", 0)), fmt_s(kv.get("eager_s", 0)),
               fmt_s(kv.get("kernel_s", 0)))
        out += ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr><tr>"
                + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr></table>",
                '<p class="legend">per step and rank of a cp group (every micro-batch, every attention op; with pp, '
                'summed over the stages)</p>']
    return out


def render_html(plan: Plan) -> str:
    """The whole report as one HTML document (inline CSS and SVG, no scripts)."""
    p = plan.predicted
    cap = plan.cluster.get("device", {}).get("hbm_bytes", 0)
    kpis = [("step time", fmt_s(p["step_time_s"])), ("bubble", f"{p['bubble_fraction']:.1%}"),
            ("MFU", f"{p['mfu']:.1%}"), ("peak memory", f"{fmt_bytes(p['peak_memory_bytes'])} of {fmt_bytes(cap)}")]
    if p.get("tokens_per_s"):
        kpis.append(("tokens/s", fmt_si(p["tokens_per_s"])))
    out = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>autopar plan: {_e(plan.model.get('name'))} on {_e(plan.cluster.get('spec'))}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>autopar plan: {_e(plan.model.get('name'))} on {_e(plan.cluster.get('spec'))}</h1>",
        f'<p class="sub">{plan.model.get("n_params", 0) / 1e9:.3g}B parameters, global batch '
        f'{_e(plan.model.get("global_batch"))}, {_e(plan.model.get("precision", ""))} precision; '
        f'autopar {_e(plan.autopar_version)}</p>',
        '<div class="kpi">' + "".join(f"<div>{_e(k)}<b>{_e(v)}</b></div>" for k, v in kpis) + "</div>",
        "<h2>Mesh</h2><ul>" + "".join(f"<li>{_e(w)}</li>" for w in mesh_words(plan) + expert_words(plan))
        + "</ul>",
        *_experts_table(plan),
        *_context_table(plan),
        "<h2>Pipeline timeline</h2>", f'<div class="timeline">{_timeline_svg(plan)}</div>',
        "<h2>Stages</h2>",
        '<p class="legend">memory of ' + _e(fmt_bytes(cap)) + " per device:" + "".join(
            f'<span style="background:{MEMORY_COLOURS[k]}"></span>{k}' for k, _ in MEMORY_PARTS) + "</p>",
        "<table><tr><th>stage</th><th>layers</th><th>devices</th><th>F / B / W per micro-batch</th>"
        "<th>compute</th><th>comm</th><th>memory</th><th></th></tr>",
    ]
    for r in stage_rows(plan):
        layers = r["first"] if r["n_layers"] == 1 else f"{r['first']} .. {r['last']} ({r['n_layers']})"
        fbw = " / ".join(fmt_s(x) for x in r["fbw_s"] if x is not None)
        out.append(f'<tr><td class="num">{r["stage"]}</td><td><code>{_e(layers)}</code></td>'
                   f'<td>{_e(r["devices"])}</td><td class="num">{_e(fbw)}</td>'
                   f'<td class="num">{_e(fmt_s(r["compute_s"]))}</td><td class="num">{_e(fmt_s(r["comm_s"]))}</td>'
                   f'<td class="num">{_e(fmt_bytes(r["memory_total"]))}</td>'
                   f'<td>{_memory_bar(r["memory"], cap or r["memory_total"])}</td></tr>')
    out.append("</table>")
    tp = plan.mesh.get("tp", 1)
    out += [f"<h2>Layer strategies on the tp axis (tp={tp})</h2>",
            "<table><tr><th>layer class</th><th>count</th><th>where</th><th>strategy</th></tr>"]
    for row in layer_strategies(plan):
        paths = row["paths"]
        where = paths[0] if len(paths) == 1 else f"{paths[0]}, ..."
        groups = "<br>".join(f"<b>{_e(words)}</b> {_e(', '.join(names))}" for words, names in row["groups"]) \
            if len(row["groups"]) > 1 or (row["groups"] and len(row["groups"][0][1]) > 1) else _e(strategy_text(row))
        out.append(f'<tr><td>{_e(row["class"])}</td><td class="num">{row["count"]}</td>'
                   f'<td><code>{_e(where)}</code></td><td>{groups}</td></tr>')
    out.append("</table>")
    comm = communication_rows(plan)
    if comm:
        out += ["<h2>Communication per step (tp and pp: summed over stages; dp: the slowest pipeline rank)</h2>",
                "<table><tr><th>collective</th><th>mesh axis</th><th>calls</th><th>bytes</th><th>time</th></tr>"]
        out += [f'<tr><td>{_e(r["kind"])}</td><td>{_e(r["axis"])}</td><td class="num">{r["count"]:.4g}</td>'
                f'<td class="num">{_e(fmt_bytes(r["bytes"]))}</td><td class="num">{_e(fmt_s(r["time_s"]))}</td></tr>'
                for r in comm]
        out.append("</table>")
    overlap = overlap_rows(plan)
    if overlap:
        cp = "cp_exposed_s" in overlap[0]
        out += [f"<h2>{_e(OVERLAP_TITLE[0].upper() + OVERLAP_TITLE[1:])}</h2>",
                "<table><tr><th>pp rank</th><th>collectives in flight</th><th>hidden</th><th>exposed</th>"
                "<th>tp (exposed)</th>" + ("<th>cp K/V (exposed)</th>" if cp else "") + "</tr>"]
        out += [f'<tr><td class="num">{r["pp_rank"]}</td><td class="num">{_e(fmt_s(r["collectives_s"]))}</td>'
                f'<td class="num">{_e(fmt_s(r["hidden_s"]))}</td><td class="num">{_e(fmt_s(r["exposed_s"]))}</td>'
                f'<td class="num">{_e(fmt_s(r["tp_exposed_s"]))}</td>'
                + (f'<td class="num">{_e(fmt_s(r["cp_exposed_s"]))}</td>' if cp else "") + "</tr>" for r in overlap]
        out.append("</table>")
    s = plan.solver
    out += ["<h2>Runners-up</h2>",
            f'<p class="sub">{_e(solver_words(s))}; '
            f'{s["search"]["configurations"]} configurations tried, {s["search"]["feasible"]} fit, '
            f'{s["search"]["simulated"]} simulated</p>']
    if s.get("candidates"):
        out.append("<table><tr><th>step time</th><th>configuration</th></tr>")
        out += [f'<tr><td class="num">{_e(fmt_s(c["step_time_s"]))}</td><td>{_e(config_words(c["config"]))}</td></tr>'
                for c in s["candidates"]]
        out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def save_html(plan: Plan, path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(plan))

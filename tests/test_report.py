"""The plan as people see it: the text summary, the pipeline timeline and the HTML report,
checked on real plans (a pipelined GPT with Megatron tensor parallelism, and a pp=1 plan)
and, when Chromium is installed, rendered in a headless browser."""
import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
from autopar import progress
from autopar.cli import main
from autopar.cost.schedule import make_schedule
from autopar.plan_summary import MEMORY_PARTS, _bar, config_words, render_summary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402
import llama  # noqa: E402


@pytest.fixture(autouse=True)
def keep_progress_stream(monkeypatch):
    # main() points progress lines at the (captured) stderr of the moment; put it back after
    monkeypatch.setattr(progress, "_stream", progress._stream)


@pytest.fixture(scope="module")
def pipelined():
    """GPT 1.3B shapes, 2 blocks, on one 8-GPU node with tp=4 and pp=2 pinned: Megatron blocks, ZB-H1.
    At 2048 tokens: at 1024, causal attention priced at the half it runs makes head-sharded and
    replicated attention cost within 0.3% of each other (tests/test_planner.py's Megatron case)."""
    model, inputs, loss_fn, target = gpt.build(size="1.3b", batch=8, seq=2048, n_layer=2)
    return autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                        fixed={"tp": 4, "pp": 2, "schedule": "zb-h1"})


@pytest.fixture(scope="module")
def single_stage(tmp_path_factory):
    """A pp=1 plan made through the CLI, with every picture the CLI writes."""
    out = tmp_path_factory.mktemp("cli")
    files = {"plan": out / "plan.json", "timeline": out / "timeline.png", "html": out / "report.html"}
    saved = progress._stream
    try:
        rc = main(["plan", str(ROOT / "examples/gpt.py:build"), "--cluster", "1x8xH100", "--fix", "pp=1",
                   "--fix", "microbatches=2", "--out", str(files["plan"]), "--timeline", str(files["timeline"]),
                   "--html", str(files["html"])])
    finally:
        progress.enable(saved)
    assert rc == 0
    return autopar.Plan.load(files["plan"]), files


# ---------------------------------------------------------------- text summary


def _linears(plan, layer):
    """The layer's linear modules (2-D weights) split by output features (S0) and by input features
    (S1), by the plan's parameter placements, in name order."""
    params = plan.layers[layer]["params"]
    short = {fqn: fqn[len(layer) + 1:-len(".weight")] for fqn in params if fqn.endswith(".weight")}
    pick = lambda p: sorted(short[f] for f, pl in params.items() if f in short and pl == p and "ln" not in f)  # noqa: E731
    return pick("S0"), pick("S1")


def test_summary_names_mesh_stages_strategies_communication_and_runners_up(pipelined):
    plan = pipelined
    text = render_summary(plan)
    assert "mesh pp=2 x dp=1 x tp=4 = 8 devices" in text
    assert "pipeline: zb-h1 over 2 stage(s) on pp=2 rank(s)" in text
    cap = plan.cluster["device"]["hbm_bytes"]
    for s, st in enumerate(plan.stages):
        row = next(line for line in text.splitlines() if re.match(rf"\s+{s} \S", line))
        assert f"{st['devices'][0]}-{st['devices'][-1]}" in row and st["layers"][0] in row
        bar = re.search(r"\[([PGOA.]+)\]", row).group(1)
        assert len(bar) == 24
        assert len(bar.rstrip(".")) == round(24 * st["predicted"]["memory_bytes"]["total"] / cap)
    # the block's linears named by their split: fc1 by output features, the projections by input
    # features (GPT's fused QKV goes either way: its column split needs an all-to-all to reach the
    # heads, priced with its copies, against the replicated GEMM it saves)
    columns, rows = _linears(plan, "transformer.h.0")
    assert "mlp.c_fc" in columns and {"attn.c_proj", "mlp.c_proj"} <= set(rows)
    assert f"column-parallel {', '.join(columns)}; row-parallel {', '.join(rows)}" in text
    assert "Embedding x1 (transformer.wte)" in text
    comm = text[text.index("communication per step"):text.index("solver:")]
    for kind, axes in plan.communication.items():
        for axis in axes:
            assert re.search(rf"^\s+{kind}\s+{axis}\s", comm, re.M), (kind, axis)
    assert re.search(r"^\s+p2p\s+pp\s", comm, re.M)  # two stages exchange activations
    runners = text[text.index("runners-up:"):].splitlines()[1:]
    assert len(runners) == len(plan.solver["candidates"]) > 0
    for line, c in zip(runners, plan.solver["candidates"]):
        assert line.endswith(config_words(c["config"]))


def test_summary_of_a_loaded_plan_keeps_forward_order(pipelined):
    """A plan file's keys are sorted; the strategies still read embedding first, loss last."""
    text = autopar.Plan.from_json(pipelined.to_json()).summary()
    section = text[text.index("layer strategies"):text.index("communication per step")]
    assert section.index("transformer.wte") < section.index("Block x2") < section.index("<loss>")


def test_sequence_parallel_is_read_off_the_norms_placements():
    """With fast links the MIP shards the norms over the sequence (Megatron-SP); the plan says so."""
    from autopar.testing import tp_friendly_cluster

    model, inputs, loss_fn, target = llama.build(size="small", batch=2)
    plan = autopar.plan(model, inputs, cluster=tp_friendly_cluster("1x2xcpu"), loss_fn=loss_fn,
                        example_target=target, fixed={"tp": 2, "pp": 1, "sp": True})
    assert plan.sequence_parallel
    block = next(v for v in plan.layers.values() if v["class"] == "TransformerBlock")
    assert {p.rsplit(".", 1)[-1] for p in block["sequence_parallel"]} == {"attention_norm", "ffn_norm"}
    text = plan.summary()
    assert "sequence-parallel attention_norm, ffn_norm" in text
    assert "reduce_scatter" in text and "all_gather" in text  # SP's collectives in place of all-reduces


def test_sequence_parallel_words_replace_replicated(pipelined):
    layers = {k: dict(v) for k, v in pipelined.layers.items()}
    block = next(k for k, v in layers.items() if v["class"] == "Block")
    layers[block]["sequence_parallel"] = [f"{block}.ln_1", f"{block}.ln_2"]
    text = dataclasses.replace(pipelined, layers=layers).summary()
    assert "sequence-parallel ln_1, ln_2" in text
    assert "replicated ln_1" not in text


def test_memory_bar_shows_parts_by_cumulative_rounding():
    # alone, 0.4 and 0.4 characters would both round away; the part in which the sum passes half a
    # character gets it, so the filled length is always round(24 * total / cap)
    assert _bar([0.4, 0.4, 0.0, 10.0], 24.0) == "G" + "A" * 10 + "." * 13
    assert _bar([6.0, 6.0, 6.0, 6.0], 24.0, width=8) == "PPGGOOAA"
    assert _bar([0.0, 0.0, 0.0, 0.0], 0.0) == "." * 24
    assert _bar([6.0, 6.0, 6.0, 6.0, 8.0], 32.0, width=16) == "PPPGGGOOOAAAZZZZ"  # ZeRO's buffers last
    assert [k for k, _ in MEMORY_PARTS] == ["params", "grads", "optimizer", "activations", "zero_buffers"]


def test_stage_memory_parts_sum_to_the_total_and_old_plans_read_zero_buffers_as_zero():
    """The summary's memory parts of a ZeRO-3 stage are the plan's whole breakdown (the bar fills
    to the total), and a plan file written before ``zero_buffers`` existed still summarises."""
    from autopar.plan_summary import stage_rows

    model, inputs, loss_fn, target = llama.build(size="tiny", batch=8, n_layers=2)
    plan = autopar.plan(model, inputs, cluster="1x2xcpu", loss_fn=loss_fn, example_target=target,
                        fixed={"dp": 2, "tp": 1, "pp": 1, "zero": 3, "microbatches": 1})
    (row,) = stage_rows(plan)
    assert row["memory"]["zero_buffers"] > 0
    assert sum(row["memory"].values()) == pytest.approx(row["memory_total"], rel=1e-5)
    stages = [dict(st, predicted=dict(st["predicted"], memory_bytes={
        k: v for k, v in st["predicted"]["memory_bytes"].items() if k != "zero_buffers"})) for st in plan.stages]
    (old,) = stage_rows(dataclasses.replace(plan, stages=stages))
    assert old["memory"]["zero_buffers"] == 0.0
    assert "Z=ZeRO buffers" in dataclasses.replace(plan, stages=stages).summary()


# ---------------------------------------------------------------- timeline


def test_resimulated_timeline_is_the_planners(pipelined):
    from autopar.report import resimulate

    plan = pipelined
    sim = resimulate(plan)
    # rel=1e-5: the plan stores floats to 6 significant digits (each within 5e-6 relative); the
    # resimulation starts from those stored stage times and is compared with a stored total, so
    # two such roundings of positive quantities separate them at most.
    assert sim.bubble_fraction == pytest.approx(plan.predicted["bubble_fraction"], rel=1e-5)
    # the whole step (pipeline, dp collectives, optimizer) is the stored step program, re-run
    assert sim.step_time_s == pytest.approx(plan.predicted["step_time_s"], rel=1e-5)
    overlap = plan.predicted["overlap"]
    assert [r["exposed_s"] for r in overlap] == pytest.approx(list(sim.exposed_s), rel=1e-5, abs=1e-12)
    sched = make_schedule("zb-h1", n_stages=2, n_micro=plan.schedule["microbatches"])
    computed = {str(op.action) for _, op, _, _ in sim.timeline if op.action is not None and op.kind != "SEND"}
    assert computed == {str(a) for acts in sched.values() for a in acts}
    assert sum(op.kind == "OPT" for _, op, _, _ in sim.timeline) == len(plan.stages)


def test_timeline_png_is_a_readable_picture(pipelined, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from autopar.report import save_timeline

    path = tmp_path / "timeline.png"
    save_timeline(pipelined, path)
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 150 and pixels.shape[1] > 800
    assert pixels[..., :3].reshape(-1, 3).std(axis=0).max() > 0.05  # not one colour
    assert path.stat().st_size < 200_000


def test_timeline_svg_has_a_row_per_stage_and_a_box_per_action(pipelined, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    from autopar.report import save_timeline

    path = tmp_path / "timeline.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        save_timeline(pipelined, path)
    svg = path.read_text()
    for s in range(len(pipelined.stages)):
        assert f"stage {s}" in svg
    sched = make_schedule("zb-h1", n_stages=2, n_micro=pipelined.schedule["microbatches"])
    actions = [str(a) for acts in sched.values() for a in acts]
    boxes = re.findall(r'id="action-(\d+(?:BW|F|B|W)\d+)"', svg)
    assert sorted(boxes) == sorted(actions)
    for label in ("forward (F)", "backward, input grad (B)", "backward, weight grad (W)"):  # the legend
        assert label in svg
    assert "predicted step" in svg


def test_single_stage_timeline_and_html_from_the_cli(single_stage):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    plan, files = single_stage
    assert plan.mesh["pp"] == 1 and plan.schedule["microbatches"] == 2
    pixels = matplotlib.image.imread(files["timeline"])
    assert pixels.shape[1] > 800 and pixels[..., :3].reshape(-1, 3).std(axis=0).max() > 0.05
    page = files["html"].read_text()
    # one row, one F and one fused BW per micro-batch
    assert sorted(re.findall(r'id="action-(\d+(?:BW|F|B|W)\d+)"', page)) == ["0BW0", "0BW1", "0F0", "0F1"]


def test_missing_matplotlib_is_one_clear_error(pipelined, monkeypatch, tmp_path):
    from autopar.report import save_timeline

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'autopar\[report\]'"):
        save_timeline(pipelined, tmp_path / "t.png")


def test_timeline_file_type_is_checked_before_planning(capsys):
    assert main(["plan", str(ROOT / "examples/gpt.py:build"), "--cluster", "1x8xH100", "--timeline", "t.jpg"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: error: --timeline 't.jpg' needs a .png, .svg or .pdf") and "tracing" not in err


# ---------------------------------------------------------------- HTML


def test_html_report_is_self_contained_and_complete(pipelined):
    pytest.importorskip("matplotlib")
    from autopar.report import render_html

    page = render_html(pipelined)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and "<link" not in page and "<img" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)
    assert not re.search(r"url\(\s*['\"]?https?:", page)
    assert page.count("<svg") == 1  # the timeline, inline
    assert "mesh pp=2 x dp=1 x tp=4 = 8 devices" in page
    stage_rows = re.findall(r'<tr><td class="num">(\d+)</td><td><code>', page)
    assert stage_rows == [str(s) for s in range(len(pipelined.stages))]
    assert page.count('<div class="bar">') == len(pipelined.stages)
    columns, _ = _linears(pipelined, "transformer.h.0")
    assert columns and f"<b>column-parallel</b> {', '.join(columns)}" in page
    for kind in pipelined.communication:
        assert f"<td>{kind}</td>" in page
    for c in pipelined.solver["candidates"]:
        assert config_words(c["config"]) in page


# ---------------------------------------------------------------- headless browser


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not on PATH (CI installs it: "
                                                             "apt-get install chromium)")


def screenshot(page: Path, png: Path, *, size=(1280, 2000)) -> list[str]:
    """Render ``page`` in headless Chromium into ``png``; return the console lines it logged.

    With ``--enable-logging=stderr`` Chromium writes every console message and uncaught
    exception as a ``...:CONSOLE...] "text", source: URL (line)`` line; a page without
    scripts should produce none.
    """
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         "--enable-logging=stderr", "--v=0", f"--screenshot={png}", f"--window-size={size[0]},{size[1]}",
         page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and png.exists(), f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]}"
    return [line for line in proc.stderr.splitlines() if re.search(r":CONSOLE\b", line) or "Uncaught" in line]


def _is_a_picture(png: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image

    pixels = matplotlib.image.imread(png)[..., :3].reshape(-1, 3)
    assert pixels.std(axis=0).max() > 0.05, "the screenshot is a single colour"
    assert len({tuple(p) for p in pixels[:: max(1, len(pixels) // 20000)]}) > 20, "too few colours: blank page?"


@needs_chromium
def test_console_check_catches_errors(tmp_path):
    """The check below can fail: a page that logs an error and throws is caught."""
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><body><p>bad page</p><script>console.error("deliberate error");'
                    "notDefinedAnywhere();</script></body></html>")
    lines = screenshot(page, tmp_path / "bad.png", size=(400, 300))
    assert any("deliberate error" in line for line in lines), lines
    assert any("Uncaught ReferenceError" in line and "notDefinedAnywhere" in line for line in lines), lines


@needs_chromium
def test_html_report_renders_in_chromium_without_console_errors(pipelined, tmp_path):
    pytest.importorskip("matplotlib")
    from autopar.report import save_html

    page = tmp_path / "report.html"
    save_html(pipelined, page)
    png = tmp_path / "report.png"
    assert screenshot(page, png) == []
    _is_a_picture(png)
    width, height = _png_size(png)
    assert (width, height) == (1280, 2000)


def _png_size(png: Path) -> tuple[int, int]:
    """Width and height from the PNG header (IHDR: bytes 16-24, big-endian)."""
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_png_size_reader(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    Figure(figsize=(3, 2)).savefig(tmp_path / "x.png", dpi=100)
    assert _png_size(tmp_path / "x.png") == (300, 200)


def test_summary_and_html_show_hidden_and_exposed_communication(pipelined):
    from autopar.fmt import fmt_s
    from autopar.plan_summary import overlap_rows
    from autopar.report import render_html

    rows = overlap_rows(pipelined)
    assert [r["pp_rank"] for r in rows] == list(range(pipelined.mesh["pp"]))
    assert any(r["exposed_s"] > 0 for r in rows)  # the tied embedding's all-reduce after the backward
    for r in rows:
        assert r["collectives_s"] == pytest.approx(r["hidden_s"] + r["exposed_s"])
    text = pipelined.summary()
    assert "communication hidden vs exposed per pipeline rank" in text
    assert all(fmt_s(r["exposed_s"]) in text for r in rows)
    page = render_html(pipelined)
    assert "Communication hidden vs exposed per pipeline rank" in page
    assert all(fmt_s(r["hidden_s"]) in page for r in rows)


def test_html_report_is_the_same_bytes_for_the_same_plan(pipelined):
    """A report can be diffed like the plan file: matplotlib's SVG carries a creation date and
    element ids salted at random unless told otherwise."""
    pytest.importorskip("matplotlib")
    from autopar.report import render_html

    assert render_html(pipelined) == render_html(pipelined)

"""Plan regression testing: the semantic diff of two plans, ``autopar diff``, and
``autopar.testing.assert_plan_matches`` with its update switch (pytest option and env var).

The plans are golden files of tests/golden, changed by hand: no planning here.
"""
import copy
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

import autopar.pytest_plugin
from autopar import progress
from autopar.cli import main
from autopar.errors import PlanError
from autopar.fmt import fmt_s
from autopar.plan import Plan
from autopar.plan_diff import ABSENT, diff_plans, load_plan_file
from autopar.testing import UPDATE_ENV, assert_plan_matches

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "llama-8b-16x8xH100.json"  # pp and tp > 1: stages and placements to move


@pytest.fixture
def plan():
    return Plan.load(GOLDEN)


@pytest.fixture(autouse=True)
def no_update_requested(monkeypatch):
    """These tests set the update switches themselves, whatever this pytest run was given."""
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    monkeypatch.setattr(autopar.pytest_plugin, "update_golden", False)
    monkeypatch.setattr(progress, "_stream", progress._stream)  # main() points it at the captured stderr


def with_changes(plan, **fields):
    """A copy of ``plan`` with some fields replaced (deep copies, so the original stays as loaded)."""
    return replace(plan, **{k: copy.deepcopy(v) for k, v in fields.items()})


def lines_of(diff, **kw):
    return diff.render(**kw).splitlines()


# -- the diff -----------------------------------------------------------------------


def test_a_plan_matches_itself_and_its_file(plan):
    assert diff_plans(plan, plan).equal
    assert diff_plans(plan, Plan.from_json(plan.to_json())).equal
    assert diff_plans(plan, plan).render(old_label="a", new_label="b") == "plans match (a -> b, relative tolerance 0.01)"


def test_predictions_compare_with_the_relative_tolerance(plan):
    step = plan.predicted["step_time_s"]
    close = with_changes(plan, predicted={**plan.predicted, "step_time_s": step * 1.005})
    assert diff_plans(plan, close, rtol=0.01).equal
    far = with_changes(plan, predicted={**plan.predicted, "step_time_s": step * 1.05})
    diff = diff_plans(plan, far, rtol=0.01)
    assert [(c.group, c.item) for c in diff.changes] == [("predicted", "step_time_s")]
    assert diff.changes[0].relative == pytest.approx(0.05, rel=1e-4)
    assert f"  step_time_s: {fmt_s(step)} -> {fmt_s(step * 1.05)} (+5.0%)" in lines_of(diff)
    assert diff_plans(plan, far, rtol=0.1).equal
    tokens = plan.predicted["tokens_per_s"]  # a rate, not a time
    faster = with_changes(plan, predicted={**plan.predicted, "tokens_per_s": tokens * 2})
    assert f"  tokens_per_s: {tokens:.6g} -> {tokens * 2:.6g} (+100.0%)" in lines_of(diff_plans(plan, faster))


def test_configuration_changes_count_whatever_the_tolerance(plan):
    assert plan.recompute != "full" and "zero" not in plan.fixed  # (what the golden file holds)
    kind = plan.schedule["kind"]
    new_kind = "gpipe" if kind != "gpipe" else "1f1b"
    new_zero = 3 if plan.zero != 3 else 2
    other = with_changes(plan, zero=new_zero, recompute="full",
                         schedule={**plan.schedule, "kind": new_kind}, fixed={**plan.fixed, "zero": str(new_zero)})
    diff = diff_plans(plan, other, rtol=10.0)
    assert not diff.equal
    lines = lines_of(diff)
    assert lines[0].startswith("plans differ (old -> new, relative tolerance 10): 4 changes (configuration 4)")
    assert lines[1:] == ["configuration:", f"  fixed.zero: absent -> {new_zero}", f"  recompute: {plan.recompute} -> full",
                         f"  schedule.kind: {kind} -> {new_kind}", f"  zero: {plan.zero} -> {new_zero}"]


def test_a_moved_stage_boundary_names_the_layers(plan):
    # two stages of the golden plan's layers, cut in the middle (long enough to print as spans),
    # then the boundary moved by one layer
    layers = [x for s in plan.stages for x in s["layers"]]
    half = len(layers) // 2
    assert half > 4
    first, second = layers[:half], layers[half:]
    base = with_changes(plan, stages=(dict(plan.stages[0], layers=first), dict(plan.stages[1], layers=second)))
    moved = (dict(plan.stages[0], layers=first[:-1]), dict(plan.stages[1], layers=[first[-1], *second]))
    diff = diff_plans(base, with_changes(base, stages=moved))
    assert [c.item for c in diff.changes] == ["stage 0 layers", "stage 1 layers"]
    lines = lines_of(diff)
    assert f"  stage 0 layers: {first[0]} .. {first[-1]} ({len(first)} layers) -> " \
           f"{first[0]} .. {first[-2]} ({len(first) - 1} layers)" in lines
    assert f"  stage 1 layers: {second[0]} .. {second[-1]} ({len(second)} layers) -> " \
           f"{first[-1]} .. {second[-1]} ({len(second) + 1} layers)" in lines


def test_placement_changes_one_line_each(plan):
    layers = copy.deepcopy(plan.layers)
    path, layer = next((p, x) for p, x in layers.items() if "S0" in x["params"].values())
    fqn = next(f for f, pl in layer["params"].items() if pl == "S0")
    layer["params"][fqn] = "R"
    ops = copy.deepcopy(plan.ops)
    name = next(n for n, op in ops.items() if op["phase"] == "F" and op["out"] == ["R"])
    ops[name]["out"] = ["S0"]
    where = f"{name} ({ops[name]['layer']}, F)"
    del ops[next(n for n in sorted(ops) if n != name)]
    diff = diff_plans(plan, with_changes(plan, layers=layers, ops=ops))
    assert {c.group for c in diff.changes} == {"layers", "ops"}
    lines = lines_of(diff)
    assert f"  {fqn}: S0 -> R" in lines
    assert f"  {where} out: [R] -> [S0]" in lines
    removed = [c for c in diff.changes if c.new is ABSENT]
    assert len(removed) == 1 and removed[0].group == "ops"


def test_many_changes_are_capped_per_group(plan):
    ops = copy.deepcopy(plan.ops)
    for op in ops.values():
        op["phase"] = "X"
    diff = diff_plans(plan, with_changes(plan, ops=ops))
    assert len(diff.changes) == len(ops)
    lines = lines_of(diff, limit=5)
    assert len(lines) == 1 + 1 + 5 + 1
    assert lines[-1] == f"  ... and {len(ops) - 5} more ops changes"
    assert len(lines_of(diff, limit=0)) == 2 + len(ops)


def test_a_negative_tolerance_is_refused(plan):
    with pytest.raises(ValueError, match="tolerance must be a finite number >= 0, got -1"):
        diff_plans(plan, plan, rtol=-1)


@pytest.mark.parametrize("content, message", [
    (None, "cannot read plan file '{path}': No such file or directory"),
    ("not json", "'{path}' is not an autopar plan file: plan is not valid JSON"),
    ('{"schema": 1, "mesh": {}}', "'{path}' is not an autopar plan file: plan is missing keys: "),
    ('[1, 2]', "'{path}' is not an autopar plan file: a plan is a JSON object, got list"),
])
def test_bad_plan_files_name_the_file(tmp_path, content, message):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(PlanError) as info:
        load_plan_file(path)
    assert str(info.value).startswith(message.format(path=path))


# -- autopar diff ---------------------------------------------------------------------


def test_cli_equal_plans_exit_0(capsys):
    assert main(["diff", str(GOLDEN), str(GOLDEN)]) == 0
    assert capsys.readouterr().out == f"plans match ({GOLDEN} -> {GOLDEN}, relative tolerance 0.01)\n"


def test_cli_changed_plans_exit_1_with_one_line_per_change(plan, tmp_path, capsys):
    new = tmp_path / "new.json"
    predicted = {**plan.predicted, "peak_memory_bytes": plan.predicted["peak_memory_bytes"] * 1.5}
    new_zero = (plan.zero + 1) % 4
    with_changes(plan, zero=new_zero, predicted=predicted).save(new)
    assert main(["diff", str(GOLDEN), str(new)]) == 1
    out = capsys.readouterr().out.splitlines()
    mem = plan.predicted["peak_memory_bytes"]
    assert out == [f"plans differ ({GOLDEN} -> {new}, relative tolerance 0.01): 2 changes (configuration 1, predicted 1)",
                   "configuration:", f"  zero: {plan.zero} -> {new_zero}",
                   "predicted:", f"  peak_memory_bytes: {mem / 1e9:.3g} GB -> {mem * 1.5 / 1e9:.3g} GB (+50.0%)"]
    assert main(["diff", str(GOLDEN), str(new), "--tolerance", "0.6"]) == 1  # ZeRO still differs


def test_cli_bad_file_or_tolerance_exit_2(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert main(["diff", str(GOLDEN), str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"autopar: error: cannot read plan file '{missing}': No such file or directory\n"
    not_a_plan = tmp_path / "report.json"
    not_a_plan.write_text(json.dumps({"n_params": 3}))
    assert main(["diff", str(not_a_plan), str(GOLDEN)]) == 2
    assert capsys.readouterr().err.startswith(f"autopar: error: '{not_a_plan}' is not an autopar plan file: plan schema")
    assert main(["diff", str(GOLDEN), str(GOLDEN), "--tolerance", "-0.1"]) == 2
    assert "--tolerance -0.1 must be >= 0" in capsys.readouterr().err


# -- assert_plan_matches --------------------------------------------------------------


def test_golden_path_is_relative_to_the_calling_test(plan, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not relative to the working directory
    assert_plan_matches(plan, f"golden/{GOLDEN.name}")


def test_a_missing_golden_fails_and_says_how_to_create_it(plan, tmp_path):
    golden = tmp_path / "golden" / "new.json"
    with pytest.raises(AssertionError, match=f"golden plan {golden} does not exist; run pytest with "
                                             f"--autopar-update-golden \\(or AUTOPAR_UPDATE_GOLDEN=1\\)"):
        assert_plan_matches(plan, golden)
    assert not golden.exists()


def test_update_writes_a_missing_golden_and_says_so(plan, tmp_path):
    golden = tmp_path / "golden" / "new.json"
    with pytest.warns(UserWarning, match=f"wrote new golden plan {golden}"):
        assert_plan_matches(plan, golden, update=True)
    assert golden.read_text() == plan.to_json()
    assert_plan_matches(plan, golden)


def test_a_differing_plan_fails_with_the_diff(plan, tmp_path):
    golden = tmp_path / "g.json"
    plan.save(golden)
    other = with_changes(plan, recompute="selective")
    with pytest.raises(AssertionError) as info:
        assert_plan_matches(other, golden)
    message = str(info.value).splitlines()
    assert message[0] == f"plan differs from golden plan {golden}"
    assert message[1].startswith("plans differ (golden -> plan, relative tolerance 0.01): 1 changes")
    assert message[2:4] == ["configuration:", "  recompute: none -> selective"]
    assert "--autopar-update-golden" in message[-1]


def test_env_var_rewrites_a_differing_golden_but_not_a_matching_one(plan, tmp_path, monkeypatch):
    golden = tmp_path / "g.json"
    plan.save(golden)
    nudged = with_changes(plan, predicted={**plan.predicted, "mfu": plan.predicted["mfu"] * 1.001})
    monkeypatch.setenv(UPDATE_ENV, "1")
    assert_plan_matches(nudged, golden)  # within tolerance: the file keeps its digits
    assert golden.read_text() == plan.to_json()
    other = with_changes(plan, recompute="full")
    with pytest.warns(UserWarning, match=f"updated golden plan {golden}: 1 changes"):
        assert_plan_matches(other, golden)
    assert Plan.load(golden).recompute == "full"
    monkeypatch.setenv(UPDATE_ENV, "0")
    with pytest.raises(AssertionError, match="recompute: full -> none"):
        assert_plan_matches(plan, golden)


def _run_pytest(test_dir, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop(UPDATE_ENV, None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "autopar.pytest_plugin", "-p", "no:cacheprovider",
                           "--rootdir", str(test_dir), "-q", str(test_dir), *args],
                          capture_output=True, text=True, env=env, cwd=test_dir, timeout=120)


def test_pytest_option_updates_goldens(tmp_path):
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(f"""
        from autopar.plan import Plan
        from autopar.testing import assert_plan_matches

        def test_plan():
            assert_plan_matches(Plan.load({str(GOLDEN)!r}), "golden/inner.json")
    """))
    golden = tmp_path / "golden" / "inner.json"
    run = _run_pytest(tmp_path)
    assert run.returncode == 1 and "does not exist; run pytest with --autopar-update-golden" in run.stdout, run.stdout
    run = _run_pytest(tmp_path, "--autopar-update-golden")
    assert run.returncode == 0 and f"wrote new golden plan {golden}" in run.stdout, run.stdout + run.stderr
    assert golden.read_text() == GOLDEN.read_text()
    data = json.loads(golden.read_text())
    data["recompute"] = "full"
    golden.write_text(json.dumps(data))
    run = _run_pytest(tmp_path)
    assert run.returncode == 1 and "  recompute: full -> none" in run.stdout, run.stdout


def test_diff_and_golden_helpers_do_not_import_torch():
    code = ("import sys, autopar.testing, autopar.plan_diff, autopar.pytest_plugin, autopar.cli\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "import autopar, autopar.plan\n"
            "from autopar.api import plan\n"
            "assert autopar.plan is plan and autopar.Plan is autopar.plan_diff.Plan\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert run.returncode == 0, run.stderr

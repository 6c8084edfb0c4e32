"""A pinned pipeline layout (``fixed={"cuts": [...]}``): the stages begin where the user says,
the search keeps every other decision, the plan is priced as laid out, and bad layouts are
one clear error each. (tests/dist/test_pipeline.py runs pinned layouts against one process.)"""

import json
import sys
from pathlib import Path

import pytest

import autopar
from autopar.cli import main
from autopar.errors import PlanError
from autopar.planner.fixed import Fixed

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import llama  # noqa: E402

LAYERS = ["tok_embeddings", "layers.0", "layers.1", "norm", "output", "<loss>"]


@pytest.fixture(scope="module")
def tiny():
    return llama.build(size="tiny")


def _plan(tiny, fixed):
    model, inputs, loss_fn, target = tiny
    return autopar.plan(model, inputs, cluster="1x4xH100", loss_fn=loss_fn, example_target=target, fixed=fixed)


def _stages(plan) -> list[list[str]]:
    return [list(st["layers"]) for st in plan.stages]


def test_parsing_takes_lists_and_comma_separated_names():
    assert Fixed.from_dict({"cuts": " layers.0, norm "}).cuts == ("layers.0", "norm")
    assert Fixed.from_dict({"cuts": ["layers.1"]}).cuts == ("layers.1",)
    assert Fixed.from_dict({"cuts": "layers.1"}).to_dict() == {"cuts": ["layers.1"]}  # (JSON: a list)
    assert Fixed.from_dict({"cuts": "layers.1"}).n_stages == 2 and Fixed.from_dict({}).n_stages is None


@pytest.mark.parametrize("value, message", [
    ([], "must name the first layer of each stage"),
    (["layers.0", 3], "must name the first layer of each stage"),
    ("a,b,a", "cuts name a more than once"),
])
def test_bad_values_are_refused_on_parsing(value, message):
    with pytest.raises(PlanError, match=message):
        Fixed.from_dict({"cuts": value})


def test_the_stages_begin_at_the_pinned_layers(tiny):
    free = _plan(tiny, {"pp": 2, "dp": 2, "tp": 1})
    assert _stages(free) == [LAYERS[:2], LAYERS[2:]]  # the partitioner's balance
    pinned = _plan(tiny, {"pp": 2, "dp": 2, "tp": 1, "cuts": "norm"})
    assert _stages(pinned) == [LAYERS[:3], LAYERS[3:]]
    assert pinned.fixed["cuts"] == ["norm"]
    # the free search is the best cut of the same configuration, so a pinned other one costs more
    assert pinned.predicted["step_time_s"] > free.predicted["step_time_s"]
    # pinning the partitioner's own layout changes nothing
    same = _plan(tiny, {"pp": 2, "dp": 2, "tp": 1, "cuts": ["layers.1"]})
    assert same.predicted["step_time_s"] == free.predicted["step_time_s"]


def test_the_stage_count_selects_pp_and_interleaving(tiny):
    plan = _plan(tiny, {"cuts": "layers.0,norm,<loss>", "schedule": "interleaved"})
    assert plan.mesh["pp"] * (len(plan.stages) // plan.mesh["pp"]) == 4 and len(plan.stages) == 4
    assert _stages(plan) == [LAYERS[:1], LAYERS[1:3], LAYERS[3:5], LAYERS[5:]]
    assert plan.schedule["kind"] == "interleaved"
    one = _plan(tiny, {"cuts": "layers.1"})  # 2 stages: pp = 2, one per rank
    assert one.mesh["pp"] == 2 and _stages(one) == [LAYERS[:2], LAYERS[2:]]


@pytest.mark.parametrize("fixed, message", [
    ({"cuts": "layers.7"}, r"fixed cuts name 'layers.7', not a layer of the model; its 6 layers in order: "
                           r"tok_embeddings, layers.0, layers.1, norm, output, <loss>"),
    ({"cuts": "norm,layers.0"}, "not in the model's layer order: 'layers.0' comes before 'norm'"),
    ({"cuts": "tok_embeddings"}, "'tok_embeddings' is the first layer"),
    ({"cuts": "layers.0,norm", "pp": 2}, "give 3 stages .2 cuts., which pp=2 does not divide; name 1 cut,"),
    ({"cuts": "layers.0,norm,output", "pp": 2, "virtual_stages": 3},
     r"give 4 stages .3 cuts., which pp=2 x virtual_stages=3 = 6 does not match; name 5 cuts"),
    ({"cuts": "layers.0,norm,output", "pp": 4, "schedule": "interleaved", "virtual_stages": 2},
     "pp=4 x virtual_stages=2 = 8 does not match"),
])
def test_bad_layouts_are_one_line_each(tiny, fixed, message):
    with pytest.raises(PlanError, match=message):
        _plan(tiny, fixed)


def test_cli_pins_cuts(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "examples/llama.py:build", "--cluster", "1x4xH100", "--fix", "pp=2",
                 "--fix", "cuts=norm", "--out", str(out)]) == 0
    stages = [st["layers"] for st in json.loads(out.read_text())["stages"]]
    assert stages == [LAYERS[:3], LAYERS[3:]]
    assert main(["plan", "examples/llama.py:build", "--cluster", "1x4xH100", "--fix", "cuts=nope"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("autopar: error: ")]
    # one error line; any other is a progress line (a phase that ran over a second announces itself)
    assert len(errors) == 1 and all(line.startswith("autopar: ") for line in lines), lines
    assert "fixed cuts name 'nope', not a layer of the model" in errors[0]


def test_a_layout_that_does_not_fit_says_so(tiny):
    from autopar.cluster import parse_cluster

    model, inputs, loss_fn, target = tiny
    cluster = parse_cluster("1x4xH100")
    # memory for the partitioner's stages, not for three blocks' activations and the embedding on one
    small = cluster.with_overrides(hbm_bytes=1.2e6)
    fixed = {"pp": 2, "dp": 2, "tp": 1}
    plan = autopar.plan(model, inputs, cluster=small, loss_fn=loss_fn, example_target=target, fixed=fixed)
    assert len(plan.stages) == 2
    with pytest.raises(PlanError, match="fits no configuration.*move the pinned cuts"):
        autopar.plan(model, inputs, cluster=small, loss_fn=loss_fn, example_target=target,
                     fixed={**fixed, "cuts": "output"})

"""Sequence parallelism as a decision of the search: pinnable both ways (``fixed={"sp": ...}``,
``--fix sp=``), recorded in the plan, and unpinned solved as two restricted sharding MIPs (every
norm op on token shards, or none), with the unrestricted MIP where neither side has a solution."""

import sys
from pathlib import Path

import pytest

import autopar
from autopar.cluster import parse_cluster
from autopar.errors import PlanError
from autopar.planner import search as S

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import gpt  # noqa: E402


@pytest.mark.parametrize("value, expected", [(True, True), ("1", True), ("true", True), (False, False),
                                             ("0", False), ("off", False)])
def test_fixed_sp_parses(value, expected):
    assert S.Fixed.from_dict({"sp": value}).sp is expected


def test_fixed_sp_rejects_non_booleans():
    with pytest.raises(PlanError, match=r"sp='maybe' is not a boolean"):
        S.Fixed.from_dict({"sp": "maybe"})


@pytest.fixture(scope="module")
def gpt_small():
    return gpt.build(size="1.3b", batch=16, seq=1024, n_layer=4)


def test_sp_pinned_both_ways_and_recorded(gpt_small):
    model, inputs, loss_fn, target = gpt_small
    plans = {sp: autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                              fixed={"tp": 4, "pp": 1, "sp": sp}) for sp in (True, False)}
    for sp, plan in plans.items():
        assert plan.sequence_parallel is sp
        assert plan.fixed["sp"] is sp
        normed = [layer for layer, d in plan.layers.items() if d["sequence_parallel"]]
        assert bool(normed) is sp, normed
        assert autopar.Plan.from_json(plan.to_json()).sequence_parallel is sp
    # sequence parallelism splits the norms' activations over tp: less memory per device
    mem = {sp: sum(st["predicted"]["memory_bytes"]["activations"] for st in p.stages) for sp, p in plans.items()}
    assert mem[True] < mem[False]
    free = autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                        fixed={"tp": 4, "pp": 1})
    assert free.predicted["step_time_s"] <= min(p.predicted["step_time_s"] for p in plans.values()) * (1 + 1e-9)
    assert "sequence parallelism: " + ("on" if free.sequence_parallel else "off") in free.summary()


def test_each_sp_side_is_pure_and_its_own_mip(gpt_small, monkeypatch):
    """Unpinned, each tp > 1 gets two restricted MIPs: sp=True puts every norm op on token
    shards, sp=False none (a layout in between is neither side), and their solutions are what
    the search gets; tp=1 gets one unrestricted MIP, labelled sp=False. The restricted side is
    found where the free MIP would not go: GPT's blocks never pick sequence parallelism alone."""
    from autopar.planner import make
    from autopar.planner.frontend import trace_pair
    from autopar.planner.record import token_sharded

    model, inputs, loss_fn, target = gpt_small
    cluster = parse_cluster("1x8xH100")
    gm, gm2 = trace_pair(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    calls = []
    solve = make.solve
    monkeypatch.setattr(make, "solve", lambda problem, **kw: calls.append(problem.forbidden) or solve(problem, **kw))
    monkeypatch.setenv("AUTOPAR_FORK", "0")  # (every call seen here: none in a forked child)
    solved = make._solve_all(gm, gm2, [1, 4], None, batch=16, cluster=cluster)
    assert sorted(solved) == [(1, False, False), (4, False, False), (4, True, False)]  # (tp, sp, ep folded)
    assert len(calls) == 3 and sum(not f for f in calls) == 1  # tp=1 unrestricted; each tp=4 side restricted
    for sp in (True, False):
        sg, sol = solved[4, sp, False]
        norms = make._norm_nodes(gm, sg)
        assert norms
        sharded = {token_sharded(sg.nodes[v].candidates[sol.choice[v]].outs[0], rank) for v, rank in norms.items()}
        assert sharded == {sp}, (sp, sharded)
    assert solved[4, True, False][1].objective_s > solved[4, False, False][1].objective_s  # the MIP prices time only


def test_unrestricted_mip_when_neither_sp_side_has_a_solution(gpt_small, monkeypatch):
    """Where both pure sides are infeasible (stood in for here), the unrestricted MIP is solved,
    labelled by where its norms landed; pinned, a side's infeasibility stands."""
    from autopar.planner import make
    from autopar.planner.frontend import trace_pair

    model, inputs, loss_fn, target = gpt_small
    cluster = parse_cluster("1x8xH100")
    gm, gm2 = trace_pair(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    side = make._solve_side
    asked = []

    def no_pure_side(sg, tp, sp, *, pinned, **rest):
        asked.append((tp, sp))
        if sp is not None:
            if pinned:
                raise autopar.InfeasibleError("stand-in: no solution on this side")
            return None
        return side(sg, tp, sp, pinned=pinned, **rest)

    monkeypatch.setattr(make, "_solve_side", no_pure_side)
    monkeypatch.setenv("AUTOPAR_FORK", "0")  # (every call seen here: none in a forked child)
    solved = make._solve_all(gm, gm2, [4], None, batch=16, cluster=cluster)
    assert sorted(asked[:2]) == [(4, False), (4, True)] and asked[2:] == [(4, None)]  # (sides in threads)
    assert list(solved) == [(4, False, False)]  # GPT's free MIP keeps its norms replicated
    with pytest.raises(autopar.InfeasibleError, match="stand-in"):
        make._solve_all(gm, gm2, [4], True, batch=16, cluster=cluster)


def test_sp_without_tp_is_a_clear_error(gpt_small):
    model, inputs, loss_fn, target = gpt_small
    with pytest.raises(PlanError, match="sp=True needs tensor parallelism"):
        autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                     fixed={"tp": 1, "sp": True})


def test_cli_fix_sp(tmp_path, monkeypatch):
    """`--fix sp=1` / `--fix sp=0` reach the planner and the plan file records the choice."""
    from autopar.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    for flag, expected in (("1", True), ("0", False)):
        out = tmp_path / f"sp{flag}.json"
        assert main(["plan", "examples/gpt.py:build", "--cluster", "1x8xH100", "--fix", "tp=2", "--fix", "pp=1",
                     "--fix", f"sp={flag}", "--out", str(out)]) == 0
        plan = autopar.Plan.load(out)
        assert plan.sequence_parallel is expected and plan.fixed["sp"] is expected
    assert main(["plan", "examples/gpt.py:build", "--cluster", "1x8xH100", "--fix", "sp=perhaps"]) == 2

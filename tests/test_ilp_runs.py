"""Runs of single-reader ops leave the sharding MIP and are chosen after it (``autopar.planner.runs``):
variable elimination on a path, so the optimum is the one the whole MIP has, and the ops of a run
get candidates whose recomputed cost is that optimum. Checked on Llama tiny's tensor-parallel
MIPs, free and with sequence parallelism pinned each way (the forbidden sets the planner uses)."""

import functools
import json
import sys
from pathlib import Path

import pytest

from autopar.cluster import parse_cluster
from autopar.passes.strategies import build_strategy_graph
from autopar.planner import evaluation, ilp, make, runs
from autopar.planner.frontend import trace_pair

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama  # noqa: E402


pytestmark = pytest.mark.usefixtures("solved_afresh")  # (tests/conftest.py)


@pytest.fixture(scope="module")
def traced():
    cluster = parse_cluster("1x4xH100")
    model, inputs, loss_fn, target = llama.build(size="tiny", batch=16, seq=128)
    gm, gm2 = trace_pair(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    return cluster, gm, gm2


def _problems(cluster, gm, gm2, tp):
    sg = build_strategy_graph(gm, axis_size=tp, gm_double=gm2, shard_batch=False)
    norms = make._norm_nodes(gm, sg)
    out = {"free": frozenset()}
    for sp in (False, True):
        out[f"sp={sp}"] = frozenset((v, i) for v, rank in norms.items() for i, s in enumerate(sg.nodes[v].candidates)
                                    if make.token_sharded(s.outs[0], rank) != sp)
    link = cluster.link_for_group(tp, stride=1)
    return sg, {k: ilp.build_problem(sg, batch=4, device=cluster.device, link=link, forbidden=f) for k, f in out.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_runs_leave_the_mip_and_the_optimum_stays(traced, tp):
    sg, problems = _problems(*traced, tp)
    free = problems["free"]
    found = runs.find_runs(sg, ilp._tensor_groups(sg), set(), functools.partial(ilp._edge_cost, free),
                           functools.partial(ilp._own_cost, free))
    ops = [v for r in found for v in r.ops]
    assert len(ops) == len(set(ops)) and len(ops) > 0.3 * len(sg.nodes)  # a third of the graph or more leaves
    for name, problem in problems.items():
        reduced = ilp.solve(problem, gap=0)  # proven optima: within a gap the two may stop apart
        whole = ilp.solve(problem, eliminate=False, gap=0)
        assert (reduced.status, whole.status) == ("OPTIMAL", "OPTIMAL"), name
        assert reduced.objective_s == pytest.approx(whole.objective_s, rel=1e-9), name
        # the runs' ops were set to candidates that cost what the MIP says, recomputed from scratch
        assert evaluation.evaluate(problem, reduced).total_s == pytest.approx(reduced.objective_s, rel=1e-9), name
        assert all((v, i) not in problem.forbidden for v, i in enumerate(reduced.choice)), name


def test_a_recalled_answer_has_its_runs_set(traced, monkeypatch, tmp_path):
    """The disk cache keys the reduced MIP; a recalled answer gets its runs' ops set from its ends
    again, whatever the entry says for them (another problem may share the reduced MIP)."""
    monkeypatch.setenv("AUTOPAR_SOLVE_CACHE", "1")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    sg, problems = _problems(*traced, 2)
    problem = problems["free"]
    first = ilp.solve(problem, tie=False)  # (untied: the entry then lists a candidate per node of sg)
    found = runs.find_runs(sg, ilp._tensor_groups(sg), set(), functools.partial(ilp._edge_cost, problem),
                           functools.partial(ilp._own_cost, problem))
    inside = [v for r in found for v in r.ops if len(sg.nodes[v].candidates) > 1]
    (entry,) = (tmp_path / "mip").glob("*.json")
    stored = json.loads(entry.read_text())
    for v in inside:  # another candidate for every op inside a run
        stored["choice"][v] = (first.choice[v] + 1) % len(sg.nodes[v].candidates)
    entry.write_text(json.dumps(stored))
    ilp._SOLVED.clear()
    recalled = ilp.solve(problem, tie=False)
    assert inside and recalled.choice == first.choice
    assert evaluation.evaluate(problem, recalled).total_s == pytest.approx(first.objective_s, rel=1e-9)

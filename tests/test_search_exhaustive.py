"""The pruned search returns what the exhaustive one returns, on traced models whose search
spans expert and context parallelism as well as pp, tp, ZeRO, recompute and schedules: every
bound the search prunes with (``autopar/planner/bounds.py``) must stay below the simulated step
of every configuration it skips (tests/test_search.py checks them one by one on hand-made layers)."""

import sys
from pathlib import Path

import autopar
from autopar.planner import make
from autopar.planner.frontend import trace_pair
from autopar.planner.search import Fixed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama  # noqa: E402
import moe  # noqa: E402


def _plans(model, inputs, loss_fn, target, spec: str, monkeypatch):
    """(plan from the pruned search, plan from the exhaustive one, the two searches' stats, and
    every configuration the exhaustive search simulated, best first)."""
    cluster = autopar.cluster.parse_cluster(spec)
    pair = trace_pair(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    real, runs = make.search, []

    def exhaustive(**kw):
        keep = kw.pop("keep")
        ranked, found = real(**kw, keep=10**9)  # nothing can be pruned: every configuration is simulated
        runs.append((ranked, found))
        return ranked[:keep], found

    pruned = make.plan_graphs(*pair, cluster=cluster, fixed=Fixed.from_dict(None))
    monkeypatch.setattr(make, "search", exhaustive)
    everything = make.plan_graphs(*pair, cluster=cluster, fixed=Fixed.from_dict(None))
    ranked, full = runs[0]
    assert full["shapes_pruned"] == 0 and full["simulated"] == full["feasible"] == len(ranked)
    return pruned, everything, pruned.solver["search"], full, [c.config for c in ranked]


def _same(pruned, everything):
    assert pruned.mesh == everything.mesh and pruned.schedule == everything.schedule
    assert pruned.predicted["step_time_s"] == everything.predicted["step_time_s"]
    assert pruned.solver["candidates"] == everything.solver["candidates"]  # the runners-up too


def test_pruned_search_equals_exhaustive_with_experts(monkeypatch):
    model, inputs, loss_fn, target = moe.build(size="tiny", batch=16, n_layers=4)
    pruned, everything, cut, full, configs = _plans(model, inputs, loss_fn, target, "1x8xH100", monkeypatch)
    assert {c.ep for c in configs} >= {1, 2, 4, 8} and {c.pp for c in configs} >= {1, 2, 4}, configs[:3]
    assert cut["simulated"] < full["simulated"] / 20, (cut, full)  # the bounds did prune
    _same(pruned, everything)


def test_pruned_search_equals_exhaustive_with_context_parallelism(monkeypatch):
    model, inputs, loss_fn, target = llama.build(size="tiny", batch=8, seq=16384, device="meta")
    pruned, everything, cut, full, configs = _plans(model, inputs, loss_fn, target, "1x8xH100", monkeypatch)
    assert {c.cp for c in configs} >= {1, 2, 4} and {c.pp for c in configs} >= {1, 2}, configs[:3]
    assert cut["simulated"] < full["simulated"] / 20, (cut, full)
    _same(pruned, everything)

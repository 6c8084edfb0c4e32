"""The search prunes only what it may: the bounds it skips configurations by before cutting them
(whole layers per rank, one micro-batch's chain), checked against brute force and against every
simulated candidate of an exhaustive search on hand-made layers; and the pruned search returns
what the exhaustive one returns on traced models whose search spans expert and context
parallelism as well as pp, tp, ZeRO, recompute and schedules (tests/test_search.py checks the
other bounds one by one)."""

import sys
from dataclasses import replace
from pathlib import Path

import autopar
from autopar.cluster import parse_cluster
from autopar.planner import make
from autopar.planner import search as S
from autopar.planner.frontend import trace_pair
from autopar.planner.search import Fixed
from test_search import _search, _units  # (tests/ is on sys.path: pytest's default import mode)

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


def test_busiest_load_bound_holds_for_every_split_and_counts_whole_layers():
    """The pigeonhole bound on the busiest rank's layers is no higher than the best of all
    assignments of layers to ranks (contiguous or not), and above the average where whole
    layers do not divide evenly: 80 equal blocks on 32 ranks make 3 on one rank, not 2.5."""
    import itertools
    import random

    rng = random.Random(5)
    for _ in range(60):
        n, ranks = rng.randint(1, 7), rng.randint(1, 4)
        loads = sorted((rng.choice((1.0, rng.uniform(0.1, 3.0))) for _ in range(n)), reverse=True)
        best = min(max(sum(x for x, r in zip(loads, owners) if r == k) for k in range(ranks))
                   for owners in itertools.product(range(ranks), repeat=n))
        assert S._busiest_load_s(loads, ranks) <= best * (1 + 1e-12), (loads, ranks)
    assert S._busiest_load_s([1.0] * 80, 32) == 3.0
    assert S._busiest_load_s([1.0] * 80, 16) == 5.0
    assert S._busiest_load_s([4.0, 1.0, 1.0], 2) == 4.0  # one layer can outweigh the average


def test_configuration_bound_counts_whole_layers_and_one_micro_batchs_chain():
    """Before its cuts exist, a configuration's bound counts the busiest rank's whole layers and
    the chain of one micro-batch's F through every stage and B back (few micro-batches, deep
    pipelines): below every simulated step, for uneven layers too, and sharper than the average
    alone on many configurations."""
    import random

    rng = random.Random(7)
    cluster = parse_cluster("2x8xH100")
    units = [replace(u, f_s=u.f_s * rng.uniform(0.3, 2.0)) for u in _units(10)]
    ranked, _ = _search(units, cluster=cluster, batch=16, keep=10**9, tp=(2,))
    sharper = 0
    for c in ranked:
        cfg = c.config
        scaled = [replace(u, f_s=u.f_s * cfg.microbatch_size / cfg.tp, b_s=u.b_s * cfg.microbatch_size / cfg.tp,
                          w_s=u.w_s * cfg.microbatch_size / cfg.tp, n_params=u.n_params / cfg.tp) for u in units]
        link = cluster.link_for_group(cfg.dp, stride=cfg.tp)
        args = dict(zero=cfg.zero, m=cfg.microbatches, pp=cfg.pp, dp=cfg.dp, link=link, precision="mixed",
                    cluster=cluster, dp_comm_s=S._dp_comm_prefix(scaled, zero=cfg.zero, dp=cfg.dp, link=link,
                                                                 microbatches=cfg.microbatches,
                                                                 precision="mixed")[-1],
                    virtual_stages=cfg.virtual_stages)
        work, n_params = S._work_s(scaled, cfg.recompute), sum(u.n_params for u in scaled)
        old = S._config_bound_s(work, n_params, **args)
        new = S._config_bound_s(work, n_params, **args, chain_s=S._chain_s(scaled, cfg.recompute),
                                load_s=S._busiest_load_s(S._unit_loads(scaled, cfg.recompute), cfg.pp))
        assert old <= new <= c.step_time_s * (1 + 1e-12), (cfg, new, c.step_time_s)
        sharper += new > old * 1.05
    assert sharper > 100, sharper

"""Other programs' token exchanges under ep, priced for comparison with runs made with them
(``fixed={"ep_dispatch": ...}``): Megatron-LM's all-to-all dispatcher and DeepEP's normal
kernels, in closed form and in plans; autopar's runtime refuses such a plan."""

import itertools
import math
import sys
from pathlib import Path

import pytest

import autopar
from autopar.cluster import parse_cluster
from autopar.cost.expert_comm import _hit_fraction, deepep_bytes, deepep_s, expert_all_to_all_bytes
from autopar.runtime.expert import check_dispatch_runnable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import moe  # noqa: E402


def test_megatron_keeps_the_dispatched_rows_for_the_backward():
    fwd, bwd = expert_all_to_all_bytes(rows=64, width=32, elem_bytes=4, n_experts=8, program="megatron")
    assert fwd == (64, 8192, 8192) and bwd == (8192, 8192)  # no counts, no second dispatch of the input
    assert expert_all_to_all_bytes(rows=64, width=32, elem_bytes=4, n_experts=8)[1] == (64, 16384, 8192)


@pytest.mark.parametrize("n_experts, groups, top_k", [(8, 4, 2), (16, 8, 3), (12, 3, 4), (8, 8, 1), (8, 2, 7)])
def test_hit_fraction_counts_the_expert_sets_that_meet_a_group(n_experts, groups, top_k):
    """The hypergeometric closed form against every top-k set of experts, enumerated."""
    per = n_experts // groups
    sets = list(itertools.combinations(range(n_experts), top_k))
    meeting = sum(any(e < per for e in chosen) for chosen in sets)  # group 0: experts 0 .. per - 1
    assert _hit_fraction(n_experts, groups, top_k) == pytest.approx(meeting / len(sets), rel=1e-12)


def test_deepep_sends_a_token_once_per_rank_and_once_per_node():
    row = 4096 * 2
    # one node of 8 ranks, 128 experts, top-8: a token meets 8 x (1 - C(112, 8) / C(128, 8)) ranks
    nvl, rdma = deepep_bytes(rows=8 * 1024, top_k=8, width=4096, elem_bytes=2, n_experts=128, ep=8,
                             ranks_per_node=8)
    ranks = 8 * (1 - math.comb(112, 8) / math.comb(128, 8))
    assert rdma == 0 and nvl == pytest.approx(1024 * row * ranks * 7 / 8)
    assert 5.2 < ranks < 5.4  # against 8 copies per token in an all-to-all of the rows
    # four nodes (ep 32): once per other node over RDMA, then on to the node's other ranks
    nvl, rdma = deepep_bytes(rows=8 * 1024, top_k=8, width=4096, elem_bytes=2, n_experts=128, ep=32,
                             ranks_per_node=8)
    nodes = 4 * (1 - math.comb(96, 8) / math.comb(128, 8))
    assert rdma == pytest.approx(1024 * row * nodes * 3 / 4)
    assert nvl == pytest.approx(1024 * row * 32 * (1 - math.comb(124, 8) / math.comb(128, 8)) * 7 / 8)
    # time: the slower of the two links, dispatch and combine each way
    device = parse_cluster("4x8xH100").device
    f, b = deepep_s(rows=8 * 1024, top_k=8, width=4096, elem_bytes=2, n_experts=128, ep=32, ranks_per_node=8,
                    device=device)
    one = max(nvl / device.intra_node_bytes_per_s, rdma / device.inter_node_bytes_per_s) + device.inter_node_latency_s
    assert f == b == pytest.approx(2 * one)


@pytest.fixture(scope="module")
def moe_pair():
    from autopar.planner.frontend import trace_pair

    model, inputs, loss_fn, target = moe.build(size="tiny", batch=8)
    return trace_pair(model, inputs, cluster=parse_cluster("2x4xH100"), loss_fn=loss_fn, example_target=target)


def _plan(pair, fixed):
    from autopar.planner.make import plan_graphs
    from autopar.planner.search import Fixed

    return plan_graphs(*pair, cluster=parse_cluster("2x4xH100"), fixed=Fixed.from_dict(fixed))


def test_plans_price_each_program(moe_pair):
    """The same pinned plan under each program: Megatron's backward moves a third less than
    autopar's, DeepEP sends a token once per node and rank holding its experts; the experts
    record names the program and its bytes, and the step time orders the same way."""
    pinned = {"tp": 1, "pp": 1, "dp": 8, "ep": 8, "microbatches": 1, "recompute": "none", "zero": 0}
    plans = {d: _plan(moe_pair, {**pinned, "ep_dispatch": d}) for d in ("autopar", "megatron", "deepep")}
    layer = {d: next(iter(p.experts["layers"].values()))["all_to_all_bytes"] for d, p in plans.items()}
    counts, s, _ = layer["autopar"]["forward"]  # per-expert counts (8 int64), then the rows (tokens x top-2)
    assert counts == 8 * 8 and s == 16 * 2 * 32 * 4  # one rank's 16-token sequence x top-2 rows of 32, fp32
    assert layer["megatron"] == {"forward": [counts, s, s], "backward": [s, s]}
    assert layer["autopar"]["backward"] == [counts, 2 * s, s]
    # DeepEP on 2 nodes of 4: each token once per other node holding one of its 2 experts (RDMA),
    # then on to that node's ranks holding them (NVLink); the record sums the two links
    nvl, rdma = deepep_bytes(rows=32, top_k=2, width=32, elem_bytes=4, n_experts=8, ep=8, ranks_per_node=4)
    assert rdma == pytest.approx(16 * 32 * 4 * 2 * (1 - 6 / 28) / 2)  # tokens x row x nodes hit x 1/2 remote
    assert layer["deepep"] == {"forward": [nvl + rdma] * 2, "backward": [nvl + rdma] * 2}
    assert rdma < s / 2  # against the all-to-all's rows bound for the other node
    assert plans["deepep"].experts["dispatch"] == "deepep" and "dispatch" not in plans["autopar"].experts
    steps = {d: p.predicted["step_time_s"] for d, p in plans.items()}
    assert steps["deepep"] < steps["megatron"] < steps["autopar"]
    assert plans["megatron"].fixed["ep_dispatch"] == "megatron"
    assert "priced as DeepEP's normal kernels, which autopar does not run" in plans["deepep"].summary()
    assert "priced as" not in plans["autopar"].summary()


def test_bad_values_and_running_are_refused():
    with pytest.raises(autopar.PlanError, match=r"ep_dispatch='nccl' is not one of autopar, megatron, deepep"):
        autopar.planner.search.Fixed.from_dict({"ep_dispatch": "nccl"})
    with pytest.raises(autopar.PlanError, match=r"ep_dispatch='deepep' prices another program's token exchange"):
        check_dispatch_runnable("deepep")
    check_dispatch_runnable(None)
    check_dispatch_runnable("autopar")

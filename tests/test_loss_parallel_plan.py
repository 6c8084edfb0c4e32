"""Planning with loss parallelism (autopar.passes.loss_parallel) and the per-rank share of the
values full recompute keeps: what each is offered, how it is priced, what it changes.

The runtime half (each op against ATen, and whole models training equal) is in
tests/dist/test_loss_parallel.py and tests/dist/test_parallel.py."""

import sys
from pathlib import Path

import pytest

import autopar
from autopar.cluster import parse_cluster
from autopar.cost import comm
from autopar.cost.compute import kernel_time_s
from autopar.passes.strategies import build_strategy_graph
from autopar.planner.cuts import CutTable
from autopar.planner.frontend import trace_pair
from autopar.planner.ilp import build_problem, node_cost_s
from autopar.planner.make import _solve_all

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama  # noqa: E402

H100 = parse_cluster("1x8xH100")


@pytest.fixture(scope="module")
def traced():
    model, inputs, loss_fn, target = llama.build(size="tiny", batch=8, device="meta")
    return trace_pair(model, inputs, cluster=H100, loss_fn=loss_fn, example_target=target)


def test_each_loss_op_is_offered_its_classes_split_and_priced_with_its_all_reduces(traced):
    gm, gm2 = traced
    sg = build_strategy_graph(gm, axis_size=4, gm_double=gm2, shard_batch=False)
    problem = build_problem(sg, batch=8, device=H100.device, link=H100.link_for_group(4, stride=1))
    split = {"_log_softmax": (0, 2), "nll_loss_forward": (0, 1), "nll_loss_backward": (1, 0),
             "_log_softmax_backward_data": (0, 1)}  # op -> (its class input, all-reduces inside)
    seen = set()
    tokens = next(n for n in sg.nodes if n.name == "_log_softmax").shape[0]  # (tokens, vocab) at batch 8
    for v, node in enumerate(sg.nodes):
        if node.name not in split:
            continue
        seen.add(node.name)
        at, reduces = split[node.name]
        lp = [s for s in node.candidates if s.reduces or s.ins[at] == "S1"]
        assert len(lp) == 1 and lp[0].ins[at] == "S1" and lp[0].reduces == reduces, node.candidates
        whole = next(s for s in node.candidates if set(s.ins) == {"R"})
        assert node.rows(8) == tokens
        inner = reduces * comm.all_reduce_s(4 * tokens, 4, problem.link)
        # a quarter of the work, plus one fp32 value per token all-reduced per reduction
        quarter = kernel_time_s(kind=node.kernel, flops=node.flops(8) / 4, bytes_moved=node.bytes_moved(8) / 4,
                                device=H100.device, dtype=node.dtype)
        assert node_cost_s(problem, v, lp[0]) == pytest.approx(quarter + inner)
        assert quarter < node_cost_s(problem, v, whole)
        assert (inner > 0) == (reduces > 0)
    assert seen == set(split)


def test_tensor_parallel_plans_shard_the_loss_and_its_logits():
    """Llama 8B's shape (vocabulary 128,256; two blocks) at tp 8: the loss runs on vocabulary
    shards behind a column-parallel head. (The tiny example's
    256 classes stay whole: its two all-reduces' latency is more than a quarter of the work.)"""
    model, inputs, loss_fn, target = llama.build(size="8b", batch=8, seq=2048, n_layers=2, device="meta")
    plan = autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                        fixed={"tp": 8, "dp": 1, "pp": 1})
    loss = {name: op for name, op in plan.ops.items() if op["layer"] == "<loss>"}
    assert loss["_log_softmax"]["in"] == ["S1"] and loss["nll_loss_backward"]["out"] == ["S1"]
    assert plan.layers["output"]["params"]["output.weight"] == "S0"  # column-parallel head: vocab shards


def test_full_recompute_keeps_each_ranks_share_of_a_block_output(traced):
    """What full recompute keeps of a block is its output, as this rank holds it: 1/tp when the
    sharding splits the residual stream (Llama 8B's shape at tp 8: split on both sides of the sp
    decision), all of it when it is replicated (the tiny example at tp 2 without sp)."""
    gm, gm2 = traced
    solved = _solve_all(gm, gm2, [2], False, batch=8, cluster=H100)
    sg, sol = solved[2, False]
    assert CutTable(gm).forward_share("layers.0", sg, sol.choice, 8) == 1.0
    model, inputs, loss_fn, target = llama.build(size="8b", batch=8, seq=2048, n_layers=2, device="meta")
    gm, gm2 = trace_pair(model, inputs, cluster=H100, loss_fn=loss_fn, example_target=target)
    cuts = CutTable(gm)
    for (tp, sp), (sg, sol) in _solve_all(gm, gm2, [8], None, batch=8, cluster=H100).items():
        assert cuts.forward_share("layers.0", sg, sol.choice, 8) == 1 / 8, sp

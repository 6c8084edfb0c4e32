"""Planning with loss parallelism (autopar.passes.loss_parallel), the per-rank share of the
values full recompute keeps, and what a pipeline cut sends per rank: what each is offered,
how it is priced, what it changes.

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
    sg, sol = solved[2, False, False]
    assert CutTable(gm).forward_share("layers.0", sg, sol.choice, 8) == 1.0
    model, inputs, loss_fn, target = llama.build(size="8b", batch=8, seq=2048, n_layers=2, device="meta")
    gm, gm2 = trace_pair(model, inputs, cluster=H100, loss_fn=loss_fn, example_target=target)
    cuts = CutTable(gm)
    for (tp, sp, _), (sg, sol) in _solve_all(gm, gm2, [8], None, batch=8, cluster=H100).items():
        assert cuts.forward_share("layers.0", sg, sol.choice, 8) == 1 / 8, sp


def test_a_replicated_cut_value_is_priced_whole_or_as_tp_pieces(traced):
    """Megatron-LM's scatter/gather of pipeline tensors, priced: at tp 2 without sp the tiny
    block's output and the rotary tables are replicated on tp, so a message can carry half of
    each (``ceil(numel / 2)`` elements) for the receiving tp group to all-gather. The planner
    takes the faster way per message: whole on NVLink (the gather's latency costs more than
    the bytes saved), as halves plus the gather over a slow network. With the residual
    stream split over tp (Llama 8B's shape) only the tables can go as pieces."""
    from autopar.planner.search import StagePlan
    from autopar.planner.timing import cut_sends

    gm, gm2 = traced
    (sg, sol), = _solve_all(gm, gm2, [2], False, batch=8, cluster=H100).values()
    table = CutTable(gm)
    crossings, placed_as = table.crossings("layers.0")
    placed = table.placed(crossings, placed_as, sg, sol.choice, 8)
    forward = [p for c, p in zip(crossings, placed) if c.side == "forward"]
    assert len(forward) == 3 and {p[1] for p in forward} == {"R"}  # the block output, the two tables
    assert all(rank == whole for whole, _, rank in forward)  # each rank holds them whole
    msgs = table.messages(crossings, placed_as, sg, sol.choice, 8)
    (dtype, whole, pieces, gathered), = msgs.forward
    assert dtype == "bfloat16" and whole == sum(p[0] for p in forward)
    assert pieces * 2 == whole and gathered == whole  # (even sizes here)
    stage = StagePlan(layers=("layers.0",), f_s=0, b_s=0, w_s=0, comm_s=0, inflight=1, params_bytes=0,
                      grads_bytes=0, optimizer_bytes=0, activations_bytes=0, grad_sync_s=0, optimizer_s=0,
                      send_messages=msgs.forward, back_messages=msgs.backward)
    tp_link = H100.link_for_group(2, stride=1)
    slow = comm.Link(bytes_per_s=1e6, latency_s=5e-6)
    ((fast_fwd, _),), ((slow_fwd, _),) = (cut_sends([stage], [link], tp=2, tp_link=tp_link)
                                          for link in (tp_link, slow))
    assert fast_fwd[0] == ("bfloat16", whole, 0.0, comm.p2p_s(whole, tp_link))
    assert slow_fwd[0] == ("bfloat16", pieces, gathered,
                           comm.p2p_s(pieces, slow) + comm.all_gather_s(gathered, 2, tp_link))

    model, inputs, loss_fn, target = llama.build(size="8b", batch=8, seq=2048, n_layers=2, device="meta")
    gm, gm2 = trace_pair(model, inputs, cluster=H100, loss_fn=loss_fn, example_target=target)
    table = CutTable(gm)
    (sg, sol), = _solve_all(gm, gm2, [8], False, batch=8, cluster=H100).values()
    crossings, placed_as = table.crossings("layers.0")
    placed = table.placed(crossings, placed_as, sg, sol.choice, 8)
    forward = [p for c, p in zip(crossings, placed) if c.side == "forward"]
    tables = [p for p in forward if p[1] == "R"]
    split = [p for p in forward if p[1].startswith("S")]
    assert len(tables) == 2 and len(split) == 1 and split[0][2] * 8 == split[0][0]
    (_, whole, pieces, gathered), = table.messages(crossings, placed_as, sg, sol.choice, 8).forward
    assert whole == split[0][2] + sum(t[0] for t in tables)
    assert pieces == split[0][2] + sum(t[0] // 8 for t in tables) and gathered == sum(t[0] for t in tables)

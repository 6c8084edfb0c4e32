"""Cost-model physics of how the programs run: the local copy of a collective along a tensor dim
other than 0 (autopar.planner.ilp.reshard_s), and torchtitan's op-level selective checkpointing
("sac": selective recompute plus every second matmul of a layer), pinned, and chosen by the search
for plans without a pipeline."""

import sys
from pathlib import Path

import pytest

import autopar
from autopar.errors import PlanError
from autopar.cluster import parse_cluster
from autopar.cost import comm
from autopar.cost.compute import MEMORY_EFFICIENCY
from autopar.passes.strategies import build_strategy_graph
from autopar.planner.evaluation import evaluate
from autopar.planner.fixed import RECOMPUTE, Fixed
from autopar.planner.frontend import trace_pair
from autopar.planner.ilp import build_problem, node_cost_s, reshard_s, solve
from autopar.planner.infeasible import MEMORY_RESERVE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama  # noqa: E402

H100 = parse_cluster("1x8xH100")


def test_collectives_along_a_later_dim_pay_one_copy_of_the_tensor():
    link = H100.link_for_group(8, stride=1)
    assert link.copy_bytes_per_s == pytest.approx(H100.device.hbm_bytes_per_s * MEMORY_EFFICIENCY)
    nbytes = 64 * 2**20
    copy = 2 * nbytes / link.copy_bytes_per_s  # read and write the whole tensor once
    flat = comm.all_gather_s(nbytes, 8, link) + link.latency_s
    assert reshard_s("S0", "R", nbytes, 8, link) == (pytest.approx(flat), "all_gather")  # NCCL's own layout
    assert reshard_s("S1", "R", nbytes, 8, link)[0] == pytest.approx(flat + copy)  # torch.cat of the chunks
    scatter = comm.reduce_scatter_s(nbytes, 8, link) + link.latency_s
    assert reshard_s("P", "S0", nbytes, 8, link)[0] == pytest.approx(scatter)
    assert reshard_s("P", "S1", nbytes, 8, link)[0] == pytest.approx(scatter + copy)  # chunks made contiguous
    assert reshard_s("P", "R", nbytes, 8, link)[0] == pytest.approx(comm.all_reduce_s(nbytes, 8, link)
                                                                     + link.latency_s)  # in place: no copy
    a2a = comm.all_to_all_s(nbytes / 8, 8, link) + link.latency_s
    assert reshard_s("S1", "S2", nbytes, 8, link)[0] == pytest.approx(a2a + 2 * copy / 8)  # both sides, 1/8 each
    assert reshard_s("S0", "S1", nbytes, 8, link)[0] == pytest.approx(a2a + copy / 8)
    # gloo CPU groups keep their plain alpha-beta figures
    assert parse_cluster("1x2xcpu").link_for_group(2, stride=1).copy_bytes_per_s == 0.0


@pytest.fixture(scope="module")
def llama_tp2():
    model, inputs, loss_fn, target = llama.build(size="small", batch=8, device="meta")
    gm, gm2 = trace_pair(model, inputs, cluster=H100, loss_fn=loss_fn, example_target=target)
    sg = build_strategy_graph(gm, axis_size=2, gm_double=gm2, shard_batch=False)
    problem = build_problem(sg, batch=8, device=H100.device, link=H100.link_for_group(2, stride=1))
    return sg, problem, solve(problem)


def test_sac_recomputes_every_second_matmul_of_a_block(llama_tp2):
    """A Llama block's forward matmuls in order are wq, wk, wv, wo, w1, w3, w2: op-level SAC
    recomputes the 2nd, 4th and 6th (wk, wo, w3), as torchtitan's policy does."""
    sg, problem, sol = llama_tp2
    layer = "layers.1"
    gemms = [(v, n) for v, n in enumerate(sg.nodes) if n.layer == layer and n.phase == "F" and n.kernel == "gemm"]
    assert len(gemms) == 7
    widths = [n.shape[-1] for _, n in gemms]  # output features: dim, kv dim, kv dim, dim, ffn, ffn, dim
    cfg = llama.SIZES["small"]
    kv = cfg.dim // cfg.n_heads * cfg.n_kv_heads
    assert widths[:4] == [cfg.dim, kv, kv, cfg.dim] and widths[4] == widths[5] and widths[6] == cfg.dim
    cost = evaluate(problem, sol).layers[layer]
    second = [gemms[i][0] for i in (1, 3, 5)]
    assert cost.sac_forward_s == pytest.approx(sum(node_cost_s(problem, v, sg.nodes[v].candidates[sol.choice[v]])
                                                   for v in second))
    assert 0 < cost.sac_activation_bytes < cost.activation_bytes - cost.cheap_activation_bytes


PINNED = {"tp": 1, "pp": 1, "dp": 8, "zero": 3, "microbatches": 1}


@pytest.fixture(scope="module")
def small_llama():
    return llama.build(size="small", batch=8, device="meta")


@pytest.fixture(scope="module")
def pinned_plans(small_llama):
    model, inputs, loss_fn, target = small_llama
    return {r: autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                            fixed={**PINNED, "recompute": r})
            for r in ("none", "selective", "sac", "full")}


def test_sac_is_priced_between_selective_and_full(pinned_plans):
    plans = {r: pinned_plans[r] for r in ("selective", "sac", "full")}
    step = {r: p.predicted["step_time_s"] for r, p in plans.items()}
    acts = {r: p.stages[0]["predicted"]["memory_bytes"]["activations"] for r, p in plans.items()}
    assert step["selective"] < step["sac"] < step["full"]  # it recomputes more than selective, less than full
    assert acts["sac"] < acts["selective"]  # and keeps less (full keeps a block's input per block, plus
    # one block's working set while it recomputes: on 4 small blocks that is more than either)
    assert plans["sac"].recompute == "sac"
    assert "activation recompute: sac (FLOP-free ops and every second matmul of a layer" in plans["sac"].summary()
    # hardware FLOPs count what is recomputed: sac's wk, wo and w3 forwards (2 T d (kv + d + ffn)
    # per block at T = 8 x 64 tokens), full's whole forward; selective's FLOP-free ops add none
    hw = {r: p.predicted["hardware_flops_per_step"] for r, p in plans.items()}
    model_flops = plans["sac"].predicted["model_flops_per_step"]
    cfg = llama.SIZES["small"]
    kv = cfg.dim // cfg.n_heads * cfg.n_kv_heads
    ffn = cfg.ffn_hidden
    assert hw["selective"] == model_flops < hw["sac"] < hw["full"]
    assert hw["sac"] - model_flops == pytest.approx(2 * 8 * 64 * cfg.dim * (kv + cfg.dim + ffn) * cfg.n_layers)
    assert Fixed.from_dict({"recompute": "sac"}).recompute == "sac"
    with pytest.raises(PlanError, match="recompute='some'"):
        Fixed.from_dict({"recompute": "some"})


def test_whole_layer_recompute_holds_a_layers_activations_again(small_llama, pinned_plans):
    """autopar's runtime makes each dropped op again right before its first backward reader, and
    the plan counts those copies by their liveness; ``make_plan(whole_layer_recompute=True)``
    prices programs that make a layer's dropped values again all at once (torch checkpoint,
    Megatron-LM): the running layer holds all its activations, full recompute keeps each layer's
    input, and the step time is the same."""
    from autopar.planner.make import make_plan

    model, inputs, loss_fn, target = small_llama
    for r in ("selective", "full"):
        ours = pinned_plans[r]
        theirs = make_plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                           fixed={**PINNED, "recompute": r}, whole_layer_recompute=True)
        acts = [p.stages[0]["predicted"]["memory_bytes"]["activations"] for p in (ours, theirs)]
        assert acts[0] < acts[1] < pinned_plans["none"].stages[0]["predicted"]["memory_bytes"]["activations"], r
        assert theirs.predicted["step_time_s"] == ours.predicted["step_time_s"], r


def test_the_search_chooses_sac_where_selective_does_not_fit(small_llama, pinned_plans):
    """On a device whose memory holds the plan under sac but not under selective, the search picks
    sac: full fits too, but recomputes the whole forward (slower). With memory for selective, it
    picks selective (sac recomputes matmuls selective keeps)."""
    model, inputs, loss_fn, target = small_llama
    need = {r: p.predicted["peak_memory_bytes"] for r, p in pinned_plans.items()}
    step = {r: p.predicted["step_time_s"] for r, p in pinned_plans.items()}
    assert need["none"] > need["selective"] > need["sac"] > need["full"]
    assert step["none"] < step["selective"] < step["sac"] < step["full"]
    chosen = {}
    for between in (("selective", "sac"), ("none", "selective")):
        room = (need[between[0]] + need[between[1]]) / 2  # more than the second needs, less than the first
        cluster = H100.with_overrides(hbm_bytes=round(room / (1 - MEMORY_RESERVE)))
        plan = autopar.plan(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target, fixed=PINNED)
        chosen[between[1]] = plan.recompute
        assert plan.predicted["step_time_s"] == step[plan.recompute]
    assert chosen == {"sac": "sac", "selective": "selective"}
    assert RECOMPUTE == ("none", "selective", "sac", "full")  # (the order the search breaks ties in)


@pytest.mark.parametrize("tp", [1, 2])
def test_recompute_keeps_what_the_dropped_ops_are_recomputed_from(tp):
    """A Llama 8B-shaped block (wq, wk, wv, wo, w1, w3, w2; T tokens, d 4096, kv 1024, ffn 14336,
    bf16) keeps, per torchtitan's op-level SAC, the outputs of wq, wv, w1 and w2, attention's
    output and log-sum-exp, and the block's input; and under selective recompute the saved
    outputs of attention, w1 and w3, plus the block input and the wq, wk, wv, wo outputs that the
    dropped norms and rotary embeddings are recomputed from. Checked as bytes per device; each
    is more than counting only the saved outputs a policy does not drop (0.44 and 0.47 GB of a
    1.04 and 1.55 GB block at 2 x 8192 tokens). The head keeps the logits under SAC; the loss,
    which reads them, does not count them again. The head keeps the final norm's output.
    autopar's runtime, which drops the same ops, keeps what the backward reads: not w2's output."""
    batch, seq = 1, 1024
    model, inputs, loss_fn, target = llama.build(size="8b", batch=batch, seq=seq, n_layers=2, device="meta")
    gm, gm2 = trace_pair(model, inputs, cluster=H100, loss_fn=loss_fn, example_target=target)
    sg = build_strategy_graph(gm, axis_size=tp, gm_double=gm2, shard_batch=False)
    problem = build_problem(sg, batch=batch, device=H100.device, link=H100.link_for_group(tp, stride=1))
    sol = solve(problem)
    cost = evaluate(problem, sol).layers
    block = cost["layers.1"]
    selective = block.activation_bytes - block.cheap_activation_bytes
    sac = selective - block.torch_sac_activation_bytes
    ours = selective - block.sac_activation_bytes
    t, d, kv, ffn, heads = batch * seq, 4096, 1024, 14336, 32

    gemms = [(v, n) for v, n in enumerate(sg.nodes) if n.layer == "layers.1" and n.phase == "F" and n.kernel == "gemm"]
    attention = [(v, n) for v, n in enumerate(sg.nodes) if n.layer == "layers.1" and n.phase == "F"
                 and n.kernel == "causal_attention"]
    assert [n.shape[-1] for _, n in gemms] == [d, kv, kv, d, ffn, ffn, d] and len(attention) == 1

    def share(v, o=0):  # this device's bytes of a value under the MIP's choice
        placement = sg.nodes[v].candidates[sol.choice[v]].outs[o]
        whole = sg.nodes[v].out_bytes[o](batch)
        return whole / tp if placement.startswith("S") else whole

    att_v = attention[0][0]
    att = share(att_v, 0) + share(att_v, 1)  # output and log-sum-exp
    assert sg.nodes[att_v].out_bytes[1](batch) == batch * heads * seq * 4
    mm = [share(v) for v, _ in gemms]
    block_in = [e for e in sg.edges if not e.virtual and sg.nodes[e.dst].layer == "layers.1"
                and sg.nodes[e.src].layer == "layers.0" and sg.nodes[e.src].kind == "op"]
    x = {(e.src, e.src_out) for e in block_in}
    assert len(x) == 1 and sg.nodes[block_in[0].src].out_bytes[0](batch) == t * d * 2
    x_local = share(*next(iter(x)))
    assert sac == pytest.approx(x_local + mm[0] + mm[2] + mm[4] + mm[6] + att)
    assert ours == pytest.approx(sac - mm[6])
    assert selective == pytest.approx(att + mm[4] + mm[5] + x_local + mm[0] + mm[1] + mm[2] + mm[3])
    if tp == 1:
        assert sac == 2 * t * (d + d + kv + ffn + d + d) + t * heads * 4
    head = cost["output"]
    assert head.activation_bytes - head.cheap_activation_bytes - head.torch_sac_activation_bytes >= t * 128256 * 2 / tp
    # and, under both, the final norm's output (replicated here), which the head's weight gradient reads: the
    # recompute pass makes copies for the norm's own backward only, so the head reads the original
    assert head.activation_bytes - head.cheap_activation_bytes == t * d * 2
    loss = cost["<loss>"]
    assert loss.activation_bytes - loss.cheap_activation_bytes - loss.torch_sac_activation_bytes == 0
    assert loss.sac_activation_bytes == 0  # (autopar's runtime keeps the log-softmax output, as selective)


def test_moe_recompute_makes_the_moe_layers_forward_again_collectives_included():
    """"moe" makes again in the backward the forward ops of each MoE layer with FLOPs (router,
    experts) and the tp collectives into any of its ops (the runtime's copies redo them, as under
    "full"); not attention's, not the norms' (those are selective's FLOP-free ops): the MoE example
    (Mixtral's shapes, two blocks) at tp = 2, its MoE layer's forward time and the collectives into
    it summed here op by op."""
    import moe

    from autopar.planner.recompute_keep import moe_recomputed_ops

    batch = 8
    model, inputs, loss_fn, target = moe.build(size="8x7b", batch=batch, seq=1024, n_layers=2, device="meta")
    gm, gm2 = trace_pair(model, inputs, cluster=H100, loss_fn=loss_fn, example_target=target)
    sg = build_strategy_graph(gm, axis_size=2, gm_double=gm2, shard_batch=False)
    problem = build_problem(sg, batch=batch, device=H100.device, link=H100.link_for_group(2, stride=1))
    sol = solve(problem)
    ops = moe_recomputed_ops(sg)
    assert ops and all(sg.nodes[v].module.rsplit(".", 1)[-1] in ("moe", "router") for v in ops)
    layer = sg.nodes[min(ops)].layer
    compute = sum(node_cost_s(problem, v, sg.nodes[v].candidates[sol.choice[v]]) for v in ops
                  if sg.nodes[v].layer == layer and sg.nodes[v].flops(batch) > 0)
    moved = 0.0
    for e in sg.edges:
        if e.virtual or e.dst not in ops or sg.nodes[e.dst].layer != layer:
            continue
        src, dst = sg.nodes[e.src], sg.nodes[e.dst]
        p, q = src.candidates[sol.choice[e.src]].outs[e.src_out], dst.candidates[sol.choice[e.dst]].ins[e.dst_in]
        moved += reshard_s(p, q, src.out_bytes[e.src_out](batch), 2, problem.link)[0] * e.weight / dst.weight
    cost = evaluate(problem, sol).layers[layer]
    assert compute > 0 and moved > 0, (compute, moved)
    assert cost.moe_forward_s == pytest.approx(compute + moved, rel=1e-6), (cost.moe_forward_s, compute, moved)

"""Expert parallelism folded over tp and dp (``fixed={"etp": 1}``, Megatron-LM's expert tensor
parallel size 1): the folded strategy graph, the plan it gives, and the values it refuses."""

import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.cluster import parse_cluster
from autopar.cost.expert_comm import expert_all_to_all_bytes
from autopar.passes import meta_keys as mk
from autopar.plan import Plan
from autopar.planner import make
from autopar.planner.experts import find_experts
from autopar.planner.frontend import trace_pair
from autopar.planner.ilp import _edge_link, build_problem, reshard_s

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import mlp  # noqa: E402
import moe  # noqa: E402


def _moe(shared_expert="0"):
    return moe.build(size="tiny", shared_expert=shared_expert)


def _qwen3_moe():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], use_cache=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    ids = torch.randint(0, 128, (4, 32))
    return model, {"input_ids": ids, "labels": ids}, None, None


def _plan(build, cluster, fixed, **kwargs):
    model, inputs, loss_fn, target = build()
    return autopar.plan(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target, fixed=fixed,
                        **kwargs)


@pytest.mark.parametrize("build, block, balance", [
    (_moe, ".moe", False), (_qwen3_moe, ".mlp", False), (lambda: _moe("1"), ".moe", False),
    (lambda: moe.build(size="tiny", shared_expert="0", aux_loss="0.01"), ".moe", True)],
    ids=["examples-moe", "hf-qwen3-moe", "with-shared-expert", "with-balance-loss"])
def test_a_folded_block_exchanges_nothing_over_tp_under_sp(build, block, balance):
    """With sequence parallelism the folded block's ops run on the tp rank's own tokens, so no
    token tensor entering, inside or leaving the block is resharded over tp; what is exchanged is
    the router weight's gradient, a sum of the tp ranks' token shares, all-reduced on its way
    back, and with a balance loss its per-sequence statistics (batch x experts), summed over the
    tp ranks' shares of each sequence before they are multiplied (as Megatron-LM all-reduces them).
    Unfolded, the same block gathers its tokens over tp. A shared expert stays tensor-parallel
    (Megatron-LM's layout): what it exchanges is outside the folded block."""
    model, inputs, loss_fn, target = build()
    cluster = parse_cluster("1x4xcpu")
    gm, gm2 = trace_pair(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target,
                         param_dtype=torch.float32)
    sites = find_experts(gm)
    paths = {n.name: n.meta[mk.TRACE].module_path for n in gm.graph.nodes if mk.TRACE in n.meta}

    def in_block(name):  # the block module or a module under it, not its shared expert
        path = paths.get(name, "") + "."
        return block + "." in path and ".shared" not in path

    def exchanges(fold):
        sg, sol = make._solve_all(gm, gm2, [2], True, batch=4, cluster=cluster, experts=sites,
                                  folds=(bool(fold),))[2, True, bool(fold)]
        problem = build_problem(sg, batch=2, device=cluster.device, link=cluster.link_for_group(2, stride=1))
        folded = {v for v, n in enumerate(sg.nodes) if n.kind == "op" and len(n.candidates) == 1
                  and in_block(n.name)} if fold else set()
        out = []
        for e in sg.edges:
            p = sg.nodes[e.src].candidates[sol.choice[e.src]].outs[e.src_out]
            q = sg.nodes[e.dst].candidates[sol.choice[e.dst]].ins[e.dst_in]
            t, kind = reshard_s(p, q, sg.nodes[e.src].out_bytes[e.src_out](2), 2,
                                _edge_link(problem, sg.nodes[e.dst].kind))
            if t and (in_block(sg.nodes[e.dst].name) or e.src in folded):
                out.append((sg.nodes[e.src].shape, sg.nodes[e.dst].name, sg.nodes[e.dst].kind, kind))
        return out, sg, folded

    folded_out, sg, folded = exchanges(sites)
    assert folded  # (the block's ops are the folded ones)
    statistics = [(shape, k) for shape, _, kind_dst, k in folded_out if kind_dst != "param"]
    assert all(s == ((sg.global_batch, sites[0].n_experts), "all_reduce") for s in statistics)
    assert bool(statistics) == balance
    router = {n.name for n in gm.graph.nodes if mk.TRACE in n.meta and n.meta[mk.TRACE].role is mk.Role.PARAM
              and ("router" in n.meta[mk.TRACE].fqn or ".gate." in n.meta[mk.TRACE].fqn + ".")}
    assert {(dst, kind) for _, dst, kind_dst, kind in folded_out if kind_dst == "param"} == \
        {(r, "all_reduce") for r in router}
    experts_op = next(v for v, n in enumerate(sg.nodes) if n.name.startswith("moe_experts"))
    (only,) = sg.nodes[experts_op].candidates  # rows and weights split: the rank's tokens, E / tp experts
    assert only.ins[0] == "S0" and only.outs[0] == "S0" and set(only.ins[2:]) == {"S0"}
    expert_params = {p for s in sites for p in s.params}
    assert all(n.candidates[0].outs == ("S0",) and len(n.candidates) == 1
               for n in sg.nodes if n.kind == "param" and n.fqn in expert_params)
    unfolded, _, _ = exchanges([])
    assert any(k == "all_gather" and kind_dst == "op" for *_, kind_dst, k in unfolded)


def test_an_etp1_plan_records_its_layout_and_prices_a_tp_share_of_the_rows():
    """ep=4 over tp=2 x dp=2: E/4 experts per rank, kept whole; each tp rank routes half its
    group's rows, so the all-to-all moves half the rows ep over dp alone moves per rank; one replica
    of each expert part (dp / (ep / tp) = 1); the summary, the runners-up and the HTML report say
    so; the plan validates and round-trips."""
    pinned = {"tp": 2, "dp": 2, "pp": 1, "sp": True, "microbatches": 1, "zero": 0}
    folded = _plan(_moe, "1x4xcpu", {"ep": 4, "etp": 1, **pinned})
    plain = _plan(_moe, "1x4xcpu", {"ep": 2, "etp": 2, **pinned})  # each expert split over tp, ep over dp
    x = folded.experts
    assert (x["ep"], x["folded_over"], x["etp"], x["replicas"]) == (4, "tp x dp", 1, 1)
    assert all(layer["experts_per_rank"] == 2 for layer in x["layers"].values())
    assert x["expert_params_per_rank"] == moe.expert_params(moe.SIZES["tiny"]) / 4
    # batch 8 / dp 2 = 4 sequences x 16 tokens x top-2 rows, half of them on each tp rank
    fwd, bwd = expert_all_to_all_bytes(rows=4 * 16 * 2 / 2, width=32, elem_bytes=4, n_experts=8)
    assert x["all_to_all"]["bytes"] == (sum(fwd) + sum(bwd)) * 2  # two MoE layers
    fwd, bwd = expert_all_to_all_bytes(rows=4 * 16 * 2, width=32, elem_bytes=4, n_experts=8)  # every tp rank's
    assert plain.experts["all_to_all"]["bytes"] == (sum(fwd) + sum(bwd)) * 2
    assert plain.experts["folded_over"] == "dp" and "etp" not in plain.experts
    summary = folded.summary()
    assert "experts: ep=4 folded over tp=2 and dp=2 (etp=1" in summary
    runners = folded.solver["candidates"]
    assert runners and all(r["config"]["ep"] == 4 and r["config"]["etp"] == 1 for r in runners)
    assert "ep=4 etp=1" in summary  # (the runners-up lines)
    from autopar.report import render_html

    assert "<h2>Experts (ep=4, folded over tp and dp: etp=1, 1 replica(s))</h2>" in render_html(folded)
    assert "<h2>Experts (ep=2, 1 replica(s))</h2>" in render_html(plain)
    assert Plan.from_json(folded.to_json()).to_json() == folded.to_json()
    with pytest.raises(autopar.PlanError, match=r"experts ep=6 folded over tp and dp must be tp=2 x k with k "
                                                r"dividing dp=2"):
        Plan.from_dict({**folded.to_dict(), "experts": {**folded.to_dict()["experts"], "ep": 6}})


def test_the_search_under_etp1_tries_ep_multiples_of_tp():
    """With etp=1 pinned and ep free, every configuration the search weighs has tp | ep and
    ep / tp | dp; an ep that is not a multiple of tp is refused when pinned."""
    plan = _plan(_moe, "1x4xcpu", {"etp": 1, "tp": 2, "sp": True, "pp": 1})
    assert plan.experts["ep"] in (2, 4) and plan.experts["folded_over"] == "tp x dp"
    assert plan.solver["candidates"]
    for row in plan.solver["candidates"]:
        config = row["config"]
        assert config.get("ep", 1) % 2 == 0 and config["dp"] % (config.get("ep", 2) // 2) == 0
        assert config.get("etp") == 1


@pytest.mark.parametrize("fixed, message", [
    ({"etp": 3, "tp": 2}, r"^etp=3 must be 1 \(experts whole, ep folded over tp and dp\) or tp=2"),
    ({"etp": 1, "tp": 2, "dp": 2, "ep": 3}, r"^ep=3 with etp=1 folds over tp=2 and dp: ep must be tp x k with k "
                                            r"dividing dp=2; pick ep among \[2, 4\]$"),
    ({"etp": 0}, r"etp=0 must be an integer >= 1"),
])
def test_bad_etp_is_one_line_naming_the_values(fixed, message):
    with pytest.raises(autopar.PlanError, match=message):
        _plan(_moe, "1x4xcpu", fixed)


def test_etp1_needs_experts_and_plans_for_parallelize():
    with pytest.raises(autopar.PlanError, match=r"^etp=1 folds expert parallelism over tp, but the model has no "
                                                r"expert layers; drop etp$"):
        _plan(lambda: mlp.build(size="tiny"), "1x2xcpu", {"etp": 1})
    model, inputs, loss_fn, target = _moe()
    plan = make.make_plan(model, inputs, cluster="1x4xcpu", loss_fn=loss_fn, example_target=target,
                          fixed={"etp": 1, "tp": 2}, runnable=True)  # (what parallelize asks for: it runs it)
    assert plan.experts["folded_over"] == "tp x dp" and plan.experts["ep"] % 2 == 0


def test_the_free_search_weighs_folding_beside_the_default():
    """With etp free the search weighs ep folded over tp beside ep over dp (for parallelize too,
    which runs both): more configurations than with etp pinned to tp, the default layout only."""
    fixed = {"tp": 2, "pp": 1, "sp": True}
    model, inputs, loss_fn, target = _moe()
    free = make.make_plan(model, inputs, cluster="1x4xcpu", loss_fn=loss_fn, example_target=target,
                          fixed=fixed, runnable=True)
    pinned = _plan(_moe, "1x4xcpu", {**fixed, "etp": 2})  # etp = tp: the default layout only
    assert all("etp" not in c["config"] for c in pinned.solver["candidates"])
    assert free.solver["search"]["configurations"] > pinned.solver["search"]["configurations"]
    configs = [free.solver["candidates"][i]["config"] for i in range(len(free.solver["candidates"]))]
    assert any(c.get("etp") == 1 for c in configs) or free.experts.get("folded_over") == "tp x dp"

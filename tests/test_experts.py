"""Expert parallelism, single process: the expert op, the all-to-all prices, ``ep`` in the planner.

The multi-process runs (ep=2, ep=4, ep=2 x dp=2 against one process) are in
``tests/dist/test_expert_parallel.py``.
"""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.cost.comm import Link, all_to_all_s
from autopar.cost.expert_comm import expert_all_to_all_bytes, expert_all_to_all_s
from autopar.experts import moe_experts
from autopar.plan import Plan
from autopar.runtime.expert import EpLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import mlp  # noqa: E402
import moe  # noqa: E402


def _dense(x, counts, w_gate, w_up, w_down):
    """The experts written out: expert e on its block of rows."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start:start + n]
        out.append(F.linear(F.silu(xe @ w_gate[e]) * (xe @ w_up[e]), w_down[e].T))
        start += n
    return torch.cat(out)


def test_expert_op_matches_the_dense_experts_in_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, dtype=torch.float64, generator=g, requires_grad=True)
    ws = [torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True) for s in ((3, 8, 4), (3, 8, 4),
                                                                                          (3, 4, 8))]
    counts = torch.tensor([3, 0, 7])  # an expert with no rows
    got = moe_experts(x, counts, *ws, "")
    want = _dense(x, counts, *ws)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    gy = torch.randn_like(got)
    grads = torch.autograd.grad(got, (x, *ws), gy)
    ref = torch.autograd.grad(want, (x, *ws), gy)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, a, b, c: moe_experts(x, counts, a, b, c, ""), (x, *ws))


def test_moe_example_routes_top2_and_trains():
    model, inputs, loss_fn, target = moe.build(size="tiny", shared_expert="1", aux_loss="0.01")
    assert isinstance(model(*inputs), tuple)
    assert sum(p.numel() for p in model.parameters()) == moe.count_params(model.config)
    assert model.layers[0].moe.w_gate.shape == (8, 32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    big, _, _, _ = moe.build(size="8x7b")
    assert next(big.parameters()).device.type == "meta"
    assert moe.count_params(big.config) == pytest.approx(47.5e9, rel=0.01)
    # DeepSeek-V3 shapes: 256 experts of width 2048, top-8, a shared expert; ~705B in all (the report's
    # 671B has MLA attention and 3 dense blocks) and ~38B active per token (report: 37B)
    ds, _, _, _ = moe.build(size="dsv3", batch=1, seq=16)
    c = ds.config
    assert (c.n_experts, c.top_k, c.expert_hidden, c.shared_expert) == (256, 8, 2048, True)
    assert sum(p.numel() for p in ds.parameters()) == moe.count_params(c) == pytest.approx(705e9, rel=0.01)
    active = moe.count_params(c) - moe.expert_params(c) * (1 - c.top_k / c.n_experts)
    assert active == pytest.approx(38.6e9, rel=0.01)


def test_balance_loss_is_linear_over_the_batch():
    """Per-sequence balance: the mean over two half batches equals the whole batch's (so dp is exact)."""
    model, (tokens,), _, _ = moe.build(size="tiny", aux_loss="1", batch="4")
    _, whole = model(tokens)
    halves = [model(t)[1] for t in tokens.split(2)]
    torch.testing.assert_close(whole, sum(halves) / 2, rtol=1e-6, atol=0)


def test_all_to_all_bytes_and_time_in_closed_form():
    fwd, bwd = expert_all_to_all_bytes(rows=64, width=32, elem_bytes=4, n_experts=8)
    assert fwd == (64, 8192, 8192) and bwd == (64, 16384, 8192)  # counts, dispatch, combine
    link = Link(bytes_per_s=1e9, latency_s=1e-6)
    f, b = expert_all_to_all_s(rows=64, width=32, elem_bytes=4, n_experts=8, ep=4, link=link)
    # each all-to-all: (n-1)/n of the send buffer over beta, plus (n-1) alpha
    assert f == pytest.approx(sum(3 / 4 * m / 1e9 + 3e-6 for m in fwd), rel=1e-12)
    assert b == pytest.approx(sum(3 / 4 * m / 1e9 + 3e-6 for m in bwd), rel=1e-12)
    assert f == pytest.approx(sum(all_to_all_s(m, 4, link) for m in fwd))
    assert expert_all_to_all_s(rows=64, width=32, elem_bytes=4, n_experts=8, ep=1, link=link) == (0.0, 0.0)


def test_ep_layout_groups():
    layout = EpLayout(dp=4, ep=2)
    assert layout.ep_groups() == [[0, 1], [2, 3]]
    assert layout.replica_groups() == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match=r"ep=3 must divide dp=4"):
        EpLayout(dp=4, ep=3)


def _plan(fixed, **build):
    model, inputs, loss_fn, target = moe.build(size="tiny", **build)
    return autopar.plan(model, inputs, cluster="1x4xcpu", loss_fn=loss_fn, example_target=target, fixed=fixed)


@pytest.mark.parametrize("fixed, message", [
    ({"ep": 3}, r"^ep=3 does not divide the 8 experts of layers\.0\.moe; pick ep among \[1, 2, 4, 8\]$"),
    ({"ep": 4, "dp": 2}, r"^ep=4 must divide dp=2: expert parallelism folds over the data-parallel ranks; "
                         r"pick ep among \[1, 2\] or another dp$"),
    ({"ep": 8}, r"^ep=8 does not divide the 4 devices of 1x4xcpu$"),
])
def test_bad_ep_is_one_line_naming_the_values(fixed, message):
    with pytest.raises(autopar.PlanError, match=message):
        _plan(fixed)


def test_ep_needs_expert_layers_and_an_integer():
    model, inputs, loss_fn, target = mlp.build(size="tiny")
    with pytest.raises(autopar.PlanError, match=r"^ep=2 but the model has no expert layers"):
        autopar.plan(model, inputs, cluster="1x2xcpu", loss_fn=loss_fn, example_target=target, fixed={"ep": 2})
    with pytest.raises(autopar.PlanError, match=r"ep='two' is not an integer"):
        autopar.plan(model, inputs, cluster="1x2xcpu", loss_fn=loss_fn, example_target=target, fixed={"ep": "two"})
    with pytest.raises(autopar.PlanError, match=r"^recompute='moe' makes each MoE layer's forward again .* no expert "
                                                r"layers .* pin recompute='selective'"):
        autopar.plan(model, inputs, cluster="1x2xcpu", loss_fn=loss_fn, example_target=target,
                     fixed={"recompute": "moe"})


def test_the_search_weighs_moe_recompute_where_selective_does_not_fit():
    """On a model with experts the search weighs "moe" beside the other policies: two pipeline stages
    (where sac is not weighed), a capacity between selective's peak (787,840 B) and moe's (713,024 B):
    moe, which recomputes less than full and here holds less too."""
    from autopar.planner.make import make_plan

    model, inputs, loss_fn, target = moe.build(size="tiny", batch=16, seq=64)
    cluster = autopar.cluster.parse_cluster("1x4xcpu").with_overrides(hbm_bytes=820_000)
    fixed = {"tp": 1, "pp": 2, "dp": 2, "ep": 2, "microbatches": 4, "zero": 1, "schedule": "1f1b"}
    plan = make_plan(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target, fixed=fixed)
    assert plan.recompute == "moe", plan.recompute
    roomy = make_plan(model, inputs, cluster=cluster.with_overrides(hbm_bytes=4_000_000), loss_fn=loss_fn,
                      example_target=target, fixed=fixed)
    assert roomy.recompute == "none"


def test_moe_recompute_prices_the_moe_layers_made_again():
    """"moe" keeps less than selective (its peak, with the running layer's copies, may be below
    full's at this size), and makes again in the backward the MoE layers' forward, their all-to-alls
    under ep included: its backward is selective's plus that, less than full's (the step of this tiny
    model is its gradient all-reduce's, the same under each)."""
    pinned = {"tp": 1, "pp": 1, "dp": 4, "ep": 2, "microbatches": 1, "zero": 0}
    plans = {r: _plan({**pinned, "recompute": r}) for r in ("selective", "moe", "full")}
    acts = {r: p.stages[0]["predicted"]["memory_bytes"]["activations"] for r, p in plans.items()}
    assert acts["selective"] > acts["moe"], acts
    backward = {r: p.stages[0]["predicted"]["b_s"] for r, p in plans.items()}
    assert backward["selective"] < backward["moe"] < backward["full"], backward
    flops = {r: p.predicted["hardware_flops_per_step"] for r, p in plans.items()}
    assert flops["selective"] < flops["moe"] < flops["full"], flops


def test_ep_plan_divides_expert_memory_and_prices_the_all_to_alls():
    pinned = {"tp": 1, "pp": 1, "microbatches": 1}
    base = _plan({"ep": 1, "zero": 0, **pinned})
    plan = _plan({"ep": 2, "zero": 0, **pinned})
    config = moe.SIZES["tiny"]
    assert "experts" not in base.to_dict() and base.mesh == plan.mesh == {"pp": 1, "dp": 4, "tp": 1}
    # parameters per device: everything but the experts, plus half the experts (fp32)
    expert = moe.expert_params(config)
    assert base.stages[0]["predicted"]["memory_bytes"]["params"] == 4 * moe.count_params(config)
    assert plan.stages[0]["predicted"]["memory_bytes"]["params"] == 4 * (moe.count_params(config) - expert / 2)
    x = plan.experts
    assert x["ep"] == 2 and x["replicas"] == 2 and x["expert_params_per_rank"] == expert / 2
    assert sorted(x["layers"]) == ["layers.0.moe", "layers.1.moe"]
    assert all(layer["experts_per_rank"] == 4 for layer in x["layers"].values())
    # per dp rank and micro-batch: batch 8 / dp 4 = 2 sequences x 16 tokens x top-2 rows of 32 fp32
    fwd, bwd = expert_all_to_all_bytes(rows=2 * 16 * 2, width=32, elem_bytes=4, n_experts=8)
    assert x["all_to_all"]["bytes"] == (sum(fwd) + sum(bwd)) * 2  # two MoE layers
    assert plan.communication["all_to_all"]["ep"]["count"] == 6 * 2
    # forward and backward of a micro-batch grow by the all-to-alls of both layers
    link = autopar.cluster.parse_cluster("1x4xcpu").link_for_group(2, stride=1)
    f, b = expert_all_to_all_s(rows=64, width=32, elem_bytes=4, n_experts=8, ep=2, link=link)
    got, want = plan.stages[0]["predicted"], base.stages[0]["predicted"]
    assert got["f_s"] == pytest.approx(want["f_s"] + 2 * f, rel=1e-5)
    assert got["b_s"] == pytest.approx(want["b_s"] + 2 * b, rel=1e-5)
    assert "experts: ep=2 folded over dp=4 (2 replica(s)" in plan.summary()
    assert "replicated over dp except the experts' (cut over ep)" in plan.summary()
    from autopar.report import render_html

    page = render_html(plan)  # the report's experts table: a row per MoE block, 4 of 8 experts per rank
    assert "<h2>Experts (ep=2, 2 replica(s))</h2>" in page
    for block in ("layers.0.moe", "layers.1.moe"):
        assert f"<tr><td>{block}</td><td>1</td><td>8</td><td>4</td>" in page
    assert "Experts (" not in render_html(base)
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    with pytest.raises(autopar.PlanError, match=r"experts ep=3 does not divide dp=4"):
        Plan.from_dict({**plan.to_dict(), "experts": {**plan.to_dict()["experts"], "ep": 3}})


def test_ep_prices_the_experts_as_taller_gemms():
    """Under ep a rank runs the same rows over E/ep experts, ep times the rows each: on a GPU the
    experts' GEMMs get faster by exactly the difference of the efficiency curve at rows/E and at
    ep x rows/E, more for many small experts; the CPU roofline (no curve) is unchanged."""
    from autopar.cost.compute import kernel_time_s
    from autopar.planner.experts import ExpertSite, _experts_gemms_s

    h100 = autopar.cluster.parse_cluster("1x8xH100")

    def site(n_experts):  # DeepSeek-V3-like widths: 4096 tokens x top-8 rows of 7168, experts of 2048
        return ExpertSite(layer="l", module="l.moe", n_experts=n_experts, rows=4096 * 8, width=7168,
                          elem_bytes=2, params=("w",), n_params=1, expert_width=2048, dtype="bf16")

    fwd, bwd = _experts_gemms_s(site(256), 4096 * 8, 8, h100)
    flops = 2 * 4096 * 8 * 7168 * 2048

    def t(gemms, m):
        return kernel_time_s(kind="gemm", flops=gemms * flops, bytes_moved=0.0, device=h100.device, dtype="bf16",
                             gemm=(m, 2048, 7168))

    assert fwd == pytest.approx(t(3, 1024) - t(3, 128)) and bwd == pytest.approx(t(8, 1024) - t(8, 128))
    assert fwd < 0 and bwd < 0 and bwd / fwd == pytest.approx(8 / 3, rel=1e-2)
    few = _experts_gemms_s(site(8), 4096 * 8, 8, h100)  # 8 big experts: already near the curve's top
    assert fwd < few[0] < 0
    assert _experts_gemms_s(site(256), 4096 * 8, 8, autopar.cluster.parse_cluster("1x8xcpu")) == (0.0, 0.0)
    assert _experts_gemms_s(replace(site(256), expert_width=0), 4096 * 8, 8, h100) == (0.0, 0.0)  # grouped sites


def test_moe_imbalance_prices_the_busiest_rank(moe_pair):
    """``fixed={"moe_imbalance": k}`` (an assumption, default balanced): the busiest rank of an ep
    group receives k times its rows, so each MoE block's forward grows by (k - 1) times the
    experts' GEMM time and its all-to-alls carry k times the rows; the record and summary say
    so, the bytes the contract test checks stay the balanced ones, and a bad k is one line."""
    from autopar.cost.compute import kernel_time_s
    from autopar.experts import FORWARD_GEMMS

    pinned = {"tp": 1, "pp": 1, "dp": 4, "ep": 2, "microbatches": 1, "recompute": "none"}
    base = _plan_pair(moe_pair, "1x4xcpu", pinned)
    busy = _plan_pair(moe_pair, "1x4xcpu", {**pinned, "moe_imbalance": 1.5})
    cluster = autopar.cluster.parse_cluster("1x4xcpu")
    rows, d, f = 2 * 16 * 2, 32, 32  # per rank: 2 sequences x 16 tokens x top-2
    link = cluster.link_for_group(2, stride=1)
    gemms = kernel_time_s(kind="gemm", flops=FORWARD_GEMMS * 2 * rows * d * f, bytes_moved=0.0, device=cluster.device,
                          dtype="fp32", gemm=(rows / 8, f, d))
    a2a = [expert_all_to_all_s(rows=r, width=d, elem_bytes=4, n_experts=8, ep=2, link=link)[0] for r in (rows, 1.5 * rows)]
    grown = busy.stages[0]["predicted"]["f_s"] - base.stages[0]["predicted"]["f_s"]
    assert grown == pytest.approx(2 * (0.5 * gemms + a2a[1] - a2a[0]), rel=1e-6)  # two MoE blocks
    assert busy.experts["imbalance"] == 1.5 and base.experts["imbalance"] == 1.0
    assert busy.experts["all_to_all"]["bytes"] == base.experts["all_to_all"]["bytes"]
    assert busy.experts["all_to_all"]["time_s"] > base.experts["all_to_all"]["time_s"]
    assert "the busiest rank receives 1.5x its balanced rows (assumed)" in busy.summary()
    assert "balanced load assumed" in base.summary()
    assert busy.fixed["moe_imbalance"] == 1.5
    with pytest.raises(autopar.PlanError, match=r"moe_imbalance='x' must be a number >= 1: the busiest ep rank"):
        autopar.planner.search.Fixed.from_dict({"moe_imbalance": "x"})
    with pytest.raises(autopar.PlanError, match=r"moe_imbalance=0.5 must be a number >= 1"):
        autopar.planner.search.Fixed.from_dict({"moe_imbalance": 0.5})


def test_expert_flops_are_counted_in_closed_form():
    """Block forward = qkv + wo + router + the experts (3 matmuls of 2 d f per row, N x top-2 rows) + attention."""
    model, inputs, loss_fn, target = moe.build(size="tiny")
    report = autopar.analyze(model, inputs, cluster="1x1xcpu", loss_fn=loss_fn, example_target=target)
    block = next(r for r in report.layers if r.class_name == "Block")
    N, d, f, E, k, T, heads = 8 * 16, 32, 32, 8, 2, 16, 4
    attention = 2 * 2 * 8 * heads * T * T * (d // heads)  # q k^T and p v
    assert block.flops_fwd == 2 * N * d * 3 * d + 2 * N * d * d + 2 * N * d * E + 3 * 2 * N * k * d * f + attention


@pytest.fixture(scope="module")
def moe_pair():
    from autopar.planner.frontend import trace_pair

    model, inputs, loss_fn, target = moe.build(size="tiny", batch=8)
    return trace_pair(model, inputs, cluster=autopar.cluster.parse_cluster("1x4xcpu"), loss_fn=loss_fn,
                      example_target=target)


def _plan_pair(pair, spec, fixed=None, **kw):
    from autopar.planner.make import plan_graphs
    from autopar.planner.search import Fixed

    cluster = autopar.cluster.parse_cluster(spec)
    if "hbm_bytes" in kw:
        cluster = cluster.with_overrides(hbm_bytes=kw.pop("hbm_bytes"))
    return plan_graphs(*pair, cluster=cluster, fixed=Fixed.from_dict(fixed), **kw)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_shards_expert_state_over_the_replicas(zero):
    """Under ep=2 over dp=4, ZeRO puts each expert part's state in chunks over its 2 replicas and
    everything else over the 4 dp ranks, as ShardedParams holds it (tests/dist/test_expert_parallel.py
    measures the runtime against these figures): fp32 parameters and gradients, AdamW's two moments."""
    plan = _plan({"tp": 1, "pp": 1, "microbatches": 1, "ep": 2, "zero": zero})
    config = moe.SIZES["tiny"]
    held = moe.expert_params(config) / 2  # the rank's expert part
    rest = moe.count_params(config) - moe.expert_params(config)
    assert plan.zero == zero and plan.experts["ep"] == 2
    assert "sharded over dp, the experts' over their 2 replicas (ZeRO-" in plan.summary()
    memory = plan.stages[0]["predicted"]["memory_bytes"]
    whole, chunks = rest + held, rest / 4 + held / 2
    assert memory["optimizer"] == pytest.approx(8 * chunks, rel=1e-12)
    assert memory["grads"] == pytest.approx(4 * (chunks if zero >= 2 else whole), rel=1e-12)
    assert memory["params"] == pytest.approx(4 * (chunks if zero == 3 else whole), rel=1e-12)
    # the plan's dp communication: the expert buckets apart, on the replica groups ("dp/ep"), each
    # collective moving the rank's expert part (fp32 gradients) padded to a multiple of 2 replicas
    reduce = plan.communication["reduce_scatter"]
    experts, others = reduce["dp/ep"], reduce["dp"]
    assert all(b["replicas"] == 2 for b in experts["buckets"]) and not any("replicas" in b for b in others["buckets"])
    per_call = {b["layer"]: b["bytes"] for b in experts["buckets"]}
    assert sum(per_call.values()) == pytest.approx(4 * held, rel=1e-12)  # (tiny's parts split evenly)
    assert sum(b["bytes"] for b in others["buckets"]) == pytest.approx(4 * rest, abs=4 * 4 * len(others["buckets"]))
    assert experts["time_s"] > 0 and others["time_s"] > 0  # (together, the stage's gradient sync)
    sync = sum(c["time_s"] for axes in plan.communication.values() for axis, c in axes.items() if "dp" in axis)
    assert sync == pytest.approx(plan.stages[0]["predicted"]["grad_sync_s"], rel=1e-6)
    assert "dp/ep" in plan.summary()


def test_experts_held_once_have_no_dp_collectives():
    """ep = dp: each expert part lives on one rank, so the plan lists no replica-group buckets and
    the dp buckets carry only the other parameters."""
    plan = _plan({"tp": 1, "pp": 1, "microbatches": 1, "ep": 4, "zero": 1})
    config = moe.SIZES["tiny"]
    rest = moe.count_params(config) - moe.expert_params(config)
    reduce = plan.communication["reduce_scatter"]
    assert set(reduce) == {"dp"}
    buckets = reduce["dp"]["buckets"]
    assert sum(b["bytes"] for b in buckets) == pytest.approx(4 * rest, abs=16 * len(buckets))  # (padding)


def test_ep_cuts_the_experts_weight_gradients_in_the_working_set(moe_pair):
    """The experts op's backward returns the weight gradients of all E experts at once (whole,
    batch-independent), and the slices and transposes after it pass them on: in the working set
    of those ops they are cut to 1/ep under ep, like the parameters (DeepSeek-V3's 256 experts
    put 45 GB there at 4096 tokens against 1 GB of token rows, and the stand-in of
    bench/fidelity.py --moe read 225 GiB for 60 measured before)."""
    from autopar.cluster import parse_cluster
    from autopar.planner.evaluation import evaluate
    from autopar.planner.experts import apply_ep, find_experts
    from autopar.planner.ilp import build_problem, solve
    from autopar.planner.search import Unit
    from autopar.passes.strategies import build_strategy_graph

    cluster = parse_cluster("1x4xcpu")
    sg = build_strategy_graph(moe_pair[0], axis_size=1, gm_double=moe_pair[1], shard_batch=True)
    problem = build_problem(sg, batch=2, device=cluster.device, link=cluster.link_for_group(1))
    lc = evaluate(problem, solve(problem)).layers["layers.0"]
    other, path = lc.expert_transient
    config = moe.SIZES["tiny"]
    grads = 3 * config.n_experts * config.dim * config.expert_hidden * 4  # w_gate, w_up, w_down, fp32
    assert grads in {g for _, g in path}  # the backward's weight gradients, all E experts
    assert lc.transient_bytes == max([other] + [rest + g for rest, g in path])
    unit = Unit(path="layers.0", f_s=0.0, b_s=0.0, w_s=0.0, comm_s=0.0, cheap_f_s=0.0, act_bytes=0.0,
                cheap_act_bytes=0.0, boundary_bytes=0.0, n_params=0.0, transient_bytes=lc.transient_bytes,
                expert_transient=lc.expert_transient)
    sites = [s for s in find_experts(moe_pair[0]) if s.layer == "layers.0"]
    for ep in (2, 4, 8):
        (cut,) = apply_ep([unit], names={"layers.0": ["layers.0"]}, sites=sites, ep=ep, tp=1, microbatch_size=2,
                          global_batch=8, cluster=cluster)
        assert cut.transient_bytes == max([other] + [rest + g / ep for rest, g in path]) < lc.transient_bytes


def test_the_search_weighs_ep_like_any_other_decision(moe_pair):
    """Left free, ep is searched: the plan is as fast as the best of the plans pinned to each ep,
    and when memory only fits with the experts cut (each rank holding 1/ep of them), the search
    finds the ep that fits."""
    spec = "1x4xcpu"
    free = _plan_pair(moe_pair, spec)
    pinned = {ep: _plan_pair(moe_pair, spec, {"ep": ep}) for ep in (1, 2, 4)}
    best = min(p.predicted["step_time_s"] for p in pinned.values())
    assert free.predicted["step_time_s"] == pytest.approx(best, rel=1e-9)
    # memory between what ep=4 needs and what ep=1 needs (pp = tp = 1, no recompute, one micro-batch)
    tight = {"pp": 1, "tp": 1, "recompute": "none", "microbatches": 1, "zero": None}
    need = {ep: _plan_pair(moe_pair, spec, {**{k: v for k, v in tight.items() if v is not None}, "ep": ep})
            .predicted["peak_memory_bytes"] for ep in (1, 4)}
    assert need[4] < need[1]
    hbm = int((need[1] + need[4]) / 2 / (1 - 0.1))  # (the search keeps a 10% reserve)
    fits = _plan_pair(moe_pair, spec, {k: v for k, v in tight.items() if v is not None and k != "zero"} | {"zero": 0},
                      hbm_bytes=hbm)
    assert fits.experts.get("ep", 1) > 1 and fits.predicted["peak_memory_bytes"] <= hbm


def _mixtral_pair(gelu: bool = False):
    """Tiny HF Mixtral traced for planning; ``gelu``: its experts' activation swapped for GELU,
    a variant autopar does not run as its experts op (it stays a grouped matmul)."""
    import hf
    from autopar.planner.frontend import trace_pair

    model, inputs, _, _ = hf.build(model="mixtral", batch=8)
    if gelu:
        for layer in model.model.layers:
            layer.mlp.experts.act_fn = torch.nn.GELU()
    return model, trace_pair(model, inputs, cluster=autopar.cluster.parse_cluster("1x4xcpu"), loss_fn=None,
                             example_target=None)


def test_hugging_face_mixtral_experts_are_planned_and_runnable_under_ep():
    """Mixtral's experts (stacked gate_up_proj / down_proj, gated SiLU) are traced as autopar's
    experts op: ep cuts both stacked parameters, a runnable plan (parallelize's) takes ep, and
    the parameters per rank drop by the experts' (ep - 1)/ep."""
    pytest.importorskip("transformers")
    model, pair = _mixtral_pair()
    pinned = {"tp": 1, "pp": 1, "microbatches": 1}
    plan = _plan_pair(pair, "1x4xcpu", {"ep": 2, **pinned}, ep_runnable_only=True)
    base = _plan_pair(pair, "1x4xcpu", {"ep": 1, "zero": 0, **pinned})
    layers = plan.experts["layers"]
    assert sorted(layers) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for path, x in layers.items():
        assert x["params"] == [f"{path}.gate_up_proj", f"{path}.down_proj"]
        assert (x["op"], x["n_experts"], x["experts_per_rank"]) == ("autopar::moe_experts", 4, 2)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert plan.stages[0]["predicted"]["memory_bytes"]["params"] == \
        base.stages[0]["predicted"]["memory_bytes"]["params"] - 4 * expert / 2


def test_hugging_face_grouped_matmul_experts_are_planned_under_ep():
    """Experts autopar does not run as its op (here Mixtral's with GELU) stay grouped matmuls:
    found in the traced graph, cut by ep and priced like autopar's own; parallelize does not
    run them under ep, so a runnable plan refuses ep in one line and the search leaves it out."""
    pytest.importorskip("transformers")
    model, pair = _mixtral_pair(gelu=True)
    pinned = {"tp": 1, "pp": 1, "microbatches": 1}
    plan = _plan_pair(pair, "1x4xcpu", {"ep": 2, **pinned})
    for path, x in plan.experts["layers"].items():
        assert x["params"] == [f"{path}.gate_up_proj", f"{path}.down_proj"]
        assert (x["op"], x["n_experts"], x["experts_per_rank"]) == ("transformers::grouped_mm_fallback", 4, 2)
    with pytest.raises(autopar.PlanError, match=r"^ep=2: the experts of model\.layers\.0\.mlp\.experts run as a "
                                                r"grouped matmul \(transformers::grouped_mm_fallback\), which "
                                                r"autopar\.parallelize does not run under expert parallelism yet"):
        _plan_pair(pair, "1x4xcpu", {"ep": 2}, ep_runnable_only=True)
    free = _plan_pair(pair, "1x4xcpu", ep_runnable_only=True)
    assert not free.experts and all("ep" not in c["config"] for c in free.solver["candidates"])


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_hugging_face_experts_through_autopar_compute_what_transformers_computes(implementation):
    """autopar's forward for a transformers experts module (autopar.experts.hf_experts_forward,
    what the trace runs) against the module's own, grouped-matmul or eager loop: outputs and
    every gradient agree to fp32 rounding (both sum each expert's rows in another order)."""
    transformers = pytest.importorskip("transformers")
    from autopar.experts import hf_experts_forward, hf_experts_supported

    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4,
                                        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, vocab_size=16)
    config._experts_implementation = implementation
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    experts = block.experts
    assert hf_experts_supported(experts) and not hf_experts_supported(block)
    x = torch.randn(24, 32)
    _, weights, index = block.gate(x)
    results = []
    for forward in (experts.forward, lambda *a: hf_experts_forward(experts, *a)):
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        y = forward(xi, index, weights.detach())
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append([y, xi.grad, experts.gate_up_proj.grad, experts.down_proj.grad])
    for theirs, ours in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    experts.act_fn = torch.nn.GELU()  # another activation: not autopar's experts op
    assert not hf_experts_supported(experts)


def test_runners_up_name_their_ep():
    from autopar.plan_summary import config_words

    config = {"tp": 1, "pp": 4, "dp": 16, "zero": 0, "recompute": "selective", "schedule": "1f1b",
              "microbatches": 8, "microbatch_size": 2}
    assert config_words({**config, "ep": 8}) == "tp=1 pp=4 dp=16 zero=0 recompute=selective 1f1b 8x2 ep=8"
    assert "ep=" not in config_words(config) and "ep=" not in config_words({**config, "ep": 1})


def test_looking_for_hf_experts_does_not_import_transformers():
    """Every trace asks each module whether it is a Hugging Face experts module; for models that
    are not Hugging Face's that must not import transformers (seconds per process: it once
    made every spawned rank of the suite import it)."""
    import subprocess

    code = ("import sys, torch; from autopar.experts import hf_experts_supported; "
            "assert not hf_experts_supported(torch.nn.Linear(2, 2)); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr

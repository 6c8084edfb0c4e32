"""Context parallelism in the planner (autopar.planner.context): a pinned cp splits each
sequence over cp data-parallel ranks; per-rank compute and activations shrink by cp, the
K/V exchange is priced, recorded in the plan and said in the summary; impossible pins are
refused in one line; beside ep each rank dispatches its own chunks' tokens; parallelize refuses
what it does not run under cp before any collective."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

import autopar
from autopar.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama  # noqa: E402
import moe  # noqa: E402

PIN = {"dp": 8, "tp": 1, "pp": 1, "zero": 0, "recompute": "none", "microbatch_size": 1, "schedule": "1f1b"}


@pytest.fixture(scope="module")
def plans():
    # Llama 3 8B's blocks (two of them) at 8192 tokens: big enough kernels that time follows work
    model, inputs, loss_fn, target = llama.build(size="8b", n_layers=2, batch=8, seq=8192, device="meta")
    out = {}
    for cp in (1, 2, 4):
        fixed = dict(PIN, **({"cp": cp} if cp > 1 else {}))
        out[cp] = autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                               fixed=fixed)
    return out


def _stage(plan):
    return plan.stages[0]["predicted"]


def test_each_rank_holds_a_cp_th_of_each_sequence(plans):
    one = _stage(plans[1])
    for cp in (2, 4):
        plan = plans[cp]
        plan.validate(world_size=8)
        assert plan.context["cp"] == cp and plan.context["tokens_per_rank"] == 8192 // cp
        assert plan.context["attention_ops"] == 2  # one per block
        assert plan.schedule["microbatches"] * plan.schedule["microbatch_size"] * (8 // cp) == 8
        st = _stage(plan)
        # forward time per micro-batch: 1/cp of the compute, plus the exposed K/V exchange
        assert st["f_s"] < one["f_s"] / cp * 1.5, cp
        kv = plan.communication["p2p"]["cp"]
        # exposed: what attention does not hide of the link time, plus the op's eager merges
        assert kv["bytes"] > 0 and kv["count"] > 0 and kv["time_s"] > 0 and kv["exposed_s"] > 0
    assert not plans[1].context and "cp" not in plans[1].communication.get("p2p", {})


def test_activations_per_rank_fall_as_one_over_cp(plans):
    # One micro-batch in flight (pp = 1): its saved activations are 1/cp of a sequence's; the
    # stage also holds its largest op's working set once, which falls as 1/cp too until it is
    # one that no token count scales: the output head's fp32 weight gradient (vocab x dim).
    # Under cp a little less: cp's attention keeps the grouped K/V (8 heads), not the head
    # repeat's copies (32 heads) the traced SDPA reads (a few % of a block's activations).
    head_grad = 128256 * 4096 * 4
    a1 = _stage(plans[1])["memory_bytes"]["activations"]
    for cp in (2, 4):
        a = _stage(plans[cp])["memory_bytes"]["activations"]
        assert a1 / cp * 0.95 <= a <= a1 / cp + head_grad, (cp, a, a1)
    assert _stage(plans[2])["memory_bytes"]["activations"] == pytest.approx(a1 / 2, rel=0.03)
    assert _stage(plans[2])["memory_bytes"]["activations"] < a1 / 2


def test_cp_plan_round_trips_and_says_what_it_did(plans):
    plan = plans[2]
    again = Plan.from_json(plan.to_json())
    assert again.context["cp"] == 2 and again.context["variants"] == plan.context["variants"]
    for key, value in plan.context["kv_exchange"].items():
        assert again.context["kv_exchange"][key] == pytest.approx(value, rel=1e-5)  # (floats are rounded in files)
    text = plan.summary()
    assert "context: cp=2 folded over dp=8 (the batch split over 4 group(s))" in text
    assert "4096 tokens per rank" in text and "p2p             cp" in text
    assert "context" not in plans[1].to_json()  # absent without cp: plan files stay as they were
    # the overlap table shows the K/V exchange's exposed time apart from tp's (what cp adds less the op's
    # eager merges and its blocks' kernel, which are compute)
    rows, kv = plan.predicted["overlap"], plan.context["kv_exchange"]
    assert kv["eager_s"] > 0 and kv["kernel_s"] > 0  # (Hopper: the blocks run FlashAttention-2, SDPA cuDNN's)
    assert sum(r["cp_exposed_s"] for r in rows) == pytest.approx(kv["exposed_s"] - kv["eager_s"] - kv["kernel_s"],
                                                                 rel=1e-6)
    assert "the op's eager merges" in text and "FlashAttention-2 blocks" in text
    assert all(r["tp_exposed_s"] >= 0 for r in rows) and "cp K/V" in text
    assert "cp_exposed_s" not in plans[1].predicted["overlap"][0] and "cp K/V" not in plans[1].summary()
    from autopar.report import render_html

    page = render_html(plan)
    assert "<h2>Context parallelism (cp=2)</h2>" in page and "cp K/V (exposed)" in page
    assert "Context parallelism" not in render_html(plans[1])


def test_torch_cp_variant_prices_torchs_program_and_is_not_run():
    """cp_variant="torch" prices torch's context_parallel as torchtitan runs it (bench/fidelity.py):
    Llama 3 8B repeats its 8 K/V heads to 32 before SDPA, so that program gathers 4x the bytes of
    autopar's all-gather and merges in eager fp32; parallelize refuses it before any collective."""
    model, inputs, loss_fn, target = llama.build(size="8b", n_layers=2, batch=8, seq=8192, device="meta")
    out = {}
    for variant in ("allgather", "torch"):
        out[variant] = autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                                    fixed=dict(PIN, cp=4, cp_variant=variant))
    ours, theirs = (out[v].context for v in ("allgather", "torch"))
    assert theirs["variants"] == ["torch"] and ours["variants"] == ["allgather"]
    # the K/V sent forward and backward: repeated heads (4x) and fp32 gradient hops against bf16 reduce-scatter
    assert theirs["kv_exchange"]["bytes"] > 3 * ours["kv_exchange"]["bytes"]
    assert theirs["kv_exchange"]["exposed_s"] > ours["kv_exchange"]["exposed_s"]
    assert out["torch"].predicted["step_time_s"] > out["allgather"].predicted["step_time_s"]
    assert "exchange K/V by torch:" in out["torch"].summary() and "eager merges" in out["torch"].summary()
    pm = autopar.parallelize(model, cluster="1x1xcpu", loss_fn=loss_fn, fixed={"cp": 2, "cp_variant": "torch"})
    with pytest.raises(autopar.PlanError, match=r"^cp=2 with cp_variant='torch': .* autopar does not run it"):
        pm.train_step(inputs, target)
    assert pm.plan is None
    with pytest.raises(autopar.PlanError, match=r"cp_variant='ulysses' is not one of ring, allgather, torch, te"):
        autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                     fixed=dict(PIN, cp=4, cp_variant="ulysses"))


def test_te_cp_variant_prices_transformer_engines_ring_and_is_not_run():
    """cp_variant="te" prices Transformer Engine's p2p ring as Megatron-LM runs it (bench/fidelity.py):
    the grouped K/V (no repeat) passed around with bf16 gradients, its blocks on the SDPA kernel the
    graph's attention is priced at, and bf16 merges; autopar's ring sends fp32 gradients and runs
    FlashAttention-2 blocks on CUDA, so TE's program is priced faster on an H100, and neither moves
    torch's repeated heads. parallelize refuses it before any collective."""
    model, inputs, loss_fn, target = llama.build(size="8b", n_layers=2, batch=8, seq=8192, device="meta")
    out = {v: autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                           fixed=dict(PIN, cp=4, cp_variant=v)) for v in ("ring", "torch", "te")}
    te, ring, torch_ = (out[v].context for v in ("te", "ring", "torch"))
    assert te["variants"] == ["te"]
    assert te["kv_exchange"]["bytes"] < ring["kv_exchange"]["bytes"] < torch_["kv_exchange"]["bytes"]
    assert te["kv_exchange"]["kernel_s"] == 0 < ring["kv_exchange"]["kernel_s"]
    assert out["te"].predicted["step_time_s"] < out["ring"].predicted["step_time_s"]
    assert "exchange K/V by te:" in out["te"].summary() and "Transformer Engine's program" in out["te"].summary()
    pm = autopar.parallelize(model, cluster="1x1xcpu", loss_fn=loss_fn, fixed={"cp": 2, "cp_variant": "te"})
    with pytest.raises(autopar.PlanError, match=r"^cp=2 with cp_variant='te': .* autopar does not run it"):
        pm.train_step(inputs, target)


def test_the_k_v_exchange_buffers_count_in_the_peak(monkeypatch):
    """Under cp the attention op also holds what its K/V exchange keeps live. With a vocabulary
    small enough that attention's backward is the largest op, the all-gather variant's peak
    exceeds the ring's by what it holds beyond the ring's one block in flight: (cp - 1) K/V
    blocks and cp - 3 more fp32 gradient blocks; per rank at cp = 4, 4096 tokens x 8 K/V heads
    x 128 x bf16: 16 MiB a block (32 MiB its fp32 gradients), so 3 x 16 + 32 MiB."""
    monkeypatch.setitem(llama.SIZES, "8b-vocab2k", replace(llama.SIZES["8b"], vocab_size=2048))
    model, inputs, loss_fn, target = llama.build(size="8b-vocab2k", n_layers=2, batch=8, seq=16384, device="meta")
    peak = {v: autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                            fixed=dict(PIN, cp=4, cp_variant=v)).predicted["peak_memory_bytes"]
            for v in ("ring", "allgather")}
    assert peak["allgather"] - peak["ring"] == 3 * 16 * 2**20 + 32 * 2**20


def test_plan_validation_counts_batch_groups(plans):
    data = plans[2].to_dict()
    data["context"] = dict(data["context"], cp=3)
    with pytest.raises(autopar.PlanError, match=r"context cp=3 does not divide dp=8"):
        Plan.from_dict(data).validate()


@pytest.mark.parametrize("fixed, message", [
    ({"cp": 3}, r"cp=3: the sequence of 2048 tokens does not split into 2 x cp = 6 equal chunks .*; "
                r"cp=3 does not divide the 8 devices"),
    ({"cp": 4, "dp": 2}, r"cp=4: cp=4 does not divide dp=2 \(cp folds over the data-parallel ranks\)"),
])
def test_impossible_cp_is_refused_in_one_line(fixed, message):
    model, inputs, loss_fn, target = llama.build(size="small", batch=8, seq=2048, device="meta")
    with pytest.raises(autopar.PlanError, match=message):
        autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target, fixed=fixed)


def test_cp_with_ep_moves_each_ranks_own_tokens():
    # ep and cp both fold over dp: a rank dispatches the tokens of its chunks (1/cp of each of its
    # group's sequences), so per micro-batch of one sequence half the rows at cp = 2, twice as often
    model, inputs, loss_fn, target = moe.build(size="tiny", batch=8, seq=64, device="meta")
    pin = {"dp": 8, "tp": 1, "pp": 1, "ep": 2, "zero": 0, "recompute": "none", "microbatch_size": 1}
    one, two = (autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                             fixed=dict(pin, **extra)) for extra in ({}, {"cp": 2}))
    assert two.context["cp"] == 2 and two.experts["ep"] == one.experts["ep"] == 2
    assert two.schedule["microbatches"] == 2 * one.schedule["microbatches"]
    for a, b in zip(one.experts["layers"].values(), two.experts["layers"].values(), strict=True):
        for way in ("forward", "backward"):
            (counts1, rows1, back1), (counts2, rows2, back2) = a["all_to_all_bytes"][way], b["all_to_all_bytes"][way]
            assert counts2 == counts1 and rows2 == rows1 / 2 and back2 == back1 / 2, (way, a, b)
    a2a1, a2a2 = one.communication["all_to_all"]["ep"], two.communication["all_to_all"]["ep"]
    # a step moves the same tokens in twice the messages (each with its token counts)
    assert a2a2["count"] == 2 * a2a1["count"] and a2a2["bytes"] == pytest.approx(a2a1["bytes"], rel=0.01)


def test_parallelize_refuses_what_it_does_not_run_under_cp_before_any_collective():
    model, inputs, loss_fn, target = llama.build(size="tiny", batch=8)
    pm = autopar.parallelize(model, cluster="1x1xcpu", loss_fn=loss_fn, fixed={"cp": 2}, compile=False)
    with pytest.raises(autopar.PlanError, match=r"^cp=2 needs the compiled step program"):
        pm.train_step(inputs, target)


@pytest.fixture(scope="module")
def long_context():
    # Llama 3 8B's blocks (two of them) at 32k tokens, a batch of 8 on one H100 node
    return llama.build(size="8b", n_layers=2, batch=8, seq=32768, device="meta")


def test_the_search_weighs_cp_for_long_sequences_and_says_why(long_context):
    model, inputs, loss_fn, target = long_context
    plan = autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target)
    x = plan.context
    assert x["considered"] == [2, 4, 8]  # 32768 tokens: down to 4096 per rank
    other = x["other_side"]
    # the decision is the better side: the other side is slower, or does not fit
    assert other is None or other["step_time_s"] >= plan.predicted["step_time_s"]
    assert (other is None) or (other["cp"] == 1) == (x["cp"] > 1)
    line = next(l for l in plan.summary().splitlines() if l.strip().startswith("context:"))
    if x["cp"] > 1:
        assert "chosen among cp 2, 4, 8 over the best plan without cp" in line
        assert plan.mesh["dp"] % x["cp"] == 0
    else:
        assert "not split (cp 2, 4, 8 weighed)" in line


def test_runnable_plans_weigh_cp_and_short_sequences_never(long_context):
    from autopar.planner.make import make_plan

    model, inputs, loss_fn, target = long_context
    runnable = make_plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target, runnable=True)
    assert runnable.context["considered"] == [2, 4, 8]  # parallelize runs cp: weighed for it too
    model, inputs, loss_fn, target = llama.build(size="8b", n_layers=2, batch=8, seq=8192, device="meta")
    short = autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target)
    assert not short.context and "context" not in short.to_json()

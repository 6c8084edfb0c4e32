"""What the plan prices is what the runtime runs: the collectives of a generated rank program.

The plan's ``communication`` section lists, per collective kind and mesh axis, how many
calls a step makes and how many bytes they carry (the MIP's choice, re-costed by
``evaluation.evaluate``). Here the rank-0 program is generated exactly as ``parallelize``
generates it (on the fake process-group backend, as ``--emit`` does), its tp collectives
are counted with their bytes, and the totals must equal the plan's, kind by kind.

Two places where the program and the plan's list differ in form, not in substance:
- Gradients returning to replicated parameters (Partial -> Replicate all-reduces,
  Shard -> Replicate all-gathers) are priced by the MIP bucketed (bandwidth, no
  per-tensor latency) but counted in the plan one per gradient; the runtime issues them
  as one call per (kind, dtype) bucket once per step. The plan's count is the number of
  gradients in the buckets, its bytes their sum. (With several micro-batches the plan
  prices them once per micro-batch while the runtime reduces once per step, after
  accumulating; these plans pin one micro-batch.)
- CPU process groups have no all-to-all: DTensor runs Shard -> Shard as an all-gather of
  the whole tensor and a local chunk, so the plan's all_to_all shows as all_gather (same
  bytes: the plan counts the whole tensor).
"""

from collections import defaultdict
from pathlib import Path

import pytest

import autopar
from autopar.modelspec import load_model_spec
from autopar.runtime.emit import rank_collectives
from autopar.testing import tp_friendly_cluster, tp_only_cluster

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SPEC_ARGS = {"size": "tiny", "batch": "8"}


def _plan(spec: str, cluster):
    model, inputs, loss_fn, target = load_model_spec(spec, SPEC_ARGS)
    return autopar.plan(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target,
                        fixed={"tp": 2, "pp": 1, "microbatches": 1})


def _tp_totals(plan) -> dict[str, dict[str, int]]:
    """The plan's tp collectives per step, all-to-all folded into all-gather (CPU backends)."""
    out = defaultdict(lambda: {"count": 0, "bytes": 0})
    for kind, axes in plan.communication.items():
        if "tp" in axes:
            key = "all_gather" if kind == "all_to_all" else kind
            out[key]["count"] += int(axes["tp"]["count"])
            out[key]["bytes"] += int(axes["tp"]["bytes"])
    return dict(out)


def _run_totals(census) -> dict[str, dict[str, int]]:
    """What the rank runs on tp per step, counted the plan's way (a bucket: one per gradient)."""
    out = defaultdict(lambda: {"count": 0, "bytes": 0})
    for kind, axes in census["program"].items():
        if "tp" in axes:
            out[kind]["count"] += axes["tp"]["count"]
            out[kind]["bytes"] += axes["tp"]["bytes"]
    for b in census["buckets"]:
        out[b["kind"]]["count"] += len(b["grads"])
        out[b["kind"]]["bytes"] += b["bytes"]
    return dict(out)


@pytest.fixture(scope="module")
def llama_sp():
    spec = f"{EXAMPLES}/llama.py:build"
    plan = _plan(spec, tp_friendly_cluster("1x2xcpu"))
    return plan, rank_collectives(spec, SPEC_ARGS, plan=plan, cluster=tp_friendly_cluster("1x2xcpu"))


@pytest.mark.parametrize("cluster", [tp_friendly_cluster, tp_only_cluster],
                         ids=["sequence_parallel", "megatron"])
def test_gpt_rank_program_runs_the_plans_collectives(cluster):
    spec, c = f"{EXAMPLES}/gpt.py:build", cluster("1x2xcpu")
    plan = _plan(spec, c)
    assert plan.mesh == {"pp": 1, "dp": 1, "tp": 2}
    census = rank_collectives(spec, SPEC_ARGS, plan=plan, cluster=c)
    assert _run_totals(census) == _tp_totals(plan)
    kinds = [(b["group"], b["kind"], b["dtype"]) for b in census["buckets"]]
    assert len(kinds) == len(set(kinds))  # one call per (layer group, kind, dtype)


def test_llama_sequence_parallel_reshards_once_per_placement(llama_sp):
    """Issue 10: the norm output was gathered once for each of wq, wk, wv and w1, w3
    (19 all-gathers in the program for the plan's 11 plus one all-to-all)."""
    plan, census = llama_sp
    assert any(layer["sequence_parallel"] for layer in plan.layers.values())
    assert _run_totals(census) == _tp_totals(plan)
    gathered_grads = sum(len(b["grads"]) for b in census["buckets"] if b["kind"] == "all_gather")
    expected = int(plan.communication["all_gather"]["tp"]["count"]) - gathered_grads \
        + int(plan.communication.get("all_to_all", {}).get("tp", {}).get("count", 0))
    assert census["program"]["all_gather"]["tp"]["count"] == expected
    assert census["program"]["reduce_scatter"]["tp"]["count"] == plan.communication["reduce_scatter"]["tp"]["count"]


def test_llama_gradient_returns_are_one_bucket_per_kind(llama_sp):
    """The MIP prices gradients returning to their parameters bucketed; the program leaves
    them to the runtime, which issues one call per (layer group, kind, dtype) right before the
    group's dp bucket, not one per parameter."""
    plan, census = llama_sp
    # inside the program, the only tp all-reduces are the loss's over vocabulary shards (loss
    # parallel: the log-softmax's row max and sum, the picked log-probability, the gradient's row
    # sum; one fp32 value per token each); every other tp all-reduce returns a gradient
    assert plan.ops["_log_softmax"]["in"] == ["S1"]
    tokens = load_model_spec(f"{EXAMPLES}/llama.py:build", SPEC_ARGS)[1][0].numel()  # (batch, seq) token ids
    inner = census["program"]["all_reduce"]["tp"]
    assert inner == {"count": 4, "bytes": 4 * 4 * tokens}
    kinds = [(b["group"], b["kind"], b["dtype"]) for b in census["buckets"]]
    assert len(kinds) == len(set(kinds))
    reduced = [b for b in census["buckets"] if b["kind"] == "all_reduce"]
    assert sum(len(b["grads"]) for b in reduced) + 4 == plan.communication["all_reduce"]["tp"]["count"]  # norms, embedding
    assert sum(b["bytes"] for b in reduced) + inner["bytes"] == plan.communication["all_reduce"]["tp"]["bytes"]
    assert any("tok_embeddings.weight" in b["grads"] for b in reduced)
    assert len(reduced) < sum(len(b["grads"]) for b in reduced)  # bucketed: fewer calls than gradients

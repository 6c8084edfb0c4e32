"""The dp collectives and pipeline messages each rank executes equal the plan's communication list.

Spawned gloo workers wrap the torch.distributed calls the runtime makes (``all_reduce``,
the reduce-scatter and all-gather of :mod:`autopar.runtime.zero`, ``isend``/``irecv``)
with a recorder that notes, during one training step (the second), every call's kind,
group ranks and bytes. The test then asserts, per rank:

- dp: the multiset of (kind, dp group, bytes) equals the plan's ``communication[kind]["dp"]
  ["buckets"]`` (each bucket ``count`` times) for the stages the rank holds: one bucket
  per layer group and dtype, as :mod:`autopar.zero_def` counts them (all-reduce once a
  step at ZeRO-0; reduce-scatter once (1) or per micro-batch (2, 3); all-gather after
  the step (1, 2) or twice per micro-batch (3)).
- p2p: the multisets of (source rank, destination rank, bytes) of the sends and of the
  receives of one pipeline (the ranks at dp = tp = 0) both equal the plan's
  ``communication["p2p"]["pp"]["cuts"]``: per cut, each forward message (one per dtype)
  from the stage before it to the one after, each gradient message back, ``count`` times
  (once per micro-batch), with the bytes one rank sends (its tp shard: the
  sequence-sharded activation of the TP+SP pipeline; bf16 under the bf16-mixed one).

tp collectives run inside the program as functional collectives and are checked against
the plan by ``tests/test_program_collectives.py``; a tp x dp case here checks that the
dp buckets hold each parameter's tp shard.
"""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from autopar.testing import slow_network_cluster, spawn_world, tp_friendly_cluster

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


def _install_recorder(log: list, on: list):
    import torch.distributed as dist

    from autopar.runtime import zero_gather, zero_reduce

    def ranks(group):
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))

    def wrap(fn, kind, tensor_at):
        def recorded(*args, **kwargs):
            if on[0]:
                t = args[tensor_at]
                log.append((kind, ranks(kwargs.get("group")), t.numel() * t.element_size()))
            return fn(*args, **kwargs)
        return recorded

    def wrap_p2p(fn, kind):
        def recorded(tensor, peer, *args, **kwargs):
            if on[0]:
                log.append((kind, (dist.get_rank(), peer), tensor.numel() * tensor.element_size()))
            return fn(tensor, peer, *args, **kwargs)
        return recorded

    dist.all_reduce = wrap(dist.all_reduce, "all_reduce", 0)
    zero_gather._all_gather = wrap(zero_gather._all_gather, "all_gather", 0)  # bytes of the gathered output
    zero_reduce._all_gather = wrap(zero_reduce._all_gather, "all_gather", 0)  # (finish_tp's, on tp)
    zero_reduce._reduce_scatter = wrap(zero_reduce._reduce_scatter, "reduce_scatter", 1)  # bytes of the whole input
    dist.isend = wrap_p2p(dist.isend, "send")
    dist.irecv = wrap_p2p(dist.irecv, "recv")
    dist.all_gather_into_tensor = wrap(dist.all_gather_into_tensor, "pp_gather", 0)  # (only the pipeline's
    # gathers look it up at call time: ZeRO's bound it at import, the program's are functional)


def _run(rank, world, cases):
    sys.path.insert(0, EXAMPLES)
    import importlib

    import autopar

    log, on = [], [False]
    _install_recorder(log, on)
    out = {}
    for name, example, n_layers, cluster, fixed, *precision in cases:
        torch.manual_seed(0)
        module = importlib.import_module(example)
        kw = {"n_layer": n_layers} if example == "gpt" else {"n_layers": n_layers}
        model, inputs, loss_fn, target = module.build(size="tiny", batch=8, **kw)
        pm = autopar.parallelize(model, cluster=cluster, loss_fn=loss_fn, fixed=fixed,
                                 precision=precision[0] if precision else None)
        pm.train_step(inputs, target)
        log.clear()
        on[0] = True
        pm.train_step(inputs, target)
        on[0] = False
        pp = pm.plan.mesh["pp"]
        pp_rank = pm.pp_mesh.get_local_rank("pp") if pp > 1 else 0
        out[name] = {"log": list(log), "plan": pm.plan.communication, "pp": pp, "pp_rank": pp_rank,
                     "sp": pm.plan.sequence_parallel, "precision": pm.plan.model["precision"],
                     "sends": [st.get("sends") for st in pm.plan.stages],
                     "dp_ranks": tuple(pm._group_ranks("dp")), "tp_ranks": tuple(pm._group_ranks("tp")),
                     "pipeline": [int(r) for r in pm.pp_mesh.mesh[:, 0, 0]] if pp > 1 else [rank]}
    return out


TWO = [
    ("dp", "gpt", 2, "1x2xcpu", {"dp": 2, "zero": 0, "microbatches": 2}),
    ("zero1", "gpt", 2, "1x2xcpu", {"dp": 2, "zero": 1, "microbatches": 2}),
    ("zero2", "gpt", 2, "1x2xcpu", {"dp": 2, "zero": 2, "microbatches": 2}),
    ("zero3", "llama", 2, "1x2xcpu", {"dp": 2, "zero": 3, "microbatches": 2}),
]
FOUR = [
    ("pp2xdp2_1f1b_zero1_bf16", "llama", 2, "1x4xcpu",
     {"pp": 2, "dp": 2, "tp": 1, "zero": 1, "microbatches": 4, "schedule": "1f1b"}, "bf16-mixed"),
    ("pp2xdp2_zbh1_zero3", "gpt", 2, "1x4xcpu",
     {"pp": 2, "dp": 2, "tp": 1, "zero": 3, "microbatches": 4, "schedule": "zb-h1"}),
    ("pp2xtp2_sp_zbh2", "llama", 2, tp_friendly_cluster("1x4xcpu"),
     {"pp": 2, "dp": 1, "tp": 2, "sp": True, "microbatches": 4, "schedule": "zb-h2"}),
    ("pp2xtp2_pieces_1f1b", "llama", 2, slow_network_cluster("2x2xcpu"),
     {"pp": 2, "dp": 1, "tp": 2, "microbatches": 4, "schedule": "1f1b"}),
    # memory-bound ops free: Megatron's tp without sp, the block output and its gradient replicated
    ("pp2xtp2_gpt_pieces_1f1b", "gpt", 2, slow_network_cluster("2x2xcpu").with_overrides(hbm_bytes_per_s=1e14),
     {"pp": 2, "dp": 1, "tp": 2, "microbatches": 4, "schedule": "1f1b"}),
    ("pp2xdp2_interleaved_zero2", "gpt", 4, "1x4xcpu",
     {"pp": 2, "dp": 2, "tp": 1, "zero": 2, "microbatches": 4, "schedule": "interleaved"}),
    ("dp2xtp2_zero2", "llama", 2, tp_friendly_cluster("1x4xcpu"), {"dp": 2, "tp": 2, "zero": 2, "microbatches": 2}),
]


@pytest.fixture(scope="module")
def two():
    return spawn_world(_run, 2, TWO)


@pytest.fixture(scope="module")
def four():
    return spawn_world(_run, 4, FOUR)


def _expected_dp(r) -> Counter:
    want: Counter = Counter()
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        seen = set()
        for b in r["plan"].get(kind, {}).get("dp", {}).get("buckets", []):
            if b["stage"] % r["pp"] != r["pp_rank"] or (b["layer"], b["dtype"]) in seen:
                continue  # another rank's stage; or a bucket two of this rank's stages share (tied)
            seen.add((b["layer"], b["dtype"]))
            want[(kind, r["dp_ranks"], b["bytes"])] += b["count"]
    return want


def _recorded_dp(r) -> Counter:
    return Counter(e for e in r["log"] if e[0] in ("all_reduce", "reduce_scatter", "all_gather")
                   and e[1] == r["dp_ranks"] and len(r["dp_ranks"]) > 1)


def _check(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        assert _recorded_dp(r) == _expected_dp(r), (name, rank, sorted(_recorded_dp(r).items()),
                                                    sorted(_expected_dp(r).items()))
    first = results[0][name]
    want = _expected_p2p(first)
    sends = Counter((*e[1], e[2]) for rank in first["pipeline"] for e in results[rank][name]["log"] if e[0] == "send")
    recvs = Counter((e[1][1], e[1][0], e[2]) for rank in first["pipeline"] for e in results[rank][name]["log"]
                    if e[0] == "recv")
    assert sends == want, (name, sorted(sends.items()), sorted(want.items()))
    assert recvs == want, (name, sorted(recvs.items()), sorted(want.items()))
    gathers = Counter((rank, *e[1:]) for rank in first["pipeline"] for e in results[rank][name]["log"]
                      if e[0] == "pp_gather")
    assert gathers == _expected_gathers(first, results, name), (name, sorted(gathers.items()))
    p2p = first["plan"].get("p2p", {}).get("pp", {"count": 0, "bytes": 0})
    assert (sum(want.values()), sum(b * k for (_, _, b), k in want.items())) == (p2p["count"], p2p["bytes"]), name


def _expected_p2p(r) -> Counter:
    """(source rank, destination rank, bytes) of the plan's pipeline messages, each ``count`` times."""
    want: Counter = Counter()
    for cut in r["plan"].get("p2p", {}).get("pp", {}).get("cuts", []):
        a, b = (r["pipeline"][s % r["pp"]] for s in cut["stages"])
        for src, dst, side in ((a, b, "forward"), (b, a, "backward")):
            for msg in cut[side]:
                want[(src, dst, msg["bytes"])] += msg["count"]
    return want


def _expected_gathers(r, results, name) -> Counter:
    """(receiving rank, its tp group, bytes) of the tp all-gathers that rebuild the replicated
    values of the plan's pipeline messages, each ``count`` times."""
    want: Counter = Counter()
    for cut in r["plan"].get("p2p", {}).get("pp", {}).get("cuts", []):
        a, b = (r["pipeline"][s % r["pp"]] for s in cut["stages"])
        for dst, side in ((b, "forward"), (a, "backward")):
            for msg in cut[side]:
                if msg.get("tp_gather_bytes"):
                    want[(dst, results[dst][name]["tp_ranks"], msg["tp_gather_bytes"])] += msg["count"]
    return want


@pytest.mark.parametrize("name", [c[0] for c in TWO])
def test_two_ranks_run_the_planned_collectives(two, name):
    _check(two, name)


@pytest.mark.parametrize("name", [c[0] for c in FOUR])
def test_four_ranks_run_the_planned_collectives(four, name):
    _check(four, name)


def test_pipeline_messages_are_per_rank_and_per_dtype(four):
    """What makes the messages checked above differ from the activation's size: the TP+SP
    pipeline's cut carries each rank's sequence shard (half the activation and of its
    gradient at tp = 2) plus the replicated rotary tables forward, and the bf16-mixed
    pipeline's messages are bf16."""
    sp, bf16 = four[0]["pp2xtp2_sp_zbh2"], four[0]["pp2xdp2_1f1b_zero1_bf16"]
    assert sp["sp"] and bf16["precision"] == "bf16-mixed"
    cut, sends = sp["plan"]["p2p"]["pp"]["cuts"][0], sp["sends"][0]
    assert [(t["placement"], t["rank_bytes"] * 2) for t in sends["backward"]] == [("S1", t["bytes"])
                                                                                  for t in sends["backward"]]
    assert sorted(t["placement"] for t in sends["forward"]) == ["R", "R", "S1"]  # cos, sin, the block output
    assert [m["bytes"] for m in cut["backward"]] == [sum(t["rank_bytes"] for t in sends["backward"])]
    assert [m["bytes"] for m in cut["forward"]] == [sum(t["rank_bytes"] for t in sends["forward"])]
    cut = bf16["plan"]["p2p"]["pp"]["cuts"][0]
    assert {m["dtype"] for m in cut["forward"] + cut["backward"]} == {"bfloat16"}
    assert {t["dtype"] for side in bf16["sends"][0].values() for t in side} == {"bfloat16"}


def test_replicated_pipeline_values_travel_as_tp_pieces(four):
    """Megatron-LM's scatter/gather of pipeline tensors, where the plan chooses it: across a
    slow network the values every tp rank holds whole (the Llama rotary tables, relayed to
    the second stage) cross the cut as one half per tp rank (tp = 2), and the receiving
    stage's tp group all-gathers the halves, once per micro-batch; the plan's message bytes
    and gathers equal what the ranks ran (``_check``). On fast links the same tables go
    whole (the gather's latency costs more than the bytes it saves)."""
    r = four[0]["pp2xtp2_pieces_1f1b"]
    cut, sends = r["plan"]["p2p"]["pp"]["cuts"][0], r["sends"][0]
    tables = [t for t in sends["forward"] if t["placement"] == "R"]
    assert len(tables) == 2 and all(t["rank_bytes"] * 2 == t["bytes"] for t in tables)
    (msg,) = cut["forward"]
    assert msg["tp_gather_bytes"] == sum(t["bytes"] for t in tables)
    assert "tp_gather_bytes" not in cut["backward"][0]  # (the tables need no gradient)
    receiver = r["pipeline"][1]
    gathers = [e for e in four[receiver]["pp2xtp2_pieces_1f1b"]["log"] if e[0] == "pp_gather"]
    assert [e[2] for e in gathers] == [msg["tp_gather_bytes"]] * 4  # 4 micro-batches
    gpt = four[0]["pp2xtp2_gpt_pieces_1f1b"]  # both ways: the block output forward, its gradient back
    (fwd,), (back,) = gpt["plan"]["p2p"]["pp"]["cuts"][0]["forward"], gpt["plan"]["p2p"]["pp"]["cuts"][0]["backward"]
    assert [t["placement"] for side in gpt["sends"][0].values() for t in side] == ["R", "R"]
    assert fwd["tp_gather_bytes"] == back["tp_gather_bytes"] == 2 * fwd["bytes"] == 2 * back["bytes"]
    fast = four[0]["pp2xtp2_sp_zbh2"]
    assert [t["rank_bytes"] for t in fast["sends"][0]["forward"] if t["placement"] == "R"] == \
        [t["bytes"] for t in tables]
    assert not any(e[0] == "pp_gather" for rank in fast["pipeline"] for e in four[rank]["pp2xtp2_sp_zbh2"]["log"])


def test_the_recorder_sees_the_buckets(two):
    """Each ZeRO stage's recorded dp calls have the kinds zero_def gives it (a recorder that
    saw nothing would pass the equality above for an empty plan list)."""
    kinds = {name: {e[0] for e in two[0][name]["log"] if e[0] not in ("send", "recv")} for name, *_ in TWO}
    assert kinds == {"dp": {"all_reduce"}, "zero1": {"reduce_scatter", "all_gather"},
                     "zero2": {"reduce_scatter", "all_gather"}, "zero3": {"reduce_scatter", "all_gather"}}

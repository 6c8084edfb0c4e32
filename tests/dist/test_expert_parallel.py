"""Expert parallelism in ``autopar.parallelize`` on spawned gloo worlds, against one process.

The MoE example (top-2 of 8 SwiGLU experts, shared expert, per-sequence balance loss)
and Hugging Face Mixtral (tiny: top-2 of 4 experts, default grouped-matmul experts, which
autopar traces through its experts op) train 3 AdamW steps under plans pinned to (and Qwen2-MoE,
whose blocks add a gated shared expert, under ep=2 on 2 ranks):

- dp=2, ZeRO-3, no ep: the experts replicated, each rank routing its own tokens
  (``autopar.passes.token_local``: no dp all-gather in the program, as the plan prices);
- ep=2 on 2 ranks (both models): each rank holds half the experts of a block, tokens
  dispatched and combined by all-to-all over the ep group;
- on 4 ranks (both models), ep=2 folded over dp=4 (two replicas of each expert half, expert
  gradients summed over the replica group; the example's beside cp=2, its sequences split over
  pairs of dp ranks, each rank dispatching the tokens of its two chunks, without the balance
  loss, which is taken per sequence; and under ZeRO-3 (the example, 2 micro-batches) and
  ZeRO-1 (Mixtral), whose expert state is in chunks over the replica group, everything else
  over dp), ep=4, and ep=2 x tp=2 with etp=2 pinned (ep over dp, each expert split over tp; the
  layout with ep folded over tp is ``test_expert_folding_run.py``'s) (the example's "small"
  size; attention sharded Megatron-style over tp, on a cluster where that pays; each expert's
  hidden width split over tp (Mixtral: down_proj only, its gate and up halves are stacked in
  one tensor), and each tp rank exchanges tokens with its ep peers in its tp column).

Every step's loss, the last gradients and the parameters must be as accurate as one fp32
process (``parallel_compare``; the optimizer is ``test_parallel.py``'s, which explains
eps). Each rank must hold only its E/ep experts (the model's parameters and the runtime's
storage), the live parameter/gradient/optimizer bytes must equal the plan's prediction,
and the program must call the experts op over this rank's ep group. A token sent to the
wrong expert, or an expert gradient summed over the wrong ranks, moves the loss by far
more than the tolerance (a first version that gave every rank rank 0's experts was 735x
outside it at the first step).
"""

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from autopar.testing import spawn_world, torch_version, tp_only_cluster
from parallel_compare import Reference, assert_matches, train_judged

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
STEPS = 3
# the stacked expert parameters of each model: the MoE example's, Hugging Face Mixtral's
EXPERT_PARAMS = {"moe": ("w_gate", "w_up", "w_down"), "mixtral": ("gate_up_proj", "down_proj"),
                 "qwen2_moe": ("gate_up_proj", "down_proj")}


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


def _record_all_to_alls(log: list, step: list):
    """Note (step, group ranks, bytes sent) of every ``all_to_all_single`` (the experts op's)."""
    import torch.distributed as dist

    import autopar.experts

    original = dist.all_to_all_single

    def recorded(output, input, *args, group=None, **kwargs):
        log.append((step[0], tuple(dist.get_process_group_ranks(group)), input.numel() * input.element_size()))
        return original(output, input, *args, group=group, **kwargs)

    dist.all_to_all_single = recorded
    assert autopar.experts.dist is dist  # (the experts op calls it through this module)


def _build(model_name: str, tp: int, cp: int = 1):
    """(model, inputs, loss_fn, target, experts per block, forward of the one-process reference).
    Under cp the MoE example without its balance loss, which is taken per sequence (the planner
    refuses cp for it: ``tests/test_sequence_mixing.py``), at 36 tokens: chunks of 9 a rank, and
    not 8 tokens a rank, the experts' count (an ``arange`` cp would take for positions)."""
    if model_name in ("mixtral", "qwen2_moe"):  # Hugging Face, tiny: 2 layers, top-2 of 4 experts; labels in the inputs
        import hf

        model, inputs, _, _ = hf.build(model=model_name, batch=8)
        n_experts = getattr(model.config, "num_local_experts", None) or model.config.num_experts
        return model, inputs, None, None, n_experts, lambda ref, like: ref(**like(inputs)).loss
    import moe

    size = "small" if tp > 1 else "tiny"
    kw = {"seq": 36} if cp > 1 else {"aux_loss": 0.01}
    model, inputs, loss_fn, target = moe.build(size=size, n_layers=2, batch=8, shared_expert=True, **kw)
    return model, inputs, loss_fn, target, model.config.n_experts, \
        lambda ref, like: loss_fn(ref(*like(inputs)), like(target))


def _train(rank, world, configs):
    """On every rank, for each (name, model, fixed): train 3 steps; rank 0 also trains the one-process
    reference alongside and judges (``train_judged``)."""
    sys.path.insert(0, EXAMPLES)
    import torch.distributed as dist

    import autopar

    report = {}
    calls, step = [], [0]
    _record_all_to_alls(calls, step)
    for name, model_name, fixed in configs:
        calls.clear()
        torch.manual_seed(0)
        model, inputs, loss_fn, target, n_experts, reference_loss = _build(model_name, fixed.get("tp", 1),
                                                                           fixed.get("cp", 1))
        reference = Reference(model, _optimizer) if rank == 0 else None  # (judged on rank 0: train_judged)
        n_tensors = sum(p.requires_grad for p in model.parameters())
        cluster = tp_only_cluster(f"1x{world}xcpu") if fixed.get("tp", 1) > 1 else f"1x{world}xcpu"
        pm = autopar.parallelize(model, cluster=cluster, loss_fn=loss_fn, optimizer=_optimizer, fixed=fixed)

        def run(pm):
            step[0] += 1
            return pm.train_step(inputs, target) if target is not None else pm.train_step(inputs)

        raw, losses, grad_err, param_err = train_judged(pm, reference, steps=STEPS, run=run,
                                                        run_reference=reference_loss)
        code = pm.step_program.code
        ep = pm.plan.experts.get("ep", 1) if pm.plan.experts else 1
        report[name] = {
            "raw": raw, "losses": losses, "grad_err": grad_err, "param_err": param_err,
            "mesh": pm.plan.mesh, "ep": ep, "n_experts": n_experts, "cp": (pm.plan.context or {}).get("cp", 1),
            "ep_ranks": dist.get_process_group_ranks(pm.params.ep_group) if ep > 1 else None,
            "replica_ranks": dist.get_process_group_ranks(pm.params.replica_group) if ep > 1 else None,
            "held": {f: tuple(p.shape) for f, p in model.named_parameters()
                     if f.rsplit(".", 1)[-1] in EXPERT_PARAMS[model_name]},
            "stored": {f: tuple(e.local_shape) for f, e in pm.params.entries.items()
                       if f.rsplit(".", 1)[-1] in EXPERT_PARAMS[model_name]},
            # the ranks each parameter's ZeRO chunks are spread over, and this rank's chunk length
            "chunked": {f: (list(e.shards.ranks), e.chunk) for f, e in pm.params.entries.items()},
            "zero": pm.plan.zero,
            # the process group each experts op (forward and backward) of the program runs over
            "experts_groups": re.findall(r"autopar\.moe_experts(?:_backward)?\.default\([^\n]*, '([^']*)'\)", code),
            "ep_group_name": pm.params.ep_group.group_name if ep > 1 else "",
            "n_tensors": n_tensors,
            "all_to_alls": [(s - step[0] + STEPS, g, b) for s, g, b in calls],  # steps 1..STEPS
            "plan_experts": pm.plan.experts, "plan_all_to_all": pm.plan.communication.get("all_to_all", {}),
            "dp_all_gathers": [g for g in re.findall(r"all_gather_into_tensor\.default\([^,]+, \d+, '([^']*)'\)", code)
                               if g == pm.mesh.get_group("dp").group_name],
            "placements": {f: v for layer in pm.plan.layers.values() for f, v in layer["params"].items()},
            "measured": pm.memory_bytes(), "predicted": pm.plan.stages[0]["predicted"]["memory_bytes"],
        }
    return report


# (the all-to-all test reads the calls of a step in order, micro-batch after micro-batch)
TWO = [("dp_zero3", "moe", {"dp": 2, "zero": 3}), ("ep2", "moe", {"dp": 2, "ep": 2, "microbatches": 1}),
       ("mixtral_ep2", "mixtral", {"dp": 2, "ep": 2, "microbatches": 1}),
       ("qwen2_moe_ep2", "qwen2_moe", {"dp": 2, "ep": 2, "microbatches": 1})]
FOUR = [("ep2_replicas2_cp2", "moe", {"dp": 4, "cp": 2, "ep": 2, "microbatches": 1}),
        ("ep2_replicas2_zero3", "moe", {"dp": 4, "ep": 2, "zero": 3, "microbatches": 2}),
        ("mixtral_ep2_replicas2_zero1", "mixtral", {"dp": 4, "ep": 2, "zero": 1, "microbatches": 1}),
        ("ep4", "moe", {"dp": 4, "ep": 4, "microbatches": 1}),
        ("ep2_tp2", "moe", {"dp": 2, "tp": 2, "ep": 2, "etp": 2, "microbatches": 1}),
        ("mixtral_ep2_replicas2", "mixtral", {"dp": 4, "ep": 2, "microbatches": 1}),
        ("mixtral_ep4", "mixtral", {"dp": 4, "ep": 4, "microbatches": 1}),
        ("mixtral_ep2_tp2", "mixtral", {"dp": 2, "tp": 2, "ep": 2, "etp": 2, "microbatches": 1})]


@pytest.fixture(scope="module", params=[2, 4], ids=["two_ranks", "four_ranks"])
def world(request):
    configs = TWO if request.param == 2 else FOUR
    return request.param, configs, spawn_world(_train, request.param, configs)


def test_moe_trains_like_one_process_with_each_rank_holding_its_experts(world):
    size, configs, results = world
    for name, model_name, fixed in configs:
        for rank, by_name in enumerate(results):
            r = by_name[name]
            where = f"{name} rank {rank}"
            if rank == 0:  # rank 0 trained the references and judged (train_judged)
                assert_matches(r["losses"], r["grad_err"], r["param_err"], where)
            assert r["raw"] == results[0][name]["raw"], where  # every rank returned the judged losses
            ep, tp = fixed.get("ep", 1), fixed.get("tp", 1)
            assert r["ep"] == ep and r["mesh"] == {"pp": 1, "dp": size // tp, "tp": tp}, where
            assert r["cp"] == fixed.get("cp", 1), where
            if tp > 1:  # Megatron attention: q, k, v by heads, the output projection by its input
                attention = {"moe": [f"layers.1.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")],
                             "mixtral": [f"model.layers.1.self_attn.{w}_proj.weight" for w in "qkvo"]}[model_name]
                # (on torch 2.14 the planner keeps the MoE example's second output projection whole after a
                # gather instead, 0.2% slower by its own model, within the sharding MIP's 1% gap)
                wo = "S1" if model_name == "mixtral" or torch_version() < (2, 14) else "R"
                assert [r["placements"][f] for f in attention] == ["S0", "S0", "S0", wo], (where, r["placements"])
            # only this rank's experts: E/ep of each stacked weight, in the model and in the storage
            # (and of those, the part of each expert's hidden width the plan gives this tp rank)
            assert len(r["held"]) == len(EXPERT_PARAMS[model_name]) * 2, r["held"]
            for fqn, shape in r["held"].items():
                split = r["placements"][fqn]
                local = list(shape)
                if split != "R":
                    local[int(split[1:])] //= tp
                assert shape[0] == r["n_experts"] // ep and r["stored"][fqn] == tuple(local), (where, fqn, shape)
            if tp > 1 and model_name == "moe":  # each expert's SwiGLU split over tp like Megatron's MLP
                assert [r["placements"][f"layers.1.moe.{w}"] for w in EXPERT_PARAMS["moe"]] == ["S2", "S2", "S1"]
            if tp > 1 and model_name == "mixtral":  # [gate; up] stacked in one tensor: only down_proj splits
                assert [r["placements"][f"model.layers.1.mlp.experts.{w}"] for w in EXPERT_PARAMS["mixtral"]] \
                    == ["R", "S2"]
            if ep > 1:  # along the rank's tp column (ranks tp apart): ep groups of consecutive dp ranks
                dp_rank, t = divmod(rank, tp)
                part = dp_rank % ep
                assert r["ep_ranks"] == [(dp_rank - part + i) * tp + t for i in range(ep)], where
                assert r["replica_ranks"] == [d * tp + t for d in range(part, size // tp, ep)], where
            if fixed.get("zero"):  # ZeRO: expert state in chunks over the replicas, the rest over dp
                assert r["zero"] == fixed["zero"], where
                dp_ranks = [d * tp + rank % tp for d in range(size // tp)]
                for fqn, (ranks, chunk) in r["chunked"].items():
                    expert = fqn in r["held"] and ep > 1
                    assert ranks == (r["replica_ranks"] if expert else dp_ranks), (where, fqn, ranks)
                    numel = math.prod(r["stored"][fqn]) if expert else None
                    assert not expert or chunk == math.ceil(numel / len(ranks)), (where, fqn, chunk)
            # forward and backward of each block's experts, over this rank's ep group ("" = all local)
            assert r["experts_groups"] == [r["ep_group_name"]] * 4, (where, r["experts_groups"])
            # routing runs on the rank's own tokens: the program gathers nothing over dp
            assert not r["dp_all_gathers"], where
            # live bytes equal the plan's, up to the padding that makes ZeRO's dp chunks equal
            # (at most dp - 1 fp32 elements per tensor, twice for Adam's m and v)
            pad = r["n_tensors"] * (size // tp - 1) * 4
            for kind in ("params", "grads"):
                assert abs(getattr(r["measured"], kind) - r["predicted"][kind]) <= pad, (where, kind)
            assert abs(r["measured"].optimizer - r["predicted"]["optimizer"]) <= 2 * pad, where


def test_each_rank_runs_the_all_to_alls_the_plan_priced(world):
    """Per step and rank, each experts op (forward, then backward) runs three all-to-alls over
    the rank's ep group: the token counts, the dispatch, the combine. The counts and dispatches
    send exactly what the plan priced (``experts.layers[*].all_to_all_bytes``: the rank's
    rows x width, twice the width in backward, whose dispatch carries input and output
    gradient together); a combine sends back what the rank's experts received, which depends
    on the routing, so per ep group the combines add up to ep times the plan's figure (it
    assumes balanced routing: the group's mean is exact)."""
    size, configs, results = world
    for name, _, fixed in configs:
        ep = fixed.get("ep", 1)
        if ep == 1:
            assert all(not r[name]["all_to_alls"] for r in results), name  # no ep: no all-to-all
            continue
        layers = results[0][name]["plan_experts"]["layers"]
        count = results[0][name]["plan_all_to_all"]["ep"]["count"]  # per step
        m = fixed.get("microbatches", 1)
        for step in range(1, STEPS + 1):
            combines: dict[tuple, list[float]] = {}
            for rank, by_name in enumerate(results):
                calls = [c for c in by_name[name]["all_to_alls"] if c[0] == step]
                assert len(calls) == count == 6 * len(layers) * m, (name, rank, step, len(calls), count)
                assert {g for _, g, _ in calls} == {tuple(by_name[name]["ep_ranks"])}, (name, rank)
                sent = [b for _, _, b in calls]
                fwd = [tuple(x["all_to_all_bytes"]["forward"]) for x in layers.values()]
                bwd = [tuple(x["all_to_all_bytes"]["backward"]) for x in layers.values()]
                # per micro-batch, forward of each layer in order, then backward in reverse order
                priced = (fwd + bwd[::-1]) * m
                for k, (counts, dispatch, combine) in enumerate(priced):
                    assert sent[3 * k] == counts and sent[3 * k + 1] == dispatch, (name, rank, step, k, sent)
                    combines.setdefault((by_name[name]["ep_ranks"][0], k), []).append(sent[3 * k + 2] / combine)
            for key, ratios in combines.items():  # each ep group's combines: ep x the balanced figure
                assert len(ratios) == ep and sum(ratios) == pytest.approx(ep, rel=1e-12), (name, step, key, ratios)

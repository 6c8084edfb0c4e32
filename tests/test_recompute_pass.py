"""The recompute pass on one process (:mod:`autopar.passes.recompute`): what each policy drops, where
the copies go, and that the rewritten joint graph computes what the original does, bit for bit.
Multi-process training and measured memory under each policy: tests/dist/test_recompute.py."""

import operator
import sys
from pathlib import Path

import pytest
import torch

from autopar.analysis import build_graph
from autopar.cluster import parse_cluster
from autopar.cost.compute import GEMM_KINDS
from autopar.passes import meta_keys as mk
from autopar.passes.annotate import kernel_of
from autopar.passes.recompute import dropped_ops, moe_modules, recompute_in_backward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

CLUSTER = parse_cluster("1x1xcpu")


def _graph(example: str, **kwargs):
    module = __import__(example)
    torch.manual_seed(0)
    model, inputs, loss_fn, target = module.build(size="tiny", batch=2, seq=16, **kwargs)
    gm = build_graph(model, inputs, cluster=CLUSTER, loss_fn=loss_fn, example_target=target, collapse_repeats=False)
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):
        t = node.meta[mk.TRACE]
        if t.role is mk.Role.PARAM:
            values.append(model.get_parameter(t.fqn).detach())
        elif t.role is mk.Role.BUFFER:
            values.append(model.get_buffer(t.fqn))
        elif t.role is mk.Role.INPUT:
            values.append(inputs[0] if t.fqn == "arg0" else target)
        else:
            values.append(torch.ones(node.meta["val"].shape, dtype=node.meta["val"].dtype))
    return gm, values


def _role(node):
    trace = node.meta.get(mk.TRACE)
    return trace.role if trace is not None else None


def _own_layer_reads(gm) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(backward node, forward op of its layer it reads) pairs, the copies the backward re-runs
    included: what the backward keeps of its layer."""
    return [(n, a) for n in gm.graph.nodes if _role(n) is mk.Role.BACKWARD
            for a in n.all_input_nodes if a.op == "call_function" and _role(a) is mk.Role.FORWARD
            and a.meta[mk.LAYER] == n.meta[mk.LAYER]]


def _source(node):
    return node.args[0] if node.target is operator.getitem else node


@pytest.mark.parametrize("example", ["llama", "gpt"])
@pytest.mark.parametrize("policy", ["none", "selective", "sac", "full"])
def test_the_backward_keeps_what_the_policy_keeps_and_computes_the_same(example, policy):
    gm, values = _graph(example)
    want = torch.fx.Interpreter(gm).run(*values, enable_io_processing=False)
    reads_before = _own_layer_reads(gm)
    ops = {n.name: object() for n in gm.graph.nodes if n.op == "call_function"}
    copied = recompute_in_backward(gm, policy, ops)
    got = torch.fx.Interpreter(gm).run(*values, enable_io_processing=False)
    for w, g in zip(want, got):
        if isinstance(w, torch.Tensor):
            assert torch.equal(w, g)
    recomputed = gm.meta[mk.RECOMPUTED]
    assert len(recomputed) == copied
    kept = {_source(a) for _, a in _own_layer_reads(gm)}
    if policy == "none":
        assert copied == 0 and len(_own_layer_reads(gm)) == len(reads_before)
        return
    assert copied > 0
    gemms = {a for a in kept if kernel_of(a)[0] in GEMM_KINDS}
    if policy == "full":
        assert kept == set(), sorted(a.name for a in kept)  # a layer keeps its inputs only
    else:  # outputs of ops with FLOPs: the GEMMs, attention
        assert all(a.meta[mk.COST].flops > 0 for a in kept), sorted(a.name for a in kept)
        assert gemms
    if policy == "sac":  # every second GEMM of a layer made again: only odd ones kept
        for layer in {a.meta[mk.LAYER] for a in gemms}:
            order = [n for n in gm.graph.nodes if _role(n) is mk.Role.FORWARD and n.meta[mk.LAYER] == layer
                     and kernel_of(n)[0] in GEMM_KINDS]
            assert all(order.index(a) % 2 == 0 for a in gemms if a.meta[mk.LAYER] == layer), layer
    by_name = {n.name: n for n in gm.graph.nodes}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    first_backward = min(position[n] for n in gm.graph.nodes if _role(n) is mk.Role.BACKWARD
                         and n.name not in recomputed)
    for copy, original in recomputed.items():
        node = by_name[copy]
        assert _role(node) is mk.Role.BACKWARD and node.target == by_name[original].target
        assert node.meta[mk.LAYER] == by_name[original].meta[mk.LAYER]
        assert ops[copy] is ops[original]  # the plan's placements of the op it copies
        assert position[node] > first_backward or node.meta[mk.LAYER] == "<loss>", copy  # made in the backward


def test_random_masks_are_kept_never_drawn_again():
    gm, values = _graph("gpt", dropout=0.1)
    random = [n for n in gm.graph.nodes if n.op == "call_function" and _role(n) is mk.Role.FORWARD
              and isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags
              and "dropout" in str(n.target)]
    assert random
    assert not set(random) & dropped_ops(gm, "full")
    recompute_in_backward(gm, "full")
    assert not {v for v in gm.meta[mk.RECOMPUTED].values()} & {n.name for n in random}


def test_an_unknown_policy_is_refused():
    gm, _ = _graph("llama")
    with pytest.raises(ValueError, match="recompute='partial' is not one of none, selective, sac, moe, full"):
        recompute_in_backward(gm, "partial")


def _qwen3_moe_graph():
    from test_expert_folding import _qwen3_moe  # (tests/ is on sys.path: pytest's default import mode)

    model, inputs, _, _ = _qwen3_moe()
    return build_graph(model, inputs, cluster=CLUSTER, collapse_repeats=False)


def _module(node) -> str:
    return node.meta[mk.TRACE].module_path


@pytest.mark.parametrize("example, block", [("moe", "moe"), ("hf-qwen3-moe", "mlp")])
def test_moe_drops_each_moe_layer_whole_and_keeps_attention(example, block):
    """"moe" (Megatron-LM's --recompute-modules layernorm moe): selective's FLOP-free ops, and every
    forward op of each MoE layer, the module around the experts op that holds the router (the
    example's ``moe``: router and stacked experts; Hugging Face's ``mlp``, around ``mlp.gate`` and
    ``mlp.experts``); attention's GEMMs keep their outputs."""
    gm = _qwen3_moe_graph() if example == "hf-qwen3-moe" else _graph(example)[0]
    forward = [n for n in gm.graph.nodes if n.op == "call_function" and _role(n) is mk.Role.FORWARD]
    experts = [n for n in forward if "moe_experts" in str(n.target)]
    assert experts
    modules = {m for m in {_module(n) for n in forward} if m.endswith("." + block) and ".layers." in f".{m}"}
    assert len(modules) == 2, modules  # (two blocks)
    dropped = dropped_ops(gm, "moe")
    selective = dropped_ops(gm, "selective")
    assert selective < dropped < dropped_ops(gm, "full")
    inside = {n for n in forward if any(_module(n) == m or _module(n).startswith(m + ".") for m in modules)}
    assert set(experts) <= dropped and dropped - selective <= inside
    assert {n for n in inside if n.meta[mk.COST].flops > 0} <= dropped  # the router's GEMM and the experts
    gemms = [n for n in forward if kernel_of(n)[0] in GEMM_KINDS and n not in inside]
    assert gemms and not set(gemms) & dropped  # attention's projections (and the head) keep their outputs


def test_moe_equals_selective_without_experts():
    gm, _ = _graph("llama")
    assert dropped_ops(gm, "moe") == dropped_ops(gm, "selective")


def test_moe_computes_what_the_graph_computes():
    gm, values = _graph("moe")
    want = torch.fx.Interpreter(gm).run(*values, enable_io_processing=False)
    assert recompute_in_backward(gm, "moe") > 0
    got = torch.fx.Interpreter(gm).run(*values, enable_io_processing=False)
    for w, g in zip(want, got):
        if isinstance(w, torch.Tensor):
            assert torch.equal(w, g)


def test_moe_layer_module_rule():
    """The innermost module around an experts op that holds another GEMM; the experts op's own module
    where none does but the model itself."""
    ops = [("layers.0.attention.wq", False, True), ("layers.0.moe.router", False, True),
           ("layers.0.moe", True, False), ("layers.0.mlp.experts", True, False), ("layers.0.mlp.gate", False, True),
           ("blocks.1.ffn.experts", True, False), ("head", False, True)]
    assert moe_modules(ops) == {"layers.0.moe", "layers.0.mlp", "blocks.1.ffn.experts"}

"""Tests for autopar.passes.dtensor_rules: DTensor's sharding rules per fx node."""

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.passes import dtensor_rules
from autopar.passes.dtensor_rules import (
    Candidate,
    UnsupportedOpError,
    has_rule,
    op_candidates,
    registry_info,
    tensor_inputs,
)

aten = torch.ops.aten
R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial("sum")


@torch.library.custom_op("autopar_test::twice", mutates_args=(), tags=(torch.Tag.pointwise,))
def _twice(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 2 * x + y


@_twice.register_fake
def _(x, y):
    return torch.empty(torch.broadcast_shapes(x.shape, y.shape), dtype=x.dtype)


@torch.library.custom_op("autopar_test::rowsum", mutates_args=())
def _rowsum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1, keepdim=True).expand_as(x).clone()


@_rowsum.register_fake
def _(x):
    return torch.empty_like(x)


def _trace(fn, *args) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def _node(gm: torch.fx.GraphModule, target) -> torch.fx.Node:
    for node in gm.graph.nodes:
        if node.target == target:
            return node
    raise AssertionError(f"{target} not in graph:\n{gm.graph}")


def _pairs(cands: list[Candidate]) -> set[tuple]:
    return {(c.outputs, c.inputs) for c in cands}


def _sharded(c: Candidate) -> bool:
    placements = [p for ps in c.outputs if ps is not None for p in ps]
    placements += [p for ps in c.inputs for p in ps]
    return any(p.is_shard() for p in placements)


def test_private_registries_are_found():
    info = registry_info()
    msg = f"torch {torch.__version__} moved DTensor's sharding registries: {info}"
    # Rules move from the classic registry to the single-dim one release by release: torch 2.11 has
    # 584 and 4, 2.13 158 and 1013, 2.14 19 and 1220. Both registries, and most ops in one of them.
    assert info["op_strategy_funcs"] > 0 and info["single_dim"] > 0, msg
    assert info["op_strategy_funcs"] + info["single_dim"] > 500, msg
    assert has_rule(aten.mm.default) and has_rule(aten.view.default) and has_rule(aten.add.Tensor)
    assert has_rule(aten._scaled_dot_product_flash_attention_for_cpu.default)  # autopar's own
    assert not has_rule(torch.ops.autopar_test.twice.default)


def test_mm_candidates_on_1d_mesh():
    linear = nn.Linear(16, 32, bias=False)
    gm = _trace(lambda x, w: F.linear(x, w), torch.randn(8, 16), linear.weight)
    mm = _node(gm, aten.mm.default)
    cands = op_candidates(mm, (4,))
    pairs = _pairs(cands)
    assert (((S0,),), ((S0,), (R,))) in pairs  # rows of x: data parallel
    assert (((S1,),), ((R,), (S1,))) in pairs  # columns of w.t(): column parallel
    assert (((P,),), ((S1,), (S0,))) in pairs  # contraction dim: row parallel, partial sum
    assert (((R,),), ((R,), (R,))) in pairs
    assert len(pairs) == len(cands), "candidates must be deduplicated"
    assert all(c.source == "dtensor" for c in cands)
    assert tensor_inputs(mm) == tuple(mm.args)

    t = _node(gm, aten.t.default)
    assert (((S1,),), ((S0,),)) in _pairs(op_candidates(t, (4,)))


def test_addmm_inputs_follow_tensor_inputs_order():
    linear = nn.Linear(16, 32)
    gm = _trace(lambda x, w, b: F.linear(x, w, b), torch.randn(8, 16), linear.weight, linear.bias)
    addmm = _node(gm, aten.addmm.default)
    assert tensor_inputs(addmm) == tuple(addmm.args[:3])  # bias, x, w.t()
    pairs = _pairs(op_candidates(addmm, (4,)))
    assert (((S0,),), ((R,), (S0,), (R,))) in pairs
    assert (((S1,),), ((S0,), (R,), (S1,))) in pairs


def _zoo() -> torch.fx.GraphModule:
    def f(x, emb, idx, lw, lb, q):
        y = F.gelu(x) + x
        z = F.layer_norm(y, (32,), lw, lb)
        e = F.embedding(idx, emb)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return z, e, a

    return _trace(
        f,
        torch.randn(8, 32),
        torch.randn(100, 16),
        torch.randint(0, 100, (2, 8)),
        torch.randn(32),
        torch.randn(32),
        torch.randn(2, 4, 8, 16),
    )


@pytest.mark.parametrize(
    "target",
    [
        aten.add.Tensor,
        aten.gelu.default,
        aten.native_layer_norm.default,
        aten.embedding.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    ],
)
def test_common_ops_have_sharded_candidates(target):
    node = _node(_zoo(), target)
    cands = op_candidates(node, (2,))
    assert cands and any(_sharded(c) for c in cands), cands
    assert all(c.source != "fallback" for c in cands)
    n_outputs = len(node.meta["val"]) if isinstance(node.meta["val"], tuple) else 1
    assert all(len(c.outputs) == n_outputs for c in cands)
    assert all(len(c.inputs) == len(tensor_inputs(node)) for c in cands)


def test_sdpa_cpu_shards_batch_and_heads():
    node = _node(_zoo(), aten._scaled_dot_product_flash_attention_for_cpu.default)
    pairs = _pairs(op_candidates(node, (2,)))
    for d in (S0, S1):
        assert (((d,), (d,)), ((d,), (d,), (d,))) in pairs

    def with_mask(q, mask):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, False, attn_mask=mask)

    # the (H, L, S) mask broadcasts over the batch
    gm = _trace(with_mask, torch.randn(2, 4, 8, 16), torch.randn(4, 8, 8))
    node = _node(gm, aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert [n.name for n in tensor_inputs(node)] == ["q_1", "q_1", "q_1", "mask_1"]
    pairs = _pairs(op_candidates(node, (2,)))
    assert (((S0,), (S0,)), ((S0,), (S0,), (S0,), (R,))) in pairs
    assert (((S1,), (S1,)), ((S1,), (S1,), (S1,), (S0,))) in pairs


@pytest.mark.parametrize("mesh_shape", [(2, 2), (4, 2), (8, 8)])
def test_two_axis_mesh(mesh_shape):
    gm = _trace(lambda x, w: x @ w, torch.randn(16, 32), torch.randn(32, 64))
    cands = op_candidates(_node(gm, aten.mm.default), mesh_shape)
    assert cands
    for c in cands:
        assert all(len(ps) == len(mesh_shape) for ps in c.outputs + c.inputs)
    pairs = _pairs(cands)
    # dp on axis 0, tp (column parallel) on axis 1
    assert (((S0, S1),), ((S0, R), (R, S1))) in pairs
    # rows sharded on both axes only where they fit: 16 rows over 64 devices do not
    both_axes = (((S0, S0),), ((S0, S0), (R, R)))
    assert (both_axes in pairs) == (mesh_shape != (8, 8))


def test_shards_must_fit():
    gm = _trace(lambda x: F.gelu(x), torch.randn(3, 64))
    for c in op_candidates(_node(gm, aten.gelu.default), (4,)):
        assert c.output != (S0,), "3 rows cannot be sharded 4 ways"


def test_fallback_for_pointwise_op_without_rule():
    gm = _trace(lambda x, y: torch.ops.autopar_test.twice(x, y), torch.randn(4, 8), torch.randn(8))
    node = _node(gm, torch.ops.autopar_test.twice.default)
    pairs = _pairs(op_candidates(node, (2,)))
    assert pairs == {
        (((R,),), ((R,), (R,))),
        (((S0,),), ((S0,), (R,))),  # y broadcasts along dim 0: replicated
        (((S1,),), ((S1,), (S0,))),  # y's only dim lines up with dim 1
    }
    assert {c.source for c in op_candidates(node, (2,))} == {"fallback"}
    with pytest.raises(UnsupportedOpError, match="autopar_test.twice") as info:
        op_candidates(node, (2,), fallback=False)
    assert node.name in str(info.value)


def test_fallback_for_other_op_is_replicate_only():
    gm = _trace(lambda x: torch.ops.autopar_test.rowsum(x), torch.randn(4, 8))
    node = _node(gm, torch.ops.autopar_test.rowsum.default)
    assert _pairs(op_candidates(node, (2, 2))) == {(((R, R),), ((R, R),))}


def test_non_op_nodes_are_rejected():
    gm = _zoo()
    getitem = next(n for n in gm.graph.nodes if n.target is operator.getitem)
    with pytest.raises(TypeError, match="getitem"):
        op_candidates(getitem, (2,))
    placeholder = next(iter(gm.graph.nodes))
    with pytest.raises(TypeError):
        op_candidates(placeholder, (2,))
    with pytest.raises(ValueError):
        op_candidates(_node(gm, aten.gelu.default), (0,))


class _Block(nn.Module):
    """A GPT block with embedding and loss: every op of a training step."""

    def __init__(self, d=64, heads=4, vocab=128):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, target):
        x = self.emb(idx)
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        x = x + self.fc2(F.gelu(self.fc(self.ln2(x))))
        logits = self.head(x)
        return (F.cross_entropy(logits.flatten(0, 1), target.flatten()),)


def test_joint_graph_has_rules_for_every_op_and_caches_them():
    from torch._functorch.aot_autograd import aot_export_module

    idx = torch.randint(0, 128, (8, 16))
    gm, _ = aot_export_module(_Block(), (idx, idx), trace_joint=True, output_loss_index=0)
    nodes = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem
    ]
    dtensor_rules._compute.cache_clear()
    for mesh_shape in [(4,), (2, 2), (8, 8)]:
        for node in nodes:
            cands = op_candidates(node, mesh_shape)
            assert cands, node.format_node()
            assert all(c.source != "fallback" for c in cands), node.format_node()
    # A second lookup on a mesh already seen is served from the cache (no DTensor
    # strategy is recomputed); counted, not timed, so machine load cannot fail it.
    misses = dtensor_rules._compute.cache_info().misses
    for node in nodes:
        op_candidates(node, (2, 2))
    assert dtensor_rules._compute.cache_info().misses == misses


def test_scatter_keeps_rows_split_off_its_dim():
    """scatter writes along its dim only: on every release (DTensor's own rule has it from 2.13 on,
    autopar adds it before) self, index and src may be split alike on a dim where all three have the
    same size, never on the scatter dim or where index and self differ. A top-k's gradient:
    ``zeros(8, 4).scatter(-1, index (8, 2), src (8, 2))``."""
    def topk_grad(index, src):
        return torch.zeros(8, 4).scatter(-1, index, src)

    def permute_rows(index, src):  # all three (8, 2): the scatter dim has the same size too
        return torch.zeros(8, 2).scatter(1, index, src)

    for fn in (topk_grad, permute_rows):
        gm = _trace(fn, torch.zeros(8, 2, dtype=torch.long), torch.randn(8, 2))
        pairs = _pairs(op_candidates(_node(gm, aten.scatter.src), (2,)))
        assert (((S0,),), ((S0,), (S0,), (S0,))) in pairs
        assert not any(S1 in ps for out, ins in pairs for ps in (*out, *ins)), fn  # the scatter dim

    def fewer_rows(index):  # index covers 6 of the 8 rows: dim 0 is no row dim, only the replicated scatter
        return torch.zeros(8, 4).scatter(1, index, 1.0)

    gm = _trace(fewer_rows, torch.zeros(6, 2, dtype=torch.long))
    cands = op_candidates(_node(gm, aten.scatter.value), (2,))
    assert not any(_sharded(c) for c in cands)

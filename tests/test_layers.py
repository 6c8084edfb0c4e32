"""passes/layers.py: nodes grouped into layers in forward order, structural signatures, graph hash."""
import functools
from pathlib import Path

import pytest
import torch

from autopar.cost.devices import DEVICES
from autopar.modelspec import load_model_spec
from autopar.passes import meta_keys as mk
from autopar.passes.annotate import annotate_cost
from autopar.passes.layers import LOSS_LAYER, graph_hash, group_layers, layer_of_path
from autopar.passes.trace import trace_joint
from autopar.testing import DROPOUT_P0_TRACED

ROOT = Path(__file__).resolve().parents[1]
DROP = ["transformer.drop"] if DROPOUT_P0_TRACED else []  # (its p=0 dropout: no op on torch 2.14)
GPT_LAYERS = ["transformer.wte", "transformer.wpe", *DROP,
              "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head", LOSS_LAYER]
H2 = GPT_LAYERS.index("transformer.h.1") + 1  # where a deeper GPT's third block goes


@functools.cache
def grouped(example="gpt", *, collapse_repeats=True, **args):
    model, inputs, loss_fn, target = load_model_spec(str(ROOT / "examples" / f"{example}.py") + ":build",
                                                     {"size": "tiny", **args})
    gm = trace_joint(model, inputs, loss_fn=loss_fn, example_target=target, collapse_repeats=collapse_repeats)
    return model, group_layers(annotate_cost(gm, device=DEVICES["H100"]))


def layers(gm):
    return {x.path: x for x in gm.meta[mk.LAYERS]}


def test_gpt_layers_in_forward_order():
    _, gm = grouped(collapse_repeats=False)
    infos = gm.meta[mk.LAYERS]
    assert [x.path for x in infos] == GPT_LAYERS
    assert [x.index for x in infos] == list(range(len(GPT_LAYERS)))
    assert [x.class_name for x in infos] == ["Embedding", "Embedding", *["Dropout"] * len(DROP), "Block", "Block",
                                             "LayerNorm", "Linear", "loss"]
    # forward order: the first forward op of each layer comes after the previous layer's
    first_op = {}
    for i, n in enumerate(gm.graph.nodes):
        if n.meta[mk.TRACE].role is mk.Role.FORWARD:
            first_op.setdefault(n.meta[mk.LAYER], i)
    assert sorted(first_op, key=first_op.get) == GPT_LAYERS
    assert all(x.count == 1 for x in infos)


def test_repeated_blocks_share_a_signature():
    model, gm = grouped(collapse_repeats=False)
    by_path = layers(gm)
    h0, h1 = by_path["transformer.h.0"], by_path["transformer.h.1"]
    assert h0.signature == h1.signature
    assert by_path["transformer.wte"].signature != by_path["transformer.wpe"].signature
    assert len({x.signature for x in gm.meta[mk.LAYERS]}) == len(GPT_LAYERS) - 1
    for field in ("n_params", "param_bytes", "flops_fwd", "flops_bwd", "bytes_fwd", "bytes_bwd", "saved_bytes"):
        assert getattr(h0, field) == getattr(h1, field), field
    assert h0.n_params == sum(p.numel() for p in model.transformer.h[0].parameters())
    assert h1.param_fqns == tuple(f"transformer.h.1.{name}" for name, _ in model.transformer.h[1].named_parameters())
    # the tied head's weight is the embedding's parameter: it belongs to wte, which reads it first
    assert "transformer.wte.weight" in by_path["transformer.wte"].param_fqns
    assert by_path["lm_head"].n_params == 0


def test_collapsed_block_stands_for_all_and_totals_agree():
    # 4 blocks: h.0 is traced as itself, h.1 stands for h.1, h.2 and h.3
    _, full = grouped(collapse_repeats=False, n_layer="4")
    _, collapsed = grouped(n_layer="4")
    by_path = layers(collapsed)
    assert [x.path for x in full.meta[mk.LAYERS]] == GPT_LAYERS[:H2] + ["transformer.h.2", "transformer.h.3"] + GPT_LAYERS[H2:]
    assert [x.path for x in collapsed.meta[mk.LAYERS]] == GPT_LAYERS
    assert [x.count for x in collapsed.meta[mk.LAYERS]] == [3 if p == "transformer.h.1" else 1 for p in GPT_LAYERS]
    assert by_path["transformer.h.1"].signature == layers(full)["transformer.h.3"].signature

    def total(gm, field):
        return sum(getattr(x, field) * x.count for x in gm.meta[mk.LAYERS])

    flops_full = total(full, "flops_fwd") + total(full, "flops_bwd")
    flops_collapsed = total(collapsed, "flops_fwd") + total(collapsed, "flops_bwd")
    # rel=1e-9: the same float64 costs, summed per layer x count instead of per node; regrouping
    # a sum of a few thousand positive terms moves it by ~1e-13 relative at most.
    assert flops_collapsed == pytest.approx(flops_full, rel=1e-9)
    assert flops_full == sum(n.meta[mk.COST].flops for n in full.graph.nodes)
    # bytes, activations and time agree too: the gradient accumulations of each
    # block's residual stream are costed in that block, not in the last layer
    for field in ("bytes_fwd", "bytes_bwd", "saved_bytes", "time_fwd_s", "time_bwd_s", "n_params"):
        assert total(collapsed, field) == pytest.approx(total(full, field), rel=1e-9), field


@pytest.mark.parametrize("path, layer", [
    ("", ""),
    ("lm_head", "lm_head"),
    ("transformer.wte", "transformer.wte"),
    ("transformer.h.1.mlp.c_fc", "transformer.h.1"),
    ("transformer.h.11", "transformer.h.11"),
    ("layers.79.attention.wq", "layers.79"),
    ("model.layers.7.mlp.up_proj", "model.layers.7"),
    ("bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0"),
    ("blocks.0.fc1", "blocks.0"),
    ("encoder.block.1.layer.0.SelfAttention.q", "encoder.block.1"),
])
def test_layer_of_path(path, layer):
    assert layer_of_path(path) == layer


def test_graph_hash_is_stable_and_sees_the_batch():
    _, a = grouped()
    _, b = grouped(seed="1")  # another trace of the same model (other weights do not matter)
    assert a is not b
    assert graph_hash(a) == graph_hash(b)
    assert len(graph_hash(a)) == 16
    _, bigger = grouped(batch="4")
    assert graph_hash(bigger) != graph_hash(a)
    _, four = grouped(n_layer="4")
    assert graph_hash(four) != graph_hash(a)


def test_every_node_has_a_layer():
    _, gm = grouped(collapse_repeats=False)
    for n in gm.graph.nodes:
        if n.op == "output":
            assert n.meta[mk.LAYER] == ""
        else:
            assert n.meta[mk.LAYER] in GPT_LAYERS, n.format_node()
    placeholders = {n.meta[mk.TRACE].fqn: n.meta[mk.LAYER] for n in gm.graph.find_nodes(op="placeholder")}
    assert placeholders["arg0"] == "transformer.wte" and placeholders["target"] == LOSS_LAYER
    assert placeholders["transformer.h.1.attn.c_attn.weight"] == "transformer.h.1"


def test_backward_of_block_one_belongs_to_it():
    _, gm = grouped(collapse_repeats=False)
    backward = [n for n in gm.graph.nodes if n.meta[mk.TRACE].role is mk.Role.BACKWARD]
    of_block = [n for n in backward if n.meta[mk.TRACE].module_path.startswith("transformer.h.1")]
    assert len(of_block) > 20
    for n in of_block:
        assert n.meta[mk.LAYER] == "transformer.h.1", n.format_node()
    # the adds that sum a residual stream's two gradients (each block reads its
    # input twice: the residual and the LayerNorm) join the block, the tied
    # embedding's gradient sum joins the embedding
    acc = [(n.meta[mk.LAYER], tuple(n.meta["val"].shape)) for n in backward if n.meta.get("is_gradient_acc")]
    assert sorted(acc) == sorted([("transformer.h.1", (8, 64, 64))] * 2 + [("transformer.h.0", (8, 64, 64))] * 2
                                 + [("transformer.wte", (256, 64))])
    # a block's backward: each matmul twice (input and weight gradients),
    # attention 2.5 times (flop_counter's SDPA backward formula)
    h1 = layers(gm)["transformer.h.1"]
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    fwd = [n for n in gm.graph.nodes if n.meta[mk.LAYER] == "transformer.h.1" and n.meta[mk.TRACE].role is mk.Role.FORWARD]
    attention = sum(n.meta[mk.COST].flops for n in fwd if n.target is sdpa)
    assert attention > 0
    assert h1.flops_fwd == sum(n.meta[mk.COST].flops for n in fwd)
    assert h1.flops_bwd == 2 * (h1.flops_fwd - attention) + 2.5 * attention


def test_backward_ops_matching_no_forward_op_join_the_block_that_reads_them():
    """Hugging Face's DeepSeek-V3 has backward ops in every block whose autograd ``seq_nr``
    matches no forward op (copies of attention-gradient slices, parts of a norm's backward).
    They joined the loss's layer, so each block's crossed every pipeline cut back from the last
    stage; they now join the latest layer whose backward reads them. No backward value of the
    loss's layer is read by a block any more, and the blocks' own backward values are read by
    no later layer (a pipeline sends gradients back only)."""
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import hf

    transformers = pytest.importorskip("transformers")
    config = hf.tiny_config(transformers.DeepseekV3Config, num_hidden_layers=3, first_k_dense_replace=1,
                            use_cache=False)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM._from_config(config, attn_implementation="sdpa")
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    gm = group_layers(annotate_cost(trace_joint(model, {"input_ids": ids, "labels": ids.clone()}, loss_fn=None,
                                                example_target=None, collapse_repeats=False), device=DEVICES["H100"]))
    position = {x.path: i for i, x in enumerate(gm.meta[mk.LAYERS])}
    blocks = {p for p in position if p.startswith("model.layers.")}
    assert len(blocks) == 3
    crossing = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.meta[mk.TRACE].role is not mk.Role.BACKWARD:
            continue
        readers = {u.meta[mk.LAYER] for u in n.users if u.op == "call_function"}
        if n.meta[mk.LAYER] == LOSS_LAYER:
            crossing += [(n.name, r) for r in readers & blocks]
        assert all(position[r] <= position[n.meta[mk.LAYER]] for r in readers if r in position), n.format_node()
    assert crossing == []

"""Ops that work along each sequence apart (autopar.passes.sequence_mixing), which context
parallelism would run on chunks: found in the joint graph, named with their module, and the
planner refuses cp for them (pinned) or does not weigh it (automatic). Without this, such a
model trained under cp computed another model: the MoE example's per-sequence balance loss
measured 63x the one-process noise apart at its first step (tests/dist, cp = 2 on 4 ranks),
and nothing failed."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.analysis import build_graph
from autopar.cluster import Cluster
from autopar.passes.sequence_mixing import labels_shifted_outside, position_collisions, sequence_mixing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402
import llama  # noqa: E402
import moe  # noqa: E402

SEQ = 32
CLUSTER = Cluster.from_spec("1x2xcpu")


def _graph(model, inputs, loss_fn=None, target=None):
    return build_graph(model, inputs, cluster=CLUSTER, loss_fn=loss_fn, example_target=target)


class _Model(nn.Module):
    """Embedding, then ``body`` (a callable on (B, T, C) and the module), then an LM head."""

    def __init__(self, body):
        super().__init__()
        self.emb, self.q, self.head = nn.Embedding(64, 16), nn.Linear(16, 16), nn.Linear(16, 64)
        self.conv = nn.Conv1d(16, 16, 3, groups=16)
        self.pos = nn.Parameter(torch.zeros(1, 4 * SEQ, 16))  # positions up to a longer sequence
        self.register_buffer("cos", torch.cos(torch.arange(4 * SEQ)[:, None] / (1 + torch.arange(16))))
        self.body = body

    def forward(self, ids):
        return self.head(self.body(self, self.emb(ids)))


def _lm(out, t):
    return F.cross_entropy(out.flatten(0, 1), t.flatten())


BODIES = {  # name -> (body, the op found and why, or None)
    "per token": (lambda m, x: torch.relu(m.q(x)) + x, None),
    "norm and mean over features": (lambda m, x: x - x.mean(-1, keepdim=True) + F.layer_norm(x, (16,)), None),
    "SDPA attention": (lambda m, x: F.scaled_dot_product_attention(m.q(x)[:, None], x[:, None], x[:, None],
                                                                   is_causal=True)[:, 0], None),  # (B, 1 head, T, C)
    "mean over the batch and the sequence": (lambda m, x: x - x.mean((0, 1)), None),
    "attention written out": (lambda m, x: torch.softmax(m.q(x) @ x.transpose(1, 2), dim=-1) @ x,
                              "runs a softmax along each sequence's positions"),
    "per-sequence mean": (lambda m, x: x - x.mean(1, keepdim=True), "reduces over the positions of each sequence"),
    "causal convolution": (lambda m, x: m.conv(F.pad(x.transpose(1, 2), (2, 0))).transpose(1, 2),
                           "pads each sequence"),
    "cumulative sum": (lambda m, x: x.cumsum(1), "runs a cumulative sum along each sequence's positions"),
    "roll": (lambda m, x: x + torch.roll(x, 1, dims=1), "runs a roll along each sequence's positions"),
    "flip over features": (lambda m, x: x + torch.flip(x, dims=[2]), None),
    "first token": (lambda m, x: x + x[:, :1], "runs a slice along each sequence's positions"),
    "position table sliced": (lambda m, x: x * m.cos[: x.shape[1]], "meets the sequence with a position table"),
    "learned positions sliced": (lambda m, x: x + m.pos[:, : x.shape[1]], "meets the sequence with a position table"),
    "positions from arange": (lambda m, x: x * torch.cos(torch.arange(x.shape[1])[:, None] / 4.0), None),
    "positions counted over ones": (lambda m, x: x + torch.ones(x.shape[:2]).cumsum(1)[..., None],
                                    "counts positions with a cumulative sum along a constant"),
    "a mask of ones": (lambda m, x: x * torch.ones(x.shape[:2])[..., None] + torch.zeros(x.shape[:2]).cumsum(1)[
        ..., None], None),  # (ones per token; zeros count nothing)
}


@pytest.mark.parametrize("name", list(BODIES))
def test_ops_along_each_sequence_are_found_and_per_token_ones_are_not(name):
    body, why = BODIES[name]
    ids, target = torch.randint(0, 64, (4, SEQ)), torch.randint(0, 64, (4, SEQ))
    found = sequence_mixing(_graph(_Model(body), (ids,), _lm, target), SEQ)
    if why is None:
        assert found == [], [str(f) for f in found]
    else:
        assert found and why in str(found[0]), [str(f) for f in found]
        assert all(f.module_path == "" for f in found)  # (the model's own forward)


def test_a_shift_inside_the_loss_is_found_and_the_examples_have_none():
    ids, target = torch.randint(0, 64, (4, SEQ)), torch.randint(0, 64, (4, SEQ))
    shifted = sequence_mixing(_graph(_Model(BODIES["per token"][0]), (ids,),
                                     lambda out, t: _lm(out[:, :-1], t[:, 1:]), target), SEQ)
    assert [f.op for f in shifted] == ["slice.Tensor", "slice.Tensor"]
    for example in (gpt, llama, moe):
        model, inputs, loss_fn, target = example.build(size="tiny", batch=4, seq=SEQ)
        assert sequence_mixing(_graph(model, inputs, loss_fn, target), SEQ) == [], example.__name__


def test_the_moe_examples_per_sequence_balance_loss_is_found_in_its_module():
    model, inputs, loss_fn, target = moe.build(size="tiny", batch=4, seq=SEQ, aux_loss=0.01)
    found = sequence_mixing(_graph(model, inputs, loss_fn, target), SEQ)
    # f (the share of each sequence's choices per expert) and P (its mean router probability), per block
    assert [(f.op, f.module_path) for f in found] == [("mean.dim", f"layers.{i}.moe") for i in (0, 0, 1, 1)]
    assert "reduces over the positions of each sequence apart" in str(found[0])


def test_hugging_face_labels_are_shifted_outside_the_chunks():
    # transformers' causal-LM loss pads and slices the labels along the sequence; under cp the
    # runtime shifts them on the whole sequence first, so that shift is not the chunks' business
    hf = pytest.importorskip("hf")
    pytest.importorskip("transformers")
    model, inputs, _, _ = hf.build(model="llama", size="tiny", batch=4, seq=SEQ)
    gm = _graph(model, inputs)
    assert labels_shifted_outside(gm) == {"labels"}
    assert sequence_mixing(gm, SEQ, untagged=labels_shifted_outside(gm)) == []
    assert [f.op for f in sequence_mixing(gm, SEQ)] == ["constant_pad_nd.default"]
    # BERT takes its positions as a slice of a buffer numbering 512: the first ones on every rank
    model, inputs, _, _ = hf.build(model="bert", batch=4, seq=SEQ)
    found = sequence_mixing(_graph(model, inputs), SEQ)
    assert [(f.op, f.module_path) for f in found] == [("add.Tensor", "bert.embeddings")], found


def test_positions_counted_over_a_mask_of_ones_are_found():
    # OPT numbers positions cumsum(attention_mask, 1) - 1, over torch.ones(B, T) when no mask is passed:
    # each rank would number its chunks from 0
    transformers = pytest.importorskip("transformers")
    config = transformers.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                    num_attention_heads=2, max_position_embeddings=4 * SEQ, word_embed_proj_dim=16)
    ids = torch.randint(0, 64, (4, SEQ))
    gm = _graph(transformers.OPTForCausalLM(config), {"input_ids": ids, "labels": ids})
    found = sequence_mixing(gm, SEQ, untagged=labels_shifted_outside(gm))
    assert [(f.op, f.module_path) for f in found] == [("cumsum.default", "model.decoder")], [str(f) for f in found]
    assert "number positions with torch.arange(T)" in str(found[0])


def test_an_arange_as_long_as_a_ranks_chunk_is_a_collision():
    # the MoE example numbers its 8 experts with arange(8): at 16 tokens and cp = 2 a rank's program
    # (traced at 8 tokens) would have it rewritten to positions
    model, inputs, loss_fn, target = moe.build(size="tiny", batch=4, seq=16)
    gm = _graph(model, inputs, loss_fn, target)
    assert position_collisions(gm, 16, 2) and not position_collisions(gm, 16, 4)
    with pytest.raises(autopar.PlanError, match=r"cp=2: the program numbers something other than positions "
                                                r"with 8 = seq / cp elements \(arange"):
        autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target,
                     fixed={"cp": 2, "dp": 8})


def test_the_planner_refuses_cp_and_does_not_weigh_it_where_an_op_mixes(monkeypatch):
    from autopar.planner import context

    model, inputs, loss_fn, target = moe.build(size="tiny", batch=8, seq=64, aux_loss=0.01)
    with pytest.raises(autopar.PlanError, match=r"^cp=2: mean.dim \(mean_\d+\) in layers.0.moe reduces over "
                                                r"the positions of each sequence apart \(and 3 more such ops\): "
                                                r".* or drop cp"):
        autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target, fixed={"cp": 2})
    # weighed automatically (here from 32 tokens, 8 a rank) only without the balance loss, and
    # not at cp = 8, whose 8 tokens a rank collide with the 8 experts' numbering
    monkeypatch.setattr(context, "MIN_SEQUENCE", 32)
    monkeypatch.setattr(context, "MIN_TOKENS_PER_RANK", 8)
    assert context.cp_options(_graph(model, inputs, loss_fn, target), 8) == ()
    # and the plan says why (its context, the summary)
    plan = autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target)
    assert plan.context["cp"] == 1 and plan.context["considered"] == []
    why = plan.context["not_weighed"]
    assert why.startswith("mean.dim (mean_") and "in layers.0.moe" in why, why
    line = next(x for x in plan.summary().splitlines() if x.strip().startswith("context:"))
    assert "sequences of 64 tokens not split; cp is not weighed: mean.dim" in line, line
    assert autopar.Plan.from_json(plan.to_json()).context == plan.context
    model, inputs, loss_fn, target = moe.build(size="tiny", batch=8, seq=64)
    assert context.cp_options(_graph(model, inputs, loss_fn, target), 8) == (2, 4)

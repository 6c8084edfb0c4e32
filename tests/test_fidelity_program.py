"""bench/fidelity.py prices torchtitan's Qwen3 TP program, not autopar's own layout: the q and k
norms' outputs and the rotary embedding after them stay whole on every tp rank
(``make_plan(replicated=...)``), as torchtitan's ``NoParallel`` norms make them."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autopar.passes import meta_keys as mk  # noqa: E402
from autopar.planner.make import make_plan  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def fidelity():
    sys.path.insert(0, str(BENCH))  # (fidelity.py imports planner_speed beside it)
    try:
        spec = importlib.util.spec_from_file_location("fidelity_bench", BENCH / "fidelity.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


@pytest.fixture(scope="module")
def qwen3(fidelity):
    config = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1000,
                                      use_cache=False, attention_dropout=0.0, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM._from_config(
            config, attn_implementation=fidelity._register_causal_sdpa(), dtype=torch.bfloat16)
    ids = torch.empty(4, 128, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids.clone()}


def test_torchtitan_qwen3_tp_keeps_q_and_k_whole_from_their_norms_to_attention(fidelity, qwen3):
    model, inputs = qwen3
    fixed = {"tp": 2, "dp": 4, "pp": 1, "sp": True}  # sp on the block norms, as torchtitan's apply_tp
    chosen = {}

    def replicated(gm):
        chosen["gm"], chosen["names"] = gm, fidelity.torchtitan_qk_replicated(gm)
        return chosen["names"]

    pinned = make_plan(model, inputs, cluster="1x8xH100", fixed=fixed, replicated=replicated)
    free = make_plan(model, inputs, cluster="1x8xH100", fixed=fixed)
    nodes = {n.name: n for n in chosen["gm"].graph.nodes}
    names = chosen["names"]

    def module(name):
        return nodes[name].meta[mk.TRACE].module_path.rsplit(".", 1)[-1]

    # per layer: each norm's output, then q's and k's transpose and rotary (mul, two slices, neg,
    # cat, mul, add); SDPA itself is not pinned: it slices q and k back to the rank's heads
    assert len(names) == 2 * (2 + 2 * 8), sorted(names)
    assert {module(n) for n in names} == {"q_norm", "k_norm", "self_attn"}
    assert not any("scaled_dot_product" in str(nodes[n].target) for n in names)
    assert {str(nodes[n].target) for n in names} >= {"aten.cat.default", "aten.neg.default", "aten.add.Tensor"}
    assert all(pinned.ops[n]["out"] == ["R"] for n in names)
    assert all(free.ops[n]["out"] != ["R"] for n in names)  # autopar's own layout shards them all
    assert pinned.predicted["step_time_s"] > free.predicted["step_time_s"]  # the gathers and whole rotary cost
    # the pins override sp only where they name an op: the block norms stay on token shards
    block_norms = [n for n in nodes if nodes[n].op == "call_function" and n in pinned.ops
                   and pinned.ops[n]["phase"] == "F" and module(n) in ("input_layernorm", "post_attention_layernorm")]
    assert block_norms and all(pinned.ops[n]["out"][0].startswith("S") for n in block_norms)

"""The bundled example models: tiny sizes train a step on CPU, big sizes build on meta at the advertised size."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def assert_identical(a, b):
    """Bit for bit: the same seed and the same ops give the same bits (no tolerance to hide
    a nondeterministic initialisation)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"_test_examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def n_params(model):
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def compute_loss(model, inputs, loss_fn, target):
    if isinstance(inputs, dict):
        output = model(**inputs)
    else:
        output = model(*inputs)
    return output.loss if loss_fn is None else loss_fn(output, target)


def assert_trains(model, inputs, loss_fn, target):
    loss = compute_loss(model, inputs, loss_fn, target)
    assert loss.dim() == 0
    assert torch.isfinite(loss), loss
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        assert torch.isfinite(p.grad).all(), f"non-finite gradient for {name}"
    return loss


def assert_on(device, model, inputs, target):
    tensors = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    tensors += [] if target is None else [target]
    for t in [*model.parameters(), *tensors]:
        assert t.device.type == device


# --- mlp ----------------------------------------------------------------------------


def test_mlp_tiny_trains_on_cpu():
    mlp = load_example("mlp")
    model, inputs, loss_fn, target = mlp.build(size="tiny")
    assert len(model.blocks) == 2
    assert inputs[0].shape == (8, 64) and target.shape == (8, 64)
    assert_on("cpu", model, inputs, target)
    assert_trains(model, inputs, loss_fn, target)


def test_mlp_string_kwargs_and_no_residual():
    mlp = load_example("mlp")
    model, inputs, loss_fn, target = mlp.build(size="small", batch="3", residual="false")
    assert inputs[0].shape == (3, 256)
    assert not model.blocks[0].residual
    assert_trains(model, inputs, loss_fn, target)


def test_mlp_large_builds_on_meta():
    mlp = load_example("mlp")
    model, inputs, _, target = mlp.build(size="large")
    assert_on("meta", model, inputs, target)
    assert n_params(model) == pytest.approx(12.9e9, rel=0.02)


def test_mlp_is_deterministic():
    mlp = load_example("mlp")
    a, b = mlp.build(size="tiny"), mlp.build(size="tiny")
    assert_identical(a[0].state_dict(), b[0].state_dict())
    assert_identical(a[1], b[1])
    assert_identical(a[3], b[3])


# --- gpt ----------------------------------------------------------------------------


def test_gpt_tiny_trains_on_cpu():
    gpt = load_example("gpt")
    model, inputs, loss_fn, target = gpt.build(size="tiny")
    assert inputs[0].shape == (8, 64) and inputs[0].dtype == torch.long
    assert_on("cpu", model, inputs, target)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(model.transformer.h) == 2
    loss = assert_trains(model, inputs, loss_fn, target)
    # random init predicts about uniformly over the vocabulary
    assert loss.item() == pytest.approx(math.log(256), rel=0.05)
    assert model(*inputs).shape == (8, 64, 256)


def test_gpt_options_from_strings():
    gpt = load_example("gpt")
    model, inputs, loss_fn, target = gpt.build(
        size="tiny", batch="2", seq="16", bias="false", tie_weights="false", dropout="0.1", n_layer="1"
    )
    assert inputs[0].shape == (2, 16)
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert model.transformer.h[0].attn.c_attn.bias is None
    assert len(model.transformer.h) == 1
    assert n_params(model) == gpt.count_params(model.config, tie_weights=False)
    model.train()
    assert_trains(model, inputs, loss_fn, target)


def test_gpt_is_deterministic():
    gpt = load_example("gpt")
    a, b = gpt.build(size="tiny"), gpt.build(size="tiny")
    assert_identical(a[0].state_dict(), b[0].state_dict())
    assert_identical(a[1], b[1])
    assert_identical(a[3], b[3])


@pytest.mark.parametrize(
    "size, expected, rel",
    [("125m", 124e6, 0.05), ("350m", 350e6, 0.05), ("1.3b", 1.3e9, 0.10), ("7b", 6.7e9, 0.05), ("175b", 175e9, 0.05), ("1t", 1e12, 0.10)],
)
def test_gpt_sizes_on_meta(size, expected, rel):
    gpt = load_example("gpt")
    model, inputs, _, target = gpt.build(size=size, device="meta")
    assert_on("meta", model, inputs, target)
    assert n_params(model) == pytest.approx(expected, rel=rel)
    assert n_params(model) == gpt.count_params(model.config)


def test_gpt_big_sizes_default_to_meta():
    gpt = load_example("gpt")
    model, inputs, _, target = gpt.build(size="1.3b")
    assert_on("meta", model, inputs, target)
    assert inputs[0].shape == (8, 2048)


def test_gpt_runs_on_meta():
    gpt = load_example("gpt")
    model, inputs, loss_fn, target = gpt.build(size="175b", n_layer=1, batch=1, seq=32)
    logits = model(*inputs)
    assert logits.shape == (1, 32, 50304) and logits.device.type == "meta"
    loss_fn(logits, target).backward()


def test_gpt_rejects_long_sequences():
    gpt = load_example("gpt")
    with pytest.raises(ValueError, match="block_size"):
        gpt.build(size="tiny", seq=65)


# --- llama --------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_llama_small_sizes_train_on_cpu(size):
    llama = load_example("llama")
    model, inputs, loss_fn, target = llama.build(size=size)
    assert_on("cpu", model, inputs, target)
    loss = assert_trains(model, inputs, loss_fn, target)
    assert loss.item() == pytest.approx(math.log(model.config.vocab_size), rel=0.05)


def test_llama_tiny_is_gqa_and_deterministic():
    llama = load_example("llama")
    a, b = llama.build(size="tiny"), llama.build(size="tiny")
    attn = a[0].layers[0].attention
    assert attn.n_kv_heads == 2 and attn.n_heads == 4
    assert attn.wk.weight.shape == (32, 64) and attn.wq.weight.shape == (64, 64)
    assert a[0].layers[0].feed_forward.w1.weight.shape == (192, 64)
    assert_identical(a[0].state_dict(), b[0].state_dict())
    assert_identical(a[1], b[1])


def test_llama_rope_is_relative():
    """q.k after RoPE depends only on the distance between the positions."""
    llama = load_example("llama")
    # In fp64, so the products' own rounding (~1e-16 |q||k|) plays no part. The tables' angles
    # pos * inv_freq are computed in fp32 (as Llama's reference code): each is off by up to
    # ~2 ulps of pos * inv_freq <= 15, and rotating q and k each by such an error moves q.k by
    # at most 2 x that x |q||k|, on each side: 4 * 2 * 15 ulps = 120 * eps32 * |q||k| (we see
    # 0.03). A RoPE bug (a wrong frequency, a swapped half) changes q.k by order |q||k|.
    cos, sin = llama.rope_cos_sin(16, 8, 10000.0, "cpu", torch.float64)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)

    def at(x, pos):
        return llama.apply_rope(x.expand(16, 8), cos, sin)[pos]

    torch.testing.assert_close(at(q, 3) @ at(k, 1), at(q, 9) @ at(k, 7),
                               rtol=0, atol=120 * torch.finfo(torch.float32).eps * float(q.norm() * k.norm()))


@pytest.mark.parametrize(
    "size, expected, rel",
    [("7b", 6.74e9, 0.05), ("8b", 8.03e9, 0.05), ("70b", 70.6e9, 0.05), ("405b", 405e9, 0.05)],
)
def test_llama_sizes_on_meta(size, expected, rel):
    llama = load_example("llama")
    model, inputs, _, target = llama.build(size=size)
    assert_on("meta", model, inputs, target)
    assert n_params(model) == pytest.approx(expected, rel=rel)
    assert n_params(model) == llama.count_params(model.config)


def test_llama_70b_shapes_on_meta():
    # Building on meta allocates nothing, which is what keeps it fast; asserted as the
    # device of every parameter, not as a wall-clock bound that machine load could break.
    llama = load_example("llama")
    model, inputs, _, _ = llama.build(size="70b", device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert len(model.layers) == 80
    assert model.layers[0].feed_forward.w1.weight.shape == (28672, 8192)
    assert model.layers[0].attention.wk.weight.shape == (1024, 8192)
    assert inputs[0].shape == (8, 4096)


def test_llama_runs_on_meta():
    llama = load_example("llama")
    model, inputs, loss_fn, target = llama.build(size="70b", n_layers="1", batch="1", seq="32")
    logits = model(*inputs)
    assert logits.shape == (1, 32, 128256) and logits.device.type == "meta"
    loss_fn(logits, target).backward()


# --- errors -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama", "moe"])
def test_unknown_size_lists_the_sizes(name):
    example = load_example(name)
    with pytest.raises(ValueError, match="tiny"):
        example.build(size="huge")


# --- Hugging Face -------------------------------------------------------------------

HF_MODELS = ["gpt2", "llama", "mistral", "qwen2", "mixtral", "bert", "t5", "vit"]


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    return load_example("hf")


@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_tiny_trains_on_cpu(hf, name):
    model, inputs, loss_fn, target = hf.build(model=name, batch="2", seq="16")
    assert loss_fn is None and target is None
    assert isinstance(inputs, dict) and "labels" in inputs
    assert_on("cpu", model, inputs, None)
    assert not model.config.use_cache
    assert_trains(model, inputs, loss_fn, target)


@pytest.mark.parametrize("name, size, expected", [("llama", "7b", 6.74e9), ("llama", "70b", 70.6e9), ("mistral", "7b", 7.24e9)])
def test_hf_big_sizes_on_meta(hf, name, size, expected):
    model, inputs, _, _ = hf.build(model=name, size=size)
    assert_on("meta", model, inputs, None)
    assert n_params(model) == pytest.approx(expected, rel=0.05)


def test_hf_unknown_model_and_size(hf):
    with pytest.raises(ValueError, match="gpt2"):
        hf.build(model="nope")
    with pytest.raises(ValueError, match="tiny"):
        hf.build(model="bert", size="70b")

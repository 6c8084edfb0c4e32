"""
Hugging Face transformers models, built from configs alone (no downloads, random
init), for autopar to plan: the "unmodified user model" case.

References:
1) Hugging Face transformers, https://github.com/huggingface/transformers
   (GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
   MixtralForCausalLM, Qwen2MoeForCausalLM, BertForMaskedLM, T5ForConditionalGeneration,
   ViTForImageClassification)
2) Shapes of the big sizes: Llama 2 (https://arxiv.org/abs/2307.09288),
   Llama 3 (https://arxiv.org/abs/2407.21783), Mistral 7B
   (https://arxiv.org/abs/2310.06825), Mixtral 8x7B (https://arxiv.org/abs/2401.04088),
   Qwen1.5-MoE-A2.7B (its config.json on the Hugging Face Hub, Qwen/Qwen1.5-MoE-A2.7B)

    autopar plan examples/hf.py:build --arg model=llama --arg size=70b --cluster 8x8xH100

build(model="gpt2", size="tiny", device=..., batch=..., seq=..., seed=0, defaults=False)
returns (model, inputs, None, None): inputs is a dict of keyword arguments that
includes `labels`, so the model computes its own `.loss`. Sizes of 1B parameters and more are
built on "meta" by default.

Two ways to build a tiny model:
- defaults=False (the default): the configs below, with use_cache=False, dropout 0 and
  attn_implementation="sdpa": deterministic runs that compare exactly with one process.
- defaults=True: the way a user builds it. The architecture's default config with only
  its sizes scaled down (`tiny_config`), `AutoModelFor*.from_config`, training mode:
  caches on, dropout as configured (GPT-2 and T5: 0.1), the configured attention
  implementation, tied or untied heads as the config says.

    autopar plan examples/hf.py:build --arg model=gpt2 --arg defaults=1 --cluster 1x8xH100
"""
import torch

try:
    import transformers
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("examples/hf.py needs Hugging Face transformers: pip install transformers") from e

# Dropout probabilities of the configs used here (GPT-2, BERT, ViT, T5, Llama family).
_DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout", "hidden_dropout_prob",
             "attention_probs_dropout_prob", "dropout_rate", "attention_dropout", "classifier_dropout")

# The tiny configs share one shape: 2 layers, hidden 64, 4 heads, vocab 256.
_TINY = dict(layers=2, hidden=64, heads=4, ffn=128, vocab=256, positions=512)


def _gpt2(size):
    assert size == "tiny"
    t = _TINY
    return transformers.GPT2Config(
        n_layer=t["layers"], n_embd=t["hidden"], n_head=t["heads"], n_inner=t["ffn"],
        vocab_size=t["vocab"], n_positions=t["positions"], bos_token_id=0, eos_token_id=0,
    ), transformers.GPT2LMHeadModel


def _decoder(config_cls, size, **extra):
    t = _TINY
    return config_cls(
        num_hidden_layers=t["layers"], hidden_size=t["hidden"], num_attention_heads=t["heads"],
        num_key_value_heads=t["heads"] // 2, intermediate_size=t["ffn"], vocab_size=t["vocab"],
        max_position_embeddings=t["positions"], **extra,
    )


def _llama(size):
    cls = transformers.LlamaForCausalLM
    if size == "tiny":
        return _decoder(transformers.LlamaConfig, size), cls
    if size == "7b":  # Llama 2 7B
        return transformers.LlamaConfig(
            num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
            intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
        ), cls
    if size == "8b":  # Llama 3 8B
        return transformers.LlamaConfig(
            num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_theta=500000.0,
        ), cls
    if size == "70b":  # Llama 3 70B
        return transformers.LlamaConfig(
            num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
            intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_theta=500000.0,
        ), cls
    raise KeyError(size)


def _mistral(size):
    cls = transformers.MistralForCausalLM
    if size == "tiny":
        return _decoder(transformers.MistralConfig, size, sliding_window=None), cls
    if size == "7b":  # Mistral 7B v0.1 (sliding window off: full causal attention)
        return transformers.MistralConfig(
            num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768, sliding_window=None,
        ), cls
    raise KeyError(size)


def _qwen2(size):
    assert size == "tiny"
    return _decoder(transformers.Qwen2Config, size), transformers.Qwen2ForCausalLM


def _mixtral(size):
    cls = transformers.MixtralForCausalLM
    if size == "tiny":
        config = _decoder(transformers.MixtralConfig, size, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=None)
        return config, cls
    if size == "8x7b":  # Mixtral 8x7B (Jiang et al. 2024, table 1): 46.7B parameters, top-2 of 8
        return transformers.MixtralConfig(
            num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768, num_local_experts=8,
            num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
        ), cls
    raise KeyError(size)


def _qwen2_moe(size):
    cls = transformers.Qwen2MoeForCausalLM
    if size == "tiny":  # every layer sparse: 4 routed experts (top-2) and a gated shared expert
        return _decoder(transformers.Qwen2MoeConfig, size, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=64, shared_expert_intermediate_size=128, decoder_sparse_step=1,
                        mlp_only_layers=[]), cls
    if size == "a2.7b":  # Qwen1.5-MoE-A2.7B (its Hub config): 14.3B parameters, top-4 of 60 experts
        return transformers.Qwen2MoeConfig(
            num_hidden_layers=24, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
            intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
            num_experts=60, num_experts_per_tok=4, vocab_size=151936, max_position_embeddings=8192,
            rope_theta=1e6, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
        ), cls
    raise KeyError(size)


def _bert(size):
    assert size == "tiny"
    t = _TINY
    return transformers.BertConfig(
        num_hidden_layers=t["layers"], hidden_size=t["hidden"], num_attention_heads=t["heads"],
        intermediate_size=t["ffn"], vocab_size=t["vocab"], max_position_embeddings=t["positions"],
    ), transformers.BertForMaskedLM


def _t5(size):
    assert size == "tiny"
    t = _TINY
    return transformers.T5Config(
        num_layers=t["layers"], num_decoder_layers=t["layers"], d_model=t["hidden"], num_heads=t["heads"],
        d_kv=t["hidden"] // t["heads"], d_ff=t["ffn"], vocab_size=t["vocab"],
        decoder_start_token_id=0, pad_token_id=0,
    ), transformers.T5ForConditionalGeneration


def _vit(size):
    assert size == "tiny"
    t = _TINY
    return transformers.ViTConfig(
        num_hidden_layers=t["layers"], hidden_size=t["hidden"], num_attention_heads=t["heads"],
        intermediate_size=t["ffn"], image_size=32, patch_size=8, num_channels=3, num_labels=10,
    ), transformers.ViTForImageClassification


# Size fields of Hugging Face configs -> the tiny value; every other field keeps its default.
_TINY_FIELDS = {
    ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers",
     "n_layers"): 2,
    ("hidden_size", "n_embd", "d_model"): 64,
    ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads"): 4,
    ("num_key_value_heads", "num_kv_heads"): 2,
    ("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim"): 128,
    ("head_dim", "d_kv"): 16,
    # rotary and multi-head latent attention sizes follow the smaller heads (GPT-J's and
    # CodeGen's rotary_dim of 64 against heads of 16 broke their own shapes, as did DeepSeek-V3's
    # 64-wide rope part)
    ("rotary_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"): 16,
    ("kv_lora_rank", "q_lora_rank"): 32,
    ("num_local_experts", "num_experts", "n_routed_experts"): 4,
    ("num_experts_per_tok", "moe_topk", "top_k"): 2,
    ("n_group", "topk_group"): 1,  # (expert groups for routing: 8 groups of 4 experts would be empty)
    ("vocab_size",): 512,
    ("image_size",): 32,
    ("patch_size",): 8,
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id")


_LAYER_FIELDS = next(names for names in _TINY_FIELDS if "num_hidden_layers" in names)


def _field(config, name: str):
    """``config.name``, or None where unset or where the config refuses a global read (Gemma 4's
    per-layer ``head_dim`` raises unless read through one layer's config)."""
    try:
        return getattr(config, name, None)
    except Exception:  # (transformers' AmbiguousGlobalPerLayerAttributeError and kin)
        return None


def _tiny_kwargs(default, *, layers: int | None) -> dict:
    """The size fields of ``default`` (a config) to change, sub-configs included; ``layers``: the
    layer count (per-layer lists cut to it), None to keep the config's depth."""
    kwargs = {}
    for names, value in _TINY_FIELDS.items():
        if names is _LAYER_FIELDS:
            if layers is None:
                continue
            value = layers
        for name in names:
            have = _field(default, name)
            derived = getattr(type(default), name, None)
            if isinstance(derived, property) and derived.fset is None:
                continue  # (computed from other fields, as xLSTM's v_head_dim: it follows them)
            if isinstance(have, int) and not isinstance(have, bool) and have > value:
                kwargs[name] = value
    n_layers = _field(default, "num_hidden_layers")
    if layers is not None and isinstance(n_layers, int) and n_layers > layers:  # per-layer lists follow the count
        for name, have in default.to_dict().items():
            if isinstance(have, list) and len(have) == n_layers and name not in kwargs:
                kwargs[name] = have[:layers]
            elif (isinstance(have, dict) and have and "layer" in name and name not in kwargs  # by layer index
                  and all(str(k).isdigit() and int(k) < n_layers for k in have)):  # (Gemma 4's "05": ...)
                kwargs[name] = {k: v for k, v in have.items() if int(k) < layers}
    heads, kv_heads = _field(default, "num_attention_heads"), _field(default, "num_key_value_heads")
    if _field(default, "kv_lora_rank") and heads == kv_heads and "num_key_value_heads" in kwargs:
        # multi-head latent attention (DeepSeek-V2/V3 and kin) expands keys and values to every
        # attention head: its key/value head count must stay equal to the head count
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", heads)
    vocab = kwargs.get("vocab_size", _field(default, "vocab_size"))
    for name in _TOKEN_IDS:
        have = _field(default, name)
        if isinstance(vocab, int) and isinstance(have, int) and have >= vocab:
            kwargs[name] = 0
    for name, sub in vars(default).items():  # text_config, vision_config, ...
        if isinstance(sub, transformers.PretrainedConfig):
            kwargs[name] = {**sub.to_dict(), **_tiny_kwargs(sub, layers=layers)}
    return kwargs


def _depths(config) -> list[int]:
    """The layer counts of ``config`` and of its sub-configs (a multimodal model's text config)."""
    own = _field(config, "num_hidden_layers")
    subs = [d for sub in vars(config).values() if isinstance(sub, transformers.PretrainedConfig) for d in _depths(sub)]
    return ([own] if isinstance(own, int) else []) + subs


def tiny_config(config_cls, **extra):
    """``config_cls``'s default config with its size fields scaled down (2 layers, hidden 64, 4
    heads of 16, ffn 128, vocab 512, 4 experts in 1 routing group, rotary and latent-attention
    widths of 16 and 32; sub-configs too) and nothing else changed; sizes the config computes
    (read-only properties) follow the others;
    key/value heads become 2, or stay as many as the heads in multi-head latent attention;
    per-layer lists follow the layer count and token ids that fall outside the smaller
    vocabulary become 0. Fields the default leaves unset (None, such as GPT-2's n_inner)
    stay unset. Where the config's own checks refuse 2 layers (a layer pattern that must hold
    an attention layer: OLMo-hybrid's 3 linear + 1 full, NeoMME's and Gemma 4 unified's text
    config's 5 sliding + 1 full), the fewest layers it accepts, the pattern cut to that length (4 and 6 there, not 32 and 17);
    where it accepts no shorter pattern, the default depth. ``extra`` overrides anything."""
    default = config_cls()
    n_layers = max(_depths(default), default=0)
    depths = range(2, n_layers) if n_layers > 2 else [2]
    for layers in depths:
        try:
            return config_cls(**{**_tiny_kwargs(default, layers=layers), **extra})
        except Exception:  # the config validates its layer pattern: one more layer
            continue
    return config_cls(**{**_tiny_kwargs(default, layers=None), **extra})


# model -> (config class, auto class, kind of inputs): built from defaults (defaults=True)
DEFAULT_MODELS = {
    "gpt2": ("GPT2Config", "AutoModelForCausalLM", "causal"),
    "llama": ("LlamaConfig", "AutoModelForCausalLM", "causal"),
    "mistral": ("MistralConfig", "AutoModelForCausalLM", "causal"),
    "qwen2": ("Qwen2Config", "AutoModelForCausalLM", "causal"),
    "mixtral": ("MixtralConfig", "AutoModelForCausalLM", "causal"),
    "gemma": ("GemmaConfig", "AutoModelForCausalLM", "causal"),
    "phi": ("PhiConfig", "AutoModelForCausalLM", "causal"),
    "bert": ("BertConfig", "AutoModelForMaskedLM", "masked"),
    "t5": ("T5Config", "AutoModelForSeq2SeqLM", "seq2seq"),
    "vit": ("ViTConfig", "AutoModelForImageClassification", "image"),
}

# model -> (config factory, sizes it offers, kind of inputs)
MODELS = {
    "gpt2": (_gpt2, ("tiny",), "causal"),
    "llama": (_llama, ("tiny", "7b", "8b", "70b"), "causal"),
    "mistral": (_mistral, ("tiny", "7b"), "causal"),
    "qwen2": (_qwen2, ("tiny",), "causal"),
    "mixtral": (_mixtral, ("tiny", "8x7b"), "causal"),
    "qwen2_moe": (_qwen2_moe, ("tiny", "a2.7b"), "causal"),
    "bert": (_bert, ("tiny",), "masked"),
    "t5": (_t5, ("tiny",), "seq2seq"),
    "vit": (_vit, ("tiny",), "image"),
}


def _inputs(kind, config, batch, seq, device, seed):
    """Keyword inputs, labels included; random on cpu, empty on meta."""
    on_meta = torch.device(device).type == "meta"
    g = None if on_meta else torch.Generator().manual_seed(seed)

    def ints(high, *shape):
        if on_meta:
            return torch.empty(*shape, dtype=torch.long, device=device)
        return torch.randint(0, high, shape, generator=g).to(device)

    if kind == "causal":
        # HF shifts labels inside the loss: labels are the input ids themselves
        input_ids = ints(config.vocab_size, batch, seq)  # (B, T)
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    if kind == "masked":
        input_ids = ints(config.vocab_size, batch, seq)  # (B, T)
        return {"input_ids": input_ids, "labels": ints(config.vocab_size, batch, seq)}  # (B, T)
    if kind == "seq2seq":
        # decoder_input_ids given explicitly, so the model does not shift labels itself
        labels = ints(config.vocab_size, batch, seq)  # (B, T)
        decoder_input_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)  # (B, T)
        return {"input_ids": ints(config.vocab_size, batch, seq), "decoder_input_ids": decoder_input_ids, "labels": labels}
    if kind == "image":
        shape = (batch, config.num_channels, config.image_size, config.image_size)  # (B, 3, H, W)
        pixel_values = torch.empty(shape, device=device) if on_meta else torch.randn(shape, generator=g).to(device)
        return {"pixel_values": pixel_values, "labels": ints(config.num_labels, batch)}  # labels (B,)
    raise AssertionError(kind)


def build(model="gpt2", size="tiny", device=None, batch=None, seq=None, seed=0, defaults=False):
    """Return (hf_model, inputs_dict, None, None). All arguments may be strings."""
    if str(defaults).lower() in ("1", "true", "yes"):
        return _build_default(model, size, device, batch, seq, seed)
    if model not in MODELS:
        raise ValueError(f"unknown hf model {model!r}; choose one of {', '.join(MODELS)}")
    make_config, sizes, kind = MODELS[model]
    if size not in sizes:
        raise ValueError(f"unknown size {size!r} for hf model {model!r}; choose one of {', '.join(sizes)}")
    config, model_cls = make_config(size)
    config.use_cache = False
    for name in _DROPOUTS:  # deterministic training: runs compare exactly with one process
        if hasattr(config, name):
            setattr(config, name, 0.0)
    big = size != "tiny"
    device = torch.device(device if device is not None else ("meta" if big else "cpu"))
    batch = int(batch) if batch is not None else 8
    seq = int(seq) if seq is not None else (4096 if big else 64)
    seed = int(seed)
    on_meta = device.type == "meta"
    if not on_meta:
        torch.manual_seed(seed)
    with torch.device(device):
        hf_model = model_cls._from_config(config, attn_implementation="sdpa")
    return hf_model, _inputs(kind, config, batch, seq, device, seed), None, None


def _build_default(model, size, device, batch, seq, seed):
    """A tiny model from the architecture's default config, built as a user builds it."""
    if model not in DEFAULT_MODELS:
        raise ValueError(f"unknown hf model {model!r} for defaults=1; choose one of {', '.join(DEFAULT_MODELS)}")
    if size != "tiny":
        raise ValueError(f"defaults=1 builds only size 'tiny', not {size!r}")
    config_name, auto_name, kind = DEFAULT_MODELS[model]
    config = tiny_config(getattr(transformers, config_name))
    device = torch.device(device if device is not None else "cpu")
    if device.type != "meta":
        torch.manual_seed(int(seed))
    with torch.device(device):
        hf_model = getattr(transformers, auto_name).from_config(config)
    hf_model.train()  # (from_config leaves it in training mode; from_pretrained would not)
    batch = int(batch) if batch is not None else 8
    seq = int(seq) if seq is not None else 32
    return hf_model, _inputs(kind, config, batch, seq, device, int(seed)), None, None

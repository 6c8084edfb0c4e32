"""
A Llama-style decoder (RMSNorm, rotary positions, grouped-query attention,
SwiGLU), in plain PyTorch for autopar to plan.

References:
1) Llama 2, Touvron et al. 2023, https://arxiv.org/abs/2307.09288 (7b, 70b shapes)
2) Llama 3, Meta 2024, https://arxiv.org/abs/2407.21783, table 3 (8b, 70b, 405b)
3) meta-llama/llama model.py and torchtitan's torchtitan/models/llama3/model.py
   (module names tok_embeddings, layers.N.attention.wq/wk/wv/wo,
   feed_forward.w1/w2/w3, attention_norm, ffn_norm, norm, output are kept)
4) RoFormer, Su et al. 2021, https://arxiv.org/abs/2104.09864 (rotary embedding)

Differences from Meta's code, on purpose: RoPE uses the rotate-half form
(Hugging Face's) with real cos/sin arithmetic computed in forward, not complex
numbers, which FakeTensor and meta tracing handle badly; there is no KV cache.

    autopar plan examples/llama.py:build --arg size=70b --cluster 8x8xH100

build(size="tiny", device=..., batch=..., seq=..., n_layers=None, seed=0)
returns (model, (tokens,), loss_fn, target). Sizes of 1B parameters and more
are built on "meta" by default (allocates nothing, skips initialisation).
"70b" is Llama 3 70B (vocab 128256, rope theta 500000): ~70.6B parameters.
"""
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    dim: int
    """Width of the residual stream."""
    n_layers: int
    n_heads: int
    n_kv_heads: int
    """Key/value heads (grouped-query attention); n_heads must divide by it."""
    vocab_size: int
    multiple_of: int = 256
    """The SwiGLU hidden width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the SwiGLU hidden width (Llama 3: 1.3 for 8b and 70b)."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        """SwiGLU width as Meta computes it: 2/3 of 4*dim, scaled, rounded up."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# Params ~ L * (2*d^2 + 2*d*kv_dim + 3*d*ffn) + 2*vocab*d (untied embedding and output):
#   7b:   32 * (2*4096^2 + 2*4096^2 + 3*4096*11008) + 2*32000*4096     = 6.74B
#   8b:   32 * (2*4096^2 + 2*4096*1024 + 3*4096*14336) + 2*128256*4096 = 8.03B
#   70b:  80 * (2*8192^2 + 2*8192*1024 + 3*8192*28672) + 2*128256*8192 = 70.55B
#   405b: 126 * (2*16384^2 + 2*16384*1024 + 3*16384*53248) + 2*128256*16384 = 405.9B
SIZES: dict[str, LlamaConfig] = {
    # ffn_hidden: 64 -> 170 -> 192 (multiple_of 32)
    "tiny": LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=128),
    # ffn_hidden: 256 -> 682 -> 768
    "small": LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=1024, multiple_of=256, max_seq_len=256),
    # Llama 2 7B: ffn_hidden 10922 -> 11008
    "7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000),
    # Llama 3 8B: ffn_hidden 10922 * 1.3 = 14198 -> 14336
    "8b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
        multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192,
    ),
    # Llama 3 70B: ffn_hidden 21845 * 1.3 = 28398 -> 28672
    "70b": LlamaConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
        multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192,
    ),
    # Llama 3.1 405B: ffn_hidden 43690 * 1.2 = 52428 -> 53248
    "405b": LlamaConfig(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
        multiple_of=4096, ffn_dim_multiplier=1.2, rope_theta=500000.0, max_seq_len=8192,
    ),
}


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self):
        """Ones (what the constructor sets), for a model built on meta and initialised per module."""
        nn.init.ones_(self.weight)

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, C)
        return xf.type_as(x) * self.weight


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device, dtype):
    """cos and sin tables for rotary embedding, each (T, hs), rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))  # (hs/2,)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)  # (T,)
    freqs = torch.outer(t, inv_freq)  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)  # 2 x (B, nh, T, hs/2)
    return torch.cat((-x2, x1), dim=-1)  # (B, nh, T, hs)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin  # (B, nh, T, hs); cos, sin broadcast from (T, hs)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        assert config.n_heads % config.n_kv_heads == 0
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.n_rep = config.n_heads // config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.wo.residual_projection = True  # scaled init, Transformer.init_std

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        # each key/value head serves n_rep consecutive query heads
        k = k.repeat_interleave(self.n_rep, dim=1)  # (B, nh, T, hs)
        v = v.repeat_interleave(self.n_rep, dim=1)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_heads * self.head_dim)  # (B, T, nh*hs)
        return self.wo(y)  # (B, T, C)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), Shazeer 2020, https://arxiv.org/abs/2002.05202."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2.residual_projection = True  # scaled init, Transformer.init_std

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, hidden) -> (B, T, C)


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden)
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: LlamaConfig, init: bool = True):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if init:
            self.init_weights()

    def init_std(self, module: nn.Module) -> float:
        """Normal(0, 0.02), residual projections (wo, w2) scaled by 1/sqrt(2 * n_layers)."""
        if getattr(module, "residual_projection", False):
            return 0.02 / math.sqrt(2 * self.config.n_layers)
        return 0.02

    @torch.no_grad()
    def init_weights(self):
        """The whole model's initialisation on CPU (init_std per weight; RMSNorm keeps its ones)."""
        nn.init.normal_(self.tok_embeddings.weight, std=self.init_std(self.tok_embeddings))
        nn.init.normal_(self.output.weight, std=self.init_std(self.output))
        for layer in self.layers:
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1, layer.feed_forward.w3):
                nn.init.normal_(lin.weight, std=self.init_std(lin))
            for lin in (layer.attention.wo, layer.feed_forward.w2):
                nn.init.normal_(lin.weight, std=self.init_std(lin))

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        """One module's share of init_weights (Hugging Face style), for a model built on meta:
        autopar.parallelize initialises each rank's pieces module by module with it (after the
        module's reset_parameters, which sets RMSNorm's ones)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.init_std(module))

    def forward(self, tokens):
        B, T = tokens.shape
        h = self.tok_embeddings(tokens)  # (B, T, C)
        cos, sin = rope_cos_sin(T, self.config.head_dim, self.config.rope_theta, h.device, h.dtype)  # (T, hs)
        for layer in self.layers:
            h = layer(h, cos, sin)  # (B, T, C)
        return self.output(self.norm(h))  # (B, T, V)


def cross_entropy_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())  # (B*T, V) vs (B*T,)


def count_params(config: LlamaConfig) -> int:
    """Exact parameter count of Transformer(config), without building it."""
    d, kv_dim = config.dim, config.n_kv_heads * config.head_dim
    layer = 2 * d * d + 2 * d * kv_dim + 3 * d * config.ffn_hidden + 2 * d
    return config.n_layers * layer + 2 * config.vocab_size * d + d


def build(size="tiny", device=None, batch=None, seq=None, n_layers=None, seed=0, dtype=None):
    """Return (model, (tokens,), cross_entropy_loss, target). All arguments may be strings.

    n_layers overrides the size's depth (a shallow copy of a big model plans faster).
    """
    if size not in SIZES:
        raise ValueError(f"unknown llama size {size!r}; choose one of {', '.join(SIZES)}")
    config = SIZES[size]
    if n_layers is not None:
        config = replace(config, n_layers=int(n_layers))
    big = count_params(SIZES[size]) >= 1e9
    device = torch.device(device if device is not None else ("meta" if big else "cpu"))
    batch = int(batch) if batch is not None else 8
    seq = int(seq) if seq is not None else (4096 if big else 64)
    on_meta = device.type == "meta"
    if not on_meta:
        torch.manual_seed(int(seed))
    with torch.device(device):
        model = Transformer(config, init=not on_meta)
    model = model.to(_dtype(dtype, on_meta))
    if on_meta:
        tokens = torch.empty(batch, seq, dtype=torch.long, device=device)  # (B, T)
        target = torch.empty(batch, seq, dtype=torch.long, device=device)  # (B, T)
    else:
        g = torch.Generator().manual_seed(int(seed))
        tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)  # (B, T)
        target = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)  # (B, T)
    return model, (tokens,), cross_entropy_loss, target


def _dtype(name, on_meta):
    """Models on "meta" plan as bf16 training (what they would run in); CPU runs use fp32."""
    if name is None:
        return torch.bfloat16 if on_meta else torch.float32
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(table)}")
    return table[name]

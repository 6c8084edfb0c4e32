"""
GPT, the decoder-only Transformer, written as nanoGPT writes it, for autopar to plan.

References:
1) nanoGPT, Andrej Karpathy: https://github.com/karpathy/nanoGPT/blob/master/model.py
   (module names transformer.wte/wpe/h/ln_f and lm_head are kept, so plans and
   state dicts read the same as nanoGPT's)
2) GPT-2, Radford et al. 2019 (sizes 125m, 350m; vocab 50257, padded to 50304)
3) GPT-3, Brown et al. 2020, https://arxiv.org/abs/2005.14165, table 2.1
   (sizes 1.3b, 6.7b ("7b" here) and 175b, context 2048)

    autopar plan examples/gpt.py:build --arg size=175b --cluster 128x8xH100

build(size="tiny", device=..., batch=..., seq=..., dropout=0.0, bias=True,
tie_weights=True, n_layer=None, seed=0) returns (model, (idx,), loss_fn, target)
where loss_fn is the cross entropy over flattened logits. Sizes of 1B
parameters and more are built on the "meta" device by default: no memory is
allocated and nothing is initialised.
"""
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    n_layer: int
    """Number of Transformer blocks."""
    n_head: int
    """Attention heads per block; n_embd must divide by it."""
    n_embd: int
    """Width of the residual stream (d)."""
    vocab_size: int = 50304
    """GPT-2's 50257 padded up to a multiple of 64 for efficiency (nanoGPT)."""
    block_size: int = 1024
    """Longest sequence the position embedding covers."""
    dropout: float = 0.0
    bias: bool = True
    """Bias in the Linears and LayerNorms, as GPT-2; False is a bit better and faster."""


# Parameters, without embeddings, are ~12 * n_layer * n_embd^2 (4d^2 attention
# + 8d^2 MLP per block); the embeddings add (vocab_size + block_size) * n_embd.
#   125m: 12*12*768^2    = 84.9M  + 39.4M  emb = 124.4M
#   350m: 12*24*1024^2   = 302M   + 52.6M  emb = 354.5M
#   1.3b: 12*24*2048^2   = 1.208B + 107M   emb = 1.315B
#   7b:   12*32*4096^2   = 6.442B + 214M   emb = 6.657B   (GPT-3 "6.7B")
#   175b: 12*96*12288^2  = 173.9B + 643M   emb = 174.6B
#   1t:   12*128*25600^2 = 1006.6B + 1.34B emb = 1.008T
SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=64),
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=512, block_size=128),
    "125m": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "350m": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=2048),
    "7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048),
    "175b": GPTConfig(n_layer=96, n_head=96, n_embd=12288, block_size=2048),
    "1t": GPTConfig(n_layer=128, n_head=160, n_embd=25600, block_size=2048),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, in one Linear
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True  # scaled init, GPT._init_weights
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()  # batch, sequence length, embedding width (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True  # scaled init, GPT._init_weights
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, tie_weights: bool = True, init: bool = True):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if tie_weights:
            # weight tying, https://paperswithcode.com/method/weight-tying
            self.lm_head.weight = self.transformer.wte.weight
        if init:
            self.apply(self._init_weights)

    def _init_weights(self, module):
        """Per module, so a model built on meta is initialised module by module (autopar.parallelize)."""
        if isinstance(module, nn.Linear):
            # scaled init of the residual projections, per GPT-2
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if getattr(module, "residual_projection", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        b, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"sequence of length {t} is longer than block_size {self.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # (T,)
        tok_emb = self.transformer.wte(idx)  # (B, T, C)
        pos_emb = self.transformer.wpe(pos)  # (T, C)
        x = self.transformer.drop(tok_emb + pos_emb)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # (B, T, V)


def cross_entropy_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())  # (B*T, V) vs (B*T,)


def _as_bool(value) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean (true/false), got {value!r}")
    return bool(value)


def count_params(config: GPTConfig, tie_weights: bool = True) -> int:
    """Exact parameter count of GPT(config), without building it."""
    d, L = config.n_embd, config.n_layer
    bias = int(config.bias)
    ln = d * (1 + bias)
    block = 2 * ln + (3 * d * d + 3 * d * bias) + (d * d + d * bias) + (4 * d * d + 4 * d * bias) + (4 * d * d + d * bias)
    emb = (config.vocab_size + config.block_size) * d
    head = 0 if tie_weights else config.vocab_size * d
    return L * block + emb + ln + head


def build(
    size="tiny",
    device=None,
    batch=None,
    seq=None,
    dropout=0.0,
    bias=True,
    tie_weights=True,
    n_layer=None,
    seed=0,
    dtype=None,
):
    """Return (model, (idx,), cross_entropy_loss, target). All arguments may be strings.

    n_layer overrides the size's depth (a shallow copy of a big model plans faster).
    """
    if size not in SIZES:
        raise ValueError(f"unknown gpt size {size!r}; choose one of {', '.join(SIZES)}")
    config = replace(SIZES[size], dropout=float(dropout), bias=_as_bool(bias))
    if n_layer is not None:
        config = replace(config, n_layer=int(n_layer))
    tie_weights = _as_bool(tie_weights)
    big = count_params(SIZES[size]) >= 1e9
    device = torch.device(device if device is not None else ("meta" if big else "cpu"))
    batch = int(batch) if batch is not None else 8
    seq = int(seq) if seq is not None else (64 if config.block_size <= 128 else config.block_size)
    if seq > config.block_size:
        raise ValueError(f"seq={seq} is longer than gpt {size}'s block_size {config.block_size}")
    on_meta = device.type == "meta"
    if not on_meta:
        torch.manual_seed(int(seed))
    with torch.device(device):
        model = GPT(config, tie_weights=tie_weights, init=not on_meta)
    model = model.to(_dtype(dtype, on_meta))
    if on_meta:
        idx = torch.empty(batch, seq, dtype=torch.long, device=device)  # (B, T)
        target = torch.empty(batch, seq, dtype=torch.long, device=device)  # (B, T)
    else:
        g = torch.Generator().manual_seed(int(seed))
        idx = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)  # (B, T)
        target = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)  # (B, T)
    return model, (idx,), cross_entropy_loss, target


def _dtype(name, on_meta):
    """Models on "meta" plan as bf16 training (what they would run in); CPU runs use fp32."""
    if name is None:
        return torch.bfloat16 if on_meta else torch.float32
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(table)}")
    return table[name]

"""
A small mixture-of-experts decoder (Mixtral-style: top-2 of 8 SwiGLU experts per
block, optional shared expert as in DeepSeekMoE), for autopar to plan and to run
under expert parallelism.

References:
1) Mixtral of Experts, Jiang et al. 2024, https://arxiv.org/abs/2401.04088
   (top-2 of 8, softmax over the two chosen logits; 8x7b shapes)
2) GShard, Lepikhin et al. 2020, https://arxiv.org/abs/2006.16668 (expert parallelism,
   all-to-all dispatch and combine)
3) Switch Transformer, Fedus et al. 2021, https://arxiv.org/abs/2101.03961, eq. 4
   (load-balancing loss E * sum_e f_e P_e)
4) DeepSeekMoE, Dai et al. 2024, https://arxiv.org/abs/2401.06066 (shared experts);
   DeepSeek-V3 2024, sec. 2.1.2 (the balance loss taken per sequence)

    autopar plan examples/moe.py:build --arg size=8x7b --cluster 8x8xH100 --fix ep=8

build(size="tiny", device=..., batch=..., seq=..., n_layers=None, shared_expert=None,
aux_loss=0.0, seed=0, dtype=None) returns (model, (tokens,), loss_fn, target). Sizes: tiny,
small, 8x7b (Mixtral shapes), dsv3 (DeepSeek-V3 shapes: 256 experts of width 2048, top-8).

Expert form. The experts of a block are three stacked parameters, ``w_gate``,
``w_up`` (E, d, f) and ``w_down`` (E, f, d), run by one op,
:func:`autopar.experts.moe_experts`, on the tokens sorted by expert. Stacked weights
rather than a ModuleList of E MLPs because expert parallelism is then one cut along
dim 0 of three tensors (rank r keeps rows [r E/ep, (r+1) E/ep)), the trace has one
expert node per block instead of E data-dependent slices, and the planner finds the
expert weights as that op's arguments. Routing (router matmul, top-k, the sort by
expert, un-sorting and weighting) is plain torch with static shapes: T*k rows.

The balance loss (``aux_loss`` > 0: the model returns (logits, balance) and the loss
adds aux_loss * balance) is computed per sequence and averaged over the batch, so a
data-parallel split of the batch gives exactly the single-process value.
"""
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.experts import route_to_experts, route_top_k


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    dim: int
    """Width of the residual stream (d)."""
    n_layers: int
    n_heads: int
    vocab_size: int
    n_experts: int = 8
    """Routed experts per block (E)."""
    top_k: int = 2
    """Experts each token is sent to."""
    expert_hidden: int
    """Hidden width of one SwiGLU expert (f)."""
    shared_expert: bool = False
    """One always-on SwiGLU expert of width f per block, added to the routed ones."""
    max_seq_len: int = 4096
    norm_eps: float = 1e-5


# Params ~ L * (4 d^2 + d E + 3 E d f [+ 3 d f shared] + 2 d) + 2 V d + T_max d + d
SIZES: dict[str, MoEConfig] = {
    "tiny": MoEConfig(dim=32, n_layers=2, n_heads=4, vocab_size=128, n_experts=8, expert_hidden=32, max_seq_len=64),
    "small": MoEConfig(dim=128, n_layers=4, n_heads=8, vocab_size=1024, n_experts=8, expert_hidden=256,
                       max_seq_len=256),
    # Mixtral 8x7B shapes (learned positions instead of RoPE, full instead of grouped-query
    # attention): 32 x (4 * 4096^2 + 3 * 8 * 4096 * 14336) + 2 * 32000 * 4096 ~ 47.5B
    "8x7b": MoEConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, n_experts=8, expert_hidden=14336),
    # DeepSeek-V3 shapes (tech report sec. 4.2: 61 layers, hidden 7168, 128 heads, 256 routed experts of
    # width 2048 with top-8, one shared expert, vocabulary 129280): many small experts. Simplified as
    # for 8x7b (full attention instead of MLA, every block MoE instead of 3 dense ones first, no
    # multi-token prediction): ~705B parameters, ~38B active per token (the report: 671B, 37B).
    "dsv3": MoEConfig(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, n_experts=256, top_k=8,
                      expert_hidden=2048, shared_expert=True),
}


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal multi-head attention with separate q, k, v projections (as Mixtral's; a tp plan
    shards them by heads)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, -1, C // self.n_heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x), Shazeer 2020: the shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (stacked weights), optional shared expert.

    ``ep_group`` is the name of the expert-parallel process group ("" when every
    expert is local); under expert parallelism :func:`autopar.parallelize` cuts
    ``w_gate``/``w_up``/``w_down`` down to this rank's experts and runs the traced
    experts op over the rank's ep group (:mod:`autopar.runtime.expert`)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        E, d, f = config.n_experts, config.dim, config.expert_hidden
        self.n_experts, self.top_k = E, config.top_k
        self.router = nn.Linear(d, E, bias=False)
        self.w_gate = nn.Parameter(torch.empty(E, d, f))
        self.w_up = nn.Parameter(torch.empty(E, d, f))
        self.w_down = nn.Parameter(torch.empty(E, f, d))
        self.shared = SwiGLU(d, f) if config.shared_expert else None
        self.ep_group = ""

    def forward(self, x):
        B, T, C = x.shape
        E, k = self.n_experts, self.top_k
        flat = x.reshape(B * T, C)  # (N, C), N = B*T tokens
        weights, experts, probs = route_top_k(self.router(flat), k)  # (N, k), (N, k), (N, E)
        out = route_to_experts(flat, weights, experts, E, self.w_gate, self.w_up, self.w_down,
                               self.ep_group).view(B, T, C)  # (B, T, C)
        if self.shared is not None:
            out = out + self.shared(x)
        # per-sequence balance (Switch eq. 4, DeepSeek-V3's sequence-wise form): E * sum_e f_e P_e
        hits = (experts.reshape(B, T * k).unsqueeze(2) == torch.arange(E, device=x.device)).to(x.dtype)  # (B, T*k, E)
        f = hits.mean(1)  # (B, E) fraction of the sequence's choices per expert
        p = probs.view(B, T, E).mean(1).to(x.dtype)  # (B, E) mean router probability
        balance = E * (f * p).sum(-1).mean()
        return out, balance


class Block(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.moe_norm = RMSNorm(config.dim, config.norm_eps)
        self.moe = MoE(config)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        y, balance = self.moe(self.moe_norm(h))
        return h + y, balance


class MoETransformer(nn.Module):
    def __init__(self, config: MoEConfig, *, aux_loss: float = 0.0, init: bool = True):
        super().__init__()
        self.config = config
        self.aux_loss = aux_loss
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings = nn.Embedding(config.max_seq_len, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if init:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Normal(0, 0.02); output projections (wo, w_down, shared w2) scaled by 1/sqrt(2 n_layers)."""
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.config.n_layers)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
            if isinstance(m, MoE):
                nn.init.normal_(m.w_gate, std=std)
                nn.init.normal_(m.w_up, std=std)
                nn.init.normal_(m.w_down, std=out_std)
        for layer in self.layers:
            nn.init.normal_(layer.attention.wo.weight, std=out_std)
            if layer.moe.shared is not None:
                nn.init.normal_(layer.moe.shared.w2.weight, std=out_std)

    def forward(self, tokens):
        B, T = tokens.shape
        pos = torch.arange(T, device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)  # (B, T, C)
        balance = h.new_zeros(())
        for layer in self.layers:
            h, b = layer(h)  # (B, T, C)
            balance = balance + b
        logits = self.output(self.norm(h))  # (B, T, V)
        if self.aux_loss:
            return logits, balance / len(self.layers)
        return logits


def make_loss(aux_loss: float):
    """Cross entropy over flattened logits, plus aux_loss x the balance loss when the model returns it."""

    def loss_fn(output, target):
        if isinstance(output, tuple):
            logits, balance = output
            return F.cross_entropy(logits.flatten(0, 1), target.flatten()) + aux_loss * balance
        return F.cross_entropy(output.flatten(0, 1), target.flatten())  # (B*T, V) vs (B*T,)

    return loss_fn


def count_params(config: MoEConfig) -> int:
    """Exact parameter count of MoETransformer(config), without building it."""
    d, E, f = config.dim, config.n_experts, config.expert_hidden
    layer = 4 * d * d + d * E + 3 * E * d * f + (3 * d * f if config.shared_expert else 0) + 2 * d
    return config.n_layers * layer + 2 * config.vocab_size * d + config.max_seq_len * d + d


def expert_params(config: MoEConfig) -> int:
    """Parameters in routed experts (the part expert parallelism divides by ep)."""
    return config.n_layers * 3 * config.n_experts * config.dim * config.expert_hidden


def _flag(v) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")


def build(size="tiny", device=None, batch=None, seq=None, n_layers=None, shared_expert=None, aux_loss=0.0,
          n_experts=None, seed=0, dtype=None):
    """Return (model, (tokens,), loss_fn, target). All arguments may be strings; ``shared_expert``
    defaults to the size's (on for dsv3)."""
    if size not in SIZES:
        raise ValueError(f"unknown moe size {size!r}; choose one of {', '.join(SIZES)}")
    config = SIZES[size]
    if shared_expert is not None:
        config = replace(config, shared_expert=_flag(shared_expert))
    if n_layers is not None:
        config = replace(config, n_layers=int(n_layers))
    if n_experts is not None:
        config = replace(config, n_experts=int(n_experts))
    big = count_params(config) >= 1e9
    device = torch.device(device if device is not None else ("meta" if big else "cpu"))
    batch = int(batch) if batch is not None else 8
    seq = int(seq) if seq is not None else (4096 if big else 16)
    if seq > config.max_seq_len:
        raise ValueError(f"seq={seq} is longer than size {size!r}'s max_seq_len={config.max_seq_len}")
    on_meta = device.type == "meta"
    if not on_meta:
        torch.manual_seed(int(seed))
    with torch.device(device):
        model = MoETransformer(config, aux_loss=float(aux_loss), init=not on_meta)
    model = model.to(_dtype(dtype, on_meta))
    if on_meta:
        tokens = torch.empty(batch, seq, dtype=torch.long, device=device)  # (B, T)
        target = torch.empty(batch, seq, dtype=torch.long, device=device)  # (B, T)
    else:
        g = torch.Generator().manual_seed(int(seed))
        tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)  # (B, T)
        target = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)  # (B, T)
    return model, (tokens,), make_loss(float(aux_loss)), target


def _dtype(name, on_meta):
    """Models on "meta" plan as bf16 training; CPU runs use fp32."""
    if name is None:
        return torch.bfloat16 if on_meta else torch.float32
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp64": torch.float64, "float64": torch.float64}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(table)}")
    return table[name]

"""
A stack of MLP blocks over a feature vector: the smallest model autopar plans.

Each block is Linear(d -> hidden) -> GELU -> Linear(hidden -> d), with an
optional residual connection around it. It is the textbook case for tensor
parallelism: the first Linear splits by columns, the second by rows, and one
all-reduce per block joins them (Megatron-LM, Shoeybi et al. 2019,
https://arxiv.org/abs/1909.08053, section 3). On a 1-D mesh with no memory
pressure the best plan is plain data parallelism.

    autopar plan examples/mlp.py:build --arg size=tiny --cluster 1x4xcpu

build(size="tiny", device=..., batch=8, residual=True) returns
(model, (x,), loss_fn, target) with an MSE loss against a random target.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    d: int
    """Feature width of the residual stream."""
    n_blocks: int
    """Number of Linear -> GELU -> Linear blocks."""
    hidden: int
    """Inner width of each block (4 * d in the standard sizes)."""


SIZES: dict[str, MLPConfig] = {
    "tiny": MLPConfig(d=64, n_blocks=2, hidden=256),
    "small": MLPConfig(d=256, n_blocks=4, hidden=1024),
    "medium": MLPConfig(d=1024, n_blocks=8, hidden=4096),
    # 24 * 2 * 8192 * 32768 ~ 12.9B parameters: a model that must be sharded.
    "large": MLPConfig(d=8192, n_blocks=24, hidden=32768),
}


class Block(nn.Module):
    def __init__(self, d: int, hidden: int, residual: bool):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.residual = residual

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))  # (B, hidden) -> (B, d)
        return x + y if self.residual else y


class MLP(nn.Module):
    def __init__(self, config: MLPConfig, residual: bool = True):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(Block(config.d, config.hidden, residual) for _ in range(config.n_blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)  # (B, d)
        return x


def _as_bool(value) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean (true/false), got {value!r}")
    return bool(value)


def mse_loss(output, target):
    return F.mse_loss(output, target)


def build(size="tiny", device=None, batch=None, residual=True, seed=0):
    """Return (model, (x,), mse_loss, target). All arguments may be strings."""
    if size not in SIZES:
        raise ValueError(f"unknown mlp size {size!r}; choose one of {', '.join(SIZES)}")
    config = SIZES[size]
    n_params = config.n_blocks * (2 * config.d * config.hidden + config.hidden + config.d)
    if device is None:
        device = "meta" if n_params >= 1e9 else "cpu"
    device = torch.device(device)
    batch = int(batch) if batch is not None else 8
    on_meta = device.type == "meta"
    if not on_meta:
        torch.manual_seed(int(seed))
    with torch.device(device):
        model = MLP(config, residual=_as_bool(residual))
    if on_meta:
        x = torch.empty(batch, config.d, device=device)  # (B, d)
        target = torch.empty(batch, config.d, device=device)  # (B, d)
    else:
        g = torch.Generator().manual_seed(int(seed))
        x = torch.randn(batch, config.d, generator=g).to(device)  # (B, d)
        target = torch.randn(batch, config.d, generator=g).to(device)  # (B, d)
    return model, (x,), mse_loss, target

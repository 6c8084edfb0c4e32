"""Memory of training state (parameters, gradients, optimizer) and reference activations.

Training state per rank, for ``N`` parameters (of this rank's model shard, i.e.
after tensor/pipeline parallelism) and ``dp`` data-parallel ranks, after
Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC 2020), Fig. 1 and Sec. 5:

    stage  params          grads           optimizer
    0      N*P             N*G             N*K
    1      N*P             N*G             N*K/dp
    2      N*P             N*G/dp          N*K/dp
    3      N*P/dp          N*G/dp          N*K/dp

Mixed-precision AdamW (ZeRO paper Sec. 3.1): P = 2 (bf16/fp16 weights), G = 2,
K = 12 (fp32 master weights, Adam m and v), 16 bytes per parameter in all, so a
7B model holds 112 GB unsharded and 1.75 GB per rank under 64-way ZeRO-3.
Plain fp32 training: P = 4, G = 4, K = 8 (Adam m and v; the weights are the master).
autopar's bf16 mixed policies (:mod:`autopar.precision`, FSDP2's ``MixedPrecisionPolicy``
semantics): P = 2 (the bf16 compute copy), G = 4 (gradients land in fp32 buffers, whatever
dtype they are reduced in), K = 12 (fp32 master, m, v): 18 bytes per parameter at stages 0-2.
At stage 3 no compute copy is held: each layer group's fp32 slice is cast when it is gathered
(``runtime/zero.py``; FSDP2 does the same), and that gathered copy is one of ZeRO's collective
buffers (:func:`autopar.zero_def.buffer_bytes_per_param`), so P = 0 there: 16 bytes per
parameter, all sharded.

:func:`activation_bytes_megatron` is the closed form of Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023,
arXiv:2205.05198), Sec. 4; autopar measures activations from the joint graph and
uses this formula only as a cross-check.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.zero_def import stage, state_shards

__all__ = [
    "COMPUTE_COPY_PRECISIONS",
    "PRECISIONS",
    "StateBytes",
    "activation_bytes_megatron",
    "training_state_bytes",
]

PRECISIONS: dict[str, tuple[int, int, int]] = {
    "mixed": (2, 2, 12),  # ZeRO paper Sec. 3.1: fp16 param + fp16 grad + fp32 (master, m, v)
    "fp32": (4, 4, 8),  # fp32 param + fp32 grad + fp32 (m, v)
    "bf16-mixed": (2, 4, 12),  # bf16 compute copy + fp32 grad + fp32 (master, m, v)
    "bf16-mixed-bf16-reduce": (2, 4, 12),  # reduced in bf16, accumulated and stepped in fp32
}
"""Bytes per parameter as ``(param, grad, optimizer)`` for AdamW, by precision name."""

COMPUTE_COPY_PRECISIONS = frozenset({"bf16-mixed", "bf16-mixed-bf16-reduce"})
"""Precisions whose ``param`` bytes are a compute copy cast from the fp32 master (counted in
``optimizer``), which ZeRO stage 3 does not hold (module docstring)."""


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes of training state one rank holds."""

    params: float
    """Model weights held by this rank."""
    grads: float
    """Gradients held by this rank."""
    optimizer: float
    """Optimizer state (master weights, moments) held by this rank."""

    @property
    def total(self) -> float:
        """``params + grads + optimizer``."""
        return self.params + self.grads + self.optimizer


def _check_count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def training_state_bytes(
    *,
    n_params: float,
    zero_stage: int,
    dp: int,
    precision: str = "mixed",
    param_bytes: int | None = None,
    grad_bytes: int | None = None,
    optimizer_bytes: int | None = None,
) -> StateBytes:
    """Per-rank bytes of parameters, gradients and optimizer state under ZeRO-``zero_stage``.

    ``precision`` picks the bytes per parameter from :data:`PRECISIONS`;
    ``param_bytes`` / ``grad_bytes`` / ``optimizer_bytes`` override single entries
    (e.g. ``optimizer_bytes=4`` for an fp32 SGD-with-momentum master copy).
    Raises ``ValueError`` for a stage outside 0..3, ``dp < 1``, a negative
    parameter count or an unknown precision.
    """
    _check_count("zero_stage", zero_stage, minimum=0)
    if zero_stage > 3:
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    _check_count("dp", dp, minimum=1)
    if isinstance(n_params, bool) or not n_params >= 0:
        raise ValueError(f"n_params must be >= 0, got {n_params!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {sorted(PRECISIONS)}")
    preset_param, preset_grad, preset_optimizer = PRECISIONS[precision]
    per_param = {
        "param_bytes": preset_param if param_bytes is None else param_bytes,
        "grad_bytes": preset_grad if grad_bytes is None else grad_bytes,
        "optimizer_bytes": preset_optimizer if optimizer_bytes is None else optimizer_bytes,
    }
    for name, value in per_param.items():
        if isinstance(value, bool) or not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    param_shards, grad_shards, optimizer_shards = state_shards(zero_stage, dp)
    if precision in COMPUTE_COPY_PRECISIONS and param_bytes is None and stage(zero_stage).params_sharded:
        per_param["param_bytes"] = 0  # stage 3 holds no compute copy (module docstring)
    return StateBytes(
        params=n_params * per_param["param_bytes"] / param_shards,
        grads=n_params * per_param["grad_bytes"] / grad_shards,
        optimizer=n_params * per_param["optimizer_bytes"] / optimizer_shards,
    )


def activation_bytes_megatron(
    *, s: int, b: int, h: int, a: int, tp: int = 1, sequence_parallel: bool = False
) -> float:
    """Activation bytes one transformer layer saves for backward (16-bit, no recompute).

    ``s`` sequence length, ``b`` micro-batch size, ``h`` hidden size, ``a`` attention
    heads, ``tp`` tensor-parallel degree. Korthikanti et al. 2022, Sec. 4:

        tp = 1:                      s*b*h * (34 + 5*a*s/h)             (eq. 1)
        tensor parallel:             s*b*h * (10 + 24/t + 5*a*s/(h*t))  (eq. 2)
        tensor + sequence parallel:  s*b*h/t * (34 + 5*a*s/h)           (eq. 3)
    """
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("tp", tp)):
        _check_count(name, value, minimum=1)
    sbh = s * b * h
    if tp == 1 or sequence_parallel:
        return sbh / tp * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / tp + 5 * a * s / (h * tp))

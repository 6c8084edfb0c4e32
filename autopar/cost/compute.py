"""Roofline compute time of one op (or a fused group of ops) on one device.

    time_s = max(flops / (peak_flops_per_s[dtype] * matmul_efficiency),
                 bytes_moved / (hbm_bytes_per_s * memory_efficiency))

Williams, Waterman and Patterson, "Roofline: An Insightful Visual Performance
Model for Multicore Architectures", CACM 52(4), 2009. An op whose arithmetic
intensity (FLOPs per byte of device memory traffic) is below the device's ridge
point is memory bound; above it, compute bound.

The efficiency factors turn datasheet peaks into achievable rates:

- ``MATMUL_EFFICIENCY = 0.6``: large bf16 GEMMs and whole training steps reach
  roughly half to two thirds of tensor-core peak. Narayanan et al., "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC 2021)
  report 163-182 TFLOP/s per A100 (52-58% of 312); Chowdhery et al., "PaLM" (2022)
  report 46-58% MFU/HFU; MLPerf Training LLM submissions sit in the same range.
- ``MEMORY_EFFICIENCY = 0.8``: streaming kernels reach ~80-90% of peak HBM
  bandwidth. Deakin et al., "GPU-STREAM v2.0 / BabelStream" (PMBS 2016 and later
  results) measure ~1.3-1.4 TB/s "Triad" on a 1.555 TB/s A100-40GB.

Both can be overridden per call (e.g. by a calibration run).

Kernel-specific efficiencies (:func:`kernel_time_s`) replace the single matmul
figure where the kind of kernel is known:

- **GEMMs** (:func:`gemm_efficiency`, :func:`kernel_time_s`): a large bf16 GEMM
  reaches ~72% of Hopper's dense peak; each dimension d costs a factor
  ``1 - exp(-d / GEMM_HALF_DIM)`` (partly filled tiles and waves, too few k-steps to
  hide the prologue and epilogue), and each GEMM pays ``GEMM_LAUNCH_S`` on top.
  ``GEMM_PEAK_EFFICIENCY`` and ``GEMM_HALF_DIM`` are a least-squares fit (log error) to
  74 cuBLAS timings on an H200 (``bench/gpu_check.py``, torch 2.11, two runs recorded in
  ``bench/gpu_check_h200.json``: the 10 generic shapes and the 27 linears of the fidelity
  rows, forward and both gradients, after the GPU had warmed up): RMS error 8.1%, 60 of
  74 within 10%. The H200's tensor cores and clocks are the H100 SXM's, so the fit serves
  both. The fit's own fixed cost came out at 20 us; that includes the dispatch of one
  Python call between the two CUDA events around it, which a training step hides (its
  kernels are queued ahead), so the kernel's own fixed cost keeps 5 us, the earlier fit's
  figure below. The GPU was warm, not cold: run back to back for 5-15 s, an 8192^3 GEMM
  falls from 767-774 to 651-665 TFLOP/s as the card reaches its 700 W cap and the SM
  clock drops from 1980 to about 1450 MHz (NVML readings in the same file); a transformer
  block's step time measured after 20 s of back-to-back steps is within 1.3% of the first
  ones, so training runs at these warm rates. The earlier constants (0.81, 300, 5 us) were
  fitted to the 30 H100 points XLA ships as its default matmul table
  (``xla/service/gpu/model/matmul_interpolator_data.h``, openxla/xla, 2025): those are
  cooler figures (4096^3 at 783 TFLOP/s against 691-735 here) and priced the fidelity rows'
  linears 4-50% faster than they ran. The same fractions are applied to any device's
  peak of the GEMM's dtype (tf32 and fp32 alike), for want of a table there.
- **Attention** (``ATTENTION_EFFICIENCY = 0.35`` unless the device has its own
  ``attention_efficiency``): PyTorch's SDPA ran FlashAttention-2 on Hopper until cuDNN's
  kernel became its first choice there (torch 2.11 with cuDNN above 9.15; cuDNN was opt-in
  after the 2.5 bugs, pytorch/pytorch#138522); Shah et al., "FlashAttention-3" (2024),
  abstract and fig. 1: FlashAttention-2 reaches about 35% of H100's peak. Measured on the
  H200 (same file, causal, head dim 128, FLOPs halved as below): FlashAttention-2 29%
  (forward 31-32%, backward 27-30%), cuDNN's kernel 50% (forward 55-62%, backward 45-48%);
  the Hopper entries of :mod:`autopar.cost.devices` carry the cuDNN figure, what autopar's
  runtime runs there.
- **Causal attention** (kind ``"causal_attention"``) executes half the FLOPs that are
  counted for it: ``torch.utils.flop_counter`` counts every attention as full ("NB: We
  aren't accounting for causal attention here", its sdpa formulas), while
  FlashAttention skips the key blocks above the diagonal. FlashAttention's own
  benchmark (Dao-AILab/flash-attention, ``benchmarks/benchmark_flash_attention.py``,
  ``flops()``: ``4 * batch * seqlen**2 * nheads * headdim // (2 if causal else 1)``)
  reports its TFLOP/s, and so the efficiency above, on the halved count, so a causal
  kernel takes ``CAUSAL_WORK_FRACTION`` x its counted FLOPs at that efficiency. The
  counted FLOPs (and MFU) keep the full figure, as torchtitan's and Megatron's MFU do.
- **Everything else** (pointwise, reductions, copies) is memory bound: bytes /
  (HBM bandwidth x ``MEMORY_EFFICIENCY``). Eager PyTorch's kernels (kind ``"other"``) are
  slower on fast memory: inside the Llama 3.1 8B and Qwen3-32B blocks on the H200 (same
  file; the kernels of one block, profiled), they took 1.40-1.59x the time bytes / (4.8
  TB/s x 0.8) gives, i.e. 0.50-0.57 of peak, about 2.6 TB/s; the slowest are PyTorch's
  generic (not vectorised) elementwise kernels, which broadcast or stride (the rotary
  embedding's products on transposed heads, the fp32 RMSNorm's). Their inner dims are
  contiguous (whole 128-element rows), so no sector is fetched in vain: the limit is the
  index arithmetic per element, which the SMs and clocks set, and those are the same on
  every Hopper part. So they are priced at min(HBM x 0.8, ``EAGER_BYTES_PER_S`` = 2.64 TB/s):
  on an H100 SXM (3.35 TB/s) that is 0.79 of peak, on the 2.4 TB/s parts 0.8. (One device:
  whether the ceiling holds elsewhere is not measured.) TorchInductor's generated kernels
  (kind ``"fused"``, :mod:`autopar.passes.fuse`) are not capped: the compiled Llama block's
  memory-bound kernels took 0.8x the uncapped price.
- **Float8 GEMMs** (kind ``"fp8_gemm"``, :mod:`autopar.passes.float8`): torchao's tensorwise
  Float8 training casts both operands of each of a linear's three GEMMs (forward, input
  gradient, weight gradient) from bf16 to float8 and runs the GEMM on the FP8 tensor cores,
  whose dense peak is twice bf16's on Hopper (the device's ``fp8_flops_per_s``). The GEMM
  gets the bf16 shape curve applied to that peak: cuBLASLt's FP8 GEMM at 8192^3 on H100 SXM
  runs at about 1,610 TFLOP/s, 0.81 of 1,979 (a public cross-check report of 16 GPUs, 1,599
  to 1,630 TFLOP/s), where a bf16 GEMM of that size reached 0.66-0.78 of 989 on the H200, warm
  to cold (the timings above), so the same fraction is, if anything, cautious. Each operand's
  cast costs ``FLOAT8_CAST_BYTES_PER_ELEMENT`` = 3 bytes per element at the memory rate (the
  bf16 read and the float8 write of the compiled cast; the scale's amax reduction is assumed
  fused into the kernel that produced the tensor, under ``torch.compile``, which torchtitan
  requires for Float8). Per
  tensor that is 6 bytes per element over its two uses, the amax, cast and transposed copy of
  a compiled program; the weight's casts are overcounted where FSDP's float8 all-gather casts
  the shards (not modelled). Nothing is measured here: no FP8 part has been lent.
"""

from __future__ import annotations

import math

from autopar.cost.devices import DeviceSpec

__all__ = [
    "ATTENTION_EFFICIENCY",
    "CAUSAL_WORK_FRACTION",
    "EAGER_BYTES_PER_S",
    "FLOAT8_CAST_BYTES_PER_ELEMENT",
    "GEMM_HALF_DIM",
    "GEMM_KINDS",
    "GEMM_LAUNCH_S",
    "GEMM_PEAK_EFFICIENCY",
    "MATMUL_EFFICIENCY",
    "MEMORY_EFFICIENCY",
    "arithmetic_intensity",
    "compute_time_s",
    "gemm_efficiency",
    "kernel_time_s",
    "ridge_intensity",
]

MATMUL_EFFICIENCY = 0.6
"""Achievable fraction of dense peak FLOP/s (Megatron-LM SC'21, PaLM MFU; see module docstring)."""

MEMORY_EFFICIENCY = 0.8
"""Achievable fraction of peak HBM bandwidth (BabelStream; see module docstring)."""

EAGER_BYTES_PER_S = 2.64e12
"""Ceiling on the HBM traffic per second of eager PyTorch's memory-bound kernels: 0.55 of an H200's
4.8 TB/s, what they reached inside transformer blocks there (module docstring)."""


GEMM_PEAK_EFFICIENCY = 0.72
"""Fraction of dense peak a large GEMM reaches (fit to H200 cuBLAS timings; see module docstring)."""

GEMM_HALF_DIM = 190.0
"""Size scale of the small-dimension penalty ``1 - exp(-d / GEMM_HALF_DIM)`` (same fit)."""

GEMM_LAUNCH_S = 5e-6
"""Fixed time per GEMM kernel (launch, ramp and tail of its waves; the fit to XLA's H100 table:
module docstring)."""

ATTENTION_EFFICIENCY = 0.35
"""Fraction of peak FlashAttention-2 reaches on H100 (FlashAttention-3 paper; see module docstring)."""

CAUSAL_WORK_FRACTION = 0.5
"""Share of its counted (full) FLOPs a causal attention kernel executes (module docstring)."""

FLOAT8_CAST_BYTES_PER_ELEMENT = 3.0
"""HBM bytes per element of a Float8 GEMM's operand cast: bf16 read, float8 write (module docstring)."""

GEMM_KINDS = ("gemm", "fp8_gemm")
"""The kernel kinds that are GEMMs (bf16 or the plan's dtype, and Float8)."""

KERNELS = ("gemm", "fp8_gemm", "attention", "causal_attention", "fused", "other")
"""Kinds of kernel :func:`kernel_time_s` prices."""


def _check_efficiency(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def _check_non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


def compute_time_s(
    *,
    flops: float,
    bytes_moved: float,
    device: DeviceSpec,
    dtype: str = "bf16",
    matmul_efficiency: float = MATMUL_EFFICIENCY,
    memory_efficiency: float = MEMORY_EFFICIENCY,
) -> float:
    """Roofline time of work doing ``flops`` FLOPs and ``bytes_moved`` bytes of HBM traffic.

    ``dtype`` picks the peak (one of ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``).
    Raises ``ValueError`` for negative work, an unknown dtype or an efficiency
    outside (0, 1].
    """
    _check_non_negative("flops", flops)
    _check_non_negative("bytes_moved", bytes_moved)
    _check_efficiency("matmul_efficiency", matmul_efficiency)
    _check_efficiency("memory_efficiency", memory_efficiency)
    math_s = flops / (device.peak(dtype) * matmul_efficiency)
    memory_s = bytes_moved / (device.hbm_bytes_per_s * memory_efficiency)
    return max(math_s, memory_s)


def arithmetic_intensity(*, flops: float, bytes_moved: float) -> float:
    """FLOPs per byte of memory traffic; ``inf`` for work that moves no bytes."""
    _check_non_negative("flops", flops)
    _check_non_negative("bytes_moved", bytes_moved)
    if bytes_moved == 0:
        return float("inf") if flops > 0 else 0.0
    return flops / bytes_moved


def ridge_intensity(
    *,
    device: DeviceSpec,
    dtype: str = "bf16",
    matmul_efficiency: float = MATMUL_EFFICIENCY,
    memory_efficiency: float = MEMORY_EFFICIENCY,
) -> float:
    """The arithmetic intensity (FLOP/byte) above which work is compute bound on ``device``."""
    _check_efficiency("matmul_efficiency", matmul_efficiency)
    _check_efficiency("memory_efficiency", memory_efficiency)
    return (device.peak(dtype) * matmul_efficiency) / (device.hbm_bytes_per_s * memory_efficiency)


def gemm_efficiency(m: float, n: float, k: float) -> float:
    """Achieved fraction of dense peak of one (m x k) @ (k x n) GEMM (batch folded into m).

    ``GEMM_PEAK_EFFICIENCY * prod(1 - exp(-d / GEMM_HALF_DIM))`` over d in (m, n, k):
    rises monotonically with every dimension towards 0.72; a dimension of 190
    costs a factor 0.63, one of 1024 a factor 0.995. Dimensions below 1 are
    clamped to 1 (an empty GEMM costs nothing anyway).
    """
    for name, d in (("m", m), ("n", n), ("k", k)):
        _check_non_negative(name, d)
    eff = GEMM_PEAK_EFFICIENCY
    for d in (m, n, k):
        eff *= 1.0 - math.exp(-max(d, 1.0) / GEMM_HALF_DIM)
    return eff


def kernel_time_s(
    *,
    kind: str,
    flops: float,
    bytes_moved: float,
    device: DeviceSpec,
    dtype: str = "bf16",
    gemm: tuple[float, float, float] | None = None,
    memory_efficiency: float | None = None,
) -> float:
    """Roofline time of one kernel, with the efficiency of its kind.

    ``kind`` is one of :data:`KERNELS`. A ``"gemm"`` (or ``"fp8_gemm"``: at the device's FP8 peak,
    plus its operands' casts, :data:`FLOAT8_CAST_BYTES_PER_ELEMENT`) with its per-device shape
    ``gemm=(m, n, k)`` gets :func:`gemm_efficiency` plus :data:`GEMM_LAUNCH_S` (without
    a shape, the generic :data:`MATMUL_EFFICIENCY`); ``"attention"`` gets :data:`ATTENTION_EFFICIENCY`,
    ``"causal_attention"`` the same on :data:`CAUSAL_WORK_FRACTION` of ``flops`` (the counted figure);
    ``"other"`` and ``"fused"`` kernels get :data:`MATMUL_EFFICIENCY` for whatever FLOPs they do,
    and every kind is bounded below by its bytes over the HBM bandwidth x :data:`MEMORY_EFFICIENCY`
    (or ``memory_efficiency`` where given); for ``"other"`` (eager PyTorch's own kernels, not
    ``"fused"``, TorchInductor's) that rate is capped at :data:`EAGER_BYTES_PER_S`. The attention
    kinds take the device's own ``attention_efficiency`` where it has one. The "cpu" device (gloo test runs) keeps the
    flat :func:`compute_time_s` for every kind.
    """
    if kind not in KERNELS:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {list(KERNELS)}")
    if device.name == "cpu":  # the gloo CPU figure has no kernel measurements: flat roofline
        return compute_time_s(flops=flops, bytes_moved=bytes_moved, device=device, dtype=dtype,
                              memory_efficiency=memory_efficiency or MEMORY_EFFICIENCY)
    if memory_efficiency is None:
        memory_efficiency = MEMORY_EFFICIENCY
        if kind == "other":
            memory_efficiency = min(memory_efficiency, EAGER_BYTES_PER_S / device.hbm_bytes_per_s)
    if kind == "fp8_gemm":
        return _float8_gemm_s(flops, bytes_moved, device, gemm, memory_efficiency)
    if kind == "gemm" and gemm is not None:
        if flops == 0:
            return 0.0
        roof = compute_time_s(flops=flops, bytes_moved=bytes_moved, device=device, dtype=dtype,
                              matmul_efficiency=max(gemm_efficiency(*gemm), 1e-6),
                              memory_efficiency=memory_efficiency)
        return roof + GEMM_LAUNCH_S
    attention = device.attention_efficiency or ATTENTION_EFFICIENCY
    if kind == "causal_attention":
        flops, eff = flops * CAUSAL_WORK_FRACTION, attention
    elif kind == "attention":
        eff = attention
    else:
        eff = MATMUL_EFFICIENCY
    return compute_time_s(flops=flops, bytes_moved=bytes_moved, device=device, dtype=dtype,
                          matmul_efficiency=eff, memory_efficiency=memory_efficiency)


def _float8_gemm_s(flops: float, bytes_moved: float, device: DeviceSpec, gemm: tuple[float, float, float] | None,
                   memory_efficiency: float) -> float:
    """A Float8 GEMM of per-device shape ``gemm`` = (m, n, k): the GEMM at the FP8 peak with the
    bf16 shape curve, then the casts of its (m, k) and (k, n) operands (module docstring)."""
    if device.fp8_flops_per_s is None:
        raise ValueError(f"device {device.name!r} has no FP8 tensor cores (fp8_flops_per_s is None): "
                         "price its linears in bf16, or plan for a device that has them (H100, H200, B200)")
    if gemm is None:
        raise ValueError("a Float8 GEMM is priced from its shape: pass gemm=(m, n, k)")
    if flops == 0:
        return 0.0
    m, n, k = gemm
    rate = device.hbm_bytes_per_s * memory_efficiency
    gemm_s = max(flops / (device.fp8_flops_per_s * max(gemm_efficiency(m, n, k), 1e-6)), bytes_moved / rate)
    return gemm_s + FLOAT8_CAST_BYTES_PER_ELEMENT * (m * k + k * n) / rate + GEMM_LAUNCH_S

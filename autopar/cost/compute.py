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
"""

from __future__ import annotations

from autopar.cost.devices import DeviceSpec

__all__ = [
    "MATMUL_EFFICIENCY",
    "MEMORY_EFFICIENCY",
    "arithmetic_intensity",
    "compute_time_s",
    "ridge_intensity",
]

MATMUL_EFFICIENCY = 0.6
"""Achievable fraction of dense peak FLOP/s (Megatron-LM SC'21, PaLM MFU; see module docstring)."""

MEMORY_EFFICIENCY = 0.8
"""Achievable fraction of peak HBM bandwidth (BabelStream; see module docstring)."""


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

"""Roofline compute time."""

import json
import math
from pathlib import Path

import pytest

from autopar.cost.compute import (
    MATMUL_EFFICIENCY,
    MEMORY_EFFICIENCY,
    arithmetic_intensity,
    compute_time_s,
    ridge_intensity,
)
from autopar.cost.devices import DEVICES, HOPPER_CUDNN_ATTENTION_EFFICIENCY, HOPPER_FLASH2_ATTENTION_EFFICIENCY

A100 = DEVICES["A100-80GB"]


def test_compute_bound_gemm():
    # (4096 x 4096) @ (4096 x 4096) in bf16: 2*n^3 FLOPs, 3 * n^2 * 2 bytes.
    n = 4096
    flops = 2 * n**3
    bytes_moved = 3 * n * n * 2
    expected = flops / (312e12 * MATMUL_EFFICIENCY)
    assert compute_time_s(flops=flops, bytes_moved=bytes_moved, device=A100) == pytest.approx(expected)


def test_memory_bound_pointwise():
    # bf16 add of two 1 GiB tensors: read 2, write 1; one FLOP per element.
    elems = 2**29
    bytes_moved = 3 * elems * 2
    expected = bytes_moved / (2.039e12 * MEMORY_EFFICIENCY)
    got = compute_time_s(flops=elems, bytes_moved=bytes_moved, device=A100)
    assert got == pytest.approx(expected)


def test_dtype_selects_peak():
    fp32 = compute_time_s(flops=1e12, bytes_moved=0, device=A100, dtype="fp32")
    bf16 = compute_time_s(flops=1e12, bytes_moved=0, device=A100, dtype="bf16")
    assert fp32 / bf16 == pytest.approx(312 / 19.5)


def test_efficiency_overrides():
    t = compute_time_s(flops=312e12, bytes_moved=0, device=A100,
                       matmul_efficiency=1.0, memory_efficiency=1.0)
    assert t == pytest.approx(1.0)
    t = compute_time_s(flops=0, bytes_moved=2.039e12, device=A100, memory_efficiency=0.5)
    assert t == pytest.approx(2.0)


def test_zero_work_is_free():
    assert compute_time_s(flops=0, bytes_moved=0, device=A100) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"flops": -1.0, "bytes_moved": 0.0},
        {"flops": 1.0, "bytes_moved": -1.0},
        {"flops": 1.0, "bytes_moved": 1.0, "matmul_efficiency": 0.0},
        {"flops": 1.0, "bytes_moved": 1.0, "memory_efficiency": 1.5},
        {"flops": 1.0, "bytes_moved": 1.0, "dtype": "fp8"},
    ],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        compute_time_s(device=A100, **kwargs)


def test_intensity_and_ridge():
    assert arithmetic_intensity(flops=100.0, bytes_moved=4.0) == 25.0
    assert arithmetic_intensity(flops=1.0, bytes_moved=0.0) == float("inf")
    assert arithmetic_intensity(flops=0.0, bytes_moved=0.0) == 0.0
    ridge = ridge_intensity(device=A100)
    assert ridge == pytest.approx(312e12 * 0.6 / (2.039e12 * 0.8))
    # Exactly at the ridge both roofs give the same time.
    bytes_moved = 1e9
    flops = ridge * bytes_moved
    t = compute_time_s(flops=flops, bytes_moved=bytes_moved, device=A100)
    assert t == pytest.approx(bytes_moved / (2.039e12 * 0.8))
    assert t == pytest.approx(flops / (312e12 * 0.6))


# --- shape-dependent GEMM efficiency, attention, memory-bound kernels ---
from autopar.cost.compute import (  # noqa: E402
    ATTENTION_EFFICIENCY,
    EAGER_BYTES_PER_S,
    GEMM_LAUNCH_S,
    gemm_efficiency,
    kernel_time_s,
)

MEASURED = Path(__file__).resolve().parents[1] / "bench" / "gpu_check_h200.json"
DISPATCH_S = 15e-6
"""What one timed Python call adds to a GEMM's kernel between its CUDA events: the fit's fixed cost
(20 us) less the kernel's own (GEMM_LAUNCH_S); autopar.cost.compute's module docstring."""


def _measured_gemms():
    runs = json.loads(MEASURED.read_text())["runs"]
    return [r for name in ("1_default_sdpa", "3_flash_attention") for r in runs[name]["kernels"]["rows"]
            if r["kind"] == "gemm"]


def test_gemm_curve_reproduces_the_h200_timings():
    """The fit the constants come from: 74 cuBLAS timings on an H200, RMS log error 8.1%."""
    errors = []
    for r in _measured_gemms():
        m, n, k = r["shape"]
        t = kernel_time_s(kind="gemm", flops=r["flops"], bytes_moved=2.0 * (m * k + k * n + m * n),
                          device=DEVICES["H200"], gemm=(m, n, k))
        errors.append(math.log((t + DISPATCH_S) / r["measured_s"]))
    assert len(errors) == 74
    assert math.sqrt(sum(e * e for e in errors) / len(errors)) < 0.085
    assert sum(abs(e) < 0.10 for e in errors) >= 60
    assert abs(sum(errors) / len(errors)) < 0.01  # unbiased


def test_gemm_efficiency_is_monotone_and_bounded():
    sizes = [1, 64, 256, 1024, 4096, 16384, 65536]
    for i in range(3):
        effs = [gemm_efficiency(*[s if j == i else 8192 for j in range(3)]) for s in sizes]
        assert all(a < b for a, b in zip(effs[:5], effs[1:5]))  # strictly rising up to 4096
        assert all(a <= b for a, b in zip(effs, effs[1:]))  # and never falling (saturates in floats)
    assert 0.71 < gemm_efficiency(65536, 65536, 65536) <= 0.72
    # small per-rank GEMMs after heavy tp: 8 ways on n is less efficient than 1 way
    assert gemm_efficiency(16384, 4096 // 8, 4096) < gemm_efficiency(16384, 4096, 4096)


def test_gemm_time_has_launch_floor_and_bytes_bound():
    h100 = DEVICES["H100"]
    assert kernel_time_s(kind="gemm", flops=2, bytes_moved=0, device=h100, gemm=(1, 1, 1)) >= GEMM_LAUNCH_S
    assert kernel_time_s(kind="gemm", flops=0, bytes_moved=0, device=h100, gemm=(0, 0, 0)) == 0.0
    # a GEMV (m = 1) moves its weight: memory bound
    n = k = 8192
    t = kernel_time_s(kind="gemm", flops=2 * n * k, bytes_moved=2 * n * k, device=h100, gemm=(1, n, k))
    assert t >= 2 * n * k / (h100.hbm_bytes_per_s * 0.8)


def test_attention_and_memory_bound_kernels():
    h100 = DEVICES["H100"]
    flops = 1e12
    att = kernel_time_s(kind="attention", flops=flops, bytes_moved=0, device=h100)
    assert h100.attention_efficiency == HOPPER_CUDNN_ATTENTION_EFFICIENCY  # cuDNN's kernel on Hopper
    assert att == pytest.approx(flops / (h100.peak("bf16") * HOPPER_CUDNN_ATTENTION_EFFICIENCY))
    a100 = DEVICES["A100-80GB"]  # no figure of its own: the default
    assert kernel_time_s(kind="attention", flops=flops, bytes_moved=0, device=a100) == \
        pytest.approx(flops / (a100.peak("bf16") * ATTENTION_EFFICIENCY))
    fa2 = h100.with_overrides(attention_efficiency=HOPPER_FLASH2_ATTENTION_EFFICIENCY)
    assert kernel_time_s(kind="attention", flops=flops, bytes_moved=0, device=fa2) == pytest.approx(att * 50 / 29)
    # causal: the counted (full) FLOPs, of which FlashAttention executes half
    causal = kernel_time_s(kind="causal_attention", flops=flops, bytes_moved=0, device=h100)
    assert causal == pytest.approx(att / 2)
    # still bounded below by its bytes
    assert kernel_time_s(kind="causal_attention", flops=1e6, bytes_moved=1e9, device=h100) == \
        pytest.approx(1e9 / (h100.hbm_bytes_per_s * 0.8))
    # a pointwise op (no FLOPs) is priced by its bytes alone: eager kernels at most EAGER_BYTES_PER_S,
    # which binds on fast memory only; TorchInductor's ("fused") at 80% of any bandwidth
    for device in (h100, DEVICES["H200"]):
        assert kernel_time_s(kind="other", flops=0, bytes_moved=1e9, device=device) == \
            pytest.approx(1e9 / EAGER_BYTES_PER_S)
    assert kernel_time_s(kind="other", flops=0, bytes_moved=1e9, device=DEVICES["H100-96GB"]) == \
        pytest.approx(1e9 / (2.4e12 * 0.8))
    for device in (h100, DEVICES["H200"]):
        assert kernel_time_s(kind="fused", flops=0, bytes_moved=1e9, device=device) == \
            pytest.approx(1e9 / (device.hbm_bytes_per_s * 0.8))
    assert kernel_time_s(kind="other", flops=0, bytes_moved=1e9, device=h100, memory_efficiency=0.5) == \
        pytest.approx(1e9 / (3.35e12 * 0.5))  # given: as given
    with pytest.raises(ValueError, match="unknown kernel kind 'conv'"):
        kernel_time_s(kind="conv", flops=1, bytes_moved=1, device=h100)


def test_cpu_device_keeps_the_flat_roofline():
    cpu = DEVICES["cpu"]
    for kind in ("gemm", "attention", "causal_attention", "fused", "other"):
        assert kernel_time_s(kind=kind, flops=1e9, bytes_moved=1e6, device=cpu, gemm=(64, 64, 64)) == \
            compute_time_s(flops=1e9, bytes_moved=1e6, device=cpu)

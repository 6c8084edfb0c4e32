"""Roofline compute time."""

import pytest

from autopar.cost.compute import (
    MATMUL_EFFICIENCY,
    MEMORY_EFFICIENCY,
    arithmetic_intensity,
    compute_time_s,
    ridge_intensity,
)
from autopar.cost.devices import DEVICES

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

"""Device catalog: datasheet figures of the accelerators autopar plans for.

One table, one source per figure (STYLE rule 4). All figures are per device (one
GPU), dense (no 2:4 sparsity), and in SI units: FLOP/s, bytes, bytes/s, seconds.

Conventions used to turn datasheets into numbers:

- NVIDIA datasheets quote tensor-core throughput "with sparsity"; the dense figure
  is half of it (footnote on every Hopper/Blackwell datasheet).
- NVLink figures on datasheets are bidirectional totals per GPU; a collective
  moves data in one direction per link, so we store half (per direction).
- Network figures are per GPU: a DGX-class node pairs every GPU with one NIC
  (ConnectX-6 200 Gb/s on DGX A100, ConnectX-7 400 Gb/s on DGX H100/H200/B200);
  8 bits per byte, so 200 Gb/s = 25e9 B/s and 400 Gb/s = 50e9 B/s.
- HBM capacities are binary: NVIDIA's "80 GB" on an A100 is 80 GiB (nvidia-smi
  reports 81920 MiB), so capacities are stored as N * 2**30 bytes. Planners should
  keep their own reserve for the CUDA context and allocator fragmentation.
- Latencies are documented assumptions, not datasheet figures: NCCL's own cost
  model (``src/graph/tuning.cc``, ``baseLat``/``hwLat`` tables) charges a few
  microseconds per ring step on NVLink and roughly twice that across InfiniBand;
  we round to 5 us (NVLink) and 10 us (network).

Sources:
- [A100] NVIDIA A100 Tensor Core GPU datasheet,
  https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
- [DGX-A100] NVIDIA DGX A100 datasheet (8x ConnectX-6 HDR 200 Gb/s for compute),
  https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/nvidia-dgx-a100-datasheet.pdf
- [H100] NVIDIA H100 Tensor Core GPU datasheet (SXM column),
  https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
- [DGX-H100] NVIDIA DGX H100 datasheet (8x ConnectX-7 400 Gb/s for compute),
  https://resources.nvidia.com/en-us-dgx-systems/ai-enterprise-dgx
- [GT] torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, "Hardware" (Meta's Grand
  Teton H100 hosts), https://github.com/pytorch/torchtitan
- [H200] NVIDIA H200 Tensor Core GPU datasheet (SXM column),
  https://www.nvidia.com/en-us/data-center/h200/
- [B200] NVIDIA DGX B200 datasheet (1,440 GB HBM3e and 64 TB/s for 8 GPUs,
  8x ConnectX-7 400 Gb/s, 1.8 TB/s NVLink 5 per GPU) and the HGX B200 spec table
  (per-GPU FP8 9 and FP16/BF16 4.5 PFLOP/s sparse, TF32 2.2 PFLOP/s sparse, FP32 75 TFLOP/s),
  https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet ,
  https://www.nvidia.com/en-us/data-center/hgx/
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["DEVICES", "DTYPES", "HOPPER_CUDNN_ATTENTION_EFFICIENCY", "HOPPER_FLASH2_ATTENTION_EFFICIENCY", "DeviceSpec",
           "lookup_device"]

DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")
"""The dtype keys every :attr:`DeviceSpec.peak_flops_per_s` holds."""

_GIB = 2**30
_NUMBER_FIELDS = (
    "hbm_bytes_per_s",
    "intra_node_bytes_per_s",
    "inter_node_bytes_per_s",
    "intra_node_latency_s",
    "inter_node_latency_s",
)


def _check_number(owner: str, field_name: str, value: Any, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}: {field_name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero) or value != value or value == float("inf"):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}: {field_name} must be finite and {bound}, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """Figures of one accelerator (one GPU, or one CPU process for gloo runs).

    Hashable and comparable; ``peak_flops_per_s`` is stored as a read-only mapping
    (it takes part in ``==`` but not in ``hash``).
    """

    name: str
    """Catalog name, e.g. ``"H100"``; used in cluster specs such as ``"2x8xH100"``."""
    peak_flops_per_s: Mapping[str, float] = field(hash=False)
    """Dense peak FLOP/s by dtype; keys are exactly :data:`DTYPES`."""
    hbm_bytes: int
    """Device memory capacity in bytes."""
    hbm_bytes_per_s: float
    """Peak device memory bandwidth."""
    intra_node_bytes_per_s: float
    """NVLink (or equivalent) bandwidth per GPU per direction."""
    inter_node_bytes_per_s: float
    """Network bandwidth per GPU (one NIC per GPU) per direction."""
    intra_node_latency_s: float
    """Per-step latency (alpha) of a collective inside a node."""
    inter_node_latency_s: float
    """Per-step latency (alpha) of a collective across nodes."""
    attention_efficiency: float | None = None
    """Fraction of the dense peak the attention kernel that runs on this device reaches (FLOPs of a
    causal one halved); None: :data:`autopar.cost.compute.ATTENTION_EFFICIENCY`."""
    fp8_flops_per_s: float | None = None
    """Dense FP8 (e4m3/e5m2) tensor-core peak; None: the device has no FP8 tensor cores. Used only
    for GEMMs priced as Float8 training runs them (:mod:`autopar.passes.float8`)."""
    flash_attention_efficiency: float | None = None
    """The same fraction for FlashAttention-2 (PyTorch's flash kernel), which autopar's
    context-parallel attention op runs on CUDA whatever SDPA's own choice
    (:mod:`autopar.context_blocks`), where it differs from ``attention_efficiency`` (Hopper, where
    SDPA runs cuDNN's kernel); None: ``attention_efficiency``."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"DeviceSpec: name must be a non-empty string, got {self.name!r}")
        owner = f"DeviceSpec {self.name!r}"
        if not isinstance(self.peak_flops_per_s, Mapping):
            raise ValueError(
                f"{owner}: peak_flops_per_s must be a mapping of dtype to FLOP/s, "
                f"got {self.peak_flops_per_s!r}"
            )
        keys = set(self.peak_flops_per_s)
        if keys != set(DTYPES):
            raise ValueError(
                f"{owner}: peak_flops_per_s must have exactly the keys {list(DTYPES)}; "
                f"missing {sorted(set(DTYPES) - keys)}, unknown {sorted(keys - set(DTYPES), key=str)}"
            )
        peaks = {
            dtype: float(_check_number(owner, f"peak_flops_per_s[{dtype!r}]",
                                       self.peak_flops_per_s[dtype], allow_zero=False))
            for dtype in DTYPES
        }
        object.__setattr__(self, "peak_flops_per_s", MappingProxyType(peaks))
        hbm = _check_number(owner, "hbm_bytes", self.hbm_bytes, allow_zero=False)
        if hbm != int(hbm):
            raise ValueError(f"{owner}: hbm_bytes must be a whole number of bytes, got {hbm!r}")
        object.__setattr__(self, "hbm_bytes", int(hbm))
        for name in _NUMBER_FIELDS:
            allow_zero = name.endswith("_latency_s")
            value = _check_number(owner, name, getattr(self, name), allow_zero=allow_zero)
            object.__setattr__(self, name, float(value))
        for name in ("attention_efficiency", "flash_attention_efficiency"):
            if getattr(self, name) is not None:
                eff = _check_number(owner, name, getattr(self, name), allow_zero=False)
                if eff > 1:
                    raise ValueError(f"{owner}: {name} is a fraction of peak, in (0, 1]; got {eff!r}")
                object.__setattr__(self, name, float(eff))
        if self.fp8_flops_per_s is not None:
            fp8 = _check_number(owner, "fp8_flops_per_s", self.fp8_flops_per_s, allow_zero=False)
            object.__setattr__(self, "fp8_flops_per_s", float(fp8))

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (one of :data:`DTYPES`)."""
        try:
            return self.peak_flops_per_s[dtype]
        except KeyError:
            raise ValueError(
                f"unknown dtype {dtype!r} for device {self.name!r}; known dtypes: {list(DTYPES)}"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field; inverse of :meth:`from_dict`."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["peak_flops_per_s"] = dict(self.peak_flops_per_s)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSpec:
        """Build from :meth:`to_dict` output; every field without a default is required (a dict
        written before ``attention_efficiency``, ``fp8_flops_per_s`` or ``flash_attention_efficiency`` existed
        reads as the default)."""
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        unknown = sorted(set(data) - names)
        missing = sorted(required - set(data))
        if unknown or missing:
            raise ValueError(
                f"device figures: missing fields {missing}, unknown fields {unknown}; "
                f"expected {sorted(required)} and optionally {sorted(names - required)}"
            )
        return cls(**data)

    def with_overrides(self, **fields: Any) -> DeviceSpec:
        """A copy with some figures replaced.

        ``peak_flops_per_s`` may be partial (e.g. ``{"bf16": 8e14}``): the dtypes it
        names replace this device's, the others are kept. The name is kept unless
        ``name`` is given.
        """
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(
                f"unknown device field(s) {unknown} for {self.name!r}; valid fields: {sorted(names)}"
            )
        if "peak_flops_per_s" in fields:
            partial = fields["peak_flops_per_s"]
            if not isinstance(partial, Mapping):
                raise ValueError(
                    f"peak_flops_per_s override must be a mapping of dtype to FLOP/s, got {partial!r}"
                )
            fields = {**fields, "peak_flops_per_s": {**self.peak_flops_per_s, **partial}}
        return dataclasses.replace(self, **fields)

    def __reduce__(self) -> tuple[Any, ...]:
        # MappingProxyType cannot be pickled or deep-copied; rebuild from plain data.
        return (self.__class__.from_dict, (self.to_dict(),))


def _peaks(*, fp32: float, tf32: float, bf16: float, fp16: float) -> dict[str, float]:
    return {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16}


# The attention kernel PyTorch's SDPA runs on Hopper (sm90) from torch 2.11 with its bundled cuDNN
# above 9.15: cuDNN's fused attention (seen in the H200's profiles, bench/gpu_check_h200.json),
# which reached 50% of the dense bf16 peak there (causal, head dim 128, FLOPs halved; forward
# 55-62%, backward 45-48%). FlashAttention-2, the kernel before it, reached 29%
# (autopar.cost.compute's module docstring).
HOPPER_CUDNN_ATTENTION_EFFICIENCY = 0.50
HOPPER_FLASH2_ATTENTION_EFFICIENCY = 0.29

# Latency assumptions shared by the GPU entries (see module docstring).
_NVLINK_LATENCY_S = 5e-6
_NETWORK_LATENCY_S = 10e-6

# [A100] FP32 19.5, TF32 156, BF16/FP16 312 TFLOP/s dense; NVLink 3 600 GB/s
# bidirectional -> 300e9 per direction. [DGX-A100] HDR 200 Gb/s per GPU -> 25e9 B/s.
_A100_PEAKS = _peaks(fp32=19.5e12, tf32=156e12, bf16=312e12, fp16=312e12)

_A100_40GB = DeviceSpec(
    name="A100-40GB",
    peak_flops_per_s=_A100_PEAKS,
    hbm_bytes=40 * _GIB,  # [A100] 40 GB HBM2
    hbm_bytes_per_s=1.555e12,  # [A100] 1,555 GB/s
    intra_node_bytes_per_s=300e9,  # [A100] NVLink 600 GB/s bidirectional
    inter_node_bytes_per_s=25e9,  # [DGX-A100] 200 Gb/s HDR InfiniBand per GPU
    intra_node_latency_s=_NVLINK_LATENCY_S,
    inter_node_latency_s=_NETWORK_LATENCY_S,
)

_A100_80GB = DeviceSpec(
    name="A100-80GB",
    peak_flops_per_s=_A100_PEAKS,
    hbm_bytes=80 * _GIB,  # [A100] 80 GB HBM2e
    hbm_bytes_per_s=2.039e12,  # [A100] 2,039 GB/s (SXM)
    intra_node_bytes_per_s=300e9,  # [A100] NVLink 600 GB/s bidirectional
    inter_node_bytes_per_s=25e9,  # [DGX-A100] 200 Gb/s HDR InfiniBand per GPU
    intra_node_latency_s=_NVLINK_LATENCY_S,
    inter_node_latency_s=_NETWORK_LATENCY_S,
)

# [H100] SXM: FP32 67 TFLOP/s; TF32 989, BF16/FP16 1,979 TFLOP/s with sparsity
# -> 494.5 and 989.5 dense. [H200] quotes the same compute figures.
_HOPPER_PEAKS = _peaks(fp32=67e12, tf32=494.5e12, bf16=989.5e12, fp16=989.5e12)
# [H100] SXM FP8 3,958 TFLOP/s with sparsity -> 1,979 dense ([H200] the same).
_HOPPER_FP8 = 1979e12

_H100 = DeviceSpec(
    name="H100",
    peak_flops_per_s=_HOPPER_PEAKS,
    hbm_bytes=80 * _GIB,  # [H100] 80 GB HBM3 (SXM)
    hbm_bytes_per_s=3.35e12,  # [H100] 3.35 TB/s (SXM)
    intra_node_bytes_per_s=450e9,  # [H100] NVLink 4 900 GB/s bidirectional
    inter_node_bytes_per_s=50e9,  # [DGX-H100] ConnectX-7 400 Gb/s per GPU
    intra_node_latency_s=_NVLINK_LATENCY_S,
    inter_node_latency_s=_NETWORK_LATENCY_S,
    attention_efficiency=HOPPER_CUDNN_ATTENTION_EFFICIENCY,
    flash_attention_efficiency=HOPPER_FLASH2_ATTENTION_EFFICIENCY,
    fp8_flops_per_s=_HOPPER_FP8,
)

# Meta's Grand Teton H100 (the machine of torchtitan's published Llama 3 and Qwen3 runs):
# [GT] "96GB HBM2e with 2.4 TB/sec peak memory bandwidth", 400 Gb/s RDMA per GPU, NVLink
# inside the host, 500 W power limit. Capacity as torch reports it: torchtitan's logs
# print 81.85 GiB as 86.17% of the device (Qwen3-32B PR #1690), i.e. 94.99 GiB.
# Compute: [GT] runs these parts at "the default 500W power limit" (the SXM part's TDP is
# 700 W) and its footnote 2 says "the actual peak TFLOPs number is between SXM and NVL, and
# we don't know its exact value". The two ends, dense BF16, as torchtitan's own MFU code
# takes them from NVIDIA's H100 page (pytorch/torchtitan, torchtitan/tools/utils.py,
# get_peak_flops: SXM 989e12, NVL 835e12): we take the middle of that interval, 912 TFLOP/s
# (0.922 of SXM), for every tensor-core dtype (FP8 too), and say so: it is the centre of the range the
# source gives, not a measurement, so its error is up to +-8.4%. (torchtitan quotes MFU
# against the SXM figure, 389.87 TFLOP/s = 39.42% for Qwen3-32B; autopar's predicted MFU
# for this device is against 912.) The achieved-efficiency tables of compute.py (measured on
# 700 W SXM parts) apply on top. A bf16 GEMM sweep at 500 W (bench/gpu_check.py) would
# replace this.
_H100_500W_PEAK_FRACTION = (835e12 + 989e12) / 2 / 989e12
_H100_96GB = DeviceSpec(
    name="H100-96GB",
    peak_flops_per_s={dtype: flops * (_H100_500W_PEAK_FRACTION if dtype != "fp32" else 1.0)
                      for dtype, flops in _HOPPER_PEAKS.items()},
    hbm_bytes=int(94.99 * _GIB),  # [GT] via torchtitan's memory log (see above)
    hbm_bytes_per_s=2.4e12,  # [GT] 2.4 TB/s HBM2e
    intra_node_bytes_per_s=450e9,  # [GT] NVLink, as H100 SXM: 900 GB/s bidirectional
    inter_node_bytes_per_s=50e9,  # [GT] 400 Gb/s per GPU
    intra_node_latency_s=_NVLINK_LATENCY_S,
    inter_node_latency_s=_NETWORK_LATENCY_S,
    attention_efficiency=HOPPER_CUDNN_ATTENTION_EFFICIENCY,
    flash_attention_efficiency=HOPPER_FLASH2_ATTENTION_EFFICIENCY,
    fp8_flops_per_s=_HOPPER_FP8 * _H100_500W_PEAK_FRACTION,
)

_H200 = DeviceSpec(
    name="H200",
    peak_flops_per_s=_HOPPER_PEAKS,
    hbm_bytes=141 * _GIB,  # [H200] 141 GB HBM3e
    hbm_bytes_per_s=4.8e12,  # [H200] 4.8 TB/s
    intra_node_bytes_per_s=450e9,  # [H200] NVLink 900 GB/s bidirectional
    inter_node_bytes_per_s=50e9,  # DGX H200 keeps DGX H100's ConnectX-7 400 Gb/s per GPU
    intra_node_latency_s=_NVLINK_LATENCY_S,
    inter_node_latency_s=_NETWORK_LATENCY_S,
    attention_efficiency=HOPPER_CUDNN_ATTENTION_EFFICIENCY,
    flash_attention_efficiency=HOPPER_FLASH2_ATTENTION_EFFICIENCY,
    fp8_flops_per_s=_HOPPER_FP8,
)

# [B200] per GPU: BF16/FP16 4.5 PFLOP/s and TF32 2.2 PFLOP/s with sparsity -> 2.25
# and 1.1 dense; FP32 75 TFLOP/s; FP8 9 PFLOP/s with sparsity -> 4.5 dense. Memory: 180 GB as
# sold in DGX B200 (1,440 GB for 8 GPUs; the chip carries 192 GB, of which 180 GB is enabled),
# 8 TB/s (64 TB/s / 8).
_B200 = DeviceSpec(
    name="B200",
    peak_flops_per_s=_peaks(fp32=75e12, tf32=1.1e15, bf16=2.25e15, fp16=2.25e15),
    fp8_flops_per_s=4.5e15,
    hbm_bytes=180 * _GIB,  # [B200] 1,440 GB / 8 GPUs
    hbm_bytes_per_s=8e12,  # [B200] 64 TB/s / 8 GPUs
    intra_node_bytes_per_s=900e9,  # [B200] NVLink 5 1.8 TB/s bidirectional
    inter_node_bytes_per_s=50e9,  # [B200] ConnectX-7 400 Gb/s per GPU
    intra_node_latency_s=_NVLINK_LATENCY_S,
    inter_node_latency_s=_NETWORK_LATENCY_S,
)

# A deliberately rough figure for gloo runs on a small CPU machine (a 2-core CI
# VM), so that plans for "1x4xcpu" are sane rather than accurate:
# - compute: 2 cores x 32 fp32 FLOP/cycle (AVX2: 2 FMA ports x 8 lanes x 2 FLOP,
#   Intel 64 and IA-32 Architectures Optimization Reference Manual) x 3 GHz
#   = 192 GFLOP/s. CPUs without AMX/AVX512-BF16 have no faster half-precision or
#   TF32 path, so every dtype gets the fp32 figure.
# - memory: 8 GiB, 20 GB/s (one DDR4-3200 channel is 25.6 GB/s; STREAM reaches ~80%).
# - "network": all ranks share one machine (gloo over loopback TCP / shared
#   memory), assumed ~1 GB/s with ~50 us per message for gloo's TCP transport,
#   the same inside and across "nodes".
_CPU = DeviceSpec(
    name="cpu",
    peak_flops_per_s=_peaks(fp32=192e9, tf32=192e9, bf16=192e9, fp16=192e9),
    hbm_bytes=8 * _GIB,
    hbm_bytes_per_s=20e9,
    intra_node_bytes_per_s=1e9,
    inter_node_bytes_per_s=1e9,
    intra_node_latency_s=50e-6,
    inter_node_latency_s=50e-6,
)

DEVICES: dict[str, DeviceSpec] = {
    "A100-40GB": _A100_40GB,
    "A100-80GB": _A100_80GB,
    "A100": _A100_80GB,  # alias: "A100" means the 80 GB SXM part
    "H100": _H100,
    "H100-96GB": _H100_96GB,
    "H200": _H200,
    "B200": _B200,
    "cpu": _CPU,
}
"""Catalog by name. Aliases map to the same object (``DEVICES["A100"].name == "A100-80GB"``)."""

_BY_LOWER = {key.lower(): spec for key, spec in DEVICES.items()}


def lookup_device(name: str) -> DeviceSpec:
    """The catalog entry for ``name``, case-insensitive (``"h100"`` -> ``DEVICES["H100"]``)."""
    spec = _BY_LOWER.get(name.strip().lower()) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}")
    return spec

"""Device catalog: datasheet figures, lookup, immutability, hashing, serialisation."""

import copy
import pickle

import pytest

from autopar.cost.devices import DEVICES, DTYPES, DeviceSpec, lookup_device

GIB = 2**30


def test_catalog_has_required_devices():
    for name in ("A100-40GB", "A100-80GB", "A100", "H100", "H200", "B200", "cpu"):
        assert name in DEVICES


def test_every_device_has_every_dtype():
    for spec in DEVICES.values():
        assert set(spec.peak_flops_per_s) == set(DTYPES)


def test_a100_datasheet_figures():
    a100 = DEVICES["A100-80GB"]
    assert a100.peak("bf16") == 312e12
    assert a100.peak("fp16") == 312e12
    assert a100.peak("tf32") == 156e12
    assert a100.peak("fp32") == 19.5e12
    assert a100.hbm_bytes == 80 * GIB
    assert a100.hbm_bytes_per_s == 2.039e12
    assert a100.intra_node_bytes_per_s == 300e9
    assert a100.inter_node_bytes_per_s == 25e9
    assert DEVICES["A100-40GB"].hbm_bytes == 40 * GIB
    assert DEVICES["A100-40GB"].hbm_bytes_per_s == 1.555e12


def test_a100_alias_is_80gb():
    assert DEVICES["A100"] is DEVICES["A100-80GB"]
    assert lookup_device("a100").name == "A100-80GB"


def test_hopper_and_blackwell_figures():
    h100, h200, b200 = DEVICES["H100"], DEVICES["H200"], DEVICES["B200"]
    assert h100.peak("bf16") == pytest.approx(989e12, rel=1e-3)
    assert h100.peak("tf32") == pytest.approx(494e12, rel=2e-3)
    assert h100.peak("fp32") == 67e12
    assert h100.hbm_bytes_per_s == 3.35e12
    assert h100.intra_node_bytes_per_s == 450e9
    assert h100.inter_node_bytes_per_s == 50e9
    assert h200.peak_flops_per_s == h100.peak_flops_per_s
    assert h200.hbm_bytes == 141 * GIB
    assert h200.hbm_bytes_per_s == 4.8e12
    assert b200.peak("bf16") == 2.25e15
    assert b200.hbm_bytes_per_s == 8e12
    assert b200.intra_node_bytes_per_s == 900e9
    assert b200.inter_node_bytes_per_s == 50e9


def test_nvlink_is_faster_than_network_and_latencies_documented():
    for name in ("A100-40GB", "A100-80GB", "H100", "H200", "B200"):
        spec = DEVICES[name]
        assert spec.intra_node_bytes_per_s > spec.inter_node_bytes_per_s
        assert 0 < spec.intra_node_latency_s < spec.inter_node_latency_s


def test_lookup_is_case_insensitive():
    assert lookup_device("h100") is DEVICES["H100"]
    assert lookup_device(" CPU ") is DEVICES["cpu"]
    assert lookup_device("a100-40gb") is DEVICES["A100-40GB"]


def test_lookup_unknown_lists_known_names():
    with pytest.raises(ValueError, match="unknown device 'H1000'") as info:
        lookup_device("H1000")
    for name in DEVICES:
        assert name in str(info.value)


def test_peak_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'int8'.*fp32"):
        DEVICES["H100"].peak("int8")


def test_device_is_frozen_hashable_and_comparable():
    h100 = DEVICES["H100"]
    with pytest.raises(AttributeError):
        h100.hbm_bytes = 1
    with pytest.raises(TypeError):
        h100.peak_flops_per_s["bf16"] = 1.0
    assert hash(h100) == hash(DeviceSpec.from_dict(h100.to_dict()))
    assert {h100: 1}[DeviceSpec.from_dict(h100.to_dict())] == 1
    assert h100 != DEVICES["H200"]
    assert h100 == h100.with_overrides()


def test_to_dict_round_trip_pickle_and_deepcopy():
    for spec in DEVICES.values():
        data = spec.to_dict()
        assert isinstance(data["peak_flops_per_s"], dict)
        assert DeviceSpec.from_dict(data) == spec
        assert pickle.loads(pickle.dumps(spec)) == spec
        assert copy.deepcopy(spec) == spec


def test_with_overrides_merges_partial_peaks():
    h100 = DEVICES["H100"]
    faster = h100.with_overrides(peak_flops_per_s={"bf16": 1e15}, hbm_bytes=40e9)
    assert faster.peak("bf16") == 1e15
    assert faster.peak("fp32") == h100.peak("fp32")
    assert faster.hbm_bytes == 40_000_000_000 and isinstance(faster.hbm_bytes, int)
    assert faster.name == "H100"


def test_with_overrides_rejects_unknown_field():
    with pytest.raises(ValueError, match="unknown device field.*hbm_gb"):
        DEVICES["H100"].with_overrides(hbm_gb=40)


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("hbm_bytes", 0, "hbm_bytes must be finite and > 0"),
        ("hbm_bytes", 1.5, "whole number"),
        ("hbm_bytes_per_s", -1.0, "hbm_bytes_per_s"),
        ("intra_node_latency_s", -1e-6, "intra_node_latency_s"),
        ("inter_node_bytes_per_s", "fast", "must be a number"),
        ("peak_flops_per_s", {"bf16": 1.0}, "missing"),
        ("name", "", "name"),
        ("attention_efficiency", 1.5, "attention_efficiency is a fraction of peak"),
        ("attention_efficiency", 0, "attention_efficiency must be finite and > 0"),
    ],
)
def test_invalid_figures_rejected(field, value, pattern):
    data = DEVICES["H100"].to_dict()
    data[field] = value
    with pytest.raises(ValueError, match=pattern):
        DeviceSpec.from_dict(data)


def test_from_dict_requires_every_field():
    data = DEVICES["H100"].to_dict()
    del data["hbm_bytes"]
    with pytest.raises(ValueError, match="missing fields \\['hbm_bytes'\\]"):
        DeviceSpec.from_dict(data)


def test_from_dict_of_a_device_without_attention_efficiency_takes_the_default():
    """Figures written before the field existed (plan files) still read; Hopper's carry cuDNN's figure."""
    data = DEVICES["H100"].to_dict()
    assert data["attention_efficiency"] == 0.50
    del data["attention_efficiency"]
    assert DeviceSpec.from_dict(data).attention_efficiency is None
    assert DEVICES["A100-80GB"].attention_efficiency is None


def test_grand_teton_h100_peak_lies_between_sxm_and_nvl():
    # torchtitan's runs: 500 W H100s whose peak is "between SXM and NVL" (989 and 835 TFLOP/s dense
    # bf16); the catalog takes the middle for tensor-core dtypes, keeps fp32 (no NVL figure used)
    gt, sxm = lookup_device("H100-96GB"), lookup_device("H100")
    assert gt.peak("bf16") / sxm.peak("bf16") == pytest.approx((835e12 + 989e12) / 2 / 989e12)
    assert 835e12 < gt.peak("bf16") < sxm.peak("bf16")
    for dtype in ("fp16", "tf32"):
        assert gt.peak(dtype) / sxm.peak(dtype) == pytest.approx(gt.peak("bf16") / sxm.peak("bf16"))
    assert gt.peak("fp32") == sxm.peak("fp32")

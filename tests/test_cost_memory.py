"""Training-state memory by ZeRO stage, and the Megatron activation formula."""

import pytest

from autopar.cost.memory import PRECISIONS, StateBytes, activation_bytes_megatron, training_state_bytes

GB = 1e9
N_7B = 7e9


def test_7b_unsharded_is_112_gb():
    state = training_state_bytes(n_params=N_7B, zero_stage=0, dp=64)
    assert state == StateBytes(params=14 * GB, grads=14 * GB, optimizer=84 * GB)
    assert state.total == pytest.approx(112 * GB, rel=1e-2)


def test_7b_zero1_64way():
    state = training_state_bytes(n_params=N_7B, zero_stage=1, dp=64)
    assert state.total == pytest.approx(28 * GB + 84 * GB / 64, rel=1e-12)
    assert state.total == pytest.approx(29.3 * GB, rel=1e-2)


def test_7b_zero2_64way():
    state = training_state_bytes(n_params=N_7B, zero_stage=2, dp=64)
    assert state.total == pytest.approx(14 * GB + 98 * GB / 64, rel=1e-12)
    assert state.total == pytest.approx(15.5 * GB, rel=1e-2)


def test_7b_zero3_64way():
    state = training_state_bytes(n_params=N_7B, zero_stage=3, dp=64)
    assert state.total == pytest.approx(1.75 * GB, rel=1e-2)
    assert state.params == pytest.approx(14 * GB / 64)


def test_dp1_shards_nothing():
    for stage in range(4):
        assert training_state_bytes(n_params=N_7B, zero_stage=stage, dp=1).total == 112 * GB


def test_fp32_precision_and_overrides():
    assert PRECISIONS["fp32"] == (4, 4, 8)
    state = training_state_bytes(n_params=1e9, zero_stage=0, dp=1, precision="fp32")
    assert state == StateBytes(params=4 * GB, grads=4 * GB, optimizer=8 * GB)
    state = training_state_bytes(n_params=1e9, zero_stage=0, dp=1, optimizer_bytes=4)
    assert state == StateBytes(params=2 * GB, grads=2 * GB, optimizer=4 * GB)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"zero_stage": 4, "dp": 8}, "zero_stage must be 0, 1, 2 or 3, got 4"),
        ({"zero_stage": -1, "dp": 8}, "zero_stage"),
        ({"zero_stage": 1.0, "dp": 8}, "zero_stage"),
        ({"zero_stage": 1, "dp": 0}, "dp must be an integer >= 1, got 0"),
        ({"zero_stage": 1, "dp": 8, "precision": "fp8"}, "unknown precision 'fp8'"),
        ({"zero_stage": 1, "dp": 8, "param_bytes": -2}, "param_bytes"),
    ],
)
def test_invalid_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        training_state_bytes(n_params=N_7B, **kwargs)


def test_negative_params_rejected():
    with pytest.raises(ValueError, match="n_params"):
        training_state_bytes(n_params=-1, zero_stage=0, dp=1)


def test_megatron_activation_hand_computed():
    # s=2048, b=1, h=4096, a=32: 5*a*s/h = 80; s*b*h = 8,388,608; * 114.
    assert activation_bytes_megatron(s=2048, b=1, h=4096, a=32) == 8_388_608 * 114


def test_megatron_activation_tensor_parallel():
    sbh = 2048 * 1 * 4096
    tp8 = activation_bytes_megatron(s=2048, b=1, h=4096, a=32, tp=8)
    assert tp8 == pytest.approx(sbh * (10 + 24 / 8 + 80 / 8))
    tp8_sp = activation_bytes_megatron(s=2048, b=1, h=4096, a=32, tp=8, sequence_parallel=True)
    assert tp8_sp == pytest.approx(sbh * 114 / 8)
    with pytest.raises(ValueError, match="tp"):
        activation_bytes_megatron(s=2048, b=1, h=4096, a=32, tp=0)

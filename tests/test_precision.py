"""Precision policies: names, defaults, what the plan prices and says (single process)."""

import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.cost.memory import training_state_bytes
from autopar.precision import PRECISIONS, plan_precision, resolve_precision

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")


def _gpt(**kw):
    sys.path.insert(0, EXAMPLES)
    import gpt

    return gpt.build(size="tiny", batch=8, **kw)


def test_defaults_follow_the_cluster_and_the_model():
    fp32 = torch.nn.Linear(2, 2)
    bf16 = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert resolve_precision(None, model=fp32, gpu_cluster=True)[0].name == "bf16-mixed"
    assert resolve_precision(None, model=fp32, gpu_cluster=False)[0].name == "fp32"
    assert resolve_precision(None, model=bf16, gpu_cluster=False)[0].name == "bf16-mixed"  # fp32 masters
    policy, why = resolve_precision("bf16", model=fp32, gpu_cluster=False)
    assert (policy.name, policy.param_dtype, policy.reduce_dtype, policy.master_dtype, why) == \
        ("bf16-mixed", torch.bfloat16, torch.float32, torch.float32, "asked")
    assert resolve_precision("bf16-mixed-bf16-reduce", model=fp32, gpu_cluster=True)[0].reduce_dtype is torch.bfloat16


def test_bad_precisions_say_what_to_pass():
    with pytest.raises(ValueError, match=r"unknown precision 'fp16'; expected one of fp32, bf16-mixed"):
        resolve_precision("fp16", model=torch.nn.Linear(2, 2), gpu_cluster=True)
    with pytest.raises(ValueError, match=r"weights are bfloat16; pass precision='bf16-mixed'"):
        resolve_precision("fp32", model=torch.nn.Linear(2, 2).to(torch.bfloat16), gpu_cluster=True)


def test_old_plan_files_run_as_they_did():
    for old in ("mixed", "fp32", None):
        policy = plan_precision({} if old is None else {"precision": old})
        assert policy.param_dtype is None and policy.reduce_dtype is None, old  # no casts: as before


def test_cli_choices_are_the_policies():
    from autopar.cli import PRECISION_CHOICES

    assert set(PRECISION_CHOICES) == set(PRECISIONS) | {"bf16"}


def test_mixed_state_is_18_bytes_per_parameter_and_16_under_zero3():
    """bf16 compute copy 2 + fp32 gradient 4 + fp32 master, m, v 12. ZeRO-3 shards the rest over 64
    and holds no compute copy: the runtime casts each group's master slice when it gathers it (the
    gathered copy is a ZeRO buffer), as FSDP2 does. The ZeRO paper's fp16 "mixed" keeps its 2 + 2 + 12."""
    s = training_state_bytes(n_params=7e9, zero_stage=0, dp=1, precision="bf16-mixed")
    assert (s.params, s.grads, s.optimizer) == (14e9, 28e9, 84e9)
    assert training_state_bytes(n_params=7e9, zero_stage=2, dp=64, precision="bf16-mixed").params == 14e9
    z3 = training_state_bytes(n_params=7e9, zero_stage=3, dp=64, precision="bf16-mixed")
    assert (z3.params, z3.total) == (0, 16 * 7e9 / 64)
    assert training_state_bytes(n_params=7e9, zero_stage=3, dp=64, precision="mixed").total == 16 * 7e9 / 64
    assert training_state_bytes(n_params=7e9, zero_stage=3, dp=64, precision="mixed").params == 2 * 7e9 / 64


def test_cli_rejects_an_unknown_precision_in_one_line(capsys):
    from autopar.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "examples/gpt.py:build", "--cluster", "1x1xH100", "--precision", "fp8"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fp8" in err, err


@pytest.fixture(scope="module")
def gpu_plans():
    model, inputs, loss_fn, target = _gpt()
    return {p: autopar.plan(model, inputs, cluster="1x1xH100", loss_fn=loss_fn, example_target=target, precision=p)
            for p in (None, "fp32")}


def test_an_fp32_model_on_gpus_is_planned_in_bf16_and_the_summary_says_so(gpu_plans):
    default, fp32 = gpu_plans[None], gpu_plans["fp32"]
    assert default.model["precision"] == "bf16-mixed"
    assert default.model["precision_source"] == "default on a GPU cluster"
    assert "precision bf16-mixed: bf16 compute" in default.summary()
    assert "default on a GPU cluster; pass precision='fp32'" in default.summary()
    assert fp32.model["precision"] == "fp32" and "precision fp32: " in fp32.summary()
    n = default.model["n_params"]
    mem = default.stages[0]["predicted"]["memory_bytes"]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == pytest.approx((2 * n, 4 * n, 12 * n), rel=0.01)
    mem = fp32.stages[0]["predicted"]["memory_bytes"]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == pytest.approx((4 * n, 4 * n, 8 * n), rel=0.01)
    # bf16 tensor-core FLOPs and half-size activations: the same step is priced faster
    assert default.predicted["step_time_s"] < fp32.predicted["step_time_s"]
    assert default.stages[0]["predicted"]["memory_bytes"]["activations"] < \
        fp32.stages[0]["predicted"]["memory_bytes"]["activations"]

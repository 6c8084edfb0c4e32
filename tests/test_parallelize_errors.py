"""Mistakes ``parallelize`` reports before any process group exists (single process).

The ones that need a process group (a plan for another model, a batch that
changes between steps, a non-scalar loss) are in ``tests/dist/test_runtime_errors.py``;
dead and stuck ranks in ``tests/dist/test_failures.py``.
"""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar.planner.make import check_batch_split
from autopar.planner.search import Fixed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import mlp  # noqa: E402


def test_gpu_cluster_without_cuda_is_an_error_unless_cpu_is_asked_for(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # runs on GPU machines too
    monkeypatch.setenv("WORLD_SIZE", "2")
    model, inputs, loss_fn, target = mlp.build(size="tiny")
    with pytest.raises(ValueError, match=r"cluster 1x2xH100 is a cluster of H100 GPUs, but this machine has no "
                                         r"CUDA device .*pass device='cpu', or plan for CPUs with cluster='1x2xcpu'"):
        autopar.parallelize(model, cluster="1x2xH100", loss_fn=loss_fn)
    pm = autopar.parallelize(model, cluster="1x2xH100", loss_fn=loss_fn, device="cpu")
    assert pm.device == "cpu"
    assert autopar.parallelize(model, cluster="1x2xcpu", loss_fn=loss_fn).device == "cpu"


@pytest.mark.parametrize("bad", [0, -1, "60", True])
def test_timeout_must_be_positive_seconds(bad):
    model, inputs, loss_fn, target = mlp.build(size="tiny")
    with pytest.raises(ValueError, match=r"timeout_s must be a positive number of seconds"):
        autopar.parallelize(model, cluster="1x1xcpu", loss_fn=loss_fn, timeout_s=bad)


def test_plan_file_that_is_not_json_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    for text in (f"__import__('pathlib').Path({str(marker)!r}).touch()",   # Python
                 "cos\nsystem\n(S'true'\ntR.",                                # a pickle
                 "mesh:\n  pp: 1\n"):                                         # YAML
        path = tmp_path / "plan.json"
        path.write_text(text)
        model, inputs, loss_fn, target = mlp.build(size="tiny")
        with pytest.raises(autopar.PlanError, match="not valid JSON"):
            autopar.parallelize(model, cluster="1x1xcpu", loss_fn=loss_fn, plan=path)
    assert not marker.exists()


def test_microbatches_that_do_not_divide_the_batch_are_named_before_planning():
    model, inputs, loss_fn, target = mlp.build(size="tiny", batch=8)
    pm = autopar.parallelize(model, cluster="1x1xcpu", loss_fn=loss_fn, fixed={"microbatches": 3})
    with pytest.raises(ValueError, match=r"the global batch of 8 is not divisible by fixed microbatches=3; .*"
                                         r"pin microbatches to a divisor of 8 \(1, 2, 4, 8\), or pass a batch "
                                         r"that is a multiple of 3"):
        pm.train_step(inputs, target)
    assert pm.plan is None  # nothing was planned


def test_plan_checks_the_batch_split_before_tracing():
    class Untraceable(nn.Linear):
        def forward(self, x):
            raise AssertionError("traced, although the pinned split was already known to be impossible")

    with pytest.raises(autopar.PlanError, match=r"the global batch of 8 is not divisible by fixed microbatches=3"):
        autopar.plan(Untraceable(4, 4), torch.randn(8, 4), cluster="1x1xcpu", fixed={"microbatches": 3})


def test_batch_split_check_counts_pinned_dp():
    check_batch_split(8, Fixed.from_dict({"microbatches": 2, "dp": 4}))
    check_batch_split(8, Fixed.from_dict({"microbatch_size": 4}))
    check_batch_split(None, Fixed.from_dict({"microbatches": 3}))
    with pytest.raises(ValueError, match=r"batch of 8 is not divisible by fixed microbatches=2 x dp=3 = 6"):
        check_batch_split(8, Fixed.from_dict({"microbatches": 2, "dp": 3}))
    with pytest.raises(ValueError, match=r"batch of 6 is not divisible by fixed microbatch_size=4"):
        check_batch_split(6, Fixed.from_dict({"microbatch_size": 4}))
    with pytest.raises(ValueError, match=r"batch of 8 is not divisible by fixed microbatches=3"):
        check_batch_split(8, Fixed.from_dict({"microbatches": "3"}))  # as examples/train.py --fix passes it

"""The one ZeRO definition: shard divisors and per-step collective counts."""

import pytest

from autopar.cost.memory import training_state_bytes
from autopar.zero_def import stage, state_shards, step_collective_counts


@pytest.mark.parametrize("zero", range(4))
def test_memory_model_uses_the_same_shards(zero):
    dp = 4
    p, g, o = state_shards(zero, dp)
    b = training_state_bytes(n_params=1000, zero_stage=zero, dp=dp, precision="fp32")
    assert (b.params, b.grads, b.optimizer) == (4000 / p, 4000 / g, 8000 / o)


def test_collective_counts_per_stage():
    assert step_collective_counts(0, n_micro=4) == {"all_reduce": 1}
    assert step_collective_counts(1, n_micro=4) == {"reduce_scatter": 1, "all_gather": 1}
    assert step_collective_counts(2, n_micro=4) == {"reduce_scatter": 4, "all_gather": 1}
    assert step_collective_counts(3, n_micro=4) == {"reduce_scatter": 4, "all_gather": 8}


def test_only_stages_without_a_full_gradient_buffer_reduce_per_microbatch():
    for zero in range(4):
        s = stage(zero)
        assert s.grad_reduce_every_microbatch == (not s.full_grad_buffer)


@pytest.mark.parametrize("bad", [4, -1, True, "3"])
def test_bad_stage(bad):
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3"):
        stage(bad)

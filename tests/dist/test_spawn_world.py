"""spawn_world's hang bound: a blocked world is stopped, a slow one is not (whatever the load)."""

import time

from autopar.testing import spawn_world


def _sleep_or_spin(rank, world, spin_s):
    if rank == 1:
        time.sleep(600)  # blocked: no CPU, like a rank waiting on a dead peer
        return "woke"
    return rank


def _spin(rank, world, spin_s):
    end = time.monotonic() + spin_s
    n = 0
    while time.monotonic() < end:  # working (slowly on a loaded machine): CPU keeps moving
        n += 1
    return rank


def test_a_blocked_rank_is_reported_hung():
    outcomes = spawn_world(_sleep_or_spin, 2, 0.0, timeout_s=4.0, allow_failures=True)
    assert outcomes[0].ok and outcomes[0].value == 0, outcomes[0]
    assert not outcomes[1].ok and "no rank finished and the ranks used almost no CPU for 4 s (hung" in \
        outcomes[1].error, outcomes[1]


def test_a_working_world_may_run_past_the_bound():
    # 3x the bound of wall clock with no rank finishing: only the CPU the ranks use keeps it alive
    # (at least a fiftieth of a CPU-second per 2 s, which a spinning rank uses on any load).
    assert spawn_world(_spin, 2, 6.0, timeout_s=2.0) == [0, 1]


def _warm_state(rank, world):
    import sys

    return "autopar._warm_ranks" in sys.modules and sys.modules["autopar._warm_ranks"].warmed


def test_ranks_are_forked_from_a_server_that_traced_once():
    # The server traced its small model before forking (autopar._warm_ranks, on builds without an
    # accelerator runtime): the warm-up swallows its own errors, so this is where a broken one shows.
    import torch

    cpu_build = not (torch.version.cuda or torch.version.hip or getattr(torch.version, "xpu", None))
    assert spawn_world(_warm_state, 2) == [cpu_build, cpu_build]


def _threads(rank, world):
    import os

    import torch

    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_ranks_of_a_world_run_one_intra_op_thread_each_unless_told(monkeypatch):
    # As torchrun: with a thread per core in every rank, their OpenMP pools spin on the same cores
    # (a 4-rank gloo step of the GPT test model: 1.4 s on 2 cores, 0.2 s with one thread each).
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert spawn_world(_threads, 2) == [(1, "1"), (1, "1")]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert spawn_world(_threads, 2)[0][1] == "3"  # left as the caller set it

"""A dead or stuck rank: every surviving rank stops with a PeerError naming it.

Worlds of 2-3 gloo ranks with a short process-group timeout (``TIMEOUT_S``); one
rank dies mid-step with ``os._exit`` (no exception, no clean-up: what a SIGKILL or
a crashed node looks like to its peers) or sleeps past the timeout. The tests
assert what every other rank's error says (its rank, the action it was waiting
on, the dead or silent rank), not how long it took: :func:`spawn_world`'s own
bounded wait only keeps a broken runtime from hanging the test run.
"""

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from autopar.testing import spawn_world

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
TIMEOUT_S = 5.0  # the stuck rank's test: a peer that is alive but silent is found by this clock
KILLED_TIMEOUT_S = 300.0
"""The killed ranks' tests: a dead peer's closed connection fails the survivors' wait at once, so the
timeout is only a backstop; a short one would let a loaded machine trip the start-up collectives."""
WAIT_S = 300.0  # spawn_world's bound on a rank that hangs: generous for 2 shared cores


def _peer_error(fn):
    """Run ``fn()``; the PeerError it raises as plain data (None when it returns)."""
    import autopar

    try:
        fn()
    except autopar.PeerError as e:
        return {"message": str(e), "rank": e.rank, "action": e.action, "dead": e.dead}
    return None


def _raw_world(rank, world, victim, stuck):
    """Two all-reduces under a PeerWatch; before the second, ``victim`` dies (or sleeps past the timeout)."""
    from datetime import timedelta

    import torch.distributed as dist

    from autopar.runtime.world import init_process_group, peer_watch

    timeout_s = TIMEOUT_S if stuck else KILLED_TIMEOUT_S
    init_process_group("cpu", KILLED_TIMEOUT_S)  # connecting may take long on a loaded machine
    watch = peer_watch(timeout_s)
    t = torch.ones(4)
    with watch.guard("the first all-reduce"):
        dist.all_reduce(t)
    # The group under test, made right after every rank passed the all-reduce above; then a barrier
    # on the world group, so that no rank dies while a peer is still connecting to it inside
    # new_group (gloo connects the new group's full mesh there, and a rank can return from it
    # first: once, rank 2's connect to the victim rank 0 failed and rank 2 died too).
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    dist.barrier()
    if rank == victim:
        if not stuck:
            os._exit(17)
        time.sleep(4 * TIMEOUT_S)
        return None

    def second():
        with watch.guard("the test's all-reduce over every rank"):
            dist.all_reduce(t, group=group)

    return _peer_error(second)


@pytest.mark.parametrize("victim", [0, 2])
def test_dead_rank_is_named_by_every_survivor(victim):
    """Rank 0 too: the store lives in the launcher (as torchrun's agent hosts it), not in rank 0."""
    outcomes = spawn_world(_raw_world, 3, victim, False, timeout_s=WAIT_S, allow_failures=True)
    assert outcomes[victim].exitcode == 17, outcomes[victim]
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.ok and o.value is not None, o
        err = o.value
        assert err["rank"] == o.rank and err["dead"] == [victim], err
        assert err["message"].startswith(f"rank {o.rank} gave up on the test's all-reduce over every rank"), err
        assert f"rank {victim} is dead (heartbeat stopped)" in err["message"], err


def test_stuck_rank_is_named_as_silent_not_dead():
    outcomes = spawn_world(_raw_world, 2, 1, True, timeout_s=WAIT_S, allow_failures=True)
    err = outcomes[0].value
    assert outcomes[0].ok and err is not None, outcomes[0]
    assert err["dead"] == [], err
    assert "no rank is dead: rank 1 did not answer within the timeout" in err["message"], err
    assert "Timed out" in err["message"], err  # the backend's own words come last


def _train_and_die(rank, world, victim, fixed, die_at):
    """Train a tiny MLP; on ``victim``, die in step 2 at ``die_at`` ("reduce": before the dp
    gradient reduction, which now runs inside the backward; "pipeline": at the rank's second pipeline action)."""
    sys.path.insert(0, EXAMPLES)
    import autopar
    import mlp

    torch.manual_seed(0)
    model, inputs, loss_fn, target = mlp.build(size="tiny", batch=6 if world == 3 else 4)
    pm = autopar.parallelize(model, cluster=f"1x{world}xcpu", loss_fn=loss_fn, fixed=fixed,
                               timeout_s=KILLED_TIMEOUT_S)
    pm.train_step(inputs, target)
    if rank == victim:
        if die_at == "reduce":
            pm.params.add_grad = lambda *args, **kwargs: os._exit(17)  # at its first gradient bucket
        else:
            compute = pm.runner._compute
            calls = []

            def die_on_second(*args):
                calls.append(args)
                if len(calls) == 2:
                    os._exit(17)
                return compute(*args)

            pm.runner._compute = die_on_second
    return _peer_error(lambda: pm.train_step(inputs, target))


def test_rank_killed_before_gradient_reduction():
    """dp=3: rank 1 dies after its forward and backward; ranks 0 and 2 wait in the dp reduction."""
    fixed = {"dp": 3, "tp": 1, "pp": 1, "zero": 0}
    outcomes = spawn_world(_train_and_die, 3, 1, fixed, "reduce", timeout_s=WAIT_S, allow_failures=True)
    assert outcomes[1].exitcode == 17, outcomes[1]
    for r in (0, 2):
        assert outcomes[r].ok and outcomes[r].value is not None, outcomes[r]
        err = outcomes[r].value
        assert err["dead"] == [1], err
        assert err["action"] == "gradient reduction over dp group [0, 1, 2]", err
        assert "rank 1 is dead" in err["message"], err


def test_rank_killed_mid_pipeline():
    """pp=2: the last stage dies between micro-batches; stage 0 waits on its gradients."""
    fixed = {"pp": 2, "dp": 1, "tp": 1, "microbatches": 2, "schedule": "1f1b"}
    outcomes = spawn_world(_train_and_die, 2, 1, fixed, "pipeline", timeout_s=WAIT_S, allow_failures=True)
    assert outcomes[1].exitcode == 17, outcomes[1]
    err = outcomes[0].value
    assert outcomes[0].ok and err is not None, outcomes[0]
    assert err["dead"] == [1], err
    assert err["action"].startswith("pipeline ") and "rank 1" in err["action"], err
    assert "rank 1 is dead" in err["message"], err

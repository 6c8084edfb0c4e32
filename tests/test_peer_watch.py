"""How PeerWatch names dead, stuck and finished peers, on an in-process store (no processes).

The real thing, with gloo worlds and killed ranks, is ``tests/dist/test_failures.py``.
"""

import json
import pickle
import threading

import pytest
import torch.distributed as dist

from autopar.errors import PeerError
from autopar.runtime.watch import PeerWatch, is_peer_failure

GLOO_RESET = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                          "[127.0.0.1]:37059: Connection reset by peer. This is typically caused by a remote "
                          "worker hanging or bugs in the application.")
GLOO_TIMEOUT = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                            "waiting 1000ms for recv operation to complete")


@pytest.fixture
def world():
    """A store, rank 0's watch, and a beater that keeps the given ranks alive."""
    store = dist.HashStore()
    stop = threading.Event()
    alive: set[int] = set()

    def beat():
        while not stop.wait(0.05):
            for r in list(alive):
                store.add(f"autopar/heartbeat/{r}", 1)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    watch = PeerWatch(store, rank=0, world=4, timeout_s=1.0)
    yield store, watch, alive
    stop.set()
    watch.close()
    assert not watch._thread.is_alive()  # no beat left in flight for the interpreter's exit


def test_a_dead_peer_is_named_and_one_that_gave_up_says_on_what(world):
    store, watch, alive = world
    alive.update({1, 2})  # rank 3 never beats: dead
    store.set("autopar/failed/1", json.dumps({"action": "pipeline recv of activations from rank 3", "dead": [3]}))
    alive.discard(1)  # rank 1 gave up and stopped
    err = watch.failure("gradient reduction over dp group [0, 1, 2, 3]", [1, 2, 3], GLOO_RESET)
    assert isinstance(err, PeerError) and err.rank == 0 and err.dead == [3]
    assert str(err) == (
        "rank 0 gave up on gradient reduction over dp group [0, 1, 2, 3] (process-group timeout 1 s); "
        "rank 3 is dead (heartbeat stopped); rank 1 gave up on pipeline recv of activations from rank 3; "
        "backend: Read error [127.0.0.1]:37059: Connection reset by peer.")
    copy = pickle.loads(pickle.dumps(err))  # crosses process boundaries intact
    assert (str(copy), copy.rank, copy.action, copy.dead) == (str(err), err.rank, err.action, err.dead)
    assert json.loads(store.get("autopar/failed/0")) == {"action": "gradient reduction over dp group [0, 1, 2, 3]",
                                                          "dead": [3]}


def test_every_peer_alive_means_a_stuck_peer(world):
    store, watch, alive = world
    alive.update({1, 2, 3})
    err = watch.failure("pipeline recv of gradients for micro-batch 0 of stage 0 from rank 1", [1], GLOO_TIMEOUT)
    assert err.dead == []
    assert "no rank is dead: rank 1 did not answer within the timeout" in str(err)
    assert str(err).endswith("backend: Timed out waiting 1000ms for recv operation to complete")


def test_a_peer_that_finished_is_not_called_dead(world):
    store, watch, alive = world
    alive.update({1, 2})
    store.set("autopar/exited/3", "1")
    err = watch.failure("all-reduce of the loss", None, GLOO_RESET)
    assert err.dead == []
    assert "rank 3 already finished and exited (did every rank call train_step the same number of times?)" in str(err)


def test_a_store_that_does_not_answer_is_said(world):
    store, watch, alive = world

    class Gone:
        def __getattr__(self, name):
            def fail(*args, **kwargs):
                raise RuntimeError("Connection reset by peer")
            return fail

    watch._store = Gone()
    err = watch.failure("receiving the plan from rank 0", [0], GLOO_RESET)
    assert "the c10d store does not answer either" in str(err) and "rank 0 when it hosts the store" in str(err)


def test_guard_converts_only_backend_failures(world):
    store, watch, alive = world
    alive.update({1, 2, 3})
    with pytest.raises(ValueError, match="shape mismatch"):
        with watch.guard("forward of micro-batch 0"):
            raise ValueError("shape mismatch")
    with pytest.raises(PeerError, match="rank 0 gave up on forward of micro-batch 0") as info:
        with watch.guard("forward of micro-batch 0", [1]):
            raise GLOO_TIMEOUT
    assert info.value.__cause__ is GLOO_TIMEOUT
    assert is_peer_failure(GLOO_RESET) and is_peer_failure(dist.DistBackendError("x"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_waiting_on_a_live_peer_outlasts_the_timeout(world):
    """Rank 0 plans for longer than the process-group timeout: the others keep waiting while it beats."""
    store, watch, alive = world
    alive.add(1)

    def publish_late():
        threading.Event().wait(3 * watch.timeout_s)  # three timeouts pass before the value appears
        store.set("autopar/plan/7", "the plan")

    threading.Thread(target=publish_late, daemon=True).start()
    assert watch.wait_for("plan/7", 1, "receiving the plan from rank 1") == b"the plan"


def test_waiting_on_a_dead_peer_names_it(world):
    store, watch, alive = world
    alive.update({1, 3})  # rank 2 never beats
    with pytest.raises(PeerError, match=r"rank 0 gave up on receiving the plan from rank 2 .*rank 2 is dead") as e:
        watch.wait_for("plan/8", 2, "receiving the plan from rank 2")
    assert e.value.dead == [2]

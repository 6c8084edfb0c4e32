"""Name the peer a rank was waiting on when a collective or a pipeline receive fails.

gloo and NCCL report a dead or stuck peer by address ("Connection reset by peer
[10.0.0.7]:41629") or not at all ("Timed out waiting 600000ms for recv
operation"), never by rank. So every rank keeps a heartbeat in the c10d store
(the rendezvous key-value store the process group was built on): a daemon thread
adds 1 to the counter ``autopar/heartbeat/RANK`` every ``interval_s``. The thread
beats while the main thread waits inside a collective (those release the GIL),
and stops only when the process dies.

When a guarded action fails (:meth:`PeerWatch.guard`), the rank

1. records that it gave up, and on what, under ``autopar/failed/RANK``;
2. reads every rank's counter, waits up to ``window_s`` (4 beats, at least 5 s, so a
   live rank whose thread a loaded machine starves for a beat or two is not called
   dead) and reads them again (stopping early once every counter moved): a rank
   whose counter did not move is
   *dead* (or frozen), unless it recorded a clean exit (``autopar/exited/RANK``) or
   a failure of its own, in which case it *gave up* (and its record says why);
3. raises :class:`autopar.errors.PeerError` naming this rank, the action, the
   dead peers, the ranks that gave up (with the dead peers they named), and the
   backend's own message.

Counters, not timestamps, so clocks that differ between nodes do not matter. The
store must outlive the ranks: under ``torchrun`` the agent hosts it (rank 0 may
die and the others still learn which rank it was); when rank 0 hosts it and dies,
the store stops answering and the error says so. NCCL's watchdog may abort the
process on a timeout before Python sees an exception; gloo raises.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from autopar.errors import PeerError

log = logging.getLogger(__name__)

__all__ = ["PeerWatch", "is_peer_failure"]

_PREFIX = "autopar/"
_COMM_FAILURE = re.compile(r"gloo|nccl|connection (reset|closed|refused)|timed out|broken pipe|socket", re.IGNORECASE)


def is_peer_failure(exc: BaseException) -> bool:
    """True for the errors a backend raises when a peer is dead or does not answer."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMM_FAILURE.search(str(exc)))


@dataclass(frozen=True)
class _Census:
    dead: list[int]
    gave_up: dict[int, dict]
    exited: list[int]
    store_error: str | None = None


class PeerWatch:
    """Heartbeats of this rank in ``store``, and :meth:`guard` for actions that wait on peers."""

    def __init__(self, store: dist.Store, *, rank: int, world: int, timeout_s: float):
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self.interval_s = min(2.0, max(0.5, timeout_s / 10))
        """Seconds between beats: a tenth of the timeout, within [0.5, 2]."""
        self.window_s = max(5.0, 4 * self.interval_s)
        """Seconds a failed rank watches the counters before it calls a silent one dead."""
        self._store = store
        self._beat_store = _own_connection(store)
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"autopar-heartbeat-{rank}", daemon=True)
        self._thread.start()

    # -- heartbeat ---------------------------------------------------------------

    def _beat(self) -> None:
        self._beat_store.add(f"{_PREFIX}heartbeat/{self.rank}", 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # the store is gone (its host died): nothing left to tell
                log.debug("heartbeat of rank %d stopped: the c10d store does not answer", self.rank)
                return

    def close(self) -> None:
        """Stop beating, wait for the beat in flight, and record a clean exit (peers still waiting on
        this rank then say so).

        The wait matters at exit (``close`` runs from ``atexit``): a daemon thread still inside the
        store's C++ call when the interpreter finalises is ended by CPython with ``pthread_exit``, whose
        forced unwinding through the binding's frames can abort the process ("terminate called without
        an active exception"). A rank of ``examples/train.py`` under torchrun aborted so once after
        its last step, in CI; that this was the cause is likely, not shown (18 runs here did not
        repeat it). It recurred once after this wait was added (fourteenth session, CI of 1de7aea,
        ``tests/dist/test_meta_start.py::test_train_example_starts_from_meta``: rank 1 aborted after
        printing its last line; the next CI run passed), so another thread in a C++ call at exit
        (gloo's, the store's) remains a candidate. It waits one detection window at most, so a store
        that no longer answers cannot hold the exit."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.window_s)
        with contextlib.suppress(Exception):
            self._store.set(f"{_PREFIX}exited/{self.rank}", "1")

    def publish(self, key: str, value: str | bytes) -> None:
        """Put ``value`` under ``key`` for :meth:`wait_for` on the other ranks."""
        self._store.set(f"{_PREFIX}{key}", value)

    def wait_for(self, key: str, peer: int, action: str) -> bytes:
        """The value ``peer`` publishes under ``key`` in the store, waiting as long as ``peer`` lives.

        For a wait on work of unknown length (rank 0 planning while the others wait):
        a clock bound would make start-up fail on a loaded machine or for a big model.
        The wait gives up (with a :class:`PeerError`) only when ``peer``'s heartbeat
        stops for a whole ``timeout_s``, or the store stops answering.
        """
        full = f"{_PREFIX}{key}"
        beats = self._store.add(f"{_PREFIX}heartbeat/{peer}", 0)
        while True:
            try:
                self._store.wait([full], timedelta(seconds=self.timeout_s))
                return self._store.get(full)
            except Exception as e:  # a wait timeout, or the store is gone
                try:
                    now = self._store.add(f"{_PREFIX}heartbeat/{peer}", 0)
                    gone = self._store.check([f"{_PREFIX}failed/{peer}"]) or \
                        self._store.check([f"{_PREFIX}exited/{peer}"])
                except Exception:
                    now, gone = beats, True
                if now == beats or gone:
                    raise self.failure(action, [peer], e) from e
                beats = now

    # -- failures ------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self, action: str, peers: Sequence[int] | None = None) -> Iterator[None]:
        """Run the body; a backend failure in it becomes a :class:`PeerError` naming the peers.

        ``action`` says what the rank waits on ("gradient reduction over dp group [0, 1]");
        ``peers`` are the ranks it waits on (default: every other rank).
        """
        try:
            yield
        except PeerError:
            raise
        except Exception as e:
            if not is_peer_failure(e):
                raise
            raise self.failure(action, peers, e) from e

    def failure(self, action: str, peers: Sequence[int] | None, exc: BaseException) -> PeerError:
        """The :class:`PeerError` for ``action`` having failed with ``exc`` (records it in the store)."""
        peers = sorted(set(range(self.world) if peers is None else peers) - {self.rank})
        census = self._census()
        named = sorted(set(census.dead) | {d for rec in census.gave_up.values() for d in rec.get("dead", [])})
        with contextlib.suppress(Exception):
            self._store.set(f"{_PREFIX}failed/{self.rank}", json.dumps({"action": action, "dead": named}))
        backend = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        backend = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\] ", "", backend)
        backend = backend.split(" This is typically caused")[0]
        parts = [f"rank {self.rank} gave up on {action} (process-group timeout {self.timeout_s:g} s)"]
        if census.store_error is not None:
            parts.append(f"the c10d store does not answer either ({census.store_error}): the process hosting "
                         f"it (the torchrun agent, or rank 0 when it hosts the store) is likely dead")
        if census.dead:
            parts.append(f"{_ranks(census.dead)} {'is' if len(census.dead) == 1 else 'are'} dead "
                         f"(heartbeat stopped)")
        elif named:
            parts.append(f"{_ranks(named)} died (named by the ranks that gave up first)")
        others = {r: rec for r, rec in census.gave_up.items() if r != self.rank}
        if others:
            parts.append("; ".join(f"rank {r} gave up on {rec.get('action')}" for r, rec in sorted(others.items())))
        if census.exited:
            parts.append(f"{_ranks(census.exited)} already finished and exited (did every rank call train_step "
                         f"the same number of times?)")
        if census.store_error is None and not named and not census.exited:
            waiting = [p for p in peers if p not in others]
            parts.append(f"no rank is dead: {_ranks(waiting or peers)} did not answer within the timeout; a rank "
                         f"is stuck or waiting on a different action (do all ranks run the same steps on the "
                         f"same batch?)")
        parts.append(f"backend: {backend}")
        return PeerError("; ".join(parts), rank=self.rank, action=action, dead=named)

    def _census(self) -> _Census:
        try:
            before = self._counters()
            deadline = time.monotonic() + self.window_s
            after = before
            while time.monotonic() < deadline:
                time.sleep(self.interval_s / 2)
                after = self._counters()
                if all(after[r] > before[r] for r in after if r != self.rank):
                    break
            gave_up, exited = {}, []
            for r in range(self.world):
                if self._store.check([f"{_PREFIX}failed/{r}"]):
                    gave_up[r] = json.loads(self._store.get(f"{_PREFIX}failed/{r}"))
                if self._store.check([f"{_PREFIX}exited/{r}"]):
                    exited.append(r)
        except Exception as e:  # the store itself is gone
            return _Census(dead=[], gave_up={}, exited=[], store_error=str(e).strip().splitlines()[0][:200])
        stopped = [r for r in range(self.world) if r != self.rank and after[r] == before[r]]
        exited = [r for r in exited if r not in gave_up]
        dead = [r for r in stopped if r not in gave_up and r not in exited]
        return _Census(dead=dead, gave_up=gave_up, exited=exited)

    def _counters(self) -> dict[int, int]:
        return {r: self._store.add(f"{_PREFIX}heartbeat/{r}", 0) for r in range(self.world)}


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _own_connection(store: dist.Store) -> dist.Store:
    """A second connection for the heartbeat thread, so a beat never queues behind a blocked store call."""
    try:
        return store.clone()
    except Exception:  # stores without clone (FileStore, HashStore) are shared
        return store

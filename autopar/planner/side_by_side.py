"""Planning work beside this process: a forked child (:class:`Child`, where :func:`may_fork`
says it is safe) and indexed tasks shared by threads here and in such a child (:func:`run_tasks`).

Why a process. Most of planning is Python: TorchDynamo and AOTAutograd tracing, building the
sharding MIPs, evaluating costs. Threads share one interpreter lock, so on two cores a second
thread only helps while the other runs native code (SCIP releases the lock while it solves); a
second process runs Python beside this one. A spawned process would spend longer importing
torch than the work takes, so the child is forked: it has the traced graphs already, and sends
back only plain results through a pipe. What it computes is what this process would: a child
that fails, dies or does not answer leaves its work to this process, so a plan never depends on
which process made which part, only the time does.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import pickle
import queue
import select
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable

import torch

from autopar import progress

__all__ = ["FORK_SWITCH", "Child", "may_fork", "run_tasks", "cpus"]

FORK_SWITCH = "AUTOPAR_FORK"
"""Set to 0 to plan in this process alone (no forked child)."""

def cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (macOS, Windows)
        return os.cpu_count() or 1


def may_fork() -> bool:
    """Whether a forked child may work beside this process: on Linux (macOS's system libraries
    are not safe to use in a forked child, which is why Python's multiprocessing spawns there);
    ``AUTOPAR_FORK`` is not 0; more than one CPU; CUDA is not initialised and no process group
    is (a forked child cannot use them, and ranks that plan side by side already fill the
    cores); and no other Python thread runs here but two kinds that hold no lock the child
    needs (a fork copies only the calling thread, and a lock another thread held stays held in
    the child): tqdm's monitor, which torch.fx's Interpreter starts in the first trace of a
    process (a disabled progress bar) and which wakes every 10 s to take tqdm's lock for a
    moment (a trace's bars are disabled), and autopar's progress timers, which wait and then
    print to the progress stream (the child prints nothing)."""
    if os.environ.get(FORK_SWITCH, "1") == "0" or not sys.platform.startswith("linux") or cpus() < 2:
        return False
    if torch.cuda.is_initialized() or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return all(t is threading.current_thread() or type(t).__name__ == "TMonitor" or t.name == progress.THREAD_NAME
               for t in threading.enumerate())


class Child:
    """``work(send)`` run in a forked child. What it passes to ``send`` and, last, what it returns
    come back over a pipe as length-prefixed pickles (:meth:`messages`, :meth:`answer`)."""

    def __init__(self, work: Callable[[Callable[[Any], None]], Any]):
        read, write = os.pipe()
        with warnings.catch_warnings():  # (Python 3.12+ warns of forking beside a thread: see may_fork)
            warnings.simplefilter("ignore", DeprecationWarning)
            self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            try:
                # (the heap it was born with out of its collections: a collection writes to every
                # object it walks, and each write copies a page the two processes share; frozen
                # here, not in this process, whose collector stays as it was)
                gc.freeze()
                os.close(read)
                torch.set_num_threads(1)
                warnings.simplefilter("ignore")  # (this process reports what it finds itself)
                logging.disable(logging.CRITICAL)
                progress.enable(None)
                pipe, lock = os.fdopen(write, "wb"), threading.Lock()

                def send(kind: str, value: Any) -> None:
                    data = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
                    with lock:
                        pipe.write(len(data).to_bytes(8, "little") + data)
                        pipe.flush()

                try:
                    result = work(lambda value: send("message", value))
                except BaseException:  # (this process does the work again and reports it)
                    send("error", None)
                else:
                    send("ok", result)
                pipe.close()
            finally:
                os._exit(0)
        os.close(write)
        self.read = read

    def messages(self, wait_s: float | None = None):
        """``(kind, value)`` as the child sends them: ("message", what it passed to ``send``),
        then ("ok", what ``work`` returned) or ("error", None). Ends when the child closes the
        pipe, or ``wait_s`` seconds from now (None: no limit)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        buffer = b""
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.read], [], [], left)
            if not ready:
                return
            chunk = os.read(self.read, 1 << 20)
            if not chunk:
                return
            buffer += chunk
            while len(buffer) >= 8 and len(buffer) >= 8 + (size := int.from_bytes(buffer[:8], "little")):
                try:
                    item = pickle.loads(buffer[8:8 + size])
                except Exception:  # (not what the child meant to send: nothing more from it)
                    return
                yield item
                buffer = buffer[8 + size:]

    def answer(self, wait_s: float) -> Any:
        """What ``work`` returned, or None (it failed, died, or did not end within ``wait_s``
        seconds)."""
        return next((value for kind, value in self.messages(wait_s) if kind == "ok"), None)

    def stop(self) -> None:
        """Kill the child if it is still running (its pipe then ends)."""
        try:
            if os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass

    def end(self) -> None:
        """Reap the child (killed first if it is still running) and close the pipe."""
        self.stop()
        os.close(self.read)


def start_child(work: Callable[[Callable[[Any], None]], Any]) -> Child | None:
    """A :class:`Child` doing ``work``, or None where the OS refuses a fork (no memory or
    processes left)."""
    try:
        return Child(work)
    except OSError:
        return None


def run_tasks(n: int, work: Callable[[int], Any], *, threads: int, fork: bool,
              on_done: Callable[[int, Any], None] | None = None, wait_s: float = 600.0) -> list:
    """``[work(0), ..., work(n - 1)]``, an exception that ``work(i)`` raises standing as its result.

    The tasks are taken in index order (put the longest first) by ``threads`` threads here and,
    with ``fork``, as many in a forked child, from a counter they share (each takes the next
    task when it is free). ``on_done(i, result)`` runs in the calling thread as each task ends,
    here or in the child (whose results stream back as they come). Once this process has no task
    left, the child gets ``wait_s`` seconds more (or twenty times what this took, if longer);
    a task it took and did not answer (an exception of its own, it died, or the wait ran out)
    is run here, so the result is always this process's ``work(i)``: the child must compute the
    same. An exception in ``on_done`` (or Ctrl-C) stops the threads here taking more tasks; it
    is raised once the tasks they run have ended."""
    results: dict[int, Any] = {}
    if threads > 1 or fork:
        _run_side_by_side(n, work, results, threads=threads, fork=fork, on_done=on_done, wait_s=wait_s)
    for i in range(n):  # (what no thread or child finished; with one thread and no child, every task)
        if i not in results:
            try:
                results[i] = work(i)
            except Exception as e:
                results[i] = e
            if on_done is not None:
                on_done(i, results[i])
    return [results[i] for i in range(n)]


def _run_side_by_side(n: int, work: Callable[[int], Any], results: dict[int, Any], *, threads: int, fork: bool,
                      on_done: Callable[[int, Any], None] | None, wait_s: float) -> None:
    """:func:`run_tasks`' threads and child: what they finish goes into ``results``."""
    shared = None
    if fork:
        try:
            shared = multiprocessing.Value("i", 0)  # (shared memory: one counter across the fork)
        except OSError:  # (no shared memory here, e.g. no /dev/shm: this process alone)
            fork = False
    local, lock = [0], threading.Lock()
    stop = threading.Event()

    def take() -> int:
        guard = shared.get_lock() if shared is not None else lock
        with guard:
            if shared is not None:
                i, shared.value = shared.value, shared.value + 1
            else:
                i, local[0] = local[0], local[0] + 1
        return i

    def drain(put: Callable[[int, Any], None]) -> None:
        while not stop.is_set() and (i := take()) < n:
            try:
                result = work(i)
            except Exception as e:
                result = e
            put(i, result)

    def in_child(send: Callable[[Any], None]) -> None:
        # (a task that raised is not sent: this process runs it again)
        put = lambda i, r: isinstance(r, BaseException) or send((i, r))  # noqa: E731
        helpers = [threading.Thread(target=drain, args=(put,)) for _ in range(threads - 1)]
        for t in helpers:
            t.start()
        drain(put)
        for t in helpers:
            t.join()

    child = start_child(in_child) if fork else None
    finished: queue.SimpleQueue = queue.SimpleQueue()  # (i, result); None as a thread here ends, ... as the child

    def worker() -> None:
        try:
            drain(lambda i, r: finished.put((i, r)))
        finally:
            finished.put(None)

    def listen() -> None:  # (the child's results, as they come)
        try:
            for kind, value in child.messages():
                if kind == "message":
                    finished.put(value)
        finally:
            finished.put(...)

    workers = [threading.Thread(target=worker, name="autopar-mip", daemon=True) for _ in range(threads)]
    listener = threading.Thread(target=listen, name="autopar-child", daemon=True) if child else None
    start = time.perf_counter()
    try:
        for t in workers + ([listener] if listener else []):
            t.start()
        own, theirs, deadline = len(workers), listener is not None, None
        while own or theirs:
            try:
                item = finished.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:  # (the child ran past its time: its pipe ends with it)
                child.stop()
                deadline = None
                continue
            if item is None or item is ...:
                own -= item is None
                theirs = theirs and item is not ...
                if not own and theirs and deadline is None:
                    deadline = time.monotonic() + max(wait_s, 20 * (time.perf_counter() - start))
                continue
            i, result = item
            if i not in results:
                results[i] = result
                if on_done is not None:
                    on_done(i, result)
    finally:
        stop.set()
        for t in workers:  # (first: a child killed while it held the counter's lock would keep it)
            t.join()
        if child:
            child.stop()
            listener.join()
            child.end()

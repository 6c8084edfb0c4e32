"""Planning beside a forked child (autopar.planner.side_by_side): the double-batch trace
(autopar.planner.frontend.trace_and_twin) gives the numbers a trace here gives, tasks shared with
a child give the results this process computes, and a child that fails, hangs or dies leaves its
work to this process."""

import os
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autopar.planner.side_by_side import Child as _Child, run_tasks

ROOT = Path(__file__).resolve().parents[1]


def test_child_answers_what_its_work_returns():
    child = _Child(lambda send: {"facts": (1, 2.5, "aten.mm.default")})
    try:
        assert child.answer(wait_s=60) == {"facts": (1, 2.5, "aten.mm.default")}
    finally:
        child.end()


@pytest.mark.parametrize("work", [lambda send: 1 / 0, lambda send: os._exit(3)], ids=["raises", "dies"])
def test_child_that_fails_answers_none(work):
    child = _Child(work)
    try:
        assert child.answer(wait_s=60) is None
    finally:
        child.end()


def test_child_that_does_not_answer_in_time_is_killed():
    child = _Child(lambda send: time.sleep(600))
    start = time.monotonic()
    try:
        assert child.answer(wait_s=0.5) is None
    finally:
        child.end()
    assert time.monotonic() - start < 60
    with pytest.raises(ChildProcessError):  # reaped
        os.waitpid(child.pid, os.WNOHANG)


SCRIPT = textwrap.dedent("""
    import os, sys, threading
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {examples!r})
    import llama
    from autopar.cluster import parse_cluster
    from autopar.planner import frontend, side_by_side
    from autopar.passes.strategies import twin_facts

    forks = []
    start = frontend.start_child
    frontend.start_child = lambda work: forks.append(1) or start(work)
    model, inputs, loss_fn, target = llama.build(size="tiny", batch=4, seq=32)
    cluster = parse_cluster("1x4xcpu")
    assert side_by_side.may_fork(), "a fresh single-threaded process on more than one CPU may fork"
    gm, forked = frontend.trace_and_twin(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    assert forks == [1] and not frontend._failed, (forks, frontend._failed)  # (its facts were used)
    os.environ[side_by_side.FORK_SWITCH] = "0"
    assert not side_by_side.may_fork()
    _, here = frontend.trace_and_twin(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    os.environ.pop(side_by_side.FORK_SWITCH)
    os.environ["AUTOPAR_TRACE_CACHE"] = "1"  # (on: a cached trace is read here, no child)
    frontend.trace_and_twin(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    os.environ.pop("AUTOPAR_TRACE_CACHE")
    assert forks == [1], forks
    assert forked == here, "the child's numbers differ from this process's"
    gm2 = frontend.trace_pair(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)[1]
    assert twin_facts(gm2) == forked
    assert len(forked) == len(gm.graph.nodes) and any(f.gemm for f in forked)
    frontend.start_child = lambda work: forks.append(1) or start(lambda send: 1 / 0)  # (a child that fails)
    _, after_failure = frontend.trace_and_twin(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    assert after_failure == forked and forks == [1, 1], forks
    frontend.trace_and_twin(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    assert forks == [1, 1], "a trace child failed in this process: no more are started"
    gate = threading.Event()
    thread = threading.Thread(target=gate.wait)
    thread.start()
    assert not side_by_side.may_fork(), "another thread: no fork"
    gate.set()
    thread.join()
    print("ok", len(forked))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="forks on Linux with two CPUs")
def test_forked_twin_equals_the_twin_traced_here():
    script = SCRIPT.format(root=str(ROOT), examples=str(ROOT / "examples"))
    # (the suite's trace cache off: with it on, a cached trace is read here, not made in a child)
    env = {k: v for k, v in os.environ.items() if k not in ("AUTOPAR_FORK", "AUTOPAR_TRACE_CACHE")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok "), out.stdout


def _square(i):
    if i == 3:
        raise ValueError("three")
    return i * i, os.getpid()


@pytest.mark.parametrize("fork, threads", [(False, 1), (False, 3), (True, 1), (True, 2)])
def test_run_tasks_returns_each_tasks_result_in_order(fork, threads):
    seen = []
    out = run_tasks(9, _square, threads=threads, fork=fork, on_done=lambda i, r: seen.append(i))
    assert [r if isinstance(r, Exception) else r[0] for r in out[:3]] == [0, 1, 4]
    assert isinstance(out[3], ValueError) and [r[0] for r in out[4:]] == [16, 25, 36, 49, 64]
    assert sorted(seen) == list(range(9))  # (each once, the child's too)


def test_a_child_takes_tasks_and_its_results_come_back():
    """The first task here waits until the child has finished one: the child must take some."""
    parent, (read, write) = os.getpid(), os.pipe()

    def work(i):
        if os.getpid() != parent:
            os.write(write, b"x")
            return i * i, os.getpid()
        ready, _, _ = select.select([read], [], [], 120)  # (a guard: the child writes within moments)
        assert ready, "the child took no task"
        return i * i, os.getpid()

    try:
        out = run_tasks(6, work, threads=1, fork=True)
    finally:
        os.close(read)
        os.close(write)
    assert [r[0] for r in out] == [0, 1, 4, 9, 16, 25]
    assert {r[1] for r in out} - {parent}, "no result came from the child"


def test_tasks_a_dead_child_took_are_run_here():
    """The child dies on the first task it takes (this process waits until it has taken one)."""
    parent, (read, write) = os.getpid(), os.pipe()
    done = []

    def work(i):
        if os.getpid() != parent:
            os.write(write, str(i).encode())
            os._exit(0)
        ready, _, _ = select.select([read], [], [], 120)  # (a guard, as above)
        assert ready, "the child took no task"
        return i * i, os.getpid()

    try:
        out = run_tasks(5, work, threads=1, fork=True, on_done=lambda i, r: done.append(i))
        lost = int(os.read(read, 16))
    finally:
        os.close(read)
        os.close(write)
    assert out == [(i * i, parent) for i in range(5)]
    assert done[-1] == lost and sorted(done) == list(range(5))  # (run here last, once)


def test_a_task_the_child_hangs_on_is_run_here_after_the_wait():
    parent, (read, write) = os.getpid(), os.pipe()

    def work(i):
        if os.getpid() != parent:
            os.write(write, b"x")
            time.sleep(600)  # (hangs on the first task it takes)
        ready, _, _ = select.select([read], [], [], 120)  # (a guard, as above)
        assert ready, "the child took no task"
        return i * i, os.getpid()

    start = time.monotonic()
    try:
        out = run_tasks(4, work, threads=1, fork=True, wait_s=0.5)
    finally:
        os.close(read)
        os.close(write)
    assert out == [(i * i, parent) for i in range(4)]
    assert time.monotonic() - start < 300  # (killed after its wait, not waited for)

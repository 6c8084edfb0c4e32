"""The double-batch trace in a forked child (autopar.planner.frontend.trace_and_twin): the same
numbers as tracing here, and a child that fails, hangs or dies leaves the answer to this process."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autopar.planner.frontend import _Child

ROOT = Path(__file__).resolve().parents[1]


def test_child_answers_what_its_work_returns():
    child = _Child(lambda: {"facts": (1, 2.5, "aten.mm.default")})
    try:
        assert child.answer(wait_s=60) == {"facts": (1, 2.5, "aten.mm.default")}
    finally:
        child.end()


@pytest.mark.parametrize("work", [lambda: 1 / 0, lambda: os._exit(3)], ids=["raises", "dies"])
def test_child_that_fails_answers_none(work):
    child = _Child(work)
    try:
        assert child.answer(wait_s=60) is None
    finally:
        child.end()


def test_child_that_does_not_answer_in_time_is_killed():
    child = _Child(lambda: time.sleep(600))
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
    from autopar.planner import frontend
    from autopar.passes.strategies import twin_facts

    forks = []
    child = frontend._Child
    frontend._Child = lambda work: forks.append(1) or child(work)
    model, inputs, loss_fn, target = llama.build(size="tiny", batch=4, seq=32)
    cluster = parse_cluster("1x4xcpu")
    assert frontend._may_fork(), "a fresh single-threaded process on more than one CPU may fork"
    gm, forked = frontend.trace_and_twin(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    assert forks == [1], forks
    os.environ[frontend.FORK_SWITCH] = "0"
    assert not frontend._may_fork()
    _, here = frontend.trace_and_twin(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    assert forks == [1], forks
    assert forked == here, "the child's numbers differ from this process's"
    gm2 = frontend.trace_pair(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)[1]
    assert twin_facts(gm2) == forked
    assert len(forked) == len(gm.graph.nodes) and any(f.gemm for f in forked)
    os.environ.pop(frontend.FORK_SWITCH)
    os.environ["AUTOPAR_TRACE_CACHE"] = "1"
    assert not frontend._may_fork(), "the trace cache on: no fork"
    os.environ.pop("AUTOPAR_TRACE_CACHE")
    gate = threading.Event()
    thread = threading.Thread(target=gate.wait)
    thread.start()
    assert not frontend._may_fork(), "another thread: no fork"
    gate.set()
    thread.join()
    print("ok", len(forked))
""")


@pytest.mark.skipif(not hasattr(os, "fork") or len(os.sched_getaffinity(0)) < 2, reason="needs fork and two CPUs")
def test_forked_twin_equals_the_twin_traced_here():
    script = SCRIPT.format(root=str(ROOT), examples=str(ROOT / "examples"))
    # (the suite's trace cache off: with it on, a cached trace is read here, not made in a child)
    env = {k: v for k, v in os.environ.items() if k not in ("AUTOPAR_TRACE_FORK", "AUTOPAR_TRACE_CACHE")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok "), out.stdout

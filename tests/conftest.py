# The --autopar-update-golden option, also where autopar is installed without its pytest11 entry point
# (an older editable install); pytest skips it when the entry point has registered it already.
pytest_plugins = ["autopar.pytest_plugin"]

import os
import resource
import sys

import pytest

# Reuse traces within a process (autopar.passes.trace_cache): the multi-process tests train one
# example under many layouts per world, and the golden plans plan one model for several clusters;
# about half of those tests' CPU was tracing the same graph again. Inherited by spawned ranks.
# tests/test_trace_cache.py checks what may and may not hit.
os.environ.setdefault("AUTOPAR_TRACE_CACHE", "1")
# No forked planner child (autopar.planner.side_by_side): the suite's two workers already fill
# both cores, so a child adds processes, not cores (CI's pytest took 17 min 29 s with it on at
# da0f54b and 17 min 31 s with it off at 30dd59b: no difference measured). tests/test_trace_fork.py
# and tests/test_solver_limits.py turn it on where they test it.
os.environ.setdefault("AUTOPAR_FORK", "0")


def _fresh_dir(env: str, prefix: str) -> None:
    """``env`` names a new directory for this run (inherited by xdist workers and spawned ranks),
    removed at exit; unless the caller set ``env`` already."""
    if env not in os.environ:
        import atexit
        import shutil
        import tempfile

        os.environ[env] = path = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, path, ignore_errors=True)


# Solved sharding MIPs are shared between the suite's processes (xdist workers, spawned ranks) through
# one fresh directory per run (autopar.planner.solve_cache): a world's rank 0 does not solve again what
# another world solved, and no run is faster or slower for what an earlier run left in ~/.cache.
_fresh_dir("AUTOPAR_CACHE_DIR", "autopar-test-cache-")
# Traces are shared the same way (autopar.passes.trace_store): each rank of a world traces the step it
# runs, the same graph on every rank, and most worlds train the same few example models; with a shared
# directory one process traces and the others load (about 0.05 s against 2 s for a tiny model).
# A fresh directory per run, whatever AUTOPAR_CACHE_DIR says: an entry trusts that the code is the same.
_fresh_dir("AUTOPAR_TRACE_CACHE_DIR", "autopar-test-traces-")

_CPU_LOG = os.environ.get("AUTOPAR_TEST_CPU")
"""A file to append each test phase's CPU seconds to (this process, its reaped children and the
ranks autopar.testing.spawn_world forked):
the suite's cost on a 2-core CI machine is its CPU time, which wall-clock durations on a
loaded machine do not show."""


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    ranks = sys.modules.get("autopar.testing")  # (imported by the tests that spawn ranks)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + (ranks.ranks_cpu_seconds() if ranks else 0.0)


def _timed(phase: str, item):
    start = _cpu_s()
    yield
    with open(_CPU_LOG, "a") as f:
        f.write(f"{_cpu_s() - start:.1f}\t{phase}\t{item.nodeid}\n")


if _CPU_LOG:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(item):
        yield from _timed("setup", item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        yield from _timed("call", item)


@pytest.fixture
def solved_afresh(monkeypatch):
    """Every solve is SCIP's, not this process's memo of solved MIPs or the disk cache
    (for tests of what the solver answers; use with ``pytest.mark.usefixtures``)."""
    from autopar.planner import ilp

    monkeypatch.setenv("AUTOPAR_SOLVE_CACHE", "0")
    monkeypatch.setattr(ilp, "_SOLVED", type(ilp._SOLVED)())

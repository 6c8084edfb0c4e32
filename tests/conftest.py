# The --autopar-update-golden option, also where autopar is installed without its pytest11 entry point
# (an older editable install); pytest skips it when the entry point has registered it already.
pytest_plugins = ["autopar.pytest_plugin"]

import os
import resource

import pytest

_CPU_LOG = os.environ.get("AUTOPAR_TEST_CPU")
"""A file to append each test phase's CPU seconds to (this process and its reaped children):
the suite's cost on a 2-core CI machine is its CPU time, which wall-clock durations on a
loaded machine do not show."""


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


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

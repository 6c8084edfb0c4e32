"""pytest plugin: ``--autopar-update-golden`` for :func:`autopar.testing.assert_plan_matches`.

Installed autopar registers it through the ``pytest11`` entry point, so any
project's tests can use the option; without the installed entry point, load it
with ``pytest -p autopar.pytest_plugin`` or ``pytest_plugins = ["autopar.pytest_plugin"]``
in a top-level conftest.py.
"""

from __future__ import annotations

update_golden = False
"""Set for the session by ``--autopar-update-golden``; read by ``autopar.testing``."""


def pytest_addoption(parser) -> None:
    parser.getgroup("autopar").addoption(
        "--autopar-update-golden", action="store_true", default=False,
        help="write golden plan files that are missing or differ (autopar.testing.assert_plan_matches) "
             "instead of failing; same as AUTOPAR_UPDATE_GOLDEN=1")


def pytest_configure(config) -> None:
    global update_golden
    update_golden = bool(config.getoption("autopar_update_golden"))


def pytest_unconfigure(config) -> None:
    global update_golden
    update_golden = False

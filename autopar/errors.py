"""Exceptions autopar raises for user mistakes and impossible requests.

Every autopar error derives from :class:`AutoparError`, so a caller (or the CLI,
which prints one line and exits 2) can catch them all at once. Each one also
derives from the matching builtin (``ValueError``, ``RuntimeError``), so code that
catches the builtin keeps working.
"""

from __future__ import annotations

__all__ = [
    "AutoparError",
    "ClusterSpecError",
    "InfeasibleError",
    "PlanError",
    "TraceError",
]


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class ClusterSpecError(AutoparError, ValueError):
    """A cluster description (``"2x8xH100"``, a dict or a JSON/YAML file) is malformed."""


class TraceError(AutoparError, RuntimeError):
    """The model could not be traced into a joint forward+backward graph."""


class PlanError(AutoparError, ValueError):
    """A plan is invalid, or does not match the model or cluster it is used with."""


class InfeasibleError(PlanError):
    """No plan satisfies the constraints (memory, pinned decisions, divisibility)."""

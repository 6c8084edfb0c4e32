"""Exceptions autopar raises for user mistakes and impossible requests.

Every autopar error derives from :class:`AutoparError`, so a caller (or the CLI,
which prints one line and exits 2) can catch them all at once. Each one also
derives from the matching builtin (``ValueError``, ``RuntimeError``), so code that
catches the builtin keeps working.
"""

from __future__ import annotations

__all__ = [
    "AutoparError",
    "CheckpointError",
    "ClusterSpecError",
    "InfeasibleError",
    "InputError",
    "LossError",
    "OutputPathError",
    "PeerError",
    "PlanError",
    "TraceError",
    "UserCodeError",
]


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class CheckpointError(AutoparError, ValueError):
    """A checkpoint cannot be loaded as asked: missing or truncated files, an incomplete save,
    another model's parameters or other shapes (:mod:`autopar.runtime.checkpoint`)."""


class ClusterSpecError(AutoparError, ValueError):
    """A cluster description (``"2x8xH100"``, a dict or a JSON/YAML file) is malformed."""


class TraceError(AutoparError, RuntimeError):
    """The model could not be traced into a joint forward+backward graph."""


class PlanError(AutoparError, ValueError):
    """A plan is invalid, or does not match the model or cluster it is used with."""


class InfeasibleError(PlanError):
    """No plan satisfies the constraints (memory, pinned decisions, divisibility)."""


class InputError(AutoparError, ValueError):
    """The example inputs, target or model cannot be trained as given (an empty batch, a
    target whose batch differs from the inputs', a model with nothing to train)."""


class LossError(InputError):
    """No scalar loss: the model's output is not one and no ``loss_fn`` was given, or
    ``loss_fn`` returned something other than a floating-point scalar tensor."""


class OutputPathError(AutoparError, ValueError):
    """A file or directory the CLI is asked to write cannot be written there."""


class UserCodeError(AutoparError, RuntimeError):
    """The user's own code (a model spec file or its function) raised an exception.

    The message says where (``path:line in function``), what (type and message) and
    that it is the user's error, not autopar's; the original exception is
    ``__cause__`` (and ``original``), with its traceback.
    """

    def __init__(self, message: str, *, original: BaseException | None = None, path: str = "",
                 line: int = 0) -> None:
        super().__init__(message)
        self.original = original
        self.path = path
        self.line = line


class PeerError(AutoparError, RuntimeError):
    """A collective or pipeline receive failed or timed out: a peer rank is dead or stuck.

    ``rank`` is the rank that raises it, ``action`` what it was waiting on, ``dead``
    the ranks found dead (empty when every peer is alive but one did not answer).
    """

    def __init__(self, message: str, *, rank: int, action: str, dead: list[int]):
        super().__init__(message)
        self.rank = rank
        self.action = action
        self.dead = list(dead)

    def __reduce__(self):  # picklable with its keywords (errors cross process boundaries in tests)
        return _make_peer_error, (str(self), self.rank, self.action, self.dead)


def _make_peer_error(message: str, rank: int, action: str, dead: list[int]) -> PeerError:
    return PeerError(message, rank=rank, action=action, dead=dead)

"""A progress line for work that takes more than a second.

Library code reports through ``logging``; the CLI turns progress on with
``enable(stream)`` so that a phase still running after one second prints
"autopar: tracing LlamaForCausalLM ..." and then its wall time when it ends.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

_stream: TextIO | None = None
_DELAY_S = 1.0


THREAD_NAME = "autopar-progress"
"""The name of the timer threads :func:`progress` starts (a forked planner child lets them be:
:func:`autopar.planner.side_by_side.may_fork`)."""


def enable(stream: TextIO | None = sys.stderr) -> None:
    """Print progress lines to ``stream`` (None turns them off)."""
    global _stream
    _stream = stream


@contextlib.contextmanager
def progress(what: str) -> Iterator[None]:
    """Announce ``what`` if it is still running after a second, then its duration."""
    stream = _stream
    if stream is None:
        yield
        return
    shown = threading.Event()

    def announce() -> None:
        shown.set()
        print(f"autopar: {what} ...", file=stream, flush=True)

    timer = threading.Timer(_DELAY_S, announce)
    timer.daemon = True
    timer.name = THREAD_NAME
    start = time.perf_counter()
    timer.start()
    ended = "stopped after"  # an error or Ctrl-C ended the phase: it is not "done"
    try:
        yield
        ended = "done in"
    finally:
        timer.cancel()
        if shown.is_set():
            print(f"autopar: {what} {ended} {time.perf_counter() - start:.1f} s", file=stream, flush=True)

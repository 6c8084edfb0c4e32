"""Traces shared between processes through a directory (opt-in, beside :mod:`.trace_cache`).

:mod:`autopar.passes.trace_cache` keeps traces within one process. Many processes trace the same
model too: every rank of a world traces the step it will run (the same joint graph at the same
global micro-batch on every rank), and the test suite starts a few hundred ranks that trace a
handful of example models. With ``AUTOPAR_TRACE_CACHE_DIR`` set (and the trace cache on,
``AUTOPAR_TRACE_CACHE=1``), a trace is written there once and loaded by every other process that
asks for it: loading a tiny model's trace takes about 0.05 s where tracing took 2 s.

How. The in-process fingerprint (:func:`.trace_cache.trace_key`) is turned into a stable digest
(:func:`digest`): types and functions by module, qualified name and code (bytecode, constants and
names), values by content, plus this file's format, the torch, Python and autopar versions and
the size and modification time of every source file of autopar and of the modules that define
the model's classes and the loss. A key holding anything else (an object only identity
describes) gets no digest and stays in-process. Whoever misses takes the key's lock
(``fcntl.flock`` on ``<digest>.lock``), traces and writes ``<digest>.fx``
(:class:`torch.fx._graph_pickler.GraphPickler`, which pickles a graph with its fake-tensor
values and node metadata) under a temporary name renamed into place; a process that asks
meanwhile waits on the lock and then loads. A lock is released when its holder exits, however
it exits; a file that fails to load is traced again and replaced.

What it trusts (why it is opt-in): that the processes run the same code. Functions the model
calls but does not hold (a helper in another module, a global it reads) are not in the digest;
a source file edited between two runs is seen only through its size and time. Entries are
pickles, loaded as code: the directory is created private (mode 0700) and must be one the user
alone writes. The test suite gives each run a fresh one.

Why written here: torch's graph caches (inductor's FX graph cache, AOTAutograd's cache) hold
compiled kernels keyed by a captured graph; they cache what comes after a capture, not the
capture itself, which is what costs autopar its seconds.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import logging
import os
import sys
import tempfile
import types
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import fx

__all__ = ["ENV", "directory", "digest", "claimed", "load", "save"]

ENV = "AUTOPAR_TRACE_CACHE_DIR"
FORMAT = 1
log = logging.getLogger(__name__)


def directory() -> Path | None:
    """The shared directory, created private if missing; None when unset or unusable."""
    root = os.environ.get(ENV, "").strip()
    if not root:
        return None
    path = Path(root)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        log.warning("%s=%s is not a usable directory (%s): traces are not shared", ENV, root, e)
        return None
    return path


class _Unstable(Exception):
    """A value with no description that holds in another process."""


def digest(key: Any) -> str | None:
    """A name for ``key`` that another process computes alike, or None where there is none."""
    h = hashlib.sha256()
    files: set[str] = set()
    try:
        _feed(h, key, files)
    except (_Unstable, RecursionError):
        return None
    h.update(repr((FORMAT, torch.__version__, sys.version_info[:3], _autopar_stamp())).encode())
    h.update(repr(sorted(_stamp(f) for f in files)).encode())
    return h.hexdigest()


def _feed(h, v: Any, files: set[str]) -> None:
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, range, slice)) or v is Ellipsis:
        h.update(f"{type(v).__name__}:{v!r};".encode())
    elif isinstance(v, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        h.update(f"{type(v).__name__}:{v};".encode())
    elif isinstance(v, enum.Enum):
        _feed(h, type(v), files)
        h.update(f"enum:{v.name};".encode())
    elif isinstance(v, (tuple, list)):
        h.update(f"{type(v).__name__}({len(v)}:".encode())
        for x in v:
            _feed(h, x, files)
        h.update(b");")
    elif isinstance(v, type):
        if "<locals>" in v.__qualname__:  # (classes made by one function may differ in what they close over)
            raise _Unstable(v.__qualname__)
        h.update(f"type:{v.__module__}.{v.__qualname__};".encode())
        module = sys.modules.get(v.__module__)
        if getattr(module, "__file__", None):
            files.add(module.__file__)
    elif isinstance(v, types.CodeType):
        h.update(f"code:{v.co_filename}:{getattr(v, 'co_qualname', v.co_name)}:{v.co_firstlineno}:".encode())
        h.update(v.co_code)
        _feed(h, v.co_names, files)
        _feed(h, v.co_consts, files)
        files.add(v.co_filename)
    elif isinstance(v, types.ModuleType):
        h.update(f"module:{v.__name__};".encode())
    elif isinstance(v, types.BuiltinFunctionType):
        h.update(f"builtin:{getattr(v, '__module__', None)}.{v.__qualname__};".encode())
    elif isinstance(v, frozenset):  # (code constants)
        _feed(h, tuple(sorted(v, key=repr)), files)
    else:
        raise _Unstable(type(v).__name__)


def _stamp(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return (path, None)
    return (path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _autopar_stamp() -> tuple:
    import autopar

    root = Path(autopar.__file__).parent
    return (autopar.__version__, tuple(_stamp(str(p)) for p in sorted(root.rglob("*.py"))))


@contextlib.contextmanager
def claimed(name: str | None) -> Iterator[Path | None]:
    """Hold ``name``'s lock for the block (another process asking waits); the entry's path, or None
    when traces are not shared (no directory, or no name)."""
    root = directory() if name is not None else None
    try:
        import fcntl
    except ImportError:  # (not a POSIX system: no shared traces)
        root = None
    if root is None:
        yield None
        return
    try:
        fd = os.open(root / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        log.info("trace store: no lock for %s (%s): tracing without it", name, e)
        yield None
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield root / f"{name}.fx"
    finally:
        os.close(fd)  # (releases the lock)


def load(path: Path) -> fx.GraphModule | None:
    """The trace stored at ``path``, its fake tensors in a fresh fake mode; None if absent or unusable."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (pytree's deprecated LeafSpec, pickled inside)
            gm = GraphPickler.loads(data, FakeTensorMode(allow_non_fake_inputs=True))
        gm.recompile()
    except Exception as e:  # a damaged or foreign file: trace again, and replace it
        log.warning("trace store: %s could not be loaded (%s: %s); tracing again", path, type(e).__name__, e)
        return None
    return gm


def save(path: Path, gm: fx.GraphModule) -> None:
    """Write ``gm`` to ``path`` (whole or not at all); a graph that does not pickle is just not shared."""
    from torch.fx._graph_pickler import GraphPickler, Options

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = GraphPickler.dumps(gm, Options(ops_filter=None, node_metadata_key_filter=None))
    except Exception as e:  # e.g. a class defined inside a function, in a node's module stack
        log.info("trace store: %s is not shared (%s: %s)", path.name, type(e).__name__, e)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        log.info("trace store: could not write %s (%s)", path, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)

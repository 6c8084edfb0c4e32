"""Solved sharding MIPs kept on disk, so another process does not solve the same model again.

A training job plans on rank 0 every time it is launched, and a restarted job (after a
node failure, a preemption, a changed learning rate) plans the same model on the same
cluster again; the CLI re-plans when only the output options change; the test suite plans
one tiny model in dozens of processes. The sharding MIPs are the dearest part of that work
that is a pure function of its input (1-12 CPU-s per solve on models of a few thousand
variables), so :func:`autopar.planner.ilp.solve` looks its model up here before solving and
stores what it solved.

The key is the SHA-256 of the MIP exactly as built (every variable, bound, row and
coefficient, serialised deterministically), the solver settings and node limit, and the
OR-tools version and this file's format version. SCIP is deterministic under a node limit,
so a hit returns what solving would have: the same choice, status, bound and node count.
A plan made from the cache is byte-identical to one made without it.

Where: ``$AUTOPAR_CACHE_DIR/mip`` if that is set, else ``$XDG_CACHE_HOME/autopar/mip``
(``~/.cache/autopar/mip``). ``AUTOPAR_SOLVE_CACHE=0`` turns it off. Each entry is one small
JSON file (the chosen candidate per node and the solver's figures), written to a temporary
name and renamed into place, so processes planning at once (the ranks of several jobs, test
workers) never read half a file; an unreadable or inconsistent entry is ignored and solved
again. Nothing here is executed: entries are plain JSON of numbers.

Why written here: OR-tools has no solution store, and the MIP's inputs are only known once
the model is built (the digest covers them), so a generic function memo would not serve.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

__all__ = ["ENV_DIR", "ENV_SWITCH", "enabled", "directory", "load", "store"]

ENV_DIR = "AUTOPAR_CACHE_DIR"
ENV_SWITCH = "AUTOPAR_SOLVE_CACHE"
FORMAT = 2  # 2: the gap tolerance is stored (gap_limit)
_FIELDS = ("choice", "status", "objective_s", "bound_s", "nodes", "node_limit", "gap_limit", "limit")
log = logging.getLogger(__name__)
_warned: set[str] = set()


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def directory() -> Path:
    root = os.environ.get(ENV_DIR)
    if root:
        return Path(root) / "mip"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "autopar" / "mip"


def salt() -> bytes:
    """What besides the model decides the answer: the solver's build and this file's format."""
    import ortools

    return f"ortools {getattr(ortools, '__version__', '?')}\nsolve_cache {FORMAT}\n".encode()


def load(key: str, n_candidates: list[int]) -> dict | None:
    """The stored solution fields for ``key``, or None when there is none (or it is unusable).

    ``n_candidates`` (candidates per node) checks the entry against the model it is for."""
    if not enabled():
        return None
    try:
        with open(directory() / f"{key}.json", encoding="utf-8") as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or any(k not in entry for k in _FIELDS):
        return None
    choice = entry["choice"]
    if (not isinstance(choice, list) or len(choice) != len(n_candidates)
            or any(not isinstance(c, int) or not 0 <= c < n for c, n in zip(choice, n_candidates))):
        return None
    return {k: (tuple(choice) if k == "choice" else entry[k]) for k in _FIELDS}


def store(key: str, fields: dict) -> None:
    """Keep a solved MIP's fields under ``key``; a cache that cannot be written is skipped."""
    if not enabled():
        return
    entry = {"format": FORMAT, **{k: (list(fields[k]) if k == "choice" else fields[k]) for k in _FIELDS}}
    folder = directory()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(entry, f)
            os.replace(tmp, folder / f"{key}.json")
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        # A read-only or full disk costs the next process a solve, nothing else: say so once per folder.
        if str(folder) not in _warned:
            _warned.add(str(folder))
            log.warning("cannot keep solved MIPs in %s (%s); planning works, but other processes will solve "
                        "them again: set %s to a writable folder, or %s=0", folder, e, ENV_DIR, ENV_SWITCH)

"""Helpers for testing with autopar: golden plans, and runs in several processes (gloo on CPU).

``assert_plan_matches(plan, "golden/NAME.json")`` compares a plan with a golden
plan file next to the calling test (see :mod:`autopar.plan_diff` for what counts
as a change) and fails with the readable diff. Run pytest with
``--autopar-update-golden`` (the :mod:`autopar.pytest_plugin` option) or with
``AUTOPAR_UPDATE_GOLDEN=1`` to write golden files that are missing or differ.

``spawn_world(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` fresh
processes with a gloo process group over loopback and returns what each rank's
``fn`` returned, in rank order; an exception on any rank is re-raised here with
that rank's traceback. Every rank has a timeout, so a hang fails the test instead
of stalling it.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from autopar.plan import Plan

__all__ = ["assert_plan_matches", "update_golden_requested", "spawn_world", "free_port", "fast_cluster",
           "tp_friendly_cluster", "tp_only_cluster"]

UPDATE_ENV = "AUTOPAR_UPDATE_GOLDEN"


def update_golden_requested() -> bool:
    """True under ``pytest --autopar-update-golden`` or with ``AUTOPAR_UPDATE_GOLDEN`` set (not to "" or "0")."""
    if os.environ.get(UPDATE_ENV, "").strip() not in ("", "0"):
        return True
    plugin = sys.modules.get("autopar.pytest_plugin")
    return bool(plugin and plugin.update_golden)


def assert_plan_matches(plan: Plan, golden: str | os.PathLike, *, rtol: float = 0.01, update: bool | None = None,
                        limit: int = 20) -> None:
    """Fail with the readable diff when ``plan`` differs from the golden plan file.

    ``golden`` is absolute or relative to the directory of the calling file.
    Floats (predictions) compare with relative tolerance ``rtol``; everything
    else exactly. With ``update`` (default: :func:`update_golden_requested`) a
    missing or differing golden file is (re)written, with a warning saying so;
    one that matches within ``rtol`` is left as it is, so files do not churn
    in their last digits. ``limit`` caps the printed changes per group.
    """
    from autopar.plan_diff import diff_plans, load_plan_file

    path = Path(golden)
    if not path.is_absolute():
        path = Path(sys._getframe(1).f_code.co_filename).resolve().parent / path
    if update is None:
        update = update_golden_requested()
    if not path.exists():
        if not update:
            raise AssertionError(
                f"golden plan {path} does not exist; run pytest with --autopar-update-golden "
                f"(or {UPDATE_ENV}=1) to write it from this plan, then review and commit it")
        path.parent.mkdir(parents=True, exist_ok=True)
        plan.save(path)
        warnings.warn(f"wrote new golden plan {path}", stacklevel=2)
        return
    diff = diff_plans(load_plan_file(path), plan, rtol=rtol)
    if diff.equal:
        return
    if update:
        plan.save(path)
        warnings.warn(f"updated golden plan {path}: {len(diff.changes)} changes", stacklevel=2)
        return
    raise AssertionError(
        f"plan differs from golden plan {path}\n{diff.render(old_label='golden', new_label='plan', limit=limit)}\n"
        f"(if the change is intended, rerun with --autopar-update-golden or {UPDATE_ENV}=1 and commit the file)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist

    try:
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_world(fn: Callable, world: int, *args: Any, timeout_s: float = 900.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; their results in rank order.

    ``timeout_s`` bounds the wait for each rank's result: long enough for a world that
    compiles several plans while another test process shares the two CPU cores (the
    4-rank pipeline world takes ~100 s alone and has needed over 300 s under load), short
    enough that a hang fails the run well inside CI's limit.
    """
    import torch.multiprocessing as mp  # here, not at the top: golden-plan tests need no torch import

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout_s)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]


def fast_cluster(spec: str):
    """A cluster whose links cost nothing, so the planner shards whatever it can
    (the numerics of every placement get exercised on tiny test models)."""
    from autopar.cluster import parse_cluster

    return parse_cluster(spec).with_overrides(intra_node_bytes_per_s=1e18, inter_node_bytes_per_s=1e18,
                                              intra_node_latency_s=0.0, inter_node_latency_s=0.0)


def tp_friendly_cluster(spec: str):
    """CPU-class compute with fast links (100 GB/s, 3 us): on tiny test models the cheapest
    plan on a tp axis is then Megatron's (weights sharded, one all-reduce per block half)."""
    from autopar.cluster import parse_cluster

    return parse_cluster(spec).with_overrides(intra_node_bytes_per_s=1e11, inter_node_bytes_per_s=1e11,
                                              intra_node_latency_s=3e-6, inter_node_latency_s=3e-6)


def tp_only_cluster(spec: str):
    """As :func:`tp_friendly_cluster`, with memory-bound ops almost free (HBM at 100 TB/s):
    sharding norms over the sequence then saves nothing and costs an extra collective
    call, so the tp axis runs plain Megatron tensor parallelism without sequence parallelism."""
    return tp_friendly_cluster(spec).with_overrides(hbm_bytes_per_s=1e14)

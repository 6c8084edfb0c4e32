"""Helpers for tests that run autopar in several processes (gloo on CPU).

``spawn_world(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` fresh
processes with a gloo process group over loopback and returns what each rank's
``fn`` returned, in rank order; an exception on any rank is re-raised here with
that rank's traceback. Every rank has a timeout, so a hang fails the test instead
of stalling it.
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["spawn_world", "free_port", "fast_cluster", "tp_friendly_cluster", "tp_only_cluster"]


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


def spawn_world(fn: Callable, world: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; their results in rank order."""
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

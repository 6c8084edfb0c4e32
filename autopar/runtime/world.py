"""The process world a parallel module runs in: size check, device, process group, peer watch, RNG.

Before the first collective (issue 17: nothing hangs) :func:`check_world` compares the job's
world size with the cluster's and :func:`resolve_device` refuses a GPU cluster on a machine
without CUDA; :func:`init_process_group` starts NCCL or gloo with the configured timeout (on a
restarted torchrun attempt, under keys of its own); :func:`peer_watch` is the heartbeat that
names a dead or stuck peer; :func:`share_rng_state` starts every rank's generator from rank 0's.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from autopar.cluster import Cluster

__all__ = ["check_world", "resolve_device", "init_process_group", "peer_watch", "share_rng_state"]


def check_world(cluster: Cluster) -> int:
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cluster.world_size:
        raise ValueError(
            f"cluster {cluster.spec} has {cluster.world_size} devices but this job has {world} "
            f"process(es) (WORLD_SIZE={world}); launch with torchrun --nproc-per-node "
            f"{cluster.devices_per_node} --nnodes {cluster.nodes}, or pass the cluster this job runs on")
    return world


def resolve_device(cluster: Cluster, device: str | None) -> str:
    gpu_cluster = cluster.device.name.lower() != "cpu"
    if device is None:
        device = "cuda" if gpu_cluster else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"cluster {cluster.spec} is a cluster of {cluster.device.name} GPUs, but this machine has no CUDA "
            f"device (torch.cuda.is_available() is False); to run the plan on CPU processes anyway (gloo, for "
            f"tests and debugging) pass device='cpu', or plan for CPUs with "
            f"cluster='{cluster.nodes}x{cluster.devices_per_node}xcpu'")
    return device


def init_process_group(device: str, timeout_s: float) -> None:
    if dist.is_initialized():  # the caller's group keeps its own timeout; pipeline receives still use timeout_s
        return
    backend = "nccl" if device == "cuda" else "gloo"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # A restarted torchrun job (--max-restarts) talks to the agent's store, which still holds the
        # previous attempt's gloo addresses under the same keys: a rank that reads one before its peer
        # overwrites it connects to a dead port ("Connection refused"; seen on every restart test
        # here). Keys of this attempt's own avoid it (used by checkpoint resumption).
        store = dist.PrefixStore(f"autopar/attempt-{restart}/", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=timeout_s)))
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=timeout_s))
        return
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


_WATCHES: dict[int, Any] = {}


def peer_watch(timeout_s: float):
    """This process's :class:`~autopar.runtime.watch.PeerWatch` on the default process group (one per group)."""
    from autopar.runtime.watch import PeerWatch

    key = id(dist.group.WORLD)
    if key not in _WATCHES:
        _WATCHES.clear()
        watch = PeerWatch(dist.distributed_c10d._get_default_store(), rank=dist.get_rank(),
                          world=dist.get_world_size(), timeout_s=timeout_s)
        atexit.register(watch.close)
        _WATCHES[key] = watch
    return _WATCHES[key]


def share_rng_state(device: str) -> None:
    """Start every rank's default generator from rank 0's state.

    Dropout draws each mask whole on every rank and keeps its part
    (:func:`autopar.passes.shard.random_ops`), so ranks must draw the same numbers: from the
    same state, as one process would. Each step draws the same amounts on every rank, so
    they stay together as long as the user's own code does too.
    """
    cuda = device == "cuda"
    state = [torch.cuda.get_rng_state() if cuda else torch.get_rng_state()]
    dist.broadcast_object_list(state, src=0, device=torch.device("cuda", torch.cuda.current_device()) if cuda else None)
    (torch.cuda.set_rng_state if cuda else torch.set_rng_state)(state[0])

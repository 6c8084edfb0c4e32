"""The one place the runtime takes its device from.

Every tensor the runtime creates (parameter shards, gradient and collective buffers,
pipeline receive buffers, the user's inputs, the loss) is created with ``device=``
one of these functions returns, never with torch's default device: on a GPU node each
process owns the GPU of its ``LOCAL_RANK`` (:func:`bind_local_device`, called before
any collective, so that NCCL's communicators and every rank's tensors land on it), and
a stray CPU tensor would otherwise fail only there. ``tests/dist/test_device.py``
checks that no runtime code creates a tensor without naming its device.
"""

from __future__ import annotations

import os

import torch

__all__ = ["bind_local_device", "local_device", "mesh_device"]


def local_device(device_type: str) -> torch.device:
    """This process's device of ``device_type``: ``cuda:LOCAL_RANK`` for CUDA, else the type itself."""
    if device_type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(device_type)


def bind_local_device(device_type: str) -> torch.device:
    """Make this process's device current (CUDA: ``torch.cuda.set_device(LOCAL_RANK)``) and return it.

    Must run before the process group's first collective: NCCL builds its communicator
    on the current device, so a later ``set_device`` leaves every rank of a node on GPU 0.
    A ``LOCAL_RANK`` beyond the node's GPUs is a ``ValueError`` naming both.
    """
    device = local_device(device_type)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if device.index >= count:
            raise ValueError(f"LOCAL_RANK={device.index} but this node has {count} CUDA device(s); launch at most "
                             f"{count} processes per node (torchrun --nproc-per-node {count})")
        torch.cuda.set_device(device)
    return device


def mesh_device(mesh) -> torch.device:
    """The device of this process's tensors on ``mesh`` (a DeviceMesh)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)

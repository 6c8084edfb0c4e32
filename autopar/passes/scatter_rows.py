"""Scatter along one dim, split along another: each rank scatters its own rows.

``scatter(self, dim, index, src)`` writes along ``dim`` only. On any other dim where
``self``, ``index`` and ``src`` have the same size, row i of the output reads row i of
each input and nothing else, so all three may be split alike on that dim and every rank
scatters its own rows with no communication. DTensor's rule says so from torch 2.13 on;
2.11's and 2.12's offer only the replicated scatter. Their autograd writes the gradient of
a top-k as ``zeros(n, k).scatter(-1, indices, grad)`` (2.13 starts from ``new_zeros``), and
under dp the indices and gradient are split over the batch. DTensor would then gather both
over dp on every step, an all-gather the plan does not price: Mixtral's router paid two
per layer on 2.11.

So autopar offers the split rule itself, to the planner (``dtensor_rules``, beside
DTensor's candidates; on 2.13+ it adds none) and at run time (:func:`run_scatter_rows`,
on every release: the computation DTensor's own rule does where it has one).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["SCATTER_OPS", "scatter_rule", "run_scatter_rows"]

_aten = torch.ops.aten
SCATTER_OPS = frozenset({_aten.scatter.src, _aten.scatter.value})


def _row_dims(dim: int, shapes: list[tuple[int, ...]]) -> list[int]:
    """The dims other than the scatter dim on which every tensor argument has the same size."""
    ndim = len(shapes[0])
    if any(len(s) != ndim for s in shapes):
        return []
    dim = dim % ndim if ndim else 0
    return [d for d in range(ndim) if d != dim and len({s[d] for s in shapes}) == 1]


def scatter_rule(op, args, ins, outs) -> list[list]:
    """Single-axis rules ``[out, self, index(, src)]`` for the planner: Shard(d) on all of
    them for each row dim d (the all-Replicate rule is implicit)."""
    return [[Shard(d)] * (len(outs) + len(ins)) for d in _row_dims(args[1], [t.shape for t in ins])]


def run_scatter_rows(op, args: tuple, kwargs: dict[str, Any]):
    """``op`` (one of :data:`SCATTER_OPS`) on each rank's rows, or None when no argument is
    split on a row dim (or a tensor argument is not a DTensor): DTensor's dispatch runs it then.

    On each mesh axis the arguments are placed alike: split on the row dim that one of them
    is split on (the first such, in argument order), else whole; the output is placed so."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if kwargs or not all(isinstance(t, DTensor) for t in tensors):
        return None
    rows = _row_dims(args[1], [tuple(t.shape) for t in tensors])
    mesh = tensors[0].device_mesh
    want = []
    for axis in range(mesh.ndim):
        split = [p.dim for t in tensors for p in [t.placements[axis]] if p.is_shard() and p.dim in rows]
        want.append(Shard(split[0]) if split else Replicate())
    if all(p.is_replicate() for p in want):
        return None
    local = [a.redistribute(mesh, want).to_local() if isinstance(a, DTensor) else a for a in args]
    # self's shape and strides (a copy of self written into): given, not inferred from uneven shards
    return DTensor.from_local(op(*local), mesh, want, run_check=False, shape=args[0].shape, stride=args[0].stride())

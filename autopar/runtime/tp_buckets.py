"""The tp gradient returns of a step grouped into collectives, and the shapes they move.

A gradient the tp program left Partial or sharded on tp (its parameter is replicated
there) comes back to its parameter through one tp collective per (kind, dtype) of a
layer group: Partial addends summed (all-reduce), Shard(dim) pieces gathered whole
(all-gather). :meth:`autopar.runtime.zero.ShardedParams.finish_tp` issues them and
``runtime/emit.py`` lists them; both group them with :func:`tp_buckets`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autopar.passes.meta_keys import GradReturn

__all__ = ["TpBucket", "contiguous_stride", "tp_buckets"]


@dataclass(frozen=True)
class TpBucket:
    """One collective on the tp axis per step: the gradients it returns to their parameters."""

    kind: str
    """"all_reduce" or "all_gather"."""
    dtype: torch.dtype
    grads: tuple[GradReturn, ...]

    @property
    def nbytes(self) -> int:
        """Whole-gradient bytes, as the plan prices them (the all-gather's padding aside)."""
        return sum(r.nbytes for r in self.grads)


def tp_buckets(returns: Sequence[GradReturn], dtypes: dict[str, torch.dtype]) -> list[TpBucket]:
    """The gradient returns grouped into one bucket per (collective, dtype), in their order."""
    groups: dict[tuple[str, torch.dtype], list[GradReturn]] = {}
    for r in returns:
        groups.setdefault((r.kind, dtypes[r.fqn]), []).append(r)
    return [TpBucket(kind=kind, dtype=dtype, grads=tuple(rs)) for (kind, dtype), rs in groups.items()]


def _piece_shape(r: GradReturn, tp: int, k: int) -> tuple[int, ...]:
    """Shape of tp rank ``k``'s piece of ``r`` (torch.chunk's split, as DTensor's Shard)."""
    size = r.shape[r.dim]
    chunk = math.ceil(size / tp)
    shape = list(r.shape)
    shape[r.dim] = max(0, min(chunk, size - k * chunk))
    return tuple(shape)


def _piece_numel(r: GradReturn, tp: int, k: int) -> int:
    return math.prod(_piece_shape(r, tp, k))


def contiguous_stride(shape) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    stride, acc = [], 1
    for d in reversed(tuple(shape)):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))

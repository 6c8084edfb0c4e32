"""Parameters, gradients and optimizer state of one rank, sharded by ZeRO stage.

Every parameter first gets its tensor-parallel shard (the plan's placement on tp);
on the dp axis:

    stage   parameters held        gradients held         optimizer state held
    0       full (tp shard)        full                   full
    1       full                   full                   1/dp slice
    2       full                   1/dp slice             1/dp slice
    3       1/dp slice             1/dp slice             1/dp slice

(Rajbhandari et al. 2020, "ZeRO", sec. 5.) A slice is one of ``dp`` equal chunks of
the flattened tp shard, padded at the end to a multiple of ``dp`` so the collectives
see equal chunks (at most ``dp - 1`` extra elements per parameter). The optimizer
the user's factory builds sees, per parameter, the tensor this rank updates: the
whole tp shard at stage 0, its slice otherwise; slices are views into the full
parameter storage at stages 1-2, so no second copy exists, and after the step the
slices are all-gathered back into it. Gradients are reduced over dp once per step
(after micro-batch accumulation): all-reduce at stages 0-1, reduce-scatter at 2-3.
Before that, gradients the program left Partial or sharded on tp (their parameter is
replicated there) are summed or gathered over tp, one bucket per collective and dtype.
Stage 3 all-gathers each parameter for every micro-batch.

Weights come from rank 0's copy of the model (``distribute_tensor`` with source rank
0), so every rank starts from exactly the single-device model's values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from autopar.passes.meta_keys import GradReturn
from autopar.passes.shard import placement

__all__ = ["OptimizerShard", "ShardedParams", "StateBytes", "TpBucket", "tp_buckets"]

# torch 2.13 renamed these (the old names warn); 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int


@dataclass(frozen=True)
class OptimizerShard:
    """The tensor the optimizer steps for one parameter on this rank, and where it lies in
    the whole parameter (read by :mod:`autopar.runtime.checkpoint`; the optimizer's state
    tensors have the same layout)."""

    param: nn.Parameter
    shape: torch.Size
    """The whole parameter's shape."""
    tp_placement: str
    """The plan's placement on tp ("R", "S0", ...): ``param`` is in this tp shard."""
    local_shape: torch.Size
    """The tp shard's shape."""
    flat_range: tuple[int, int] | None
    """None when ``param`` is the whole tp shard (ZeRO-0); else ``param`` is a flat chunk whose
    first ``stop - start`` elements are elements [start, stop) of the flattened tp shard (the
    rest is padding)."""


class _Entry:
    """One parameter's storage on this rank."""

    def __init__(self, fqn: str, shape: torch.Size, tp_placement: str, local_shape: torch.Size,
                 stride: tuple[int, ...], dtype: torch.dtype, dp: int, rank: int, zero: int):
        self.fqn, self.shape, self.tp_placement = fqn, shape, tp_placement
        self.local_shape, self.stride, self.dtype = local_shape, stride, dtype
        self.numel = math.prod(local_shape)
        self.chunk = math.ceil(self.numel / dp) if self.numel else 0
        self.padded = self.chunk * dp if zero else self.numel
        self.rank, self.zero = rank, zero
        self.flat: torch.Tensor | None = None  # padded full tp shard (stages 0-2)
        self.slice: torch.Tensor | None = None  # this rank's chunk (stages 1-3)
        self.grad: torch.Tensor | None = None  # accumulated gradient: full (0-1) or chunk (2-3)
        self.opt_param: nn.Parameter | None = None

    def full_local(self) -> torch.Tensor:
        return self.flat[: self.numel].view(self.local_shape)


class ShardedParams:
    """The rank's parameters under a plan's tp placements and ZeRO stage."""

    def __init__(self, model: nn.Module, *, mesh: DeviceMesh, tp_placements: dict[str, str], zero: int,
                 trainable: list[str], dp_dim: int = 0, tp_dim: int = 1):
        self.mesh, self.zero, self.dp_dim, self.tp_dim = mesh, zero, dp_dim, tp_dim
        self.dp_group = mesh.get_group(dp_dim)
        self.dp = mesh.size(dp_dim)
        self.dp_rank = mesh.get_local_rank(dp_dim)
        named = dict(model.named_parameters())
        self.entries: dict[str, _Entry] = {}
        for fqn in trainable:
            full = named[fqn].detach()
            pls = [Replicate()] * mesh.ndim
            pls[tp_dim] = placement(tp_placements.get(fqn, "R"))
            local = distribute_tensor(full, mesh, pls, src_data_rank=0).to_local()
            e = _Entry(fqn, full.shape, tp_placements.get(fqn, "R"), local.shape, local.stride(), local.dtype,
                       self.dp, self.dp_rank, zero)
            flat = torch.zeros(e.padded, dtype=local.dtype)
            flat[: e.numel] = local.reshape(-1)
            if zero == 3:
                e.slice = flat[self.dp_rank * e.chunk:(self.dp_rank + 1) * e.chunk].clone()
            else:
                e.flat = flat
                if zero >= 1:
                    e.slice = flat[self.dp_rank * e.chunk:(self.dp_rank + 1) * e.chunk]
            e.opt_param = nn.Parameter(e.full_local() if zero == 0 else e.slice)
            self.entries[fqn] = e

    # -- compute view -------------------------------------------------------

    def _placements(self, e: _Entry):
        pls = [Replicate()] * self.mesh.ndim
        pls[self.tp_dim] = placement(e.tp_placement)
        return pls

    def local_params(self) -> dict[str, torch.Tensor]:
        """Every parameter's tp shard, whole on dp (ZeRO-3 gathers its slices first)."""
        if self.zero == 3:
            return self._gather({fqn: e.slice for fqn, e in self.entries.items()})
        return {fqn: e.full_local() for fqn, e in self.entries.items()}

    def compute_params(self) -> dict[str, DTensor]:
        """:meth:`local_params` as DTensors, replicated on dp and placed on tp."""
        return {fqn: DTensor.from_local(local, self.mesh, self._placements(self.entries[fqn]), run_check=False,
                                        shape=self.entries[fqn].shape,
                                        stride=_contiguous_stride(self.entries[fqn].shape))
                for fqn, local in self.local_params().items()}

    # -- gradients ------------------------------------------------------------

    def reduce_gradients(self, partials: dict[str, torch.Tensor], *,
                         tp_returns: Sequence[GradReturn] = ()) -> None:
        """Sum each gradient's per-rank addends over dp, into the parameter's gradient buffer.

        ``partials[fqn]`` is this rank's addend on the parameter's tp shard (see
        :func:`autopar.passes.shard.grad_addends`), accumulated over micro-batches;
        for the parameters in ``tp_returns`` it is still Partial or a Shard(dim) piece
        on tp, and is first summed or gathered over tp (:meth:`finish_tp`).
        All parameters of a dtype travel in one bucket: one collective per step, as
        DDP's and FSDP's buckets do, instead of one per parameter.
        """
        partials = self.finish_tp(partials, tp_returns)
        for group in self._by_dtype():
            if self.zero <= 1:  # all-reduce over dp: each rank gets the full tp-shard gradient
                bucket = torch.zeros(sum(e.padded for e in group), dtype=group[0].dtype)
                offset = 0
                for e in group:
                    bucket[offset: offset + e.numel] = partials[e.fqn].reshape(-1)
                    offset += e.padded
                if self.dp > 1:
                    dist.all_reduce(bucket, group=self.dp_group)
                offset = 0
                for e in group:
                    buf = bucket[offset: offset + e.padded]
                    e.grad = buf if self.zero == 1 else buf[: e.numel].view(e.local_shape)
                    offset += e.padded
            else:  # reduce-scatter over dp: each rank gets its chunk of every parameter
                send = torch.zeros(self.dp, sum(e.chunk for e in group), dtype=group[0].dtype)
                col = 0
                for e in group:
                    padded = torch.zeros(e.padded, dtype=e.dtype)
                    padded[: e.numel] = partials[e.fqn].reshape(-1)
                    send[:, col: col + e.chunk] = padded.view(self.dp, e.chunk)
                    col += e.chunk
                recv = torch.empty(send.shape[1], dtype=send.dtype)
                _reduce_scatter(recv, send.reshape(-1), group=self.dp_group)
                col = 0
                for e in group:
                    e.grad = recv[col: col + e.chunk]
                    col += e.chunk
        for e in self.entries.values():
            if self.zero == 1:
                e.opt_param.grad = e.grad[self.dp_rank * e.chunk:(self.dp_rank + 1) * e.chunk]
            else:
                e.opt_param.grad = e.grad

    def finish_tp(self, partials: dict[str, torch.Tensor], returns: Sequence[GradReturn]) -> dict[str, torch.Tensor]:
        """The tp collectives the program left to the runtime, one per bucket of :func:`tp_buckets`:
        Partial addends summed (all-reduce), Shard(dim) pieces gathered whole (all-gather)."""
        returns = [r for r in returns if r.fqn in partials]
        if not returns:
            return partials
        out = dict(partials)
        tp, group = self.mesh.size(self.tp_dim), self.mesh.get_group(self.tp_dim)
        dtypes = {r.fqn: partials[r.fqn].dtype for r in returns}
        for bucket in tp_buckets(returns, dtypes):
            if bucket.kind == "all_reduce":
                flat = torch.cat([partials[r.fqn].reshape(-1) for r in bucket.grads])
                dist.all_reduce(flat, group=group)
                offset = 0
                for r in bucket.grads:
                    n = partials[r.fqn].numel()
                    out[r.fqn] = flat[offset: offset + n].view(r.shape)
                    offset += n
                continue
            # all-gather: every rank sends its torch.chunk piece of each gradient, padded to the largest
            widths = [_piece_numel(r, tp, 0) for r in bucket.grads]  # rank 0 holds the largest piece
            send = torch.zeros(sum(widths), dtype=bucket.dtype)
            offset = 0
            for r, w in zip(bucket.grads, widths):
                piece = partials[r.fqn].reshape(-1)
                send[offset: offset + piece.numel()] = piece
                offset += w
            recv = torch.empty(tp * send.numel(), dtype=send.dtype)
            _all_gather(recv, send, group=group)
            table = recv.view(tp, send.numel())
            offset = 0
            for r, w in zip(bucket.grads, widths):
                pieces = [table[k, offset: offset + _piece_numel(r, tp, k)].view(_piece_shape(r, tp, k))
                          for k in range(tp)]
                out[r.fqn] = torch.cat(pieces, dim=r.dim)
                offset += w
        return out

    def after_step(self) -> None:
        """Stages 1-2: all-gather the updated slices back into the full parameters."""
        if self.zero in (1, 2):
            full = self._gather({fqn: e.slice for fqn, e in self.entries.items()})
            for fqn, e in self.entries.items():
                e.full_local().copy_(full[fqn])

    def _by_dtype(self, only=None) -> list[list[_Entry]]:
        groups: dict[torch.dtype, list[_Entry]] = {}
        for e in self.entries.values():
            if only is None or e.fqn in only:
                groups.setdefault(e.dtype, []).append(e)
        return list(groups.values())

    def _gather(self, slices: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """All-gather every parameter's dp chunks in one bucket; the full tp shards."""
        out = {}
        for group in self._by_dtype(slices):
            send = torch.cat([slices[e.fqn].reshape(-1) for e in group])
            recv = torch.empty(self.dp * send.numel(), dtype=send.dtype)
            _all_gather(recv, send, group=self.dp_group)
            table = recv.view(self.dp, send.numel())
            col = 0
            for e in group:
                out[e.fqn] = table[:, col: col + e.chunk].reshape(-1)[: e.numel].view(e.local_shape)
                col += e.chunk
        return out

    def optimizer_params(self) -> list[nn.Parameter]:
        return [e.opt_param for e in self.entries.values()]

    def optimizer_shard(self, fqn: str) -> OptimizerShard:
        """Where this rank's optimizer tensor of ``fqn`` lies in the whole parameter (for checkpoints).

        Writing into ``param`` in place and then calling :meth:`after_step` makes every
        rank's parameters whole again (ZeRO-1/2 gather the updated chunks)."""
        e = self.entries[fqn]
        rng = None
        if self.zero:
            start = min(self.dp_rank * e.chunk, e.numel)
            rng = (start, min(start + e.chunk, e.numel))
        return OptimizerShard(param=e.opt_param, shape=e.shape, tp_placement=e.tp_placement,
                              local_shape=e.local_shape, flat_range=rng)

    # -- inspection -------------------------------------------------------------

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> StateBytes:
        """Bytes held on this rank, measured on the live tensors (padding included)."""
        params = grads = opt = 0
        for e in self.entries.values():
            held = e.slice if self.zero == 3 else e.flat
            params += held.numel() * held.element_size()
            if e.grad is not None:
                grads += e.grad.numel() * e.grad.element_size()
            for value in optimizer.state.get(e.opt_param, {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # "step" counters aside
                    opt += value.numel() * value.element_size()
        return StateBytes(params=params, grads=grads, optimizer=opt)

    def full_tensor(self, fqn: str) -> torch.Tensor:
        """The whole parameter, gathered over dp and tp (a collective: call on every rank)."""
        e = self.entries[fqn]
        local = self._gather({fqn: e.slice})[fqn] if self.zero == 3 else e.full_local()
        return DTensor.from_local(local, self.mesh, self._placements(e), run_check=False,
                                  shape=e.shape, stride=_contiguous_stride(e.shape)).full_tensor()

    def full_grad(self, fqn: str) -> torch.Tensor:
        """The whole reduced gradient (a collective: call on every rank)."""
        e = self.entries[fqn]
        if self.zero >= 2:
            local = self._gather({fqn: e.grad})[fqn]
        else:
            local = e.grad.reshape(-1)[: e.numel].view(e.local_shape)
        return DTensor.from_local(local, self.mesh, self._placements(e), run_check=False,
                                  shape=e.shape, stride=_contiguous_stride(e.shape)).full_tensor()


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


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(tuple(shape)):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))

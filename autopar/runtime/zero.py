"""Parameters, gradients and optimizer state of one rank, sharded by ZeRO stage, and the
dp collectives of a step, as :mod:`autopar.zero_def` defines them.

Every parameter first gets its tensor-parallel shard (the plan's placement on tp);
on the dp axis (Rajbhandari et al. 2020, "ZeRO", sec. 5):

    stage   parameters held   gradients held                 optimizer   dp collectives per bucket
    0       full (tp shard)   full buffer, across micro      full        all-reduce once a step
    1       full              full buffer, across micro      1/dp        reduce-scatter once a step,
                                                                         all-gather after the optimizer
    2       full              1/dp slice                     1/dp        reduce-scatter every micro-batch,
                                                                         all-gather after the optimizer
    3       1/dp slice        1/dp slice                     1/dp        reduce-scatter every micro-batch,
                                                                         all-gather per use (forward and
                                                                         backward of every micro-batch)

A slice is one of ``dp`` equal chunks of the flattened tp shard, padded at the end to a
multiple of ``dp`` (at most ``dp - 1`` extra elements per parameter). The optimizer sees,
per parameter, the tensor this rank updates: the whole tp shard at stage 0, its slice
otherwise (at stages 1-2 a view into the full parameter, so no second copy exists).

Buckets. The parameters are grouped as the planner groups layers (one group per layer,
``passes/layers.py``, given as ``groups``); a bucket is one group's parameters of one
dtype. Each bucket is one collective: a gradient bucket is issued, asynchronously
(``async_op=True``), as soon as its group's gradients of the micro-batch are final
(:meth:`ShardedParams.add_grad`; at stages 0-1 only after the last micro-batch), so it
runs while the rest of the backward computes. At most
:data:`~autopar.zero_def.MAX_INFLIGHT_REDUCES` buckets are in flight: issuing
one more first waits for the oldest, which bounds the send buffers at stages 2-3 to a few
layer groups (no full-size gradient exists there).
:meth:`ShardedParams.finish_step` waits for the rest before the optimizer reads them.

Stage 3 gathers one group at a time (:meth:`ShardedParams.unshard`) right before its
first use and issues the gather of the group used next (prefetch depth
:data:`autopar.zero_def.PREFETCH_GROUPS`); the gathered tensors are handed to the
program, which drops them after their last use (``runtime/zero_program.py`` inserts the
calls into the rank's fx program), so at most the group in use and the prefetched one
are alive, once for forward and again for backward.

Gradients the tp program left Partial or sharded on tp (their parameter is replicated
there) are summed or gathered over tp right before their bucket's dp collective, one tp
collective per (kind, dtype) of the group (:meth:`ShardedParams.finish_tp`).

``live`` (a :class:`~autopar.runtime.memtrack.LiveBytes`) tracks every buffer this class
allocates by kind (params, grads, gathered weights, collective buffers) until its storage
is freed, so tests read the step's real peak.

The code: this module holds the storage, the compute view and inspection;
:mod:`autopar.runtime.zero_reduce` the gradient path (buckets accumulated, reduced, waited
for) and :mod:`autopar.runtime.zero_gather` the gathers (stage 3 per use, stages 1-2 after
the optimizer, whole tensors), both mixins of :class:`ShardedParams`.

Weights come from rank 0's copy of the model (``distribute_tensor`` with source rank
0), so every rank starts from exactly the single-device model's values. A parameter on
``meta`` gets only this rank's storage here, filled by :meth:`ShardedParams.load_whole` as
:mod:`autopar.runtime.materialize` initialises the model module by module.

Mixed precision (:mod:`autopar.precision`, FSDP2's ``MixedPrecisionPolicy`` semantics).
With ``param_dtype`` the storage above holds fp32 masters (``master_dtype``), which the
optimizer steps; the program reads bf16 copies: at stages 0-2 one copy of the held
parameters cast once per step (:meth:`ShardedParams.begin_step`), at stage 3 each
group's fp32 slice cast and then all-gathered in bf16 (half the bytes), as FSDP2
does. The program's bf16 gradients are accumulated in the fp32 gradient buffers and
reduced in ``reduce_dtype`` (fp32 by default; bf16 halves the bytes, then the result
is widened into the fp32 buffers, as FSDP2 upcasts its reduce-scattered shard). Tensor
parallel gradient sums run in ``reduce_dtype`` too. Every buffer is created on
``device`` (the mesh's device unless given).

Expert parallelism (``experts``): the stacked expert parameters are held as this rank's
experts (the model's parameters were cut to them before the build), and their gradients are
summed over the ``replica_group`` (the dp ranks holding the same experts) instead of all of
dp: the all-to-alls inside the experts op already brought every token of the rank's ep group
to them. So at stages 1-3 an expert parameter's chunks are spread over that group (``dp / ep``
chunks, each entry's :class:`_Shards`), in buckets of their own, and every collective of such a
bucket (reduce-scatter, all-gather) runs over it; the planner shards their state so
(:func:`autopar.planner.state_memory.state_per_param`). :meth:`ShardedParams.full_tensor` gathers
the ep parts whole.

Streams on CUDA: the overlap above needs no stream of autopar's own. NCCL runs every
``async_op=True`` collective on its internal stream, after waiting for the work the
current (compute) stream has queued on its buffers, and ``Work.wait()`` makes the current
stream wait for it in turn (without blocking the host), so a bucket's reduce-scatter runs
under the next layers' backward and the ``done`` copy after ``wait`` is ordered after it;
the process group keeps the buffers alive until then (``Work`` holds them). A side stream
here would only add the same two waits.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar import zero_def
from autopar.passes.meta_keys import GradReturn
from autopar.passes.shard import placement
from autopar.runtime.device import mesh_device
from autopar.runtime.memtrack import LiveBytes
from autopar.runtime.tp_buckets import contiguous_stride
from autopar.runtime.zero_gather import ZeroGather
from autopar.runtime.zero_reduce import ZeroReduce

__all__ = ["OptimizerShard", "ShardedParams", "StateBytes"]


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


@dataclass(frozen=True)
class _Shards:
    """The ranks a parameter's ZeRO chunks are spread over: all of dp, or, for an expert
    parameter, its replica group (the dp ranks holding the same experts)."""

    n: int
    rank: int
    group: dist.ProcessGroup
    ranks: tuple[int, ...]


class _Entry:
    """One parameter's storage on this rank."""

    def __init__(self, fqn: str, shape: torch.Size, tp_placement: str, local_shape: torch.Size,
                 stride: tuple[int, ...], dtype: torch.dtype, shards: _Shards, zero: int):
        self.fqn, self.shape, self.tp_placement = fqn, shape, tp_placement
        self.local_shape, self.stride, self.dtype = local_shape, stride, dtype
        self.numel = math.prod(local_shape)
        self.shards = shards
        self.chunk = math.ceil(self.numel / shards.n) if self.numel else 0
        self.padded = self.chunk * shards.n if zero else self.numel
        self.rank, self.zero = shards.rank, zero
        self.flat: torch.Tensor | None = None  # padded full tp shard (stages 0-2)
        self.slice: torch.Tensor | None = None  # this rank's chunk (stages 1-3)
        self.grad: torch.Tensor | None = None  # reduced gradient: full tp shard (0) or this rank's chunk (1-3)
        self.opt_param: nn.Parameter | None = None

    def full_local(self) -> torch.Tensor:
        return self.flat[: self.numel].view(self.local_shape)


class _Bucket:
    """The parameters of one layer group and dtype: one dp collective each time it runs.

    ``col[i]`` is entry i's first column in the (dp, width) layout of reduce-scatter and
    all-gather buffers (stages 1-3; each entry ``chunk`` columns wide), or its offset in the
    flat all-reduce buffer (stage 0; ``numel`` wide).
    """

    def __init__(self, group: int, entries: list[_Entry], zero: int, expert: bool = False):
        self.group, self.entries, self.dtype = group, entries, entries[0].dtype
        self.expert = expert  # expert parameters: reduced (and ZeRO-sharded) over their replica group
        self.shards = entries[0].shards
        widths = [e.numel if zero == 0 else e.chunk for e in entries]
        self.col = [sum(widths[:i]) for i in range(len(entries))]
        self.width = sum(widths)
        self.full: torch.Tensor | None = None  # stages 0-1: the gradient accumulated over micro-batches
        self.grad: torch.Tensor | None = None  # stages 1-3: this rank's reduced slice, (width,)


class ShardedParams(ZeroGather, ZeroReduce):
    """The rank's parameters under a plan's tp placements and ZeRO stage (see the module docstring).

    ``groups`` lists the layer groups' parameter names in forward order (default: one
    group); ``addends`` how many gradient addends of a parameter one micro-batch yields
    on this rank (default 1; 2 for a tied parameter both of whose stages run here).
    ``experts``, ``ep_group`` and ``replica_group``: expert parallelism (module docstring).
    """

    def __init__(self, model: nn.Module, *, mesh: DeviceMesh, tp_placements: dict[str, str], zero: int,
                 trainable: list[str], groups: Sequence[Sequence[str]] | None = None,
                 addends: dict[str, int] | None = None, dp_dim: int = 0, tp_dim: int = 1,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 master_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 experts: Sequence[str] = (), ep_group: dist.ProcessGroup | None = None,
                 replica_group: dist.ProcessGroup | None = None):
        self.mesh, self.zero, self.dp_dim, self.tp_dim = mesh, zero, dp_dim, tp_dim
        self.experts, self.ep_group, self.replica_group = frozenset(experts), ep_group, replica_group
        self.param_dtype, self.reduce_dtype, self.master_dtype = param_dtype, reduce_dtype, master_dtype
        self.device = torch.device(device) if device is not None else mesh_device(mesh)
        self.stage = zero_def.stage(zero)
        self.dp_group = mesh.get_group(dp_dim)
        self.dp = mesh.size(dp_dim)
        self.dp_rank = mesh.get_local_rank(dp_dim)
        self.live = LiveBytes(sums={"state": ("params", "grads", "gathered")})
        self.overlap = True
        """False: every collective is waited for at once (a debugging aid; same numbers, no overlap)."""
        self.guard = lambda action, peers=None: contextlib.nullcontext()
        """``guard(action, peers)``: a context that turns a failed wait into an error naming them."""
        self._dp_ranks = dist.get_process_group_ranks(self.dp_group)
        dp_shards = _Shards(self.dp, self.dp_rank, self.dp_group, tuple(self._dp_ranks))
        expert_shards = dp_shards if replica_group is None else _Shards(
            dist.get_world_size(replica_group), dist.get_rank(replica_group), replica_group,
            tuple(dist.get_process_group_ranks(replica_group)))
        named = dict(model.named_parameters())
        self.entries: dict[str, _Entry] = {}
        for fqn in trainable:
            full = named[fqn].detach()
            shards = expert_shards if fqn in self.experts else dp_shards
            pls = [Replicate()] * mesh.ndim
            pls[tp_dim] = placement(tp_placements.get(fqn, "R"))
            if full.device.type == "meta":
                # started from meta: allocate only this rank's piece; load_whole fills it
                shape, _ = compute_local_shape_and_global_offset(full.shape, mesh, pls)
                dtype = master_dtype if master_dtype is not None and full.is_floating_point() else full.dtype
                e = _Entry(fqn, full.shape, tp_placements.get(fqn, "R"), torch.Size(shape),
                           contiguous_stride(shape), dtype, shards, zero)
                if zero == 3:
                    e.slice = self.live.track(torch.zeros(e.chunk, dtype=e.dtype, device=self.device), "params")
                else:
                    e.flat = self.live.track(torch.zeros(e.padded, dtype=e.dtype, device=self.device), "params")
                    if zero >= 1:
                        e.slice = e.flat[e.rank * e.chunk:(e.rank + 1) * e.chunk]
                e.opt_param = nn.Parameter(e.full_local() if zero == 0 else e.slice)
                self.entries[fqn] = e
                continue
            # from rank 0's copy, except a rank's own experts (each rank holds other experts: the
            # caller cut them from rank 0's whole values, autopar.runtime.expert.cut_experts)
            local = distribute_tensor(full.to(self.device), mesh, pls,
                                      src_data_rank=None if fqn in self.experts else 0).to_local()
            dtype = master_dtype if master_dtype is not None and local.is_floating_point() else local.dtype
            e = _Entry(fqn, full.shape, tp_placements.get(fqn, "R"), local.shape, local.stride(), dtype,
                       shards, zero)
            flat = torch.zeros(e.padded, dtype=dtype, device=self.device)
            flat[: e.numel] = local.reshape(-1)
            if zero == 3:
                e.slice = self.live.track(flat[e.rank * e.chunk:(e.rank + 1) * e.chunk].clone(),
                                          "params")
            else:
                e.flat = self.live.track(flat, "params")
                if zero >= 1:
                    e.slice = flat[e.rank * e.chunk:(e.rank + 1) * e.chunk]
            e.opt_param = nn.Parameter(e.full_local() if zero == 0 else e.slice)
            self.entries[fqn] = e
        self.groups = _complete_groups(groups, trainable)
        self.group_of = {f: g for g, fqns in enumerate(self.groups) for f in fqns}
        self.buckets: list[list[_Bucket]] = []  # per group, one bucket per dtype
        for g, fqns in enumerate(self.groups):
            by_kind: dict[tuple[torch.dtype, bool], list[_Entry]] = {}
            for f in fqns:
                by_kind.setdefault((self.entries[f].dtype, f in self.experts), []).append(self.entries[f])
            self.buckets.append([_Bucket(g, es, zero, expert) for (_, expert), es in by_kind.items()])
        self.addends = {f: (addends or {}).get(f, 1) for f in trainable}
        self.tp_returns: dict[str, GradReturn] = {}
        self._n_micro = 1
        self._inflight: list[tuple[dist.Work, callable]] = []
        self._gathers: dict[str, list] = {}  # stage 3: prefetched gathers by the program's key
        self._microbatch = 0
        self._compute: dict[str, torch.Tensor] = {}  # mixed precision, stages 0-2: the bf16 copies
        self._cast_params()

    def _cast(self, e: _Entry) -> torch.dtype:
        """The dtype the program reads ``e`` in (the policy's param_dtype for floating parameters)."""
        return self.param_dtype if self.param_dtype is not None and e.dtype.is_floating_point else e.dtype

    def _cast_params(self) -> None:
        """Mixed precision, stages 0-2: cast the held masters to the compute dtype, once per step."""
        if self.zero == 3 or self.param_dtype is None:
            return
        for fqn, e in self.entries.items():
            if self._cast(e) == e.dtype:
                continue
            if fqn in self._compute:
                self._compute[fqn].copy_(e.full_local())
            else:
                self._compute[fqn] = self.live.track(e.full_local().to(self._cast(e)), "params")

    def _reduce(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``dtype`` is summed in across ranks."""
        return self.reduce_dtype if self.reduce_dtype is not None and dtype.is_floating_point else dtype

    def load_whole(self, fqn: str, whole: torch.Tensor) -> None:
        """Copy this rank's piece (its tp shard's ZeRO slice, or the whole tp shard) of ``whole``, the
        full value of parameter ``fqn``, into its storage: a model started from meta is initialised
        module by module (:mod:`autopar.runtime.materialize`) and each rank keeps only its piece."""
        e = self.entries[fqn]
        if tuple(whole.shape) != tuple(e.shape):
            raise ValueError(f"parameter {fqn!r} is {tuple(e.shape)} but its initial value is {tuple(whole.shape)}")
        local = distribute_tensor(whole.to(self.device), self.mesh, self._placements(e),
                                  src_data_rank=None).to_local().reshape(-1)
        if e.flat is not None:
            e.flat[: e.numel].copy_(local)
        else:
            part = local[e.rank * e.chunk:(e.rank + 1) * e.chunk]
            e.slice[: part.numel()].copy_(part)

    def set_tp_returns(self, returns: Iterable[GradReturn]) -> None:
        """The gradients the tp program left Partial or sharded (see :meth:`finish_tp`)."""
        self.tp_returns = {r.fqn: r for r in returns if r.fqn in self.entries}

    # -- compute view -------------------------------------------------------

    def _placements(self, e: _Entry):
        pls = [Replicate()] * self.mesh.ndim
        pls[self.tp_dim] = placement(e.tp_placement)
        return pls

    def local_params(self) -> dict[str, torch.Tensor]:
        """Every parameter's tp shard, whole on dp (at stage 3 a gather of every group: for tracing
        and the interpreted path; the compiled step gathers group by group, :meth:`unshard`)."""
        if self.zero == 3:
            out = {}
            for g in range(len(self.groups)):
                out.update(self._finish_gather(self._start_gather(g)))
            return out
        return {fqn: self._compute.get(fqn, e.full_local()) for fqn, e in self.entries.items()}

    def compute_params(self) -> dict[str, DTensor]:
        """:meth:`local_params` as DTensors, replicated on dp and placed on tp."""
        return {fqn: DTensor.from_local(local, self.mesh, self._placements(self.entries[fqn]), run_check=False,
                                        shape=self.entries[fqn].shape,
                                        stride=contiguous_stride(self.entries[fqn].shape))
                for fqn, local in self.local_params().items()}

    def optimizer_params(self) -> list[nn.Parameter]:
        return [e.opt_param for e in self.entries.values()]

    def optimizer_shard(self, fqn: str) -> OptimizerShard:
        """Where this rank's optimizer tensor of ``fqn`` lies in the whole parameter (for checkpoints).

        Writing into ``param`` in place and then calling :meth:`after_step` makes every
        rank's parameters whole again (ZeRO-1/2 gather the updated chunks)."""
        e = self.entries[fqn]
        rng = None
        if self.zero:
            start = min(e.rank * e.chunk, e.numel)
            rng = (start, min(start + e.chunk, e.numel))
        return OptimizerShard(param=e.opt_param, shape=e.shape, tp_placement=e.tp_placement,
                              local_shape=e.local_shape, flat_range=rng)

    # -- inspection -------------------------------------------------------------

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> StateBytes:
        """Bytes held on this rank, measured on the live tensors (padding included).

        Under mixed precision, as the cost model splits them (``cost/memory.py``): ``params``
        are the bf16 compute copies (none held between uses at stage 3), ``optimizer`` the
        fp32 masters with the optimizer's state."""
        params = grads = opt = 0
        for fqn, e in self.entries.items():
            held = e.slice if self.zero == 3 else e.flat
            if self.param_dtype is not None and self._cast(e) != e.dtype:
                opt += held.numel() * held.element_size()
                held = self._compute.get(fqn, held[:0])
            params += held.numel() * held.element_size()
            for value in optimizer.state.get(e.opt_param, {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # "step" counters aside
                    opt += value.numel() * value.element_size()
        for bs in self.buckets:
            for b in bs:
                held = b.full if self.stage.full_grad_buffer else b.grad
                if held is not None:
                    grads += held.numel() * held.element_size()
        return StateBytes(params=params, grads=grads, optimizer=opt)

def _complete_groups(groups, trainable: list[str]) -> list[tuple[str, ...]]:
    """``groups`` restricted to ``trainable``, in order; parameters in no group form a last one."""
    if groups is None:
        return [tuple(trainable)] if trainable else []
    held, out = set(trainable), []
    placed: set[str] = set()
    for fqns in groups:
        mine = tuple(f for f in fqns if f in held and f not in placed)
        placed.update(mine)
        if mine:
            out.append(mine)
    rest = tuple(f for f in trainable if f not in placed)
    return out + ([rest] if rest else [])

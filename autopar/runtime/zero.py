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
runs while the rest of the backward computes. At most :data:`MAX_INFLIGHT_REDUCES`
buckets are in flight: issuing one more first waits for the oldest, which bounds the
send buffers at stages 2-3 to a few layer groups (no full-size gradient exists there).
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

Expert parallelism (``experts``, ZeRO-0 only): the stacked expert parameters are held as
this rank's experts (the model's parameters were cut to them before the build), and their
gradients are summed over the ``replica_group`` (the dp ranks holding the same experts)
instead of all of dp: the all-to-alls inside the experts op already brought every token of
the rank's ep group to them. :meth:`ShardedParams.full_tensor` gathers the ep parts whole.

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
from autopar.runtime.tp_buckets import _piece_numel, _piece_shape, contiguous_stride, tp_buckets

__all__ = ["MAX_INFLIGHT_REDUCES", "OptimizerShard", "ShardedParams", "StateBytes"]

# torch 2.13 renamed these (the old names warn); 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

MAX_INFLIGHT_REDUCES = 2
"""Gradient buckets in flight at once; one more waits for the oldest first."""


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
        self.expert = expert  # expert parameters: reduced over their replica group
        widths = [e.numel if zero == 0 else e.chunk for e in entries]
        self.col = [sum(widths[:i]) for i in range(len(entries))]
        self.width = sum(widths)
        self.full: torch.Tensor | None = None  # stages 0-1: the gradient accumulated over micro-batches
        self.grad: torch.Tensor | None = None  # stages 1-3: this rank's reduced slice, (width,)

    def nbytes(self, dp: int, zero: int) -> int:
        """Bytes of the whole bucket (all dp chunks) as its collectives move it."""
        return self.width * (1 if zero == 0 else dp) * self.entries[0].opt_param.element_size()


class ShardedParams:
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
        if experts and zero:
            raise ValueError(f"expert parallelism runs with ZeRO-0 only (zero={zero} was asked for)")
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
        named = dict(model.named_parameters())
        self.entries: dict[str, _Entry] = {}
        for fqn in trainable:
            full = named[fqn].detach()
            pls = [Replicate()] * mesh.ndim
            pls[tp_dim] = placement(tp_placements.get(fqn, "R"))
            if full.device.type == "meta":
                # started from meta: allocate only this rank's piece; load_whole fills it
                shape, _ = compute_local_shape_and_global_offset(full.shape, mesh, pls)
                dtype = master_dtype if master_dtype is not None and full.is_floating_point() else full.dtype
                e = _Entry(fqn, full.shape, tp_placements.get(fqn, "R"), torch.Size(shape),
                           contiguous_stride(shape), dtype, self.dp, self.dp_rank, zero)
                if zero == 3:
                    e.slice = self.live.track(torch.zeros(e.chunk, dtype=e.dtype, device=self.device), "params")
                else:
                    e.flat = self.live.track(torch.zeros(e.padded, dtype=e.dtype, device=self.device), "params")
                    if zero >= 1:
                        e.slice = e.flat[self.dp_rank * e.chunk:(self.dp_rank + 1) * e.chunk]
                e.opt_param = nn.Parameter(e.full_local() if zero == 0 else e.slice)
                self.entries[fqn] = e
                continue
            # from rank 0's copy, except a rank's own experts (each rank holds other experts: the
            # caller cut them from rank 0's whole values, autopar.runtime.expert.cut_experts)
            local = distribute_tensor(full.to(self.device), mesh, pls,
                                      src_data_rank=None if fqn in self.experts else 0).to_local()
            dtype = master_dtype if master_dtype is not None and local.is_floating_point() else local.dtype
            e = _Entry(fqn, full.shape, tp_placements.get(fqn, "R"), local.shape, local.stride(), dtype,
                       self.dp, self.dp_rank, zero)
            flat = torch.zeros(e.padded, dtype=dtype, device=self.device)
            flat[: e.numel] = local.reshape(-1)
            if zero == 3:
                e.slice = self.live.track(flat[self.dp_rank * e.chunk:(self.dp_rank + 1) * e.chunk].clone(),
                                          "params")
            else:
                e.flat = self.live.track(flat, "params")
                if zero >= 1:
                    e.slice = flat[self.dp_rank * e.chunk:(self.dp_rank + 1) * e.chunk]
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
            part = local[self.dp_rank * e.chunk:(self.dp_rank + 1) * e.chunk]
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

    # -- stage 3: gather a group before its use -------------------------------

    def unshard(self, group: int, key: str = "", next_key: str | None = None,
                next_group: int | None = None) -> tuple[torch.Tensor, ...]:
        """Stage 3: group ``group``'s parameters whole on dp (tp shards), in ``groups`` order.

        Waits for the gather issued ahead under ``key`` (or issues it now), then issues the
        gather of ``next_group`` under ``next_key`` (the group the program reads next), so it
        runs during this group's compute (prefetch of one group).
        """
        pending = self._gathers.pop(key, None) or self._start_gather(group)
        out = self._finish_gather(pending)
        if next_group is not None and next_key not in self._gathers:
            self._gathers[next_key] = self._start_gather(next_group)
        return tuple(out[f] for f in self.groups[group])

    def _start_gather(self, group: int, source: str = "slice", compute: bool = True, kind: str = "gathered") -> list:
        """Issue the all-gather of each bucket of ``group`` (of ``slice`` or the reduced ``grad``);
        ``compute``: of the parameters as the program reads them (cast to param_dtype first).
        ``kind``: what the gathered tensors are counted as in :attr:`live` (the receive buffer
        itself where :meth:`_finish_gather` hands out views of it, else "buffers")."""
        started = []
        for b in self.buckets[group]:
            dtype = self._cast(b.entries[0]) if compute else b.dtype
            send = torch.cat([getattr(e, source).reshape(-1) for e in b.entries]).to(dtype) if b.entries else None
            viewed = len(b.entries) == 1 or self.dp == 1  # _finish_gather's views of the buffer, not copies
            recv = self.live.track(torch.empty(self.dp * b.width, dtype=dtype, device=self.device),
                                   kind if viewed else "buffers")
            work = _all_gather(recv, send, group=self.dp_group, async_op=True)
            if not self.overlap:
                self._wait_gather(work)
            started.append((work, recv, b))
        return started

    def _wait_gather(self, work) -> None:
        with self.guard(f"parameter all-gather over dp group {self._dp_ranks}", self._dp_ranks):
            work.wait()

    def _finish_gather(self, started: list, kind: str = "gathered") -> dict[str, torch.Tensor]:
        out = {}
        for work, recv, b in started:
            self._wait_gather(work)
            table = recv.view(self.dp, b.width)
            for e, col in zip(b.entries, b.col):
                # a bucket of several parameters: reshape copies the parameter's columns out of the
                # (dp, width) table (the table dies with the last copy); of one parameter (or dp = 1)
                # it is a view of the receive buffer, kept as it is (at most dp - 1 padding elements
                # per parameter): a copy would hold the parameter twice until the buffer is freed
                whole = table[:, col: col + e.chunk].reshape(-1)[: e.numel].view(e.local_shape)
                out[e.fqn] = self.live.track(whole, kind)
        return out

    # -- gradients ------------------------------------------------------------

    def begin_step(self, n_micro: int) -> None:
        """Start a step of ``n_micro`` micro-batches: zero the gradient buffers."""
        self._n_micro = n_micro
        self._seen: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._counts: dict[tuple[int, int], int] = {}
        self._done = [0] * len(self.groups)  # micro-batches whose gradients a group has received
        self.live.reset_peak()
        for bs in self.buckets:
            for b in bs:
                if self.stage.full_grad_buffer:
                    if b.full is None:
                        rows = 1 if self.zero == 0 else self.dp
                        b.full = self.live.track(torch.zeros(rows * b.width, dtype=b.dtype, device=self.device),
                                                 "grads")
                    else:
                        b.full.zero_()
                if self.zero == 1:  # the reduced slice lands in this rank's row of the full buffer
                    b.grad = b.full.view(self.dp, b.width)[self.dp_rank]
                elif self.zero >= 2:
                    if b.grad is None:
                        b.grad = self.live.track(torch.zeros(b.width, dtype=b.dtype, device=self.device), "grads")
                    else:
                        b.grad.zero_()
                for e, col in zip(b.entries, b.col):
                    e.grad = (b.full[col: col + e.numel].view(e.local_shape) if self.zero == 0
                              else b.grad[col: col + e.chunk])
                    e.opt_param.grad = e.grad
        self._cast_params()  # the masters the last optimizer step (or a checkpoint) wrote

    def add_grad(self, fqn: str, grad: torch.Tensor, microbatch: int) -> None:
        """This rank's addend of ``fqn``'s gradient for ``microbatch``; once its layer group has
        all of them, the group's buckets are reduced (asynchronously)."""
        g = self.group_of[fqn]
        seen = self._seen.setdefault((g, microbatch), {})
        seen[fqn] = grad if fqn not in seen else seen[fqn] + grad
        self._counts[(g, microbatch)] = self._counts.get((g, microbatch), 0) + 1
        if self._counts[(g, microbatch)] == sum(self.addends[f] for f in self.groups[g]):
            self._group_ready(g, self._seen.pop((g, microbatch)))

    def begin_microbatch(self, microbatch: int) -> None:
        """The micro-batch the program about to run computes (for :meth:`grads_ready`)."""
        self._microbatch = microbatch

    def grads_ready(self, group: int, fqns: tuple[str, ...], *grads: torch.Tensor) -> None:
        """REDUCE_GRAD, called from inside the program: :meth:`add_grad` of each, this micro-batch."""
        for fqn, grad in zip(fqns, grads):
            self.add_grad(fqn, grad, self._microbatch)

    def _group_ready(self, g: int, grads: dict[str, torch.Tensor]) -> None:
        self._done[g] += 1
        grads = self.finish_tp(grads, [self.tp_returns[f] for f in grads if f in self.tp_returns])
        if self.stage.grad_reduce_every_microbatch:
            self._issue_reduce(g, grads)
            return
        for b in self.buckets[g]:  # stages 0-1: accumulate into the full buffer, reduce after the last
            rows = b.full.view(1 if self.zero == 0 else self.dp, b.width)
            for e, col in zip(b.entries, b.col):
                _add_padded(rows, col, e, grads[e.fqn], self.zero)
        if self._done[g] == self._n_micro:
            self._issue_reduce(g, None)

    def _issue_reduce(self, g: int, grads: dict[str, torch.Tensor] | None) -> None:
        """Issue the dp collective of each bucket of group ``g``: from ``grads`` (one
        micro-batch, stages 2-3) or from the accumulated full buffer (stages 0-1)."""
        for b in self.buckets[g]:
            if len(self._inflight) >= MAX_INFLIGHT_REDUCES:
                self._wait_oldest()
            wire = self._reduce(b.dtype)  # a bf16 reduction sends a bf16 copy, widened when it lands
            if self.zero == 0:
                done = None
                group = self.replica_group if b.expert else self.dp_group
                if dist.get_world_size(group) == 1:
                    work = None
                elif wire == b.dtype:
                    work = dist.all_reduce(b.full, group=group, async_op=True)
                else:
                    send = self.live.track(b.full.to(wire), "buffers")
                    work = dist.all_reduce(send, group=group, async_op=True)
                    done = (lambda b=b, send=send: b.full.copy_(send))
            else:
                if grads is None:
                    send = b.full if wire == b.dtype else self.live.track(b.full.to(wire), "buffers")
                elif len(b.entries) == 1 and b.entries[0].numel == self.dp * b.width:
                    # one parameter, no padding: its gradient already is the (dp, width) layout, so it
                    # is sent as it is (cast to the wire dtype if need be), not copied into a new buffer
                    send = self.live.track(grads[b.entries[0].fqn].reshape(-1).to(wire), "buffers")
                else:
                    send = self.live.track(torch.zeros(self.dp * b.width, dtype=wire, device=self.device),
                                           "buffers")
                    rows = send.view(self.dp, b.width)
                    for e, col in zip(b.entries, b.col):
                        _add_padded(rows, col, e, grads[e.fqn], self.zero)
                recv = self.live.track(torch.empty(b.width, dtype=wire, device=self.device), "buffers")
                work = _reduce_scatter(recv, send, group=self.dp_group, async_op=True)
                if grads is None:  # stage 1: into this rank's row of the full buffer, once the send is done
                    done = (lambda b=b, recv=recv: b.grad.copy_(recv))
                else:  # stages 2-3: accumulated into the held slice
                    done = (lambda b=b, recv=recv, send=send: b.grad.add_(recv))
            if work is not None:
                self._inflight.append((work, done))
                if not self.overlap:
                    self._wait_oldest()
            elif done is not None:
                done()

    def _wait_oldest(self) -> None:
        work, done = self._inflight.pop(0)
        with self.guard(f"gradient reduction over dp group {self._dp_ranks}", None):  # any rank may be the dead one
            work.wait()
        if done is not None:
            done()

    def finish_step(self) -> None:
        """Wait for every gradient bucket in flight; the optimizer may then read the gradients."""
        while self._inflight:
            self._wait_oldest()
        missing = [self.groups[g][0] for g, n in enumerate(self._done) if n != self._n_micro]
        if missing or self._seen:
            raise AssertionError(f"gradients of {missing or sorted(self._seen)} were not all produced this step "
                                 f"({self._done} of {self._n_micro} micro-batches per group)")

    def reduce_gradients(self, partials: dict[str, torch.Tensor], *,
                         tp_returns: Sequence[GradReturn] = ()) -> None:
        """One micro-batch's addends of every parameter (``n_micro=1``): the whole step's
        reduction at once (the interpreted path and tests; the compiled step reduces
        group by group while the backward runs)."""
        self.set_tp_returns(tp_returns)
        self.begin_step(1)
        for fqn, g in partials.items():
            for _ in range(self.addends[fqn]):
                self.add_grad(fqn, g / self.addends[fqn], 0)
        self.finish_step()

    def finish_tp(self, partials: dict[str, torch.Tensor], returns: Sequence[GradReturn]) -> dict[str, torch.Tensor]:
        """The tp collectives the program left to the runtime, one per bucket of :func:`tp_buckets`:
        Partial addends summed (all-reduce), Shard(dim) pieces gathered whole (all-gather)."""
        returns = [r for r in returns if r.fqn in partials]
        if not returns:
            return partials
        out = dict(partials)
        tp, group = self.mesh.size(self.tp_dim), self.mesh.get_group(self.tp_dim)
        dtypes = {r.fqn: self._reduce(partials[r.fqn].dtype) for r in returns}  # summed in the reduce dtype
        for bucket in tp_buckets(returns, dtypes):
            if bucket.kind == "all_reduce":
                flat = torch.cat([partials[r.fqn].reshape(-1).to(bucket.dtype) for r in bucket.grads])
                dist.all_reduce(flat, group=group)
                offset = 0
                for r in bucket.grads:
                    n = partials[r.fqn].numel()
                    out[r.fqn] = flat[offset: offset + n].view(r.shape)
                    offset += n
                continue
            # all-gather: every rank sends its torch.chunk piece of each gradient, padded to the largest
            widths = [_piece_numel(r, tp, 0) for r in bucket.grads]  # rank 0 holds the largest piece
            send = torch.zeros(sum(widths), dtype=bucket.dtype, device=self.device)
            offset = 0
            for r, w in zip(bucket.grads, widths):
                piece = partials[r.fqn].reshape(-1)
                send[offset: offset + piece.numel()] = piece
                offset += w
            recv = torch.empty(tp * send.numel(), dtype=send.dtype, device=self.device)
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
        """Stages 1-2: all-gather the updated slices back into the full parameters, one bucket per group."""
        if self.stage.param_gather != "after_step":
            return
        pending = self._start_gather(0, compute=False, kind="buffers") if self.groups else []
        for g in range(len(self.groups)):  # one group gathered ahead, as stage 3's prefetch
            ahead = self._start_gather(g + 1, compute=False, kind="buffers") if g + 1 < len(self.groups) else []
            for fqn, whole in self._finish_gather(pending, "buffers").items():  # copied in at once
                self.entries[fqn].full_local().copy_(whole)
            pending = ahead

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

    def full_tensor(self, fqn: str) -> torch.Tensor:
        """The whole parameter, gathered over dp and tp (a collective: call on every rank)."""
        e = self.entries[fqn]
        local = self._gather_one(e.slice, e) if self.zero == 3 else e.full_local()
        return self._whole(fqn, DTensor.from_local(local, self.mesh, self._placements(e), run_check=False,
                                                   shape=e.shape, stride=contiguous_stride(e.shape)).full_tensor())

    def full_grad(self, fqn: str) -> torch.Tensor:
        """The whole reduced gradient (a collective: call on every rank)."""
        e = self.entries[fqn]
        local = e.grad if self.zero == 0 else self._gather_one(e.grad, e)
        return self._whole(fqn, DTensor.from_local(local, self.mesh, self._placements(e), run_check=False,
                                                   shape=e.shape, stride=contiguous_stride(e.shape)).full_tensor())

    def _whole(self, fqn: str, part: torch.Tensor) -> torch.Tensor:
        """An expert parameter's (or gradient's) ep parts, gathered along dim 0 (in ep-group rank
        order, which is the experts' order); any other tensor as it is."""
        if fqn not in self.experts or self.ep_group is None or dist.get_world_size(self.ep_group) == 1:
            return part
        recv = torch.empty((dist.get_world_size(self.ep_group) * part.numel(),), dtype=part.dtype, device=part.device)
        _all_gather(recv, part.reshape(-1).contiguous(), group=self.ep_group)
        return recv.view(-1, *part.shape[1:])

    def _gather_one(self, piece: torch.Tensor, e: _Entry) -> torch.Tensor:
        """This parameter's dp chunks (``piece`` on this rank) gathered into its whole tp shard."""
        recv = torch.empty(self.dp * e.chunk, dtype=piece.dtype, device=self.device)
        _all_gather(recv, piece.reshape(-1).contiguous(), group=self.dp_group)
        return recv[: e.numel].view(e.local_shape)


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


def _add_padded(rows: torch.Tensor, col: int, e: _Entry, grad: torch.Tensor, zero: int) -> None:
    """Add ``grad`` (e's local shape) into its place in a (rows, width) bucket layout."""
    if zero == 0:
        rows[0, col: col + e.numel].add_(grad.reshape(-1))
        return
    flat = grad.reshape(-1)
    full_rows, rest = divmod(e.numel, e.chunk) if e.chunk else (0, 0)
    if full_rows:
        rows[:full_rows, col: col + e.chunk].add_(flat[: full_rows * e.chunk].view(full_rows, e.chunk))
    if rest:
        rows[full_rows, col: col + rest].add_(flat[full_rows * e.chunk:])

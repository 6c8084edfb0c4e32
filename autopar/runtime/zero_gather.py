"""The gather path of :class:`autopar.runtime.zero.ShardedParams`: parameters whole on dp.

Kept apart from :mod:`autopar.runtime.zero` (the storage, the compute view, inspection) as
a mixin, as :mod:`autopar.runtime.zero_reduce` keeps the gradient path; it works on the
class's storage (``entries``, ``buckets``, ``groups``, ``dp_group``, ``live``, ...; see the
:mod:`~autopar.runtime.zero` module docstring for the layouts). Three gathers live here:

- stage 3, one layer group right before its use, the next one prefetched
  (:meth:`ZeroGather.unshard`);
- stages 1-2, the updated slices back into the full parameters after the optimizer
  (:meth:`ZeroGather.after_step`);
- any stage, a whole parameter or gradient over dp, tp and ep, for state dicts and
  checkpoints (:meth:`ZeroGather.full_tensor`, :meth:`ZeroGather.full_grad`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.runtime.tp_buckets import contiguous_stride

if TYPE_CHECKING:
    from autopar.runtime.zero import _Entry

__all__ = ["ZeroGather"]

# torch 2.13 renamed it (the old name warns); 2.11 has only the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ZeroGather:
    """``ShardedParams``' all-gathers over dp (and, for whole tensors, tp and ep)."""

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
            viewed = len(b.entries) == 1 or b.shards.n == 1  # _finish_gather's views of the buffer, not copies
            recv = self.live.track(torch.empty(b.shards.n * b.width, dtype=dtype, device=self.device),
                                   kind if viewed else "buffers")
            work = _all_gather(recv, send, group=b.shards.group, async_op=True)
            if not self.overlap:
                self._wait_gather(work, b.shards.ranks)
            started.append((work, recv, b))
        return started

    def _wait_gather(self, work, ranks: tuple[int, ...]) -> None:
        with self.guard(f"parameter all-gather over group {list(ranks)}", list(ranks)):
            work.wait()

    def _finish_gather(self, started: list, kind: str = "gathered") -> dict[str, torch.Tensor]:
        out = {}
        for work, recv, b in started:
            self._wait_gather(work, b.shards.ranks)
            table = recv.view(b.shards.n, b.width)
            for e, col in zip(b.entries, b.col):
                # a bucket of several parameters: reshape copies the parameter's columns out of the
                # (dp, width) table (the table dies with the last copy); of one parameter (or dp = 1)
                # it is a view of the receive buffer, kept as it is (at most dp - 1 padding elements
                # per parameter): a copy would hold the parameter twice until the buffer is freed
                whole = table[:, col: col + e.chunk].reshape(-1)[: e.numel].view(e.local_shape)
                out[e.fqn] = self.live.track(whole, kind)
        return out

    # -- stages 1-2: gather back after the optimizer ----------------------------

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

    # -- whole tensors ------------------------------------------------------------

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
        """This parameter's ZeRO chunks (``piece`` on this rank) gathered into its whole tp shard."""
        recv = torch.empty(e.shards.n * e.chunk, dtype=piece.dtype, device=self.device)
        _all_gather(recv, piece.reshape(-1).contiguous(), group=e.shards.group)
        return recv[: e.numel].view(e.local_shape)

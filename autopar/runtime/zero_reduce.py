"""The gradient path of :class:`autopar.runtime.zero.ShardedParams`: buckets reduced over dp.

Kept apart from :mod:`autopar.runtime.zero` (the storage, the compute view, inspection) as
a mixin, as :mod:`autopar.runtime.zero_gather` keeps the gather path; it works on the
class's storage (``entries``, ``buckets``, ``groups``, ``stage``, ``live``, ...; see the
:mod:`~autopar.runtime.zero` module docstring for the buckets, their collectives per ZeRO
stage and the overlap). A step is :meth:`ZeroReduce.begin_step`, the gradient addends of
every micro-batch (:meth:`ZeroReduce.add_grad`, or :meth:`ZeroReduce.grads_ready` from
inside the program), then :meth:`ZeroReduce.finish_step`; the tp collectives the program
left to the runtime run first, per group (:meth:`ZeroReduce.finish_tp`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from autopar.passes.meta_keys import GradReturn
from autopar.runtime.tp_buckets import _piece_numel, _piece_shape, tp_buckets
from autopar.runtime.zero_gather import _all_gather
from autopar.zero_def import MAX_INFLIGHT_REDUCES

if TYPE_CHECKING:
    from autopar.runtime.zero import _Entry

__all__ = ["MAX_INFLIGHT_REDUCES", "ZeroReduce"]

# torch 2.13 renamed it (the old name warns); 2.11 has only the old one.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

class ZeroReduce:
    """``ShardedParams``' gradient buckets: accumulated, reduced over dp, waited for."""

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
                        rows = 1 if self.zero == 0 else b.shards.n
                        b.full = self.live.track(torch.zeros(rows * b.width, dtype=b.dtype, device=self.device),
                                                 "grads")
                    else:
                        b.full.zero_()
                if self.zero == 1:  # the reduced slice lands in this rank's row of the full buffer
                    b.grad = b.full.view(b.shards.n, b.width)[b.shards.rank]
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
            rows = b.full.view(1 if self.zero == 0 else b.shards.n, b.width)
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
                group = b.shards.group
                if b.shards.n == 1:
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
                elif len(b.entries) == 1 and b.entries[0].numel == b.shards.n * b.width:
                    # one parameter, no padding: its gradient already is the (n, width) layout, so it
                    # is sent as it is (cast to the wire dtype if need be), not copied into a new buffer
                    send = self.live.track(grads[b.entries[0].fqn].reshape(-1).to(wire), "buffers")
                else:
                    send = self.live.track(torch.zeros(b.shards.n * b.width, dtype=wire, device=self.device),
                                           "buffers")
                    rows = send.view(b.shards.n, b.width)
                    for e, col in zip(b.entries, b.col):
                        _add_padded(rows, col, e, grads[e.fqn], self.zero)
                recv = self.live.track(torch.empty(b.width, dtype=wire, device=self.device), "buffers")
                work = _reduce_scatter(recv, send, group=b.shards.group, async_op=True)
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

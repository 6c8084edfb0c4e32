"""Live bytes of the tensors a component allocates, by kind, with the peak: a CPU-friendly tracker.

``LiveBytes.track(t, kind)`` adds the bytes of ``t``'s storage to ``kind`` and registers a
finalizer on that storage (torch keeps one Python object per storage while it is alive),
so the bytes leave the count when the last tensor viewing the storage is freed, not when
the caller forgets ``t``. ``peak`` is the largest sum over all kinds seen since the last
``reset_peak``; ``peak_by_kind`` the largest of each kind on its own.

It counts what it was shown, each storage once, not every allocation of the process
(activations and autograd temporaries are not its business): the runtime shows it its
parameter, gradient, collective and gathered-weight buffers (:mod:`autopar.runtime.zero`).
Unlike the CUDA caching allocator's statistics it works on any device.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["LiveBytes"]


class LiveBytes:
    def __init__(self, sums: dict[str, tuple[str, ...]] | None = None) -> None:
        self.now: dict[str, int] = {}
        self.peak = 0
        self.peak_by_kind: dict[str, int] = {}
        self.sums = dict(sums or {})
        """Named sets of kinds whose summed peak is kept too (``peak_of``)."""
        self.peak_of: dict[str, int] = {name: 0 for name in self.sums}
        self._seen: weakref.WeakSet = weakref.WeakSet()

    def track(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        """Count ``t``'s storage under ``kind`` until it is freed; returns ``t``."""
        storage = t.untyped_storage()
        if storage in self._seen:
            return t
        self._seen.add(storage)
        nbytes = storage.nbytes()
        self.now[kind] = self.now.get(kind, 0) + nbytes
        self.peak_by_kind[kind] = max(self.peak_by_kind.get(kind, 0), self.now[kind])
        self.peak = max(self.peak, sum(self.now.values()))
        for name, kinds in self.sums.items():
            self.peak_of[name] = max(self.peak_of[name], sum(self.now.get(k, 0) for k in kinds))
        weakref.finalize(storage, self._free, kind, nbytes)
        return t

    def _free(self, kind: str, nbytes: int) -> None:
        self.now[kind] -= nbytes

    def reset_peak(self) -> None:
        self.peak = sum(self.now.values())
        self.peak_by_kind = dict(self.now)
        self.peak_of = {name: sum(self.now.get(k, 0) for k in kinds) for name, kinds in self.sums.items()}

    def total(self) -> int:
        return sum(self.now.values())

"""What a step program holds while it runs: its intermediate tensors' bytes, op by op, measured.

On CUDA the caching allocator reports a step's peak (``torch.cuda.max_memory_allocated``); on
CPU nothing does, and the runtime's own tracker (:mod:`autopar.runtime.memtrack`) sees only the
buffers it owns (parameters, gradients, gathered weights), not activations. :class:`LiveBytes`
runs a step program op by op (an ``fx.Interpreter`` that frees each value after its last use,
as the generated code does) and after every op adds up the bytes of the distinct storages the
program's intermediate values hold (its inputs, parameters and constants excluded). Two
figures come out: the bytes alive when the backward starts (the forward's activations kept for
the backward, what the planner's activation memory predicts) and the peak over the step.

Used by :meth:`autopar.parallel.ParallelModule.measure_step`; it runs the real step (its
collectives and gradient buckets included), only slower.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["LiveBytes", "storage_key"]


class LiveBytes(fx.Interpreter):
    """Run ``gm`` and measure its live intermediate bytes (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.peak_bytes = 0
        self.at_backward_bytes: int | None = None
        """Live bytes just before the first backward op (an op whose name says ``backward``)."""
        self._outside: set[int] = set()  # storages of inputs, parameters and constants

    def run(self, *args: Any, counted_elsewhere: set[int] | None = None, **kwargs: Any) -> Any:
        """``counted_elsewhere``: the storages (``untyped_storage().data_ptr()``) the caller counts
        itself; by default the inputs', so only the program's own intermediates count. (A pipeline
        piece counts the inputs it took over from the store: they die inside it.)"""
        if counted_elsewhere is None:
            counted_elsewhere = {storage_key(a) for a in args if isinstance(a, torch.Tensor)}
        self._outside = set(counted_elsewhere)
        self._outside |= {storage_key(t) for t in (*self.module.buffers(), *self.module.parameters())}
        return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        if self.at_backward_bytes is None and n.op == "call_function" and "backward" in str(n.target):
            self.at_backward_bytes = self._live()
        result = super().run_node(n)
        if n.op == "get_attr" and isinstance(result, torch.Tensor):
            self._outside.add(storage_key(result))
        self.peak_bytes = max(self.peak_bytes, self._live(result))
        return result

    def _live(self, extra: Any = None) -> int:
        seen: dict[int, int] = {}
        for value in (*self.env.values(), extra):
            for t in _tensors(value):
                key = storage_key(t)
                if key not in self._outside:
                    seen[key] = t.untyped_storage().nbytes()
        return sum(seen.values())


def storage_key(t: torch.Tensor) -> int:
    """What identifies ``t``'s memory: views of one storage share it."""
    return t.untyped_storage().data_ptr()


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)

"""Price the memory-bound ops of compiled layers as TorchInductor fuses them.

autopar's own runtime runs every op as its own kernel (eager), and :mod:`autopar.passes.annotate`
prices it so: each pointwise op or reduction reads its inputs from HBM and writes its output
back. A program compiled with ``torch.compile`` does not: TorchInductor fuses chains of
pointwise ops and reductions into one generated kernel each, which reads the chain's inputs
and writes only the outputs that leave it; the intermediates stay in registers (Ansel et al.,
"PyTorch 2: Faster Machine Learning Through Dynamic Python Bytecode Transformation and Graph
Compilation", ASPLOS 2024, sec. 5: TorchInductor's scheduler fuses pointwise and reduction
nodes, vertically and horizontally; matmuls and convolutions stay library calls). torchtitan
compiles each transformer block on its own (``apply_compile``: ``torch.compile(block,
fullgraph=True)`` per block; the embedding, final norm, head and loss stay eager).

:func:`fuse_memory_bound` applies that rule to an annotated graph, to predict such runs: a
tensor made by a memory-bound op in a compiled layer, read only by memory-bound ops of compiled
layers in the same phase (forward or backward) and not saved for the backward, is not written
by its producer nor read by its consumers. Each op's remaining bytes are what its share of the
fused kernel moves, and its time is re-priced from them (:func:`autopar.cost.compute.kernel_time_s`).
What is not modelled: Inductor's own choice of what to save for the backward (its min-cut
partitioner may recompute instead of saving; here the eager saved set is kept), and fusions
into matmul epilogues (off by default; cuBLAS calls write their outputs).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from torch import fx

from autopar.cost.compute import kernel_time_s
from autopar.cost.devices import DeviceSpec
from autopar.passes import meta_keys as mk
from autopar.passes.annotate import _dtype_name, _is_view, kernel_of, tensor_bytes

__all__ = ["fuse_memory_bound"]


def _fusible(node: fx.Node, compiled: Callable[[str], bool]) -> bool:
    """A memory-bound op (no FLOPs, not a GEMM or attention kernel, not a view) in a compiled layer."""
    if node.op != "call_function" or _is_view(node) or mk.COST not in node.meta:
        return False
    cost = node.meta[mk.COST]
    return kernel_of(node)[0] == "other" and cost.flops == 0 and compiled(node.meta.get(mk.LAYER) or "")


def _readers(node: fx.Node):
    """(consumer, the node it reads) for every non-view use of ``node``, through views."""
    for user in node.users:
        if user.op == "call_function" and _is_view(user):
            yield from ((c, via) for c, via in _readers(user))
        else:
            yield user, node


def fuse_memory_bound(gm: fx.GraphModule, *, device: DeviceSpec, compiled: Callable[[str], bool],
                      compute_dtype: str | None = None) -> int:
    """Re-price ``gm``'s memory-bound ops in the layers ``compiled(layer_path)`` says are compiled,
    as fused kernels (module docstring). Changes ``meta[COST]`` in place; returns how many
    intermediate tensors no longer go through HBM.

    Contract: needs ``meta[COST]`` (:func:`autopar.passes.annotate.annotate_cost`), ``meta[TRACE]``
    and ``meta[LAYER]`` (:func:`autopar.passes.layers.group_layers`); run it once per graph.
    """
    # every memory-bound op of a compiled layer runs in a generated kernel (kind "fused"; decided
    # once, before marking: the mark changes what kernel_of says)
    fused = [n for n in gm.graph.nodes if _fusible(n, compiled)]
    fusible = set(fused)
    delta: dict[fx.Node, list[float]] = {}  # node -> [bytes no longer read, bytes no longer written]
    internal = 0
    for node in fused:
        if node.meta[mk.COST].saved_bytes > 0:
            continue
        size = tensor_bytes(node.meta.get("val"))
        readers = list(_readers(node))
        role = node.meta[mk.TRACE].role
        if not readers or size == 0 or not all(
                c in fusible and c.meta[mk.TRACE].role is role for c, _ in readers):
            continue
        if any(via is not node and via.meta[mk.COST].saved_bytes > 0 for _, via in readers):
            continue
        internal += 1
        delta.setdefault(node, [0.0, 0.0])[1] += size
        seen = set()
        for consumer, via in readers:
            if (consumer, via) in seen:
                continue
            seen.add((consumer, via))
            delta.setdefault(consumer, [0.0, 0.0])[0] += tensor_bytes(via.meta.get("val"))
    for node in fused:
        less_read, less_written = delta.get(node, (0.0, 0.0))
        cost = node.meta[mk.COST]
        read = max(0.0, cost.bytes_read - less_read)
        written = max(0.0, cost.bytes_written - less_written)
        dtype = compute_dtype or _dtype_name(node.meta.get("val"))
        node.meta[mk.FUSED] = True
        node.meta[mk.COST] = dataclasses.replace(
            cost, bytes_read=read, bytes_written=written,
            time_s=kernel_time_s(kind="fused", flops=0.0, bytes_moved=read + written, device=device, dtype=dtype))
    return internal

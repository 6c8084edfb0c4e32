"""Price the linears of a Float8 training run as it executes them.

torchao's Float8 training (``torchao.float8.convert_to_float8_training``, which torchtitan
applies with ``--float8.enable_float8_linear``) swaps each selected ``nn.Linear`` for a
``Float8Linear``: the forward GEMM and both backward GEMMs (input gradient, weight gradient)
cast their operands to float8 with a dynamic per-tensor scale and run on the FP8 tensor cores.
Everything else (attention, norms, the loss, any linear left out: torchtitan leaves out the
output head, ``module_filter_fn=lambda mod, fqn: fqn != "output"`` in its ``float8.py`` at
9dec370) stays in bf16.

:func:`mark_float8_linears` marks those GEMMs of a traced, annotated graph (``meta[FLOAT8]``),
so :func:`autopar.passes.annotate.kernel_of` reports them as kind ``"fp8_gemm"`` and every
later pricing (the sharding MIP re-prices each op per strategy) takes the FP8 peak and the
casts (:func:`autopar.cost.compute.kernel_time_s`). It is for predicting such runs
(``bench/fidelity.py``), as :mod:`autopar.passes.fuse` is for compiled ones: autopar's own
runtime runs its linears in the plan's precision, not in float8.

Activation memory is priced as the bf16 program's: the saved set is the same ops' outputs, and
torchtitan's Llama 3.1 8B runs peaked at 77.0 and 76.8 GiB without and with Float8 (62.0 and
61.8 on 128 GPUs). Float8 tensor-parallel all-gathers (a byte per element) are priced where
the plan's costs are evaluated (:func:`autopar.planner.evaluation._feeds_float8_only`). Not
modelled: the halved bytes of FSDP's float8 all-gather of the weights, and how op-level SAC
treats ``_scaled_mm`` (torchtitan's
save list at 9dec370 names ``aten.mm`` only; the policy's every-second-matmul rule is kept,
consistent with the unchanged peaks above).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import fx

from autopar.cost.compute import GEMM_KINDS, kernel_time_s
from autopar.cost.devices import DeviceSpec
from autopar.passes import meta_keys as mk
from autopar.passes.annotate import kernel_of

__all__ = ["mark_float8_linears"]


def mark_float8_linears(gm: fx.GraphModule, *, device: DeviceSpec, linears: Callable[[str], bool]) -> int:
    """Mark and re-price the GEMMs of every ``nn.Linear`` whose module path ``linears(path)``
    accepts (forward and backward: a backward GEMM carries its forward module's path) as
    Float8 GEMMs; return how many GEMMs were marked.

    Contract: needs ``meta[COST]`` and ``meta[TRACE]`` (:func:`autopar.passes.annotate.annotate_cost`);
    changes ``meta[COST].time_s`` of the marked nodes in place (marking a marked graph again changes
    nothing). Raises ``ValueError`` if
    ``device`` has no FP8 tensor cores, or if no linear matched (a predicate that selects
    nothing is a mistake, not a bf16 plan)."""
    if device.fp8_flops_per_s is None:
        raise ValueError(f"Float8 linears: device {device.name!r} has no FP8 tensor cores "
                         "(fp8_flops_per_s is None); plan them in bf16, or for an H100, H200 or B200")
    marked = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or mk.COST not in node.meta:
            continue
        kind, shape = kernel_of(node)
        trace = node.meta[mk.TRACE]
        if kind not in GEMM_KINDS or shape is None or trace.module_class != "Linear" or not linears(trace.module_path):
            continue
        node.meta[mk.FLOAT8] = True
        cost = node.meta[mk.COST]
        time_s = kernel_time_s(kind="fp8_gemm", flops=cost.flops, bytes_moved=cost.bytes_read + cost.bytes_written,
                               device=device, gemm=tuple(shape[:3]))
        node.meta[mk.COST] = dataclasses.replace(cost, time_s=time_s)
        marked += 1
    if not marked:
        raise ValueError("Float8 linears: the predicate accepted no nn.Linear GEMM of the graph; "
                         "it is called with module paths such as 'layers.0.attention.wq'")
    return marked

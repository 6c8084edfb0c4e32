"""The planner's front end: trace a model twice (batch G and 2G) and annotate both.

Two traces make every cost affine in the batch size (see
:mod:`autopar.passes.strategies`) and reveal which tensor dims are batch dims.

Why not one trace. The second trace is about a quarter of planning a tiny Hugging Face
model (3.4 of 15.7 CPU seconds for Llama, 8.8 of 36.5 for T5), but what it gives cannot be
read off the first: a concrete trace bakes sizes derived from the batch into literal integer
arguments (``view``/``reshape`` sizes, ``expand`` sizes, factory shapes such as a mask built
for B sequences), so re-running shape propagation at 2G over the traced graph fails or
misses batch dims, and pushing a batch "shard" through DTensor's rules misses tensors that
are built from the batch size rather than computed from an input. Tracing once with a
symbolic batch (``mark_dynamic`` on dim 0, then TorchDynamo and AOTAutograd on symbolic
shapes) costs more than two concrete traces (measured, CPU seconds, torch 2.13: tiny Llama
3.6 + 5.8 = 9.4 against 2 x 3.4; T5 7.2 + 12.6 = 19.8 against 2 x 8.8), before the
symbolic graph is even instantiated at G and 2G; capturing once symbolically and exporting
twice concretely would save about 0.3 of Llama's 6.9 (from the parts above). So: two concrete traces.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx, nn

from autopar.analysis import build_graph
from autopar.cluster import Cluster

__all__ = ["trace_pair", "double_batch"]


def double_batch(x: Any, batch: int) -> Any:
    """The same inputs at twice the batch: tensors whose dim 0 is ``batch`` are repeated."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or x.shape[0] != batch:
            return x
        if x.device.type == "meta":
            return x.new_empty((2 * batch,) + tuple(x.shape[1:]))
        return torch.cat([x, x])
    if isinstance(x, dict):
        return {k: double_batch(v, batch) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(double_batch(v, batch) for v in x)
    return x


def trace_pair(model: nn.Module, example_inputs: Any, *, cluster: Cluster, loss_fn: Callable | None,
               example_target: Any, param_dtype=None) -> tuple[fx.GraphModule, fx.GraphModule]:
    """(graph at the example batch, graph at twice that batch), both annotated and grouped."""
    gm = build_graph(model, example_inputs, cluster=cluster, loss_fn=loss_fn, example_target=example_target,
                     param_dtype=param_dtype)
    from autopar.passes import meta_keys as mk

    batch = gm.meta[mk.GRAPH].global_batch
    gm2 = build_graph(model, double_batch(example_inputs, batch), cluster=cluster, loss_fn=loss_fn,
                      example_target=double_batch(example_target, batch), param_dtype=param_dtype)
    return gm, gm2

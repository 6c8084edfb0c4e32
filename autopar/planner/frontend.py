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

Side by side. The planner itself (:func:`trace_and_twin`) reads only numbers of the second
graph (:func:`autopar.passes.strategies.twin_facts`), so where a fork is safe
(:func:`autopar.planner.side_by_side.may_fork`) it traces the double batch in a forked child
while this process traces the example batch, and the child sends the numbers back: on two cores
the pair takes about the time of one trace (Llama 70B: 1.4-1.5 s for both, 0.9-1.1 s side by
side; ``bench/planner_speed.py``). Not with the trace cache on (:mod:`autopar.passes.trace_cache`:
it hands this process a trace made before in a moment, which a child would make again). A
child that fails, dies or does not answer in time (a minute, or twenty times this process's own
trace) leaves the double batch to be traced here, as before (and later plans in this process
trace both here: on torch's CUDA builds a child forked after this process ran autograd cannot run
it, so once one has failed the next would too): the plan does not depend on which process
traced it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import fx, nn

from autopar.analysis import build_graph
from autopar.cluster import Cluster
from autopar.passes import meta_keys as mk
from autopar.passes import trace_cache
from autopar.passes.strategies import TwinFacts, twin_facts
from autopar.planner.side_by_side import may_fork, start_child

__all__ = ["trace_pair", "trace_and_twin", "double_batch", "leading_batch"]


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
    batch = gm.meta[mk.GRAPH].global_batch
    gm2 = build_graph(model, double_batch(example_inputs, batch), cluster=cluster, loss_fn=loss_fn,
                      example_target=double_batch(example_target, batch), param_dtype=param_dtype)
    return gm, gm2


def trace_and_twin(model: nn.Module, example_inputs: Any, *, cluster: Cluster, loss_fn: Callable | None,
                   example_target: Any, param_dtype=None, prepare: Callable[[fx.GraphModule], None] | None = None
                   ) -> tuple[fx.GraphModule, tuple[TwinFacts, ...]]:
    """(graph at the example batch, the :func:`~autopar.passes.strategies.twin_facts` of the
    graph at twice it): what :func:`trace_pair` gives the planner, the second trace made side by
    side in a forked child where that is safe (the module docstring). ``prepare`` runs on each
    graph after its trace (passes that change its costs)."""

    def trace(inputs: Any, target: Any) -> fx.GraphModule:
        g = build_graph(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target,
                        param_dtype=param_dtype)
        if prepare is not None:
            prepare(g)
        return g

    batch = leading_batch(example_inputs)
    twin = (lambda _: twin_facts(trace(double_batch(example_inputs, batch), double_batch(example_target, batch)))
            ) if batch else None
    child = start_child(twin) if twin and may_fork() and not trace_cache.enabled() and not _failed else None
    try:
        start = time.perf_counter()
        gm = trace(example_inputs, example_target)
        facts = child.answer(wait_s=max(60.0, 20 * (time.perf_counter() - start))) if child else None
    finally:
        if child:
            child.end()
    if child and facts is None:
        # (not again in this process: on torch's CUDA builds a child forked after this process
        # ran autograd cannot run it, and every later trace child would fail the same way)
        _failed.append(True)
    traced = gm.meta[mk.GRAPH].global_batch
    if facts is None or traced != batch:  # (the child guessed another batch than the trace found)
        facts = twin_facts(trace(double_batch(example_inputs, traced), double_batch(example_target, traced)))
    return gm, facts


_failed: list[bool] = []
"""Whether a trace child failed in this process (then the double batch is traced here)."""


def leading_batch(x: Any) -> int | None:
    """Dim 0 of the first tensor of at least one dim in ``x``: the batch the trace will find
    (checked against it after)."""
    if isinstance(x, torch.Tensor):
        return x.shape[0] if x.dim() else None
    values = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    return next((b for b in map(leading_batch, values) if b is not None), None)

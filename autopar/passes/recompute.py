"""Activation recompute at run time: the forward ops a plan's policy drops run again in the backward.

The planner prices ``recompute`` (:mod:`autopar.planner.recompute_keep`, ``_unit_times`` of
:mod:`autopar.planner.bounds`) as keeping, per layer, only some of what the backward reads and
running the rest of the layer's forward again when its backward starts. This pass makes the
joint graph do exactly that, so the step program holds what the plan says it holds:

- ``selective``: the layer's FLOP-free forward ops (norms, activations, rotary embeddings,
  casts, views) are dropped; the outputs of its GEMMs and attention are kept.
- ``sac`` (torchtitan's op-level SAC): as selective, and every second forward GEMM of
  the layer in graph order is dropped too (:func:`~autopar.planner.recompute_keep.sac_recomputed_matmuls`
  counts the same ones).
- ``moe`` (Megatron-LM's ``--recompute-modules layernorm moe``): as selective, and every forward
  op of each MoE layer (router, token exchange, experts, combine: the module
  :func:`moe_modules` finds) is dropped too; attention and the other GEMMs keep their outputs.
  Under ep the experts op's copy exchanges the tokens again, as Megatron-LM's recomputed MoE
  layer does.
- ``full``: every forward op of the layer is dropped; the layer keeps its inputs.

A dropped value is one a backward node of the same layer reads. Each such reader gets a copy of
the value's producer, inserted right before the first backward node that needs it, and the
copy's inputs are copies too as far as they are dropped ops of the same layer; the chain stops
at a kept value: a GEMM's output the policy keeps, a parameter, a graph input, or a value
another layer made (the layer's input, rotary tables). The forward originals then die after
their last forward reader (fx's generated code drops each value after its last use), and the
copies after their last backward reader, so a layer's recomputed activations exist only while
its backward runs: the one layer's activations the plan adds on top of what every layer keeps.

Never dropped: ops that draw random numbers (a dropout mask drawn again would differ; the mask
is kept, as the planner's op-level count does not see: a few bytes per element) and ops fx
must not drop (side effects). This is a graph rewrite rather than ``torch.utils.checkpoint``
because there is no autograd at run time: the program is the traced joint graph, forward and
backward in one list of ATen ops, and its node order is the order it runs.

Copies are backward nodes (``Role.BACKWARD``) of the original's layer, with the original's
plan placements, so tp, ZeRO-3 gathers (a backward node reads the gathered weight of the
backward), pipeline stages and the B/W split treat them like any backward op.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict

from torch import fx

from autopar.cost.compute import GEMM_KINDS
from autopar.passes import meta_keys as mk
from autopar.passes.annotate import kernel_of
from autopar.passes.shard import _impure
from autopar.passes.token_local import EXPERT_OPS, op_name
from autopar.plan import RECOMPUTE_POLICIES

__all__ = ["recompute_in_backward", "dropped_ops"]


def _forward_op(node: fx.Node) -> bool:
    trace = node.meta.get(mk.TRACE)
    return node.op == "call_function" and trace is not None and trace.role is mk.Role.FORWARD


FORWARD_EXPERT_OPS = tuple(sorted(op for op in EXPERT_OPS if not op.endswith("_backward")))
"""The experts ops an MoE layer is recognised by (:data:`autopar.passes.token_local.EXPERT_OPS`, forward)."""


def moe_modules(ops) -> frozenset[str]:
    """The module paths of a model's MoE layers, from its forward ops ``ops``: (module path,
    is an experts op, is a GEMM) each. An MoE layer is the innermost module around an experts op
    (:func:`autopar.experts.moe_experts`) that also holds another forward GEMM, its router: Hugging
    Face's ``mlp`` around ``mlp.experts`` and ``mlp.gate``, the example's ``moe`` holding its
    router and stacked experts. With no such module, the experts op's own."""
    ops = list(ops)
    gemm_paths = {path for path, experts, gemm in ops if gemm and not experts}

    def holds(module: str) -> bool:
        return any(p == module or p.startswith(module + ".") or not module for p in gemm_paths)

    out = set()
    for path, experts, _ in ops:
        if not experts:
            continue
        module = path
        while not holds(module) and module:
            module = module.rpartition(".")[0]
        out.add(module if holds(module) and module else path)
    return frozenset(out)


def in_modules(path: str, modules: frozenset[str]) -> bool:
    """Whether a module path is one of ``modules`` or inside one."""
    return any(path == m or path.startswith(m + ".") for m in modules)


def _moe_ops(gm: fx.GraphModule) -> set[fx.Node]:
    """The forward ops of ``gm`` inside its MoE layers (:func:`moe_modules`)."""
    forward = [n for n in gm.graph.nodes if _forward_op(n)]
    modules = moe_modules((n.meta[mk.TRACE].module_path, op_name(n) in FORWARD_EXPERT_OPS,
                           kernel_of(n)[0] in GEMM_KINDS) for n in forward)
    return {n for n in forward if in_modules(n.meta[mk.TRACE].module_path, modules)}


def dropped_ops(gm: fx.GraphModule, policy: str) -> set[fx.Node]:
    """The forward ops of ``gm`` whose outputs ``policy`` does not keep for the backward."""
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute={policy!r} is not one of {', '.join(RECOMPUTE_POLICIES)}")
    if policy == "none":
        return set()
    gemms: dict[str, int] = defaultdict(int)
    out: set[fx.Node] = set()
    moe = _moe_ops(gm) if policy == "moe" else set()
    for node in gm.graph.nodes:
        if not _forward_op(node):
            continue
        if node.target is operator.getitem:  # an output of a multi-output op: dropped with its op
            if node.args[0] in out:
                out.add(node)
            continue
        if _impure(node):  # draws random numbers (a dropout mask), or has side effects
            continue
        gemm = kernel_of(node)[0] in GEMM_KINDS
        if gemm:
            gemms[node.meta[mk.LAYER]] += 1
        cost = node.meta.get(mk.COST)
        flop_free = cost is not None and cost.flops == 0
        if policy == "full" or flop_free or node in moe or (
                policy == "sac" and gemm and gemms[node.meta[mk.LAYER]] % 2 == 0):
            out.add(node)
    return out


def recompute_in_backward(gm: fx.GraphModule, policy: str, ops: dict | None = None) -> int:
    """Rewrite ``gm`` (a joint graph with layers grouped) in place so that its backward re-runs
    what ``policy`` drops (see the module docstring); ``ops`` (node name -> plan placements)
    gets an entry for each copy. Returns the number of ops copied."""
    dropped = dropped_ops(gm, policy)
    gm.meta[mk.RECOMPUTED] = {}
    if not dropped:
        return 0
    graph = gm.graph
    copies: dict[fx.Node, fx.Node] = {}

    def copy_of(node: fx.Node, layer: str) -> fx.Node:
        if node not in copies:
            args = fx.node.map_arg((node.args, node.kwargs), lambda a: remade(a, layer))
            new = graph.create_node("call_function", node.target, args[0], args[1], name=f"{node.name}_recomputed")
            new.meta = dict(node.meta)
            new.meta[mk.TRACE] = dataclasses.replace(node.meta[mk.TRACE], role=mk.Role.BACKWARD)
            if ops is not None and node.name in ops:
                ops[new.name] = ops[node.name]
            copies[node] = new
        return copies[node]

    def remade(value: fx.Node, layer: str) -> fx.Node:
        if value in dropped and value.meta[mk.LAYER] == layer:
            return copy_of(value, layer)
        return value

    for node in list(graph.nodes):
        trace = node.meta.get(mk.TRACE)
        if node.op != "call_function" or trace is None or trace.role is not mk.Role.BACKWARD:
            continue
        layer = node.meta[mk.LAYER]
        if not any(a in dropped and a.meta[mk.LAYER] == layer for a in node.all_input_nodes):
            continue
        with graph.inserting_before(node):
            node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: remade(a, layer))
    graph.lint()
    gm.recompile()
    gm.meta[mk.RECOMPUTED] = {new.name: old.name for old, new in copies.items()}
    return len(copies)

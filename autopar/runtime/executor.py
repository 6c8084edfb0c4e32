"""Run the joint forward+backward graph on one rank, sharded as the plan says.

The graph is interpreted over DTensors on the (dp, tp) mesh. Before each op, every
tensor argument is redistributed to the placement the plan chose for that op on the
tp axis (its dp placement is left as it is: the batch stays split over dp); DTensor
then runs the op on local shards with local shapes (views and reshapes included)
and inserts the collectives a change of placement needs (all-reduce, all-gather,
reduce-scatter, all-to-all) through torch's functional collectives. Ops that
DTensor has no rule for (the CPU flash-attention kernels) run on the local shards
directly under autopar's own rule (batch and heads are independent), which the
planner priced.

Using DTensor as the engine, rather than rewriting each view's shape arguments by
hand, keeps one implementation of sharding semantics: the same one the planner
read its candidate strategies from.

``placements_for_graph`` maps a plan onto a traced graph: by node name when the
plan was made from this very trace, otherwise by layer signature and the op's
position in its layer (a plan made from a trace with repeated blocks collapsed
drives the full graph).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_leaves, tree_map

from autopar.errors import PlanError
from autopar.passes import meta_keys as mk
from autopar.passes.dtensor_rules import dtensor_dispatches
from autopar.plan import Plan

__all__ = ["OpPlacements", "placements_for_graph", "placement", "run_joint"]


@dataclass(frozen=True)
class OpPlacements:
    ins: tuple[str, ...]
    outs: tuple[str | None, ...]


def placement(s: str | None):
    """Plan strings ("R", "P", "S<d>") to DTensor placements."""
    if s is None or s == "R":
        return Replicate()
    if s == "P":
        return Partial()
    return Shard(int(s[1:]))


def _stand_in(path: str, planned: dict) -> str | None:
    """The plan's layer for ``path``: itself, or the traced block that stands for it
    ("h.7" -> "h.1" when the plan's trace collapsed a run of identical blocks)."""
    if path in planned:
        return path
    container, _, index = path.rpartition(".")
    if index.isdigit():
        for candidate in (f"{container}.1", f"{container}.0"):
            if candidate in planned and (candidate.endswith(".0") or int(index) >= 1):
                return candidate
    return None


def placements_for_graph(gm: fx.GraphModule, plan: Plan) -> tuple[dict[str, OpPlacements], dict[str, str]]:
    """(op node name -> tp placements, parameter name -> tp placement) for ``gm``.

    Layers match by path (a block of a collapsed run maps to the block that stood for
    it); ops match by their position inside the layer. Raises PlanError if the plan
    does not cover the graph.
    """
    plan_ops: dict[tuple[str, int], dict] = {(op["layer"], op["index"]): op for op in plan.ops.values()}
    members: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            members.setdefault(node.meta[mk.LAYER], []).append(node)
    ops: dict[str, OpPlacements] = {}
    params: dict[str, str] = {}
    for layer in gm.meta[mk.LAYERS]:
        source = _stand_in(layer.path, plan.layers)
        if source is None:
            raise PlanError(f"the plan has no layer for {layer.path} ({layer.class_name}); it was made "
                            f"for another model: re-plan for this one")
        for i, node in enumerate(members.get(layer.path, [])):
            op = plan_ops.get((source, i))
            if op is None:
                raise PlanError(f"the plan's layer {source} has no op #{i} for {node.format_node()}; "
                                f"it was made for another model: re-plan for this one")
            ops[node.name] = OpPlacements(ins=tuple(op["in"]), outs=tuple(op["out"]))
        src_params = {k[len(source) + 1:] if k.startswith(source + ".") else k: v
                      for k, v in plan.layers[source]["params"].items()}
        for fqn in layer.param_fqns:
            rel = fqn[len(layer.path) + 1:] if fqn.startswith(layer.path + ".") else fqn
            params[fqn] = src_params.get(rel, "R")
    return ops, params


def _wrap_replicated(value: Any, mesh: DeviceMesh) -> Any:
    """Factory ops (arange, zeros) make plain tensors, identical on every rank."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return value


def _redistribute(args: Any, wanted: tuple[str, ...], mesh: DeviceMesh, tp_dim: int) -> Any:
    it = iter(wanted)

    def move(v):
        if not isinstance(v, DTensor):
            return v
        want = list(v.placements)
        want[tp_dim] = placement(next(it, "R"))
        if tuple(want) == tuple(v.placements):
            return v
        if want[tp_dim].is_partial() and not v.placements[tp_dim].is_partial():
            return _to_partial(v, mesh, tp_dim, want)
        return v.redistribute(mesh, want)

    return tree_map(move, args)


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def _contiguous(v: Any) -> Any:
    if isinstance(v, DTensor) and not v.to_local().is_contiguous():
        return DTensor.from_local(v.to_local().contiguous(), v.device_mesh, v.placements, run_check=False,
                                  shape=v.shape, stride=v.stride())
    return v


def _to_partial(v: DTensor, mesh: DeviceMesh, tp_dim: int, want: list) -> DTensor:
    """Replicate -> Partial(sum) on tp: one rank keeps the value, the others hold zeros.
    (DTensor keeps this conversion internal, so it is spelled out here.)"""
    pre = list(want)
    pre[tp_dim] = Replicate()
    v = v.redistribute(mesh, pre) if tuple(pre) != tuple(v.placements) else v
    local = v.to_local()
    if mesh.get_local_rank(tp_dim) != 0:
        local = torch.zeros_like(local)
    return DTensor.from_local(local, mesh, want, run_check=False, shape=v.shape, stride=v.stride())


def _run_local(node: fx.Node, args, kwargs, rule: OpPlacements, mesh: DeviceMesh, tp_dim: int):
    """An op DTensor cannot dispatch: run it on local shards under autopar's own rule."""
    first = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, DTensor))
    local = tree_map(lambda v: v.to_local() if isinstance(v, DTensor) else v, (args, kwargs))
    result = node.target(*local[0], **local[1])
    outs = iter(rule.outs)

    def wrap(v):
        o = next(outs, "R")
        if not isinstance(v, torch.Tensor):
            return v
        pls = list(first.placements)  # batch-parallel on dp, like its first input
        pls[tp_dim] = placement(o)
        return DTensor.from_local(v, mesh, pls, run_check=False)

    return tuple(wrap(v) for v in result) if isinstance(result, (tuple, list)) else wrap(result)


def run_joint(gm: fx.GraphModule, *, mesh: DeviceMesh, ops: dict[str, OpPlacements],
              params: dict[str, DTensor], inputs: dict[str, torch.Tensor], loss_scale: float,
              tp_dim: int = 1, dp_dim: int = 0) -> tuple[DTensor, dict[str, DTensor]]:
    """One forward+backward of ``gm`` on one micro-batch: (loss, parameter gradients).

    ``params`` are the parameters as DTensors (replicated on dp, placed on tp);
    ``inputs`` the micro-batch by input name, whole (each dp rank keeps its slice);
    ``loss_scale`` seeds the backward (1 / micro-batches, so gradients average).
    """
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    env: dict[fx.Node, Any] = {}
    outputs = None
    for node in gm.graph.nodes:
        trace = node.meta[mk.TRACE]
        if node.op == "placeholder":
            if trace.role in (mk.Role.PARAM, mk.Role.BUFFER):
                env[node] = params[trace.fqn]
            elif trace.role is mk.Role.INPUT:
                value = inputs[trace.fqn]
                pls = [Replicate()] * mesh.ndim
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == info.global_batch:
                    pls[dp_dim] = Shard(0)  # the batch is split over dp
                env[node] = distribute_tensor(value, mesh, pls, src_data_rank=None) \
                    if isinstance(value, torch.Tensor) else value
            else:  # the loss tangent
                val = node.meta["val"]
                seed = torch.full(tuple(val.shape), loss_scale, dtype=val.dtype)
                env[node] = distribute_tensor(seed, mesh, [Replicate()] * mesh.ndim, src_data_rank=None)
        elif node.op == "call_function":
            args = fx.node.map_arg(node.args, lambda a: env[a])
            kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a])
            if node.target is operator.getitem:
                env[node] = args[0][args[1]]
                continue
            rule = ops.get(node.name)
            if rule is not None:
                args, kwargs = _redistribute((args, kwargs), rule.ins, mesh, tp_dim)
            if node.target in _VIEWS:  # a resharded local shard may be strided; view needs contiguous
                args = tree_map(_contiguous, args)
            has_dtensor = any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs)))
            if has_dtensor and rule is not None and not dtensor_dispatches(node.target):
                env[node] = _run_local(node, args, kwargs, rule, mesh, tp_dim)
            else:
                env[node] = tree_map(lambda v: _wrap_replicated(v, mesh), node.target(*args, **kwargs))
        elif node.op == "output":
            outputs = fx.node.map_arg(node.args[0], lambda a: env[a])
    loss = outputs[info.loss_output]
    grads = {fqn: outputs[i] for fqn, i in info.grad_outputs.items()}
    return loss, grads

"""Map a plan onto a traced graph: the tp placement of every op and parameter.

``placements_for_graph`` matches by node name's layer and position when the plan
was made from this very trace, and otherwise by layer path and the op's position
in its layer, so a plan made from a trace with repeated blocks collapsed drives
the full graph ("h.7" takes the placements of "h.1", which stood for it).
"""

from __future__ import annotations

import operator

from torch import fx

from autopar.errors import PlanError
from autopar.passes import meta_keys as mk
from autopar.passes.shard import OpPlacements
from autopar.plan import Plan

__all__ = ["placements_for_graph"]


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

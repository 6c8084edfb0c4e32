"""Map a plan onto a traced graph: the tp placement of every op and parameter.

``placements_for_graph`` matches by node name's layer and position when the plan
was made from this very trace, and otherwise by layer path and the op's position
in its layer, so a plan made from a trace with repeated blocks collapsed drives
the full graph ("h.7" takes the placements of "h.1", which stood for it).
"""

from __future__ import annotations

import difflib
import operator
import re

from torch import fx

from autopar.errors import PlanError
from autopar.passes import meta_keys as mk
from autopar.passes.layers import LOSS_LAYER
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


def _kind(name: str) -> str:
    """An fx node name without its numbering: the op it calls (``slice_3`` -> ``slice``)."""
    return re.sub(r"_\d+$", "", name)


def _align(nodes: list[fx.Node], planned: list[str]) -> list[int | None]:
    """Each node's position among the plan's ops of the loss layer, matched by op kind in order
    (``difflib``'s longest matching blocks); None for a node the plan has no op for."""
    out: list[int | None] = [None] * len(nodes)
    matcher = difflib.SequenceMatcher(None, [_kind(p) for p in planned], [_kind(n.name) for n in nodes],
                                      autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            out[block.b + k] = block.a + k
    return out


def placements_for_graph(gm: fx.GraphModule, plan: Plan) -> tuple[dict[str, OpPlacements], dict[str, str]]:
    """(op node name -> tp placements, parameter name -> tp placement) for ``gm``.

    Layers match by path (a block of a collapsed run maps to the block that stood for
    it); ops match by their position inside the layer. Raises PlanError if the plan
    does not cover the graph.
    """
    plan_ops: dict[tuple[str, int], dict] = {(op["layer"], op["index"]): op for op in plan.ops.values()}
    loss_ops = sorted((op["index"], name) for name, op in plan.ops.items() if op["layer"] == LOSS_LAYER)
    members: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            members.setdefault(node.meta[mk.LAYER], []).append(node)
    ops: dict[str, OpPlacements] = {}
    params: dict[str, str] = {}
    folded: set[str] = set()
    if plan.ep_over_tp:  # (etp=1: the experts blocks on token shards)
        from autopar.planner.expert_folding import block_ops
        from autopar.planner.experts import find_experts

        folded = {n.name for n in block_ops(gm, find_experts(gm))}
    for layer in gm.meta[mk.LAYERS]:
        source = _stand_in(layer.path, plan.layers)
        if source is None:
            raise PlanError(f"the plan has no layer for {layer.path} ({layer.class_name}); it was made "
                            f"for another model: re-plan for this one")
        nodes = members.get(layer.path, [])
        order = range(len(nodes))
        # The loss is the only layer whose ops may differ from the plan's: under context parallelism
        # a Hugging Face causal LM gets its labels shifted already (autopar.runtime.context), which
        # leaves out the shift's ops.
        if source == LOSS_LAYER and len(nodes) != len(loss_ops):
            order = _align(nodes, [name for _, name in loss_ops])
        for i, node in zip(order, nodes):
            if i is None:  # an op of the loss the plan's trace did not have: DTensor places it
                continue
            op = plan_ops.get((source, i))
            if op is None:
                raise PlanError(f"the plan's layer {source} has no op #{i} for {node.format_node()}; "
                                f"it was made for another model: re-plan for this one")
            ops[node.name] = OpPlacements(ins=tuple(op["in"]), outs=tuple(op["out"]), folded=node.name in folded)
        src_params = {k[len(source) + 1:] if k.startswith(source + ".") else k: v
                      for k, v in plan.layers[source]["params"].items()}
        for fqn in layer.param_fqns:
            rel = fqn[len(layer.path) + 1:] if fqn.startswith(layer.path + ".") else fqn
            params[fqn] = src_params.get(rel, "R")
    return ops, params

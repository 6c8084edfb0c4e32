"""The one B/W rule: which backward ops are on a pipeline's critical path.

A zero-bubble schedule (Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
https://arxiv.org/abs/2401.10241, sec. 2) splits a stage's backward into B, what
the previous stage waits for, and W, the rest, which it may defer into a bubble.
autopar decides the split by dataflow on the graph, in one place for both users:

- the runtime (:func:`autopar.passes.pipeline.split_program`) splits each
  pipeline *stage*: groups are stages;
- the planner (:func:`autopar.passes.strategies.build_strategy_graph`) prices each
  *layer*'s B and W before any cut is chosen: groups are layers in forward order.

The rule, for groups numbered in forward order: a backward node of group ``g`` is
B when a node of an earlier group depends on it (reads it, or reads a value
computed from it); every other backward node is W. For a linear
layer B holds ``dX = dY W`` and W holds ``dW = dY^T X``; no op-specific rule is
needed. With one stage per layer the two users agree node for node. (For the
runtime this is "the stage's backward nodes that what earlier stages read depends
on": a backward value never flows to a later stage, ``split_program`` refuses that,
so a path to an earlier stage stays inside the stage until it leaves. Per layer the
path may pass through a later layer of the same stage-to-be: Mixtral's routing-weight
gradient goes through the loss layer's backward and back into its block.)

A parameter read by several groups (GPT's embedding tied to its output head) has
a gradient that sums one addend per group. The runtime splits that sum into one
output per stage (:func:`autopar.passes.pipeline.split_tied_gradients`) and adds
the addends across stages after the pipeline drains, so the sum is no reader: the
output head's ``dW`` is W on both sides. :func:`tied_gradient_sums` finds those
sums for both.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import fx

from autopar.passes import meta_keys as mk

__all__ = ["split_backward", "tied_gradient_sums"]

_ADDS = (torch.ops.aten.add.Tensor,)


def split_backward(backward: Mapping[fx.Node, int], group_of: Mapping[fx.Node, int], *,
                   ignore_readers: Collection[fx.Node] = (), remade: Collection[fx.Node] = ()) -> set[fx.Node]:
    """The B nodes among ``backward`` (backward node -> its group, in graph order); the others are W.

    A backward node is B when a node of an earlier group depends on it: reads it, or
    reads a value computed from it (through backward nodes of any group). ``group_of``
    gives the group of every node that may read a backward value; other readers (the
    output) do not count, nor do readers in ``ignore_readers`` (the tied-gradient sums
    of :func:`tied_gradient_sums`), which are not followed either.

    ``remade``: forward ops the backward makes again (:mod:`autopar.passes.recompute`; only the
    runtime's graph has them). One whose backward inputs are all B is B too, even where only W
    reads it: the planner prices recompute in B, and W then holds what it reads, not what it
    would remake that from (ZB-H1's last stage under full recompute held the copies of silu's and
    w3's outputs for w2's weight gradient, which remade their product in W: 0.79 MB a micro-batch
    more, 11.1% over its plan on Llama tiny). One made from forward values only stays W: a first
    stage's B is empty, and such a copy there would be held from B to W.
    """
    # ``backward`` is in graph order, so a node's users come after it: one sweep from the last
    # node back gives each node the earliest group among the nodes that depend on it
    lowest: dict[fx.Node, float] = {}
    for n in reversed(list(backward)):
        low = float("inf")
        for u in n.users:
            if u in ignore_readers:
                continue
            if u in group_of:
                low = min(low, group_of[u])
            if u in lowest:
                low = min(low, lowest[u])
        lowest[n] = low
    b_nodes = {n for n, g in backward.items() if lowest[n] < g}
    for n in backward:  # (in graph order: a copy's inputs come before it)
        if n in remade and n not in b_nodes:
            made = [u for u in n.all_input_nodes if u in backward]
            if made and all(u in b_nodes for u in made):
                b_nodes.add(n)
    return b_nodes


def tied_gradient_sums(gm: fx.GraphModule, group_of: Mapping[fx.Node, int]
                       ) -> dict[str, tuple[set[fx.Node], list[fx.Node]]]:
    """Parameter -> (the add nodes that sum its gradient, the addends in graph order),
    for every parameter whose gradient adds addends of more than one group.

    An addend outside ``group_of`` counts as group -1 (a caller that must split the sum
    refuses it). Needs ``gm.meta[GRAPH]`` (``trace_joint``).
    """
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    outputs = list(out_node.args[0])
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = {}
    for fqn, idx in info.grad_outputs.items():
        root = outputs[idx]
        if not isinstance(root, fx.Node) or root.op != "call_function":
            continue
        tree = _sum_tree(root)
        leaves = sorted({a for n in tree for a in n.args[:2] if a not in tree}, key=order.__getitem__) \
            if tree else [root]
        if len({group_of.get(leaf, -1) for leaf in leaves}) > 1:
            found[fqn] = (tree, leaves)
    return found


def _sum_tree(root: fx.Node) -> set[fx.Node]:
    """The add nodes that form the sum whose result is ``root`` (single-use inner adds)."""
    tree, todo = set(), [root]
    while todo:
        n = todo.pop()
        if n.op == "call_function" and n.target in _ADDS and not n.kwargs and len(n.args) == 2 \
                and (n is root or len(n.users) == 1) and all(isinstance(a, fx.Node) for a in n.args):
            tree.add(n)
            todo.extend(n.args[:2])
    return tree

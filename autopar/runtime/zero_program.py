"""Insert ZeRO's step actions into a rank's fx program: UNSHARD before use, REDUCE_GRAD when final.

``insert_zero_calls(gm, ...)`` rewrites a copy of a per-rank program (the pp = 1 step
program, or one F/B/W piece of a pipeline stage) so that the collectives of
:mod:`autopar.zero_def` run inside it, where their data is ready:

- REDUCE_GRAD: right after the last node that produces a gradient of a layer group, a
  call ``params.group_grads_ready(group, *grads)`` hands the group's gradients to
  :class:`~autopar.runtime.zero.ShardedParams`, which issues the group's bucket
  asynchronously while the rest of the backward runs. The program's gradient outputs
  become ``None``, so it holds no gradient longer than its bucket needs it.
- UNSHARD (stage 3): right before the first node of a phase that reads a group's
  parameters, ``params.unshard(group, key, next_key, next_group)`` returns the group's
  gathered tensors and issues the gather of the group the program reads next (prefetch
  of one group). Forward nodes (the ancestors of the loss) and backward nodes get
  separate gathers: the forward copy dies after its last forward reader (fx's generated
  code drops every value after its last use: that is RESHARD), and the backward gathers
  again. View ops of a parameter made in forward (``t(w)``) and read in backward are
  re-made in backward from the backward copy, so no forward copy lives across the
  step's middle.

Why graph surgery rather than hooks: the program is one traced function of ATen ops
with no module boundaries left to hook, and its node order is the order it runs, so
inserting calls is the one place that knows "last producer" and "first reader".
A parameter that several groups read (a tied embedding and head) stays in the group that
reads it first; its forward copy lives until its last reader.
"""

from __future__ import annotations

import copy

import torch
from torch import fx

from autopar.passes.pipeline import PARAM_VIEWS as _VIEWS

__all__ = ["insert_zero_calls"]


def insert_zero_calls(gm: fx.GraphModule, *, params, param_inputs: dict[int, str], grad_outputs: dict[int, str],
                      loss_output: int | None = None, phase: str = "F", gather: bool = False,
                      key: str = "") -> fx.GraphModule:
    """A copy of ``gm`` with the ZeRO calls of ``params`` (a ShardedParams) inserted.

    Contract: ``param_inputs`` maps placeholder positions to parameter names;
    ``grad_outputs`` maps positions in the output tuple to the parameter whose gradient
    addend they are (replaced by ``None`` in the result). With ``loss_output``, nodes
    the loss depends on are forward and the rest backward; without it every node is of
    ``phase`` ("F" or "B"). ``gather`` (stage 3) inserts the UNSHARD calls; ``key``
    names this program among the rank's programs (prefetch keys).
    """
    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    out_node = graph.find_nodes(op="output")[0]
    outs = list(out_node.args[0]) if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
    forward = _ancestors(outs[loss_output]) if loss_output is not None else (set(nodes) if phase == "F" else set())
    placeholders = graph.find_nodes(op="placeholder")
    pnode = {f: placeholders[i] for i, f in param_inputs.items()}
    if gather:
        _insert_unshard(graph, params, pnode, forward, order, key)
    _insert_reduce(graph, params, outs, grad_outputs, order)
    now = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
    new_outs = [None if i in grad_outputs else v for i, v in enumerate(now)]
    out_node.args = (tuple(new_outs),)
    roots = set(pnode.values())
    if gather:  # the views the readers no longer use (they would read the unused placeholders)
        for n in reversed(list(graph.nodes)):
            if n.op == "call_function" and n.target in _VIEWS and not n.users and _views_param(n, roots):
                graph.erase_node(n)
        left = {p.name: [u.format_node() for u in p.users] for p in roots if p.users}
        assert not left, f"parameters still read after the gathers were inserted: {left}"
    graph.lint()
    gm.recompile()
    return gm


def _views_param(n: fx.Node, roots: set[fx.Node]) -> bool:
    """``n`` is a chain of view ops of one of ``roots``."""
    while n.op == "call_function" and n.target in _VIEWS and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n in roots


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _hoist_views(graph: fx.Graph, node: fx.Node) -> None:
    """Move ``node``, if it is a chain of view ops, up to right after what it views.

    The program's gradient outputs end in views made when the traced step took each
    gradient's local tensor (``DTensor.to_local``: an ``aten.view`` per gradient, traced
    after the whole joint graph), so every gradient's last producer sat at the program's
    end: every REDUCE_GRAD ran after the whole backward (no overlap) and every layer's
    gradients were alive at once, a full gradient copy at stage 3. A view reads nothing
    but its input and writes nothing, so moving it next to its input changes no value
    and no storage's lifetime.

    The per-rank program turns a ``view`` of a computed tensor into ``reshape``
    (:func:`autopar.passes.shard._reshape_computed_views`), so the trailing views are
    ``reshape`` there: they move too. The program is functional (nothing writes into a
    gradient or its views before REDUCE_GRAD reads it), so a ``reshape`` gives the same values
    right after its input, whether it views or copies. (Until 2026-12-07 the chain stopped at
    ``reshape``: from 2026-12-03, when that pass came, every REDUCE_GRAD was back at the
    program's end.)"""
    chain = []
    while node.op == "call_function" and node.target in _VIEWS and node.args and isinstance(node.args[0], fx.Node) \
            and all(a is node.args[0] for a in node.all_input_nodes):
        chain.append(node)
        node = node.args[0]
    for view in reversed(chain):  # outermost input first: each lands right after what it views
        view.args[0].append(view)


def _view_root(node: fx.Node) -> fx.Node:
    """What the chain of views (``reshape`` included, as :func:`_hoist_views` moves them) ends at."""
    while node.op == "call_function" and node.target in _VIEWS and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _sum_in_place(node: fx.Node) -> None:
    """Make a gradient that is a sum of two addends (a tied parameter's: the head's and the
    embedding's) add into one addend's buffer instead of a third one.

    Only where that is invisible: ``node`` is ``aten.add.Tensor(a, b)`` without ``alpha``, and
    the addend written (``b``, else ``a``) is a fresh contiguous result of a non-view op of
    the sum's shape and dtype that nothing else reads (so no view of it exists either)."""
    if node.op != "call_function" or node.target is not torch.ops.aten.add.Tensor or node.kwargs \
            or len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return
    out = node.meta.get("val")
    for i in (1, 0):
        x = node.args[i]
        val = x.meta.get("val")
        if x.op == "call_function" and x.target not in _VIEWS and len(x.users) == 1 \
                and isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) \
                and val.shape == out.shape and val.dtype == out.dtype and val.is_contiguous():
            node.target, node.args = torch.ops.aten.add_.Tensor, (x, node.args[1 - i])
            node.meta["val"] = val
            return


def _insert_reduce(graph: fx.Graph, params, outs: list, grad_outputs: dict[int, str], order) -> None:
    by_group: dict[int, list[tuple[str, fx.Node]]] = {}
    for i, fqn in grad_outputs.items():
        _hoist_views(graph, outs[i])
        _sum_in_place(_view_root(outs[i]))
        by_group.setdefault(params.group_of[fqn], []).append((fqn, outs[i]))
    order.update({n: i for i, n in enumerate(graph.nodes)})
    for g, items in by_group.items():
        members = params.groups[g]
        last = max((n for _, n in items), key=lambda n: order[n])
        # every addend of the group that this program yields, in ``groups`` order (a tied
        # parameter's two addends both count)
        items.sort(key=lambda item: members.index(item[0]))
        with graph.inserting_after(last):
            graph.call_function(params.grads_ready, (g, tuple(f for f, _ in items), *[n for _, n in items]))


def _insert_unshard(graph: fx.Graph, params, pnode: dict[str, fx.Node], forward: set, order, key: str) -> None:
    derived = _param_views(graph, set(pnode.values()))
    # (first reader, group, phase) for every group and phase the program reads
    firsts: dict[tuple[int, str], fx.Node] = {}
    readers: dict[fx.Node, dict[str, list[fx.Node]]] = {}
    for fqn, p in pnode.items():
        g = params.group_of[fqn]
        for user in _readers(p, derived):
            ph = "F" if user in forward else "B"
            readers.setdefault(p, {}).setdefault(ph, []).append(user)
            if (g, ph) not in firsts or order[user] < order[firsts[(g, ph)]]:
                firsts[(g, ph)] = user
    seq = sorted(firsts.items(), key=lambda kv: order[kv[1]])
    for k, ((g, ph), first) in enumerate(seq):
        nxt = seq[k + 1][0][0] if k + 1 < len(seq) else None
        with graph.inserting_before(first):
            call = graph.call_function(params.unshard, (g, f"{key}{k}", f"{key}{k + 1}", nxt))
            got = {f: graph.call_function(_item, (call, i)) for i, f in enumerate(params.groups[g])}
        for fqn in params.groups[g]:
            p = pnode.get(fqn)
            if p is None:
                continue
            for user in readers.get(p, {}).get(ph, []):
                _rewire(graph, user, p, got[fqn], derived)


def _item(values: tuple, i: int):
    return values[i]


def _param_views(graph: fx.Graph, roots: set[fx.Node]) -> dict[fx.Node, fx.Node]:
    """View nodes of a parameter (chains of view ops), mapped to the parameter they view."""
    out: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _VIEWS and n.args and isinstance(n.args[0], fx.Node):
            src = n.args[0]
            if src in roots:
                out[n] = src
            elif src in out:
                out[n] = out[src]
    return out


def _readers(p: fx.Node, derived: dict[fx.Node, fx.Node]) -> list[fx.Node]:
    """Nodes that read ``p`` or a view of it, other than the views themselves."""
    out, stack = [], list(p.users)
    while stack:
        u = stack.pop()
        if u in derived:
            stack.extend(u.users)
        else:
            out.append(u)
    return out


def _rewire(graph: fx.Graph, user: fx.Node, p: fx.Node, whole: fx.Node, derived: dict[fx.Node, fx.Node]) -> None:
    """Make ``user`` read ``whole`` where it read ``p`` (or a view of ``p``, re-made from ``whole``)."""
    made: dict[fx.Node, fx.Node] = {p: whole}

    def remake(n: fx.Node) -> fx.Node:
        if n in made:
            return made[n]
        src = remake(n.args[0])
        with graph.inserting_before(user):
            copy_ = graph.call_function(n.target, (src, *n.args[1:]), dict(n.kwargs))
        copy_.meta = dict(n.meta)
        made[n] = copy_
        return copy_

    def swap(a):
        if isinstance(a, fx.Node) and (a is p or derived.get(a) is p):
            return remake(a)
        return a

    user.args = fx.node.map_arg(user.args, swap)
    user.kwargs = fx.node.map_arg(user.kwargs, swap)

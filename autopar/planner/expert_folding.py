"""Expert parallelism folded over tp as well as dp (``fixed={"etp": 1}``): the sharding MIP's side.

Megatron-LM's "MoE parallel folding" (its ``--expert-tensor-parallel-size 1``): inside a
routed-experts block the tp ranks stop being tensor parallel and act as more data-parallel
ranks. Each tp rank routes its own share of the tokens (under sequence parallelism, the
sequence shard it already holds), the experts stay whole (no split of their hidden width),
and the ep group spans the tp ranks and ``ep / tp`` data-parallel ranks: ``ep = tp x k``
consecutive ranks of the world, each holding ``E / ep`` whole experts. Without folding
(``etp = tp``, autopar's default) each expert's hidden width is split over tp (Megatron's
MLP split per expert), every tp rank routes all of its group's tokens, and the ep group is
``ep`` data-parallel ranks of one tp column (:mod:`autopar.planner.experts`).

What folding changes is in the layout on the tp axis, so it is written as a strategy graph
whose experts-block ops each have one candidate (:func:`fold_experts`), the layout a
token-local block has on tp:

- a tensor with batch-derived dims (the block's tokens, their k routed copies, anything in
  token order) is split over tp along them: dim 1 of a (sequences, positions, ...) tensor, where
  sequence parallelism splits the residual stream (so under sp nothing is exchanged at the
  block's edges), else its first batch-derived dim (rows of flattened tokens);
- a stacked expert parameter (and every 3-d view or gradient of one) is split over tp on
  dim 0, the expert dim: a tp rank holds ``E / tp`` experts whole, and the search's ep cut
  (:func:`autopar.planner.experts.apply_ep`, by the ``ep / tp`` data-parallel part) leaves
  ``E / ep``;
- a value computed from token-split values without batch dims of its own (token counts per
  expert, the router's weight gradient, the balance loss's statistics), or by a sum or mean over
  the dim its input is split on (a per-sequence mean over a sequence split over tp), is partial
  over tp, a sum of the ranks' addends: the router's weight gradient is all-reduced over tp on its
  way to the parameter, as Megatron-LM does for parameters under sequence parallelism;
- anything else (the router's weight, constants) is whole.

The MIP prices the rest as for any layout: the block's compute and saved activations are
1/tp per rank, its edges are free where the neighbours hold the same split (sp) and pay an
all-gather or reduce-scatter where they do not. The all-to-alls over the ep group, which
now spans the tp ranks, are :func:`autopar.planner.experts.apply_ep`'s. Shared experts
(a child module named ``shared...``) keep the MIP's free choice: Megatron-LM runs them
tensor-parallel beside the routed experts.

:func:`autopar.parallelize` runs it (:func:`autopar.passes.folded.run_folded`, the groups in
:mod:`autopar.runtime.expert`; ``tests/dist/test_expert_folding_run.py`` trains it against one
process); the search weighs it beside the default wherever tp > 1 and the experts allow ep.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch
from torch import fx

from autopar.errors import PlanError
from autopar.passes import meta_keys as mk
from autopar.passes.strategies import Skeleton, StrategyGraph, Strategy
from autopar.planner.context import sequence_length
from autopar.planner.experts import ExpertSite

__all__ = ["block_roots", "block_ops", "fold_experts", "token_split"]


def block_roots(sites: list[ExpertSite]) -> dict[str, int]:
    """Module path of each experts block -> its expert count. The block is the module that
    routes: the experts op's own module (``examples/moe.py``'s ``MoE``), or its parent when the
    op runs in a child module named like ``experts`` (Hugging Face's ``mlp.experts``, routed by
    its sibling ``mlp.gate``)."""
    roots = {}
    for s in sites:
        parent, _, last = s.module.rpartition(".")
        roots[parent if "expert" in last.lower() and parent else s.module] = s.n_experts
    return roots


def _in_block(path: str, roots: dict[str, int]) -> str | None:
    """The block root ``path`` lies in (shared experts excluded), or None."""
    for root in roots:
        if path == root:
            return root
        if path.startswith(root + "."):
            child = path[len(root) + 1:].split(".")[0]
            return None if child.lower().startswith("shared") else root
    return None


def token_split(val, dims: frozenset[int], batch: int, seq: int | None = None) -> str | None:
    """The tp placement of a token-ordered value with batch-derived dims ``dims``: dim 1 of a
    (sequences, positions, ...) tensor (dim 0 the global ``batch`` of sequences; dim 1 a multiple
    of the ``seq`` tokens of a sequence: the positions, or their top-k copies), where sequence
    parallelism splits the residual stream; else its first batch-derived dim (the rows of
    flattened tokens, or of their top-k copies). None for a per-sequence value that has no
    positions (a statistic per sequence and expert): not split over tp."""
    first = min(dims)
    if first == 0 and isinstance(val, torch.Tensor) and val.dim() >= 2 and int(val.shape[0]) == batch:
        return "S1" if not seq or int(val.shape[1]) % seq == 0 else None
    return f"S{first}"


# reductions over listed dims: reducing the dim a token-split input is split on leaves a sum of the
# tp ranks' addends (the balance loss's per-sequence means over a sequence split over tp)
_REDUCTIONS = {torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim}


def _reduces_split(node: fx.Node, placement: str) -> bool:
    """Whether ``node`` reduces away the dim its first input is split on (``placement``)."""
    if node.target not in _REDUCTIONS or not placement.startswith("S") or len(node.args) < 2:
        return False
    rank = node.args[0].meta["val"].dim()
    dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    return int(placement[1:]) in {d % rank for d in dims}


def block_ops(gm: fx.GraphModule, sites: list[ExpertSite]) -> dict[fx.Node, str]:
    """The ops of ``gm`` that a fold puts on token shards, each with its block's root: forward
    and backward ops traced in an experts block (shared experts excluded), and the sums of a
    block's gradient addends that autograd adds outside any module (every tensor input theirs)."""
    roots = block_roots(sites)
    out: dict[fx.Node, str] = {}

    def producer(a: fx.Node) -> fx.Node:
        return a.args[0] if a.target is operator.getitem else a

    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or mk.TRACE not in node.meta:
            continue
        trace = node.meta[mk.TRACE]
        root = _in_block(trace.module_path, roots)
        if root is None and trace.role is mk.Role.BACKWARD and not trace.module_path:
            srcs = [producer(a) for a in node.all_input_nodes]
            if srcs and all(src in out for src in srcs):
                root = out[srcs[0]]
        if root is not None:
            out[node] = root
    return out


def _spreads_over_positions(node: fx.Node, val, batch: int, seq: int | None) -> bool:
    """An ``expand`` of a per-sequence value over the positions ((B, 1, ...) -> (B, T, ...): a
    statistic's gradient on its way back to the tokens): each tp rank expands it over its own
    positions, a free slice of the whole."""
    if node.target is not torch.ops.aten.expand.default or not isinstance(val, torch.Tensor) or val.dim() < 2:
        return False
    src = node.args[0].meta.get("val")
    return int(val.shape[0]) == batch and isinstance(src, torch.Tensor) and src.dim() == val.dim() \
        and int(src.shape[1]) == 1 and int(val.shape[1]) > 1 and (not seq or int(val.shape[1]) % seq == 0)


def _values(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    return tuple(val) if isinstance(val, (tuple, list)) else (val,)


def fold_experts(sg: StrategyGraph, skeleton: Skeleton, sites: list[ExpertSite]) -> StrategyGraph:
    """``sg`` (at tp = ``sg.axis_size`` > 1) with every op of an experts block given its one
    folded candidate and every stacked expert parameter split on the expert dim (module
    docstring). Raises :class:`PlanError` when a block's experts do not split evenly over tp."""
    tp = sg.axis_size
    roots = block_roots(sites)
    for root, n_experts in roots.items():
        if n_experts % tp:
            raise PlanError(f"etp=1 folds ep over tp={tp}, which must divide the {n_experts} experts of {root}; "
                            f"pick tp among {[d for d in range(1, n_experts + 1) if n_experts % d == 0]} or drop etp")
    expert_params = {p for s in sites for p in s.params}
    inputs: dict[int, dict[int, tuple[int, int]]] = {}  # dst -> dst_in -> (src, src_out)
    for e in sg.edges:
        if not e.virtual:
            inputs.setdefault(e.dst, {})[e.dst_in] = (e.src, e.src_out)
    nodes = list(sg.nodes)
    folded: dict[int, Strategy] = {}
    gm = skeleton.sources[0][0].graph.owning_module
    blocks = block_ops(gm, sites)
    seq = sequence_length(gm)
    for v, (snode, source) in enumerate(zip(sg.nodes, skeleton.sources)):
        if source is None:
            continue
        node = source[0]
        if snode.kind == "param" and snode.fqn in expert_params:
            nodes[v] = replace(snode, candidates=(Strategy(outs=("S0",), ins=("S0",)),))
            continue
        if snode.kind != "op" or node not in blocks:
            continue
        root = blocks[node]
        out_dims, in_dims = skeleton.batch_dims.get(node, ((), ()))
        n_in = len(snode.candidates[0].ins) if snode.candidates else len(in_dims)
        ins = []
        for i in range(n_in):
            src = inputs.get(v, {}).get(i)
            dims = in_dims[i] if i < len(in_dims) else frozenset()
            if src is not None and src[0] in folded:
                have = folded[src[0]].outs[src[1]] or "R"
                # a partial per-sequence statistic read by anything but a sum is summed over tp
                # first (the balance loss's means; Megatron-LM all-reduces them over its tp group)
                ins.append("R" if have == "P" and dims and node.target not in _REDUCTIONS else have)
            elif dims:
                arg_val = _values(skeleton.sources[src[0]][0])[src[1]] if src else None
                ins.append(token_split(arg_val, dims, sg.global_batch, seq) or "R")
            elif src is not None and sg.nodes[src[0]].kind == "param" and sg.nodes[src[0]].fqn in expert_params:
                ins.append("S0")
            else:
                ins.append("R")
        # a whole token-shaped value read beside token-split ones of its shape (a gradient expanded
        # from a per-sequence statistic) is read as this rank's slice of it (free: R -> S)
        shapes = [_values(skeleton.sources[src[0]][0])[src[1]] if (src := inputs.get(v, {}).get(i)) else None
                  for i in range(n_in)]
        # (per-sequence tensors only: a flattened rows tensor's slice would not be the rank's tokens)
        split = {tuple(a.shape) for a, p in zip(shapes, ins) if p.startswith("S") and isinstance(a, torch.Tensor)}
        ins = [(token_split(a, in_dims[i], sg.global_batch, seq) or p) if p == "R" and i < len(in_dims) and in_dims[i]
               and isinstance(a, torch.Tensor) and tuple(a.shape) in split and a.dim() >= 2
               and int(a.shape[0]) == sg.global_batch else p
               for i, (a, p) in enumerate(zip(shapes, ins))]
        tokens_in = any(p.startswith("S") or p == "P" for p in ins)  # (read from the rank's tokens)
        outs = []
        for k, val in enumerate(_values(node)):
            dims = out_dims[k] if k < len(out_dims) else frozenset()
            if not isinstance(val, torch.Tensor):
                outs.append(None)
            elif dims and ins and _reduces_split(node, ins[0]):
                outs.append("P")  # (its batch dims are whole sequences' sums over their tp shares)
            elif dims and token_split(val, dims, sg.global_batch, seq) and (
                    not ins or any(p.startswith("S") for p in ins)
                    or _spreads_over_positions(node, val, sg.global_batch, seq)):
                outs.append(token_split(val, dims, sg.global_batch, seq))  # (a factory numbers the rank's tokens)
            elif dims:
                # a per-sequence value: read from the rank's tokens (a sum of their addends), or from
                # whole values only (a summed statistic, its gradient)
                outs.append("P" if tokens_in else "R")
            elif val.dim() >= 3 and int(val.shape[0]) == roots[root]:
                outs.append("S0")  # a stacked expert weight's view or gradient: E / tp experts per rank
            elif tokens_in:
                outs.append("P")  # a sum over the rank's tokens
            else:
                outs.append("R")
        folded[v] = Strategy(outs=tuple(outs), ins=tuple(ins))
        nodes[v] = replace(snode, candidates=(folded[v],))
    if not folded:
        raise PlanError("etp=1 folds ep over tp, but no experts block was found in the traced graph")
    return replace(sg, nodes=tuple(nodes))

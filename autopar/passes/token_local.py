"""Mixture-of-experts routing, run on each data-parallel rank's own tokens.

A routed-experts block sorts its tokens by expert, runs the experts on the sorted rows
and puts the results back in token order. Taken op by op, the sort and the gathers by
index are not batch-parallel (``argsort`` of the batch-split expert ids needs every id,
``x[order]`` with a batch-split index reads any row), so DTensor, asked to run them on
tensors split over dp, gathers the whole batch on every rank and runs every token's
experts everywhere: dp all-gathers the planner never priced, and dp times the expert
work. Taken as a block, though, routing is a function of each token alone (sort, experts,
un-sort), so each rank may route its own tokens: the sort gives local row numbers, the
gathers read local rows, the experts see the rank's rows (and its token counts, the local
addend of the batch's counts), and the un-sort brings them back to the rank's token order.
That is what the planner prices (every op of the block on the rank's share of the batch),
and what expert parallelism needs: the experts' all-to-all dispatches each rank's own
tokens (:mod:`autopar.experts`).

The block is recognised by :func:`autopar.experts.moe_experts`: every sort, index, scatter
or expert op traced inside the module that calls it runs here, on local shards, when one
of its tensor arguments is split over dp. Everything else in the block (the router,
softmax, views, the balance loss's means) stays with DTensor, which keeps the batch split
through them and reduces what must be reduced (a mean over the batch).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._pytree import tree_leaves, tree_map

from autopar.passes import meta_keys as mk

__all__ = ["expert_ops", "token_local_nodes", "run_token_local", "split_on_dp"]

_aten = torch.ops.aten
# ops whose rows are the block's tokens (or their k copies) and that DTensor would gather
_ROUTING_OPS = {_aten.sort.default, _aten.sort.stable, _aten.index.Tensor, _aten.index_put.default,
                _aten._unsafe_index_put.default, _aten.scatter.src, _aten.scatter.value, _aten.gather.default,
                _aten.scatter_add.default, _aten.index_add.default, _aten.index_select.default}


def expert_ops() -> set:
    """The experts ops of :mod:`autopar.experts` (forward and backward)."""
    import autopar.experts  # noqa: F401  (registers the ops)

    return {torch.ops.autopar.moe_experts.default, torch.ops.autopar.moe_experts_backward.default}


def token_local_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The routing nodes of every experts block in ``gm`` (see the module docstring)."""
    experts = expert_ops()
    blocks = {n.meta[mk.TRACE].module_path for n in gm.graph.nodes
              if n.op == "call_function" and n.target in experts and mk.TRACE in n.meta}
    if not blocks:
        return set()
    wanted = _ROUTING_OPS | experts
    return {n for n in gm.graph.nodes if n.op == "call_function" and n.target in wanted
            and mk.TRACE in n.meta and n.meta[mk.TRACE].module_path in blocks}


def _weight_args(node: fx.Node) -> range:
    """Positions of the expert weights among the op's arguments (whole on every dp rank)."""
    if node.target == torch.ops.autopar.moe_experts.default:  # (x, counts, w_gate, w_up, w_down, group)
        return range(2, 5)
    if node.target == torch.ops.autopar.moe_experts_backward.default:  # (grad_y, x, counts, w..., group)
        return range(3, 6)
    return range(0)


def split_on_dp(args: Any, dp_dim: int) -> bool:
    """Whether any tensor argument is split (or partial) over dp: the node then runs token-local."""
    return any(isinstance(a, DTensor) and not a.placements[dp_dim].is_replicate() for a in tree_leaves(args))


def run_token_local(node: fx.Node, args: tuple, kwargs: dict, tp_outs: tuple, mesh: DeviceMesh, tp_dim: int,
                    dp_dim: int, token_sizes: set[int]):
    """Run ``node``'s op on this rank's tokens; outputs split over dp like its token inputs.

    Arguments split over dp on dim 0 give their local rows; an argument partial over dp
    (the batch's tokens per expert, a sum over the batch) gives this rank's addend, its own
    counts; a replicated argument whose dim 0 is a token dim of the split ones (the zeros
    an index_put of the backward fills) gives this rank's rows of it; the expert weights
    stay whole. Outputs with the local token count on dim 0 are split over dp; the expert
    weight gradients are partial over dp (each rank's tokens' share).

    ``tp_outs``: the outputs' placements on tp (from the plan). ``token_sizes``: the dim-0
    sizes seen split over dp so far in the program (the batch, its tokens B*T, their k
    copies B*T*k); a replicated argument whose dim 0 is one of them is token-indexed (the
    zeros of a backward index_put, made for all B*T tokens)."""
    dp = mesh.size(dp_dim)
    tokens = set(token_sizes)  # global sizes of the token dims
    for a in tree_leaves((args, kwargs)):
        if isinstance(a, DTensor):
            p = a.placements[dp_dim]
            if p.is_shard():
                if p.dim != 0:
                    raise NotImplementedError(f"{node.format_node()}: an argument is split over dp on dim {p.dim}; "
                                              f"routing runs token-local only on dim 0")
                tokens.add(a.shape[0])
    weights = _weight_args(node)

    def local(a: Any, weight: bool) -> Any:
        if not isinstance(a, DTensor):
            return a
        if a.placements[dp_dim].is_replicate() and not weight and a.dim() > 0 and a.shape[0] in tokens:
            pls = list(a.placements)
            pls[dp_dim] = Shard(0)
            a = a.redistribute(mesh, pls)  # Replicate -> Shard: this rank's rows, no communication
        return a.to_local()

    # (index lists, [idx], hold tensors too: tree_map reaches them)
    local_args = [tree_map(lambda v, w=i in weights: local(v, w), a) for i, a in enumerate(args)]
    local_kwargs = tree_map(lambda v: local(v, False), kwargs)
    result = node.target(*local_args, **local_kwargs)
    local_tokens = {t // dp for t in tokens}
    outs = iter(tp_outs)
    is_backward = node.target == torch.ops.autopar.moe_experts_backward.default

    def wrap(k: int, v: Any) -> Any:
        tp_out = next(outs, Replicate())
        if not isinstance(v, torch.Tensor):
            return v
        pls = [Replicate()] * mesh.ndim
        pls[tp_dim] = tp_out
        if is_backward and k > 0:  # an expert weight gradient: this rank's tokens' addend
            pls[dp_dim] = Partial()
            return DTensor.from_local(v, mesh, pls, run_check=False)
        if v.dim() == 0 or v.shape[0] not in local_tokens:
            raise NotImplementedError(f"{node.format_node()}: output of shape {tuple(v.shape)} has no token dim "
                                      f"(local token counts {sorted(local_tokens)}); cannot run it token-local")
        pls[dp_dim] = Shard(0)  # (every rank holds as many tokens: the batch splits evenly over dp)
        return DTensor.from_local(v, mesh, pls, run_check=False)

    if isinstance(result, (tuple, list)):
        return type(result)(wrap(k, v) for k, v in enumerate(result))
    return wrap(0, result)

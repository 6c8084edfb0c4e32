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

The block is recognised by its experts op: :func:`autopar.experts.moe_experts` (as
Hugging Face's gated-SiLU experts are traced too), or the grouped matmul other Hugging Face
experts run with (``aten._grouped_mm``, or
``transformers::grouped_mm_fallback`` where that kernel does not apply, e.g. fp32 on CPU,
with offsets from ``histc``/``cumsum`` of the sorted expert ids). Every sort, index,
scatter, count (``histc``, ``cumsum``), token-numbering ``arange`` or experts op traced
inside the module that calls it runs here, on local shards, when one of its tensor
arguments is split (or partial) over dp. Everything else in the block (the router,
softmax, views, the balance loss's means) stays with DTensor, which keeps the batch split
through them and reduces what must be reduced (a mean over the batch).

Inside the block index values are local (a rank's row numbers), which is what each rank's
routing computes; only token-ordered results leave it (the experts' output back in token
order, split over dp like the tokens) and sums over the rank's tokens (token counts, expert
weight gradients: partial over dp, summed where DTensor or the runtime sums them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._pytree import tree_leaves, tree_map

from autopar.passes import meta_keys as mk

__all__ = ["op_name", "token_local_nodes", "run_token_local", "split_on_dp", "EXPERT_OPS"]

_aten = torch.ops.aten
# ops whose rows are the block's tokens (or their k copies) and that DTensor would gather, and the
# token counts and offsets routing derives from them
_ROUTING_OPS = {_aten.sort.default, _aten.sort.stable, _aten.index.Tensor, _aten.index_put.default,
                _aten._unsafe_index_put.default, _aten.scatter.src, _aten.scatter.value, _aten.gather.default,
                _aten.scatter_add.default, _aten.index_add.default, _aten.index_select.default,
                _aten.histc.default, _aten.cumsum.default, _aten.arange.default}
# experts ops by name: the rows they return follow their first argument (x, or the output
# gradient), the weight gradients a backward returns are sums over the rank's tokens
EXPERT_OPS = {"autopar::moe_experts", "autopar::moe_experts_backward", "aten::_grouped_mm",
               "transformers::grouped_mm_fallback", "transformers::grouped_mm_fallback_backward"}


def op_name(node: fx.Node) -> str:
    """``namespace::op`` of an ATen or custom op node, without its overload ("" for others)."""
    name = getattr(node.target, "name", None)
    return name().split(".")[0] if callable(name) else ""


def token_local_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The routing nodes of every experts block in ``gm`` (see the module docstring)."""
    blocks = {n.meta[mk.TRACE].module_path for n in gm.graph.nodes
              if n.op == "call_function" and op_name(n) in EXPERT_OPS and mk.TRACE in n.meta}
    if not blocks:
        return set()
    return {n for n in gm.graph.nodes if n.op == "call_function" and mk.TRACE in n.meta
            and (n.target in _ROUTING_OPS or op_name(n) in EXPERT_OPS)
            and n.meta[mk.TRACE].module_path in blocks and (n.target is not _aten.arange.default
                                                            or _numbers_tokens(n))}


def _numbers_tokens(node: fx.Node) -> bool:
    """An ``arange(end)`` written as the values of index_puts (an inverse permutation:
    ``inv[perm] = arange(n)``): it numbers the tokens, so under dp it numbers the rank's own."""
    return len(node.args) == 1 and not node.kwargs.get("step") and bool(node.users) and all(
        u.target in (_aten.index_put.default, _aten._unsafe_index_put.default) and len(u.args) > 2
        and u.args[2] is node for u in node.users)


def split_on_dp(node: fx.Node, args: Any, dp_dim: int) -> bool:
    """Whether a routing node runs token-local: a tensor argument is split (or partial) over dp,
    or it numbers the tokens (an ``arange`` :func:`token_local_nodes` kept) and dp > 1."""
    if node.target is _aten.arange.default:
        return True
    return any(isinstance(a, DTensor) and not a.placements[dp_dim].is_replicate() for a in tree_leaves(args))


def _follows(node: fx.Node, k: int) -> tuple[int, int | None] | None:
    """Which argument output ``k`` is split over dp like: (position, index in a list argument or
    None); None when the output is a sum over the rank's tokens instead (partial over dp)."""
    if op_name(node) in EXPERT_OPS:  # the rows out (y, or grad_x), then weight gradients
        return (0, None) if k == 0 else None
    t = node.target
    if t is _aten.index.Tensor:
        return (1, 0)  # rows picked by the first index tensor
    if t is _aten.gather.default:
        return (2, None)
    if t is _aten.index_select.default:
        return (2, None) if node.args[1] == 0 else (0, None)
    if t is _aten.histc.default:
        return None
    return (0, None)  # sort, cumsum, and index_put/scatter into their first argument


def _destination(node: fx.Node) -> bool:
    """Ops writing into their first argument by index: a replicated destination is token rows."""
    return node.target in (_aten.index_put.default, _aten._unsafe_index_put.default, _aten.scatter.src,
                           _aten.scatter.value, _aten.scatter_add.default, _aten.index_add.default)


def run_token_local(node: fx.Node, args: tuple, kwargs: dict, tp_outs: tuple, mesh: DeviceMesh, tp_dim: int,
                    dp_dim: int):
    """Run ``node``'s op on this rank's tokens; its outputs split over dp like the tokens they follow.

    Arguments split over dp on dim 0 give their local rows; an argument partial over dp
    (the batch's tokens per expert, a sum over the batch) gives this rank's addend, its own
    counts; a replicated destination of an index_put or scatter (the zeros a backward fills,
    made for all the batch's tokens) gives this rank's rows of it; the expert weights and
    anything else replicated stay whole. An output is split over dp like the argument whose
    rows it follows (:func:`_follows`); a sum over the rank's tokens (token counts per expert,
    their running sums, the expert weight gradients) is partial over dp. A token-numbering
    ``arange`` (the positions an inverse permutation writes) numbers the rank's tokens.

    ``tp_outs``: the outputs' placements on tp (from the plan)."""
    dp = mesh.size(dp_dim)
    if node.target is _aten.arange.default:  # (end,): this rank's positions 0 .. end/dp - 1
        local = torch.arange(args[0] // dp, **kwargs)
        pls = [Replicate()] * mesh.ndim
        pls[dp_dim] = Shard(0)
        return DTensor.from_local(local, mesh, pls, run_check=False)
    for a in tree_leaves((args, kwargs)):
        if isinstance(a, DTensor) and a.placements[dp_dim].is_shard() and a.placements[dp_dim].dim != 0:
            raise NotImplementedError(f"{node.format_node()}: an argument is split over dp on dim "
                                      f"{a.placements[dp_dim].dim}; routing runs token-local only on dim 0")
    placed = list(args)
    if _destination(node) and isinstance(args[0], DTensor) and args[0].placements[dp_dim].is_replicate():
        pls = list(args[0].placements)
        pls[dp_dim] = Shard(0)
        placed[0] = args[0].redistribute(mesh, pls)  # Replicate -> Shard: this rank's rows, no communication
    local_args = tree_map(lambda v: v.to_local() if isinstance(v, DTensor) else v, placed)
    local_kwargs = tree_map(lambda v: v.to_local() if isinstance(v, DTensor) else v, kwargs)
    result = node.target(*local_args, **local_kwargs)
    outs = iter(tp_outs)

    def dp_placement(k: int):
        src = _follows(node, k)
        if src is None:
            return Partial()  # a sum over this rank's tokens
        a = placed[src[0]]
        if src[1] is not None:
            a = a[src[1]]
        p = a.placements[dp_dim] if isinstance(a, DTensor) else Replicate()
        return Shard(0) if p.is_shard() else p

    def wrap(k: int, v: Any) -> Any:
        tp_out = next(outs, Replicate())
        if not isinstance(v, torch.Tensor):
            return v
        pls = [Replicate()] * mesh.ndim
        pls[tp_dim] = tp_out
        pls[dp_dim] = dp_placement(k)  # (a split: every rank holds as many tokens, the batch splits evenly)
        return DTensor.from_local(v, mesh, pls, run_check=False)

    if isinstance(result, (tuple, list)):
        return type(result)(wrap(k, v) for k, v in enumerate(result))
    return wrap(0, result)

"""The ops of an experts block whose ep the plan folds over tp as well (``etp=1``), at run time.

:mod:`autopar.planner.expert_folding` gives every op of such a block one layout on tp, the one a
token-local block has: tensors in token order split over tp along their tokens, the experts split
on their expert dim, sums over the rank's tokens partial. :func:`run_folded` runs an op so: on tp,
on this rank's shard as if the tp ranks were more data-parallel ranks (each its own tokens, the
experts whole); on dp as the op would run without tp (DTensor on the dp sub-mesh, the routing
token-local: :mod:`autopar.passes.token_local`). The traced program was traced whole over tp, so
the sizes it gives an op (a view's, a factory's) are the whole ones: they are divided to the
shard's here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils._pytree import tree_leaves, tree_map

from autopar.passes.dtensor_rules import dtensor_dispatches
from autopar.passes.token_local import run_token_local, split_on_dp

if TYPE_CHECKING:
    from autopar.passes.shard import OpPlacements

__all__ = ["run_folded"]


# ops taking a list of sizes (position of the list), which a folded op is given for its tp shard
_SIZED = {torch.ops.aten.view.default: 1, torch.ops.aten._unsafe_view.default: 1, torch.ops.aten.reshape.default: 1,
          torch.ops.aten.expand.default: 1, torch.ops.aten.new_zeros.default: 1, torch.ops.aten.new_empty.default: 1,
          torch.ops.aten.new_ones.default: 1, torch.ops.aten.new_full.default: 1, torch.ops.aten.zeros.default: 0,
          torch.ops.aten.ones.default: 0, torch.ops.aten.empty.memory_format: 0, torch.ops.aten.full.default: 0,
          torch.ops.aten.slice_backward.default: 1, torch.ops.aten.select_backward.default: 1}


def _tp_local_sizes(node: fx.Node, args: tuple, outs: tuple, tp: int) -> tuple:
    """``args`` with the sizes a folded op is given (global ones, in the trace) divided by tp on the
    dim its output is split on over tp: the tp rank's shard. An ``arange`` numbering the tokens
    numbers the rank's."""
    out = outs[0] if outs else None
    if not out or not out.startswith("S"):
        return args
    d = int(out[1:])
    if node.target is torch.ops.aten.arange.default and d == 0 and len(args) == 1:
        return (args[0] // tp,)
    at = _SIZED.get(node.target)
    if at is None or len(args) <= at:
        return args
    sizes = list(args[at])
    if d < len(sizes) and sizes[d] != -1:
        sizes[d] = sizes[d] // tp
    return (*args[:at], sizes, *args[at + 1:])


def run_folded(node: fx.Node, args, kwargs, rule: OpPlacements, mesh: DeviceMesh, tp_dim: int, dp_dim: int, *,
               routing: bool = False):
    """An op of an experts block whose ep the plan folds over tp as well (``etp=1``,
    :mod:`autopar.planner.expert_folding`): on tp it runs on this rank's shard as if the tp ranks
    were more data-parallel ranks (each its own tokens, the experts whole), with the plan's
    placements declared on tp; on dp it runs as it would without tp: DTensor on the dp sub-mesh,
    the routing ops token-local (:func:`run_token_local`). Sizes the op is given are its tp shard's
    (:func:`_tp_local_sizes`)."""
    from autopar.passes.shard import _run_local, placement  # (shard runs this module's ops: imported when run)

    args = _tp_local_sizes(node, args, rule.outs, mesh.size(tp_dim))
    if routing and split_on_dp(node, (args, kwargs), dp_dim):
        return run_token_local(node, args, kwargs, tuple(placement(o) for o in rule.outs), mesh, tp_dim, dp_dim)
    if not dtensor_dispatches(node.target) and any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs))):
        return _run_local(node, args, kwargs, rule, mesh, tp_dim, dp_dim)  # (local shards, batch-parallel on dp)
    with disable_proxy_modes_tracing():  # (torch 2.11 builds a sub-mesh by indexing a tensor: not into the program)
        sub = mesh[mesh.mesh_dim_names[dp_dim]]

    def down(v):
        return DTensor.from_local(v.to_local(), sub, [v.placements[dp_dim]], run_check=False) \
            if isinstance(v, DTensor) else v

    args, kwargs = tree_map(down, (args, kwargs))
    if sub.size() == 1:  # (one dp rank: its values are all of dp's)
        local = tree_map(lambda v: v.to_local() if isinstance(v, DTensor) else v, (args, kwargs))
        result = node.target(*local[0], **local[1])
    else:
        result = node.target(*args, **kwargs)
    outs = iter(rule.outs)
    # a mean over the rank's share of the tokens: the tp ranks' means average (the sum of them does not)
    mean = node.target is torch.ops.aten.mean.dim

    def up(v):
        o = next(outs, "R")
        if not isinstance(v, torch.Tensor):
            return v
        pls = [Replicate()] * mesh.ndim
        pls[dp_dim] = v.placements[0] if isinstance(v, DTensor) else Replicate()
        pls[tp_dim] = Partial("avg") if o == "P" and mean else placement(o)
        return DTensor.from_local(v.to_local() if isinstance(v, DTensor) else v, mesh, pls, run_check=False)

    return type(result)(up(v) for v in result) if isinstance(result, (tuple, list)) else up(result)

"""Loss parallelism: the cross-entropy over logits split along the classes (the vocabulary).

A language model's head is column-parallel under tensor parallelism: each tp rank computes
its slice of the vocabulary's logits. Gathering them for the loss costs a (tokens x vocab)
all-gather and a whole fp32 copy of the logits per rank, the largest activation of a
large-vocabulary model (Qwen3's 151,936 classes x 65,536 tokens: 40 GB in fp32). Megatron's
vocab-parallel cross-entropy and torchtitan's ``loss_parallel`` instead reduce over the
classes in place: a per-row max and sum of exponentials for the log-softmax, and a per-row
sum for the picked log-probability, each an all-reduce of one value per token.

This module is both halves of that for autopar's per-op plans:

- planning: :func:`loss_rules` adds, for the four ATen ops the cross-entropy is traced into
  (``_log_softmax``, ``nll_loss_forward``, ``nll_loss_backward``,
  ``_log_softmax_backward_data``), the strategy that keeps the class dim split
  (:mod:`autopar.passes.dtensor_rules` offers it beside DTensor's own); :data:`REDUCES` and
  :func:`row_count` tell the cost model the all-reduces it runs inside the op.
- running: :func:`run_loss_parallel` executes one of those ops on its local class shard
  with the all-reduces over tp (:mod:`autopar.passes.shard` calls it).

Why not DTensor's ``torch.distributed.tensor.parallel.loss_parallel``: its handlers are a
pair that only works together (its NLL backward returns the gradient of the *logits* and its
log-softmax backward passes that through unchanged), because it serves a whole
``cross_entropy`` call. autopar's planner places every op on its own, so the MIP may split
the classes of one op and not of the next; each op here computes exactly its own ATen
result. Its mean reduction is also refused on a (dp, tp) mesh before torch 2.13, and the
mean here divides by the tokens counted over the whole data-parallel batch, as autopar's
dp loss does (:func:`autopar.passes.shard._token_mean_nll`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._functional_collectives import all_reduce
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = ["LOSS_OPS", "REDUCES", "loss_rules", "row_count", "class_split", "run_loss_parallel"]

_aten = torch.ops.aten
_LOG_SOFTMAX = _aten._log_softmax.default
_LOG_SOFTMAX_BWD = _aten._log_softmax_backward_data.default
_NLL = _aten.nll_loss_forward.default
_NLL_BWD = _aten.nll_loss_backward.default

LOSS_OPS = frozenset({_LOG_SOFTMAX, _LOG_SOFTMAX_BWD, _NLL, _NLL_BWD})

REDUCES = {_LOG_SOFTMAX: 2, _NLL: 1, _NLL_BWD: 0, _LOG_SOFTMAX_BWD: 1}
"""All-reduces of one fp32 value per row each op runs inside when its classes are split: the
row max and the sum of exponentials; the picked log-probability; none (the gradient lands on
the shard that holds the target); the row sum of the incoming gradient."""

_NONE, _MEAN = 0, 1  # ATen's reduction enum (2: sum)


def _class_input(op) -> int:
    """Position (among the op's tensor inputs) of the input whose class dim is split."""
    return 1 if op is _NLL_BWD else 0


def _class_dim(op, args) -> int:
    """The split (class) dim of the op's class input."""
    if op in (_LOG_SOFTMAX, _LOG_SOFTMAX_BWD):
        return args[2 if op is _LOG_SOFTMAX_BWD else 1] % args[0].dim()
    return 1


def loss_rules(op, args, ins, outs) -> list[list]:
    """The class-split strategy of ``op`` in DTensor's single-axis form (``[out..., in...]``),
    or no rows. ``args``/``ins``/``outs``: :mod:`autopar.passes.dtensor_rules`' signatures."""
    if op in (_LOG_SOFTMAX, _LOG_SOFTMAX_BWD):
        dim = args[2 if op is _LOG_SOFTMAX_BWD else 1] % len(ins[0].shape)
        return [[Shard(dim)] + [Shard(dim)] * len(ins)]
    if len(ins[_class_input(op)].shape) != 2:  # (tokens, classes) only, as the loss is traced
        return []
    if op is _NLL:  # ins: log-probs, target[, weight] -> loss, total weight
        return [[Replicate(), Replicate(), Shard(1)] + [Replicate()] * (len(ins) - 1)]
    # nll_loss_backward ins: grad, log-probs, target[, weight], total weight -> grad of the log-probs
    return [[Shard(1), Replicate(), Shard(1)] + [Replicate()] * (len(ins) - 2)]


def _traced_args(node: torch.fx.Node) -> tuple:
    """``node``'s arguments with each tensor node replaced by its traced value."""
    return tuple(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args)


def row_count(node: torch.fx.Node) -> int:
    """Rows of ``node``'s class-dim reduction (tokens): the size of each inner all-reduce."""
    args = _traced_args(node)
    x = args[_class_input(node.target)]
    return x.numel() // max(1, x.shape[_class_dim(node.target, args)])


def class_split(node: torch.fx.Node, ins: tuple[str, ...]) -> bool:
    """Whether a plan's tp placements ``ins`` of a loss op split its classes."""
    if node.target not in LOSS_OPS or not ins:
        return False
    return ins[_class_input(node.target)] == f"S{_class_dim(node.target, _traced_args(node))}"


def _shard_span(size: int, n: int, rank: int) -> tuple[int, int]:
    """(offset, length) of ``rank``'s piece of a dim of ``size`` split ``n`` ways: torch.chunk's
    rule (ceil-sized pieces, the last ones short or empty), which is DTensor's ``Shard``."""
    piece = -(-size // n)
    start = min(size, rank * piece)
    return start, min(size, start + piece) - start


def run_loss_parallel(node: torch.fx.Node, args: tuple, mesh: DeviceMesh, tp_dim: int, dp_dim: int) -> Any:
    """Run loss op ``node`` on DTensors whose classes are split over tp (``args``: the op's
    arguments, already in the plan's placements); returns what the op returns, as DTensors."""
    op = node.target
    dim = _class_dim(op, args)
    x = args[_class_input(op)]
    group = mesh.get_group(tp_dim)
    offset, length = _shard_span(x.shape[dim], mesh.size(tp_dim), mesh.get_local_rank(tp_dim))
    if x.to_local().shape[dim] != length:
        raise RuntimeError(f"{node.format_node()}: the local class shard has {x.to_local().shape[dim]} "
                           f"classes, expected {length} (torch.chunk's split of {x.shape[dim]})")
    if op is _LOG_SOFTMAX:
        return _like(_log_softmax(x.to_local(), dim, args[2], group), x)
    if op is _LOG_SOFTMAX_BWD:
        grad, out = args[0].to_local(), args[1].to_local()
        total = all_reduce(grad.sum(dim, keepdim=True), "sum", group)
        return _like((grad - torch.exp(out) * total).to(args[3]), x)
    if op is _NLL:
        return _nll(x, args[1], args[2], args[3], args[4], offset, group, mesh, tp_dim, dp_dim)
    grad, target, weight, reduction, ignore, total = args[0], args[2], args[3], args[4], args[5], args[6]
    rows_w = _row_weights(target.to_local(), weight, ignore, x.dtype)
    g = grad.to_local()
    if reduction == _MEAN:
        g = g / total.to_local()
    coef = -(rows_w * g)
    local, inside = _local_target(target.to_local(), ignore, offset, length)
    src = torch.where(inside, coef, torch.zeros_like(coef)).unsqueeze(1).to(x.dtype)
    out = torch.zeros_like(x.to_local()).scatter(1, local.unsqueeze(1), src)
    return _like(out, x)


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool, group) -> torch.Tensor:
    """ATen's ``_log_softmax`` decomposition with the row max and sum reduced over ``group``."""
    result_dtype = torch.float32 if half_to_float else x.dtype
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()  # the computation dtype of a reduced-precision softmax
    shifted = x - all_reduce(torch.amax(x, dim, keepdim=True), "max", group)
    sumexp = all_reduce(torch.sum(torch.exp(shifted), dim, keepdim=True), "sum", group)
    return (shifted - torch.log(sumexp)).to(result_dtype)


def _row_weights(target: torch.Tensor, weight, ignore: int, dtype) -> torch.Tensor:
    """Each row's class weight (0 for ignored rows)."""
    kept = target != ignore
    if weight is None:
        return kept.to(dtype)
    w = weight.to_local() if isinstance(weight, DTensor) else weight
    return torch.where(kept, w[torch.where(kept, target, 0)], 0).to(dtype)


def _local_target(target: torch.Tensor, ignore: int, offset: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets as column numbers of this shard (clamped into it), and which rows this shard holds."""
    local = target - offset
    inside = (target != ignore) & (local >= 0) & (local < length)
    return local.clamp(0, max(length - 1, 0)), inside


def _nll(x: DTensor, target: DTensor, weight, reduction: int, ignore: int, offset: int, group,
         mesh: DeviceMesh, tp_dim: int, dp_dim: int):
    """``nll_loss_forward`` of (tokens, classes) log-probabilities split along the classes."""
    xl, tl = x.to_local(), target.to_local()
    local, inside = _local_target(tl, ignore, offset, xl.shape[1])
    picked = xl.gather(1, local.unsqueeze(1)).squeeze(1)
    picked = all_reduce(torch.where(inside, picked, torch.zeros_like(picked)), "sum", group)
    rows_w = _row_weights(tl, weight, ignore, xl.dtype)
    losses = -(picked * rows_w)
    dp_split = x.placements[dp_dim].is_shard()
    pls = list(x.placements)
    pls[tp_dim] = Replicate()
    if reduction == _NONE:
        pls[dp_dim] = target.placements[dp_dim]
        return (DTensor.from_local(losses, mesh, pls, run_check=False, shape=target.shape, stride=target.stride()),
                DTensor.from_local(xl.new_zeros(()), mesh, [Replicate()] * mesh.ndim, run_check=False))
    acc = torch.promote_types(xl.dtype, torch.float32)  # (fp32 for bf16 logits; fp64 stays fp64)
    counted = rows_w.to(acc).sum()
    if dp_split:  # the batch's denominator: counted tokens summed over dp
        counted = all_reduce(counted, "sum", mesh.get_group(dp_dim))
        pls[dp_dim] = Partial("sum")
    # summed and divided in fp32, rounded once to the logits' dtype, as ATen's kernel does
    total = losses.to(acc).sum()
    loss = (total / counted if reduction == _MEAN else total).to(xl.dtype)
    return (DTensor.from_local(loss, mesh, pls, run_check=False),
            DTensor.from_local(counted.to(xl.dtype), mesh, [Replicate()] * mesh.ndim, run_check=False))


def _like(local: torch.Tensor, x: DTensor) -> DTensor:
    """``local`` as this rank's piece of a tensor placed and shaped like ``x`` (the global shape
    given: with an uneven split, every rank would infer another from its own piece)."""
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())

"""Shard the joint graph: one rank's local program, with collectives where placements change.

Two layers, both plain fx + DTensor (no planner, no process-group setup):

- ``run_joint`` interprets the joint forward+backward graph over DTensors on the
  (dp, tp) mesh. Before each op every tensor argument is redistributed to the
  placement chosen for that op on the tp axis (its dp placement is left as it
  is: the batch stays split over dp); DTensor then runs the op on local shards
  with local shapes (views and reshapes included) and inserts the collectives a
  change of placement needs. Ops DTensor has no rule for (the CPU
  flash-attention kernels) run on the local shards under autopar's own rule
  (batch and heads are independent), which the planner priced; the cross-entropy's ops
  with their classes split over tp run as :mod:`autopar.passes.loss_parallel` computes
  them (DTensor keeps its own loss-parallel rules out of its dispatch). DTensor is the
  engine, rather than hand-rewritten view shapes, so that execution uses the
  same sharding semantics the planner read its candidate strategies from.
- ``shard_joint_graph`` traces that interpretation with ``make_fx`` into the
  per-rank program: local-shape ATen ops and ``_c10d_functional`` collectives
  (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all; on
  gloo, all-to-all becomes all-gather + slice), nothing of DTensor left. It
  runs at the speed of the ops, and ``gm.code`` is the readable program
  (``autopar plan ... --emit DIR`` writes it).

Contract of ``shard_joint_graph(gm, ...)``:
  needs: ``gm`` from ``trace_joint`` at the global micro-batch size, with
    ``meta[TRACE]`` and ``meta[LAYER]``; per op node its tp placements
    (``ops``); the parameters as DTensors; an initialised process group and mesh.
  produces: a new GraphModule ``step(*param_shards, *inputs) -> (loss, *grad_addends)``:
    ``param_shards`` each trainable parameter's tp shard, whole on dp;
    ``inputs`` the global micro-batch (each rank slices its dp part inside);
    ``loss`` the micro-batch's global mean loss, replicated; ``grad_addends``
    per parameter this rank's addend of the gradient on its tp shard, to be
    summed over dp (all-reduce or reduce-scatter by ZeRO stage) once per step
    after micro-batch accumulation; ``meta[GRAD_RETURNS]`` on the program lists
    the addends that are still Partial (to sum) or Shard(dim) pieces (to gather)
    on tp, because their parameter is replicated there. ``gm`` is not modified.
  raises: whatever DTensor raises for a placement it cannot run.

Each value is redistributed once per target placement, and that copy serves every
consumer that needs it, as the planner prices it ("a tensor resharded once serves
all its consumers").

The data-parallel gradient reduction, ZeRO's parameter gathers and the tp
collectives that return gradients to replicated parameters are not in this program
on purpose: they happen once per step (after accumulating micro-batches), bucketed,
in :mod:`autopar.runtime.zero`, as the planner prices gradient returns (bandwidth,
no per-tensor latency).
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx import traceback as fx_traceback
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx
from torch.utils._pytree import tree_leaves, tree_map

from autopar.passes import meta_keys as mk
from autopar.passes.dtensor_rules import dtensor_dispatches
from autopar.passes.loss_parallel import class_split, run_loss_parallel
from autopar.passes.folded import run_folded
from autopar.passes.scatter_rows import SCATTER_OPS, run_scatter_rows
from autopar.passes.token_local import run_token_local, split_on_dp, token_local_nodes

__all__ = ["OpPlacements", "placement", "run_joint", "interpret", "grad_partial", "grad_addends",
           "shard_joint_graph", "random_ops"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpPlacements:
    ins: tuple[str, ...]
    outs: tuple[str | None, ...]
    folded: bool = False
    """An op of an experts block whose ep the plan folds over tp (``etp=1``): it runs on the tp
    rank's own tokens (:func:`run_folded`)."""


def placement(s: str | None):
    """Plan strings ("R", "P", "S<d>") to DTensor placements."""
    if s is None or s == "R":
        return Replicate()
    if s == "P":
        return Partial()
    return Shard(int(s[1:]))


def _wrap_replicated(value: Any, mesh: DeviceMesh) -> Any:
    """Factory ops (arange, zeros) make plain tensors, identical on every rank."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return value


class _Reshards:
    """Each value's redistributed copies, one per target placement, shared by all its consumers.

    The planner prices "a tensor resharded once serves all its consumers" (the coverage
    form in :mod:`autopar.planner.ilp`); redistributing per consumer would issue the
    collective again for each (the norm output of a Llama block gathered once for each of
    wq, wk and wv). Copies are keyed by the source DTensor (held here, so its ``id`` stays
    unique) and its target placements, and dropped with :meth:`drop` after the source's
    last consumer has run.
    """

    def __init__(self) -> None:
        self._copies: dict[int, tuple[DTensor, dict[tuple, DTensor]]] = {}

    def get(self, v: DTensor, want: tuple, make) -> DTensor:
        source, copies = self._copies.setdefault(id(v), (v, {}))
        assert source is v, "a cached source was released before its last consumer"
        if want not in copies:
            copies[want] = make()
        return copies[want]

    def drop(self, value: Any) -> None:
        """Forget ``value``'s copies. (A tuple's elements are read through getitem nodes,
        whose values they are: those are dropped after their own last consumer.)"""
        if isinstance(value, DTensor):
            self._copies.pop(id(value), None)


def _redistribute(args: Any, wanted: tuple[str, ...], mesh: DeviceMesh, tp_dim: int,
                  reshards: _Reshards | None = None) -> Any:
    it = iter(wanted)
    reshards = reshards if reshards is not None else _Reshards()

    def move(v):
        if not isinstance(v, DTensor):
            return v
        want = list(v.placements)
        want[tp_dim] = placement(next(it, "R"))
        if tuple(want) == tuple(v.placements):
            return v
        if want[tp_dim].is_partial() and not v.placements[tp_dim].is_partial():
            moved = reshards.get(v, tuple(want), lambda: _to_partial(v, mesh, tp_dim, want))
        else:
            moved = reshards.get(v, tuple(want), lambda: v.redistribute(mesh, want))
        note_tp_placement(moved, tp_dim)  # (a copy made on one stage may be read on the next)
        return moved

    return tree_map(move, args)


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def note_tp_placement(value: Any, tp_dim: int) -> None:
    """While ``make_fx`` traces, write each DTensor's tp placement onto the program node that makes its
    local tensor (``meta[TP_PLACEMENT]``; "?" where DTensors of two placements share a node, e.g.
    ``from_local`` reinterpreting one tensor).

    The pipeline reads it to send a value replicated on tp as 1/tp pieces, all-gathered on the receiving
    stage (:mod:`autopar.runtime.pipeline`). The per-rank program keeps no DTensors, so this is the only
    moment the placement and the node meet; a tensor the tracer does not track (a constant) gets no mark
    and is sent whole. ``get_proxy_slot`` is the tracer's own lookup of a tensor's node (none is public)."""
    mode = get_proxy_mode()
    if mode is None:
        return
    for v in tree_leaves(value):
        if not isinstance(v, DTensor) or v.device_mesh.size(tp_dim) == 1:
            continue
        slot = get_proxy_slot(v._local_tensor, mode.tracer, None)
        if slot is None:
            continue
        p = v.placements[tp_dim]
        mark = "R" if p.is_replicate() else "P" if p.is_partial() else f"S{p.dim}" if type(p) is Shard else "?"
        node = slot.proxy.node
        node.meta[mk.TP_PLACEMENT] = mark if node.meta.get(mk.TP_PLACEMENT, mark) == mark else "?"


def _contiguous(v: Any) -> Any:
    """A DTensor whose local shard and global strides are both contiguous. (A shard with a batch of 1
    counts as contiguous locally whatever its strides, while the global strides DTensor derives from
    them may not be: view would then refuse the global shape.)"""
    if not isinstance(v, DTensor):
        return v
    stride = tuple(math.prod(v.shape[d + 1:]) for d in range(v.dim()))
    if v.to_local().is_contiguous() and tuple(v.stride()) == stride:
        return v
    return DTensor.from_local(v.to_local().contiguous(), v.device_mesh, v.placements, run_check=False,
                              shape=v.shape, stride=stride)


_RANDOM_LIKE = {torch.ops.aten.native_dropout.default, torch.ops.aten.bernoulli.p,
                torch.ops.aten.rand_like.default, torch.ops.aten.randn_like.default}


def _random_like(op, args, kwargs, mesh: DeviceMesh):
    """A random op shaped like its DTensor argument, drawn whole and then sliced.

    Every rank draws the op's *global* shape from its default generator, in graph order,
    and keeps its own part (Replicate -> Shard is a local slice, no communication). So the
    values are the same whatever the mesh: tp ranks that hold a replicated activation drop
    the same entries, dp ranks take their rows of one mask, and with one micro-batch per
    step the masks are exactly those of the model run eagerly in one process from the
    same generator state (``F.dropout`` on CPU draws like ``native_dropout`` on ones).
    The ranks' generators must agree: ``ParallelModule`` starts them from rank 0's state.
    The price is drawing the whole tensor on every rank, cheap beside the matmuls.
    """
    like = args[0]
    pls = [Replicate() if p.is_partial() else p for p in like.placements]

    def place(t: torch.Tensor) -> DTensor:
        whole = DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return whole.redistribute(mesh, pls) if any(not p.is_replicate() for p in pls) else whole

    if op is torch.ops.aten.native_dropout.default:  # (input, p, train) -> (input * keep / (1 - p), keep)
        scaled, keep = op(torch.ones(like.shape, dtype=like.dtype, device=mesh_tensor_device(mesh)), *args[1:],
                          **kwargs)
        return like * place(scaled), place(keep)
    return place(op(torch.empty(like.shape, dtype=like.dtype, device=mesh_tensor_device(mesh)), *args[1:], **kwargs))


def mesh_tensor_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors on ``mesh`` live on (the current CUDA device for a cuda mesh).
    The joint graph was traced on fake CPU tensors, so its factory ops (``aten.full``,
    ``aten.arange``, ...) name ``device=cpu``: :func:`interpret` creates them here instead."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def on_mesh_device(kwargs: dict[str, Any], mesh: DeviceMesh) -> dict[str, Any]:
    """An op's keyword arguments with a traced ``device=`` (the fake trace's CPU) replaced by the mesh's."""
    if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type != mesh.device_type:
        return {**kwargs, "device": mesh_tensor_device(mesh)}
    return kwargs


def random_ops(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` that draw random numbers (dropout, ``rand``, ...)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in n.target.tags]


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


def _split_token_mean(args, kwargs, dp_dim: int) -> bool:
    """A mean cross-entropy over a batch split on dp (not over sharded classes), with plain arguments."""
    if kwargs or len(args) != 5 or args[3] != 1 or not isinstance(args[0], DTensor):
        return False
    x, target, weight = args[:3]
    split = x.placements[dp_dim]
    return (x.device_mesh.size(dp_dim) > 1 and split.is_shard() and isinstance(target, DTensor)
            and target.placements[dp_dim] == split and all(p.is_replicate() for i, p in enumerate(x.placements)
                                                            if i != dp_dim)
            and (weight is None or all(p.is_replicate() for p in weight.placements)))


def _token_mean_nll(args, mesh: DeviceMesh, dp_dim: int):
    """``nll_loss_forward`` (mean) of a batch split over dp, with the batch's denominator: each rank's
    sum over its tokens divided by the number of counted tokens summed over dp (an all-reduce of
    one number). DTensor's own rule divides by the rank's own count and averages the ranks'
    means, which differs when ranks count different numbers of tokens (``ignore_index``
    labels, e.g. the last token of each sequence, which under cp one rank holds); its backward
    already uses the summed count, so this makes the loss agree with its gradient and with one
    process. Returns (loss Partial(sum) on dp, total weight replicated), as the op's outputs."""
    from torch.distributed._functional_collectives import all_reduce

    x, target, weight, _, ignore_index = args
    local_w = weight.to_local() if weight is not None else None
    total, counted = torch.ops.aten.nll_loss_forward.default(x.to_local(), target.to_local(), local_w, 2,
                                                              ignore_index)
    counted = all_reduce(counted, "sum", mesh.get_group(dp_dim))
    pls = list(x.placements)
    pls[dp_dim] = Partial("sum")
    loss = DTensor.from_local(total / counted, mesh, pls, run_check=False)
    return loss, DTensor.from_local(counted, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _dtensor_or_local(node: fx.Node, args, kwargs, rule: OpPlacements, mesh: DeviceMesh, tp_dim: int, dp_dim: int):
    """The op on DTensors, or on local shards (:func:`_run_local`) where DTensor's own rule fails here
    or returns a DTensor of the wrong rank: torch 2.14's ``convolution_backward`` without the input
    gradient on a 2-D mesh (ViT's first layer), 2.11's ``constant_pad_nd`` (the label shift)."""
    try:
        out = tree_map(lambda v: _wrap_replicated(v, mesh), node.target(*args, **kwargs))
        if any(isinstance(v, DTensor) and len(v.placements) != mesh.ndim for v in tree_leaves(out)):
            raise RuntimeError(f"an output's placements do not match the {mesh.ndim}-D mesh")
        return out
    except Exception as e:  # DTensor's rule, not the op: the local run raises the op's own errors again
        log.warning("DTensor cannot run %s on these placements (%s); running it on local shards", node.target,
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return _run_local(node, args, kwargs, rule, mesh, tp_dim, dp_dim)


def _run_local(node: fx.Node, args, kwargs, rule: OpPlacements, mesh: DeviceMesh, tp_dim: int, dp_dim: int):
    """An op DTensor cannot dispatch (or not here): run it on local shards under the plan's rule.
    On dp it is batch-parallel when its first tensor input is split on a batch dim and
    every tensor output carries that dim (attention): inputs with that batch are split
    like the first, the others are whole. Otherwise (e.g. a grouped-matmul backward whose
    weight gradient sums over the tokens) every input is made whole on dp and the op runs
    replicated there, which is correct for any op."""
    first = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, DTensor))
    split = first.placements[dp_dim]
    outs_val = node.meta.get("val")
    outs_val = outs_val if isinstance(outs_val, (tuple, list)) else (outs_val,)
    if not split.is_shard() or not all(
            o.dim() > split.dim and o.shape[split.dim] == first.shape[split.dim]
            for o in outs_val if isinstance(o, torch.Tensor)):
        split = Replicate()

    def align(v):
        if not isinstance(v, DTensor):
            return v
        want = Replicate()  # broadcast along the batch (size 1), or no batch: every rank needs all of it
        if split.is_shard() and v.dim() > split.dim and v.shape[split.dim] == first.shape[split.dim]:
            want = split  # same batch: take this rank's part
        if v.placements[dp_dim] == want:
            return v
        pls = list(v.placements)
        pls[dp_dim] = want
        return v.redistribute(mesh, pls)

    args, kwargs = tree_map(align, (args, kwargs))
    local = tree_map(lambda v: v.to_local() if isinstance(v, DTensor) else v, (args, kwargs))
    result = node.target(*local[0], **local[1])
    outs = iter(rule.outs)

    def wrap(v):
        o = next(outs, "R")
        if not isinstance(v, torch.Tensor):
            return v
        pls = [Replicate()] * mesh.ndim
        pls[dp_dim] = split  # batch-parallel on dp, or replicated
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
    outputs = interpret(gm, mesh=mesh, ops=ops, params=params, inputs=inputs, loss_scale=loss_scale,
                        tp_dim=tp_dim, dp_dim=dp_dim)
    loss = outputs[info.loss_output]
    grads = {fqn: outputs[i] for fqn, i in info.grad_outputs.items()}
    return loss, grads


def interpret(gm: fx.GraphModule, *, mesh: DeviceMesh, ops: dict[str, OpPlacements],
              params: dict[str, DTensor], inputs: dict[str, torch.Tensor], loss_scale: float,
              tp_dim: int = 1, dp_dim: int = 0) -> tuple:
    """:func:`run_joint`'s engine: the joint graph's whole output tuple, over DTensors.

    Each node runs under ``fx.traceback.set_current_meta``, so a ``make_fx`` trace
    taken under ``preserve_node_meta`` copies the node's ``meta["custom"]`` (the
    pipeline stage tags) onto every op and collective it records for it.
    """
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    env: dict[fx.Node, Any] = {}
    reshards = _Reshards()
    last_reader: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        for a in node.all_input_nodes:
            last_reader[a] = node
    done_after: dict[fx.Node, list[fx.Node]] = {}
    for a, reader in last_reader.items():
        done_after.setdefault(reader, []).append(a)
    routing = token_local_nodes(gm) if mesh.size(dp_dim) > 1 else set()
    for node in gm.graph.nodes:
        with fx_traceback.set_current_meta(node):
            if node.op == "output":
                return fx.node.map_arg(node.args[0], lambda a: env[a])
            _run_node(node, env, info, mesh=mesh, ops=ops, params=params, inputs=inputs, loss_scale=loss_scale,
                      tp_dim=tp_dim, dp_dim=dp_dim, reshards=reshards, token_local=node in routing)
            note_tp_placement(env.get(node), tp_dim)
        for a in done_after.get(node, ()):  # no consumer left: its resharded copies can go
            reshards.drop(env[a])
    raise ValueError("the joint graph has no output node")


def _run_node(node: fx.Node, env: dict[fx.Node, Any], info: mk.GraphTrace, *, mesh, ops, params, inputs,
              loss_scale, tp_dim, dp_dim, reshards: _Reshards, token_local: bool = False) -> None:
    trace = node.meta[mk.TRACE]
    if node.op == "placeholder":
        if trace.role in (mk.Role.PARAM, mk.Role.BUFFER):
            env[node] = params[trace.fqn]
        elif trace.role is mk.Role.INPUT:
            value = inputs[trace.fqn]
            pls = [Replicate()] * mesh.ndim
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == info.global_batch \
                    and mesh.size(dp_dim) > 1:  # (DTensor will not merge a Shard(0) batch of 1 into a view)
                pls[dp_dim] = Shard(0)  # the batch is split over dp
            env[node] = distribute_tensor(value, mesh, pls, src_data_rank=None) \
                if isinstance(value, torch.Tensor) else value
        else:  # the loss tangent
            val = node.meta["val"]
            seed = torch.full(tuple(val.shape), loss_scale, dtype=val.dtype, device=mesh_tensor_device(mesh))
            env[node] = distribute_tensor(seed, mesh, [Replicate()] * mesh.ndim, src_data_rank=None)
        return
    if node.op == "get_attr":  # a graph constant: the same value on every rank
        env[node] = _wrap_replicated(getattr(node.graph.owning_module, node.target), mesh)
        return
    if node.op != "call_function":
        return
    args = fx.node.map_arg(node.args, lambda a: env[a])
    kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a])
    kwargs = on_mesh_device(kwargs, mesh)
    if node.target is operator.getitem:
        env[node] = args[0][args[1]]
        return
    rule = ops.get(node.name)
    if rule is not None:
        args, kwargs = _redistribute((args, kwargs), rule.ins, mesh, tp_dim, reshards)
    if node.target in _VIEWS:  # a resharded local shard may be strided; view needs contiguous
        args = tree_map(_contiguous, args)
    has_dtensor = any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs)))
    try:
        if node.target in _RANDOM_LIKE and isinstance(args[0], DTensor):
            env[node] = _random_like(node.target, args, kwargs, mesh)
        elif rule is not None and not kwargs and class_split(node, rule.ins):  # the loss over split classes
            env[node] = run_loss_parallel(node, args, mesh, tp_dim, dp_dim)
        elif node.target is torch.ops.aten.nll_loss_forward.default and _split_token_mean(args, kwargs, dp_dim):
            env[node] = _token_mean_nll(args, mesh, dp_dim)
        elif rule is not None and rule.folded:  # an experts block folded over tp: this tp rank's tokens
            env[node] = run_folded(node, args, kwargs, rule, mesh, tp_dim, dp_dim, routing=token_local)
        elif token_local and split_on_dp(node, (args, kwargs), dp_dim):  # experts' routing: own tokens
            env[node] = run_token_local(node, args, kwargs, tuple(placement(o) for o in (rule.outs if rule else ())),
                                        mesh, tp_dim, dp_dim)
        elif node.target in SCATTER_OPS and (rows := run_scatter_rows(node.target, args, kwargs)) is not None:
            env[node] = rows  # each rank's rows, on releases whose DTensor rule would gather them too
        elif has_dtensor and rule is not None:  # (on local shards where DTensor has no rule for the op)
            run = _dtensor_or_local if dtensor_dispatches(node.target) else _run_local
            env[node] = run(node, args, kwargs, rule, mesh, tp_dim, dp_dim)
        else:
            env[node] = tree_map(lambda v: _wrap_replicated(v, mesh), node.target(*args, **kwargs))
    except Exception as e:  # name the node: the op, its placements, where it came from
        pls = [f"{tuple(a.shape)}{list(a.placements)}" for a in tree_leaves((args, kwargs))
               if isinstance(a, DTensor)]
        raise RuntimeError(f"{node.format_node()} (module {node.meta[mk.TRACE].module_path!r}, "
                           f"arguments {pls}, plan {rule}) failed: {e}") from e


def grad_partial(g: DTensor, *, mesh: DeviceMesh, tp_placement: str, dp_dim: int = 0, tp_dim: int = 1,
                 keep_tp: bool = False):
    """A gradient as this rank's local addend: tp placed like its parameter, Partial on dp.

    ``keep_tp`` leaves the tp placement as it is (the runtime finishes it, see
    :func:`grad_addends`)."""
    want = list(g.placements)
    if not keep_tp:
        want[tp_dim] = placement(tp_placement)
        if want[tp_dim].is_partial() and not g.placements[tp_dim].is_partial():
            want[tp_dim] = Replicate()  # a partial parameter placement is not a thing; keep it whole
    if want[dp_dim].is_shard():
        want[dp_dim] = Replicate()
    if tuple(want) != tuple(g.placements):
        g = g.redistribute(mesh, want)
    local = g.to_local()
    if not g.placements[dp_dim].is_partial() and mesh.get_local_rank(dp_dim) != 0:
        local = torch.zeros_like(local)  # replicated on dp: one rank contributes the value
    return local


def _grad_return(fqn: str, g: DTensor, tp_placement: str, tp_dim: int) -> mk.GradReturn | None:
    """The tp collective that takes ``g`` to its parameter's placement, when the runtime
    can issue it bucketed: Partial -> Replicate (all-reduce) or Shard(dim) -> Replicate
    (all-gather of torch.chunk pieces). Anything else stays in the program."""
    have = g.placements[tp_dim]
    if tp_placement != "R" or g.device_mesh.size(tp_dim) == 1:
        return None
    nbytes = g.numel() * g.element_size()
    if have.is_partial() and have.reduce_op == "sum":
        return mk.GradReturn(fqn=fqn, kind="all_reduce", dim=None, shape=tuple(g.shape), nbytes=nbytes)
    if type(have) is Shard:  # (not a _StridedShard: its pieces are not plain chunks)
        return mk.GradReturn(fqn=fqn, kind="all_gather", dim=have.dim, shape=tuple(g.shape), nbytes=nbytes)
    return None


def grad_addends(grads: list[tuple[str, DTensor]], *, mesh: DeviceMesh, tp_placements: dict[str, str],
                 dp_dim: int = 0, tp_dim: int = 1) -> tuple[list[torch.Tensor], tuple[mk.GradReturn, ...]]:
    """This rank's local addend of each (parameter, gradient) and the tp collectives left to the runtime.

    The planner prices gradients returning to their parameters bucketed (bandwidth, no
    per-tensor latency), so a gradient that is Partial or Shard(dim) on tp while its
    parameter is replicated leaves the program as it is; the runtime sums or gathers
    such gradients in one bucket per (collective, dtype) once per step
    (:meth:`autopar.runtime.zero.ShardedParams.reduce_gradients`). A parameter with
    several addends (a tied embedding's, one per pipeline stage) is deferred only if
    all its addends need the same collective, since the runtime adds them first.
    """
    found: dict[str, set] = {}
    for fqn, g in grads:
        found.setdefault(fqn, set()).add(_grad_return(fqn, g, tp_placements.get(fqn, "R"), tp_dim))
    returns = {fqn: next(iter(rs)) for fqn, rs in found.items() if len(rs) == 1 and None not in rs}
    local = [grad_partial(g, mesh=mesh, tp_placement=tp_placements.get(fqn, "R"), dp_dim=dp_dim, tp_dim=tp_dim,
                          keep_tp=fqn in returns) for fqn, g in grads]
    return local, tuple(returns.values())


def shard_joint_graph(gm: fx.GraphModule, *, mesh: DeviceMesh, ops: dict[str, OpPlacements],
                      params: dict[str, DTensor], frozen: dict[str, DTensor], trainable: list[str],
                      tp_placements: dict[str, str], inputs: dict[str, Any], loss_scale: float,
                      tracing_mode: str = "real", addends: list[tuple[str, int]] | None = None,
                      keep_tags: bool = False) -> fx.GraphModule:
    """This rank's step program (see the module docstring).

    ``addends`` lists the gradient outputs the program returns after the loss, as
    (parameter, index in ``gm``'s outputs); by default each trainable parameter's.
    ``keep_tags`` copies each joint-graph node's ``meta["custom"]`` onto the ops
    traced for it (the pipeline pass reads its stage tags there).
    """
    names = list(inputs)
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    addends = addends if addends is not None else [(n, info.grad_outputs[n]) for n in trainable]

    def step(*flat):
        shards, values = flat[: len(trainable)], flat[len(trainable):]
        ps = {n: DTensor.from_local(local, mesh, params[n].placements, run_check=False,
                                    shape=params[n].shape, stride=params[n].stride())
              for n, local in zip(trainable, shards)}
        outputs = interpret(gm, mesh=mesh, ops=ops, params={**ps, **frozen}, inputs=dict(zip(names, values)),
                            loss_scale=loss_scale)
        partials, found = grad_addends([(n, outputs[i]) for n, i in addends], mesh=mesh, tp_placements=tp_placements)
        returns[:] = found
        return (outputs[info.loss_output].full_tensor(), *partials)

    returns: list[mk.GradReturn] = []

    example = [params[n].to_local() for n in trainable] + [inputs[n] for n in names]
    if keep_tags:
        with fx_traceback.preserve_node_meta():
            program = make_fx(step, tracing_mode=tracing_mode)(*example)
    else:
        program = make_fx(step, tracing_mode=tracing_mode)(*example)
    program.graph.eliminate_dead_code(is_impure_node=_impure)
    _reshape_computed_views(program.graph)
    program.recompile()
    program.meta[mk.GRAD_RETURNS] = tuple(returns)
    return program


def _impure(node: fx.Node) -> bool:
    """fx's test of a node that dead-code elimination must keep, except that an op whose only
    randomness is a ``dropout_p`` of 0 is pure. The SDPA kernels carry the ``nondeterministic_seeded``
    tag for their dropout, so fx keeps an unused call. On CUDA, DTensor's sharding propagation of
    cuDNN attention leaves one such call in the traced program, on empty tensors of the CPU
    (torch 2.11 on an H200, bench/gpu_check.py), which the step would then run and fail on."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
            and torch.Tag.nondeterministic_seeded in node.target.tags:
        schema = node.target._schema.arguments
        names = [a.name for a in schema]
        if "dropout_p" in names:
            i = names.index("dropout_p")
            p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", schema[i].default_value)
            if p == 0:
                return False
    return node.is_impure()


def _reshape_computed_views(graph: fx.Graph) -> None:
    """``view`` of a computed tensor becomes ``reshape`` (a view where the strides allow, else a copy).

    The program is traced on fake tensors, and ``view`` is recorded where the fake strides allow
    it. Some kernels lay their output out otherwise than their fake (meta) implementation says:
    on CPU, ``softplus_backward`` follows a transposed gradient's layout, (1024, 1, 32), where the
    fake tensor is contiguous, (1024, 32, 1) (torch 2.13; Qwen3.5's gated delta rule), and a
    ``view`` to (128, 32) downstream then fails at run time. The program is functional (no op
    writes into its inputs or into a view), so ``reshape`` computes the same values whether it
    views or copies. Views whose chain starts at a placeholder (parameters, inputs: strides this
    rank made itself) stay views: the ZeRO program pass follows those chains
    (:mod:`autopar.runtime.zero_program`)."""
    views = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in views:
            continue
        root = n.args[0]
        while isinstance(root, fx.Node) and root.op == "call_function" and root.target in views:
            root = root.args[0]
        if isinstance(root, fx.Node) and root.op != "placeholder":
            n.target = torch.ops.aten.reshape.default

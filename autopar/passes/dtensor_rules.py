"""DTensor's sharding rules, asked one fx node at a time.

This is the only module in autopar that touches torch's private DTensor
sharding-propagation internals. It answers: for this ATen op call (an fx node
whose tensor arguments are nodes carrying FakeTensors in ``node.meta["val"]``)
on a device mesh of these axis sizes, which strategies are valid? A strategy
(`Candidate`) is one placement per mesh axis for every output tensor and the
placements it requires of every tensor input.

Where the answers come from, in order (checked on torch 2.11, 2.13 and 2.14; the counts are
2.13's: rules move from the classic registry to the single-dim one release by release, 584 and 4
on 2.11, 19 and 1220 on 2.14):

1. DTensor's single-dim registry, ``ShardingPropagator.op_single_dim_strategy_funcs``
   (~1013 ops: pointwise, mm, layer_norm, embedding, ...). Each entry is a
   ``_SingleDimStrategyInfo`` whose ``func(op, args_meta, kwargs_meta)`` lists
   the rules for ONE mesh axis as ``[out..., in...]`` placement lists, with
   ``_ShardingPlaceholder(d)`` standing for "any shard of dim d" and the
   all-Replicate rule left implicit. We resolve placeholders to ``Shard(d)``,
   add the all-Replicate rule and take the cartesian product over mesh axes
   (what ``single_dim_strategy._expand_single_dim_strategy_to_mesh`` does for
   one runtime input placement), dropping combinations whose shards do not
   fit the tensor or that mix Partial kinds. DTensor dispatch prefers this
   registry when an op is in both, and so do we.
2. DTensor's classic registry, ``ShardingPropagator.op_strategy_funcs`` (~158
   ops: reductions, softmax, nll_loss, views, cat/split, GPU SDPA, ...): each
   ``func(OpSchema) -> OpStrategy`` needs a DeviceMesh and, for every tensor
   input, an ``OpStrategy`` of the placements the input may arrive in; many of
   them (views, reductions) map each input placement to an output placement.
   We offer every placement that fits (Replicate, Partial("sum"), Shard(d) per
   axis) and collect what comes back. The mesh is built without a process
   group (``DeviceMesh(..., _init_backend=False)``), so no global state.
3. autopar's own rules, for ops DTensor lacks (``_OWN_RULES``): the CPU flash
   attention pair ``_scaled_dot_product_flash_attention_for_cpu`` (+ backward)
   shards batch (dim 0) or heads (dim 1) like DTensor's GPU SDPA rule; the
   constant-fill factories (full, zeros, ones, empty) and the functional
   ``fill.Scalar`` may produce any sharding; autopar's experts op
   (:func:`autopar.experts.moe_experts`, + backward) splits each expert's hidden
   width (Megatron's MLP split, per expert), its rows a partial sum.
   The cross-entropy's four ops (log-softmax, NLL and their backwards) also get the
   strategy that keeps the classes split (:mod:`autopar.passes.loss_parallel`), beside
   DTensor's own, which only split the batch; ``scatter`` (.src, .value) gets the one that
   keeps rows split off its scatter dim (:mod:`autopar.passes.scatter_rows`), which DTensor
   has from 2.13 on only.
4. The fallback (``fallback=True``, autopar's own, source ``"fallback"``): the
   all-Replicate candidate, plus for ops tagged ``torch.Tag.pointwise`` Shard(d)
   on every output dim, with each input sharded on its broadcast-aligned dim
   (or replicated where it broadcasts).

Contract of `op_candidates`:
    needs   a ``call_function`` node whose target is an ``OpOverload``; every
            tensor argument is an fx Node with a Tensor (usually a FakeTensor)
            in ``meta["val"]``; ``meta["val"]`` of the node itself holds its
            output(s). SymInt sizes are read through their hints.
    returns a deduplicated list of `Candidate` in a deterministic order. The
            entries of ``Candidate.inputs`` follow `tensor_inputs(node)`: the
            tensor-valued nodes in ``node.args`` then ``node.kwargs``, lists
            flattened, repeats kept. ``Candidate.outputs`` has one entry per
            element of ``meta["val"]`` (one for a single tensor), None where
            that element is not a tensor.
    raises  TypeError for nodes that are not ATen op calls (placeholders,
            ``operator.getitem``: a getitem's placement is its producer's
            ``outputs[i]``); `UnsupportedOpError` (a LookupError) when
            ``fallback=False`` and neither DTensor nor autopar has a rule, or
            DTensor's rule failed on these arguments.
    never   mutates the node or the graph; results are cached per (op, tensor
            shapes/strides/dtypes, other arguments, mesh_shape).

Candidates hold Replicate, Shard and Partial placements, including Partial
kinds other than "sum" (avg, max, min: a pointwise op passes them through) and
DTensor's ``_MaskPartial`` (a Partial subclass: a row-sharded embedding's output
and, on the input side, its indices, which are replicated and masked locally).
Shards may be uneven (DTensor only requires dim size >= number of shards).
Candidates that would hold DTensor's private ``_StridedShard`` (e.g. flattening
(B, T) while T is sharded) are dropped: the rest of autopar does not model it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._ops import OpOverload
from torch.distributed.tensor.placement_types import (
    _StridedShard,
    Partial,
    Placement,
    Replicate,
    Shard,
)

import autopar.experts  # noqa: F401  (registers torch.ops.autopar.moe_experts, which has a rule here)
from autopar.passes.loss_parallel import LOSS_OPS, loss_rules
from autopar.passes.scatter_rows import SCATTER_OPS, scatter_rule

logger = logging.getLogger(__name__)

aten = torch.ops.aten

Placements = tuple[Placement, ...]  # one per mesh axis

# Unbacked SymInts have no hint; use inductor's default guess for their size.
_UNBACKED_SIZE_GUESS = 8192


class UnsupportedOpError(LookupError):
    """No sharding rule for an op (neither DTensor's nor autopar's)."""


@dataclass(frozen=True)
class Candidate:
    """One strategy of one op call on one mesh.

    outputs: per output of the op, its placements (one per mesh axis), or None
        where that output is not a tensor.
    inputs: per tensor input (ordered as `tensor_inputs(node)`), the placements
        the op needs it in.
    source: "dtensor" (either DTensor registry), "autopar" (own rule),
        "loss_parallel" (a cross-entropy op with its classes split) or "fallback".
    """

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements, ...]
    source: str

    @property
    def output(self) -> Placements:
        """The placements of the op's only tensor output."""
        tensors = [o for o in self.outputs if o is not None]
        if len(tensors) != 1:
            raise ValueError(f"op has {len(tensors)} tensor outputs; use .outputs")
        return tensors[0]


# ---------------------------------------------------------------------------
# Access to torch's private registries (the only place that names them).


def _propagator():
    from torch.distributed.tensor import DTensor  # import registers the rules

    try:
        prop = DTensor._op_dispatcher.sharding_propagator
        prop.op_strategy_funcs, prop.op_single_dim_strategy_funcs  # noqa: B018
    except AttributeError as e:
        raise RuntimeError(
            f"torch {torch.__version__} moved DTensor's private sharding registries "
            f"({e}); autopar/passes/dtensor_rules.py must be updated"
        ) from e
    return prop


def _placeholder_type() -> type:
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder

    return _ShardingPlaceholder


@functools.lru_cache(maxsize=None)
def _mesh(mesh_shape: tuple[int, ...]):
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(math.prod(mesh_shape), dtype=torch.int).reshape(mesh_shape)
    return DeviceMesh("cpu", ranks, _init_backend=False, _rank=0)


def registry_info() -> dict[str, int]:
    """How many ops each registry knows (a sanity check against torch upgrades)."""
    prop = _propagator()
    return {
        "op_strategy_funcs": len(prop.op_strategy_funcs),
        "single_dim": len(prop.op_single_dim_strategy_funcs),
        "autopar": len(_OWN_RULES),
    }


def has_rule(op: OpOverload) -> bool:
    """Whether DTensor or autopar has a rule for ``op`` (the fallback aside)."""
    prop = _propagator()
    return (
        op in prop.op_single_dim_strategy_funcs
        or op in prop.op_strategy_funcs
        or op in _OWN_RULES
    )


def dtensor_dispatches(op: OpOverload) -> bool:
    """Whether DTensor itself can run ``op`` on DTensors (autopar's own rules aside)."""
    prop = _propagator()
    return op in prop.op_single_dim_strategy_funcs or op in prop.op_strategy_funcs


# ---------------------------------------------------------------------------
# Public entry points.


def tensor_inputs(node: torch.fx.Node) -> tuple[torch.fx.Node, ...]:
    """The tensor-valued argument nodes of ``node``, in `Candidate.inputs` order."""

    def leaves(a: Any):
        if isinstance(a, torch.fx.Node):
            if _is_tensor_node(a):
                yield a
        elif isinstance(a, (list, tuple)):
            for x in a:
                yield from leaves(x)

    return tuple(leaves((tuple(node.args), tuple(node.kwargs.values()))))


def op_candidates(
    node: torch.fx.Node, mesh_shape: tuple[int, ...], *, fallback: bool = True
) -> list[Candidate]:
    """The sharding strategies of ``node``'s op on a mesh of ``mesh_shape``.

    See the module docstring for the contract and where the rules come from.
    """
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        hint = " (use the producer's outputs[i])" if node.target is operator.getitem else ""
        raise TypeError(f"op_candidates needs an ATen op call, got {node.format_node()}{hint}")
    mesh_shape = tuple(mesh_shape)
    if not mesh_shape or any(not isinstance(s, int) or s < 1 for s in mesh_shape):
        raise ValueError(f"mesh_shape must be a non-empty tuple of positive ints, got {mesh_shape}")
    args = _signature(node.args)
    kwargs = tuple((k, _signature(v)) for k, v in node.kwargs.items())
    outs = _output_signature(node.meta.get("val"))
    key = (node.target, args, kwargs, outs, mesh_shape, fallback)
    try:
        hash(key)
    except TypeError:
        result, error = _compute.__wrapped__(*key)
    else:
        result, error = _compute(*key)
    if result is None:
        why = f"DTensor's rule failed: {error}" if error else "no rule in DTensor or autopar"
        raise UnsupportedOpError(f"{node.target}: {why}; node: {node.format_node()}")
    return list(result)


# ---------------------------------------------------------------------------
# Node arguments -> hashable signature (tensors become _TensorSig).


@dataclass(frozen=True)
class _TensorSig:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def meta(self):
        from torch.distributed.tensor._dtensor_spec import TensorMeta

        return TensorMeta(torch.Size(self.shape), self.stride, self.dtype)


def _hint(x: Any) -> Any:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        from torch.fx.experimental.symbolic_shapes import optimization_hint

        return optimization_hint(x, fallback=_UNBACKED_SIZE_GUESS)
    return x


def _is_tensor_node(a: torch.fx.Node) -> bool:
    return isinstance(a.meta.get("val"), torch.Tensor)


def _tensor_sig(t: torch.Tensor) -> _TensorSig:
    return _TensorSig(
        tuple(int(_hint(s)) for s in t.shape), tuple(int(_hint(s)) for s in t.stride()), t.dtype
    )


def _signature(a: Any) -> Any:
    if isinstance(a, torch.fx.Node):
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            return _tensor_sig(val)
        if val is None:
            raise TypeError(f"argument node {a.format_node()} has no meta['val']")
        return _hint(val)
    if isinstance(a, (list, tuple)):
        return tuple(_signature(x) for x in a)
    return _hint(a)


def _output_signature(val: Any) -> tuple[_TensorSig | None, ...]:
    vals = val if isinstance(val, (list, tuple)) else (val,)
    return tuple(_tensor_sig(v) if isinstance(v, torch.Tensor) else None for v in vals)


def _tensor_leaves(sig: Any) -> list[_TensorSig]:
    if isinstance(sig, _TensorSig):
        return [sig]
    if isinstance(sig, tuple):
        return [t for x in sig for t in _tensor_leaves(x)]
    return []


# ---------------------------------------------------------------------------
# The cached computation.


@functools.lru_cache(maxsize=16384)
def _compute(op, args, kwargs, outs, mesh_shape, fallback):
    ins = _tensor_leaves(args) + _tensor_leaves(tuple(v for _, v in kwargs))
    prop = _propagator()
    error = None
    try:
        if op in prop.op_single_dim_strategy_funcs:
            info = prop.op_single_dim_strategy_funcs[op]
            # (the positional arguments as a tuple, as OpSchema.args_meta holds them: torch 2.14's slice
            # rule appends its defaults to them with +)
            rules = info.func(op, tuple(_to_meta(a) for a in args), {k: _to_meta(v) for k, v in kwargs})
            return _with_extra(_expand(rules, ins, outs, mesh_shape, "dtensor"), op, args, ins, outs,
                               mesh_shape), None
        if op in prop.op_strategy_funcs:
            return _with_extra(_classic(prop, op, args, kwargs, ins, outs, mesh_shape), op, args, ins, outs,
                               mesh_shape), None
    except Exception as e:  # a DTensor rule that cannot handle these arguments
        error = f"{type(e).__name__}: {e}"
        logger.warning("DTensor's rule for %s failed (%s)", op, error)
    if error is None and op in _OWN_RULES:
        rules = _OWN_RULES[op](args, dict(kwargs), ins, outs)
        return _expand(rules, ins, outs, mesh_shape, "autopar"), None
    if fallback:
        rules = _fallback_rules(op, ins, outs)
        return _expand(rules, ins, outs, mesh_shape, "fallback"), None
    return None, error


def _with_extra(found: tuple[Candidate, ...], op, args, ins, outs, mesh_shape) -> tuple[Candidate, ...]:
    """DTensor's candidates plus autopar's for the ops it adds a strategy to (``_EXTRA_RULES``)."""
    if op not in _EXTRA_RULES:
        return found
    rules, source = _EXTRA_RULES[op]
    rows = rules(op, args, ins, outs)
    seen = {(c.outputs, c.inputs) for c in found}
    extra = tuple(c for c in _expand(rows, ins, outs, mesh_shape, source)
                  if (c.outputs, c.inputs) not in seen) if rows else ()
    return found + extra


def _to_meta(sig: Any) -> Any:
    if isinstance(sig, _TensorSig):
        return sig.meta()
    if isinstance(sig, tuple):
        if sig and all(isinstance(x, _TensorSig) for x in sig):
            return tuple(x.meta() for x in sig)  # like OpSchema.args_meta of a TupleStrategy
        return [_to_meta(x) for x in sig]
    return sig


def _expand(rules, ins, outs, mesh_shape, source) -> tuple[Candidate, ...]:
    """Single-axis rules ``[out..., in...]`` -> candidates over all mesh axes."""
    placeholder = _placeholder_type()
    n_out = len(outs)
    rows = []
    for rule in rules:
        row = tuple(Shard(p.dim) if isinstance(p, placeholder) else p for p in rule)
        if len(row) != n_out + len(ins):
            raise AssertionError(f"rule {rule} has {len(row)} entries, expected {n_out}+{len(ins)}")
        rows.append(row)
    replicate = tuple(None if o is None else Replicate() for o in outs) + (Replicate(),) * len(ins)
    if not any(all(p is None or p.is_replicate() for p in r) for r in rows):
        rows.insert(0, replicate)
    found: dict[tuple, Candidate] = {}
    for combo in itertools.product(rows, repeat=len(mesh_shape)):
        columns = list(zip(*combo))  # per tensor position: placement per axis
        outputs = tuple(
            None if o is None or any(p is None for p in col) else col
            for o, col in zip(outs, columns[:n_out])
        )
        inputs = tuple(columns[n_out:])
        if any(p is None for col in inputs for p in col):
            continue
        cand = Candidate(outputs, inputs, source)
        if _valid(cand, ins, outs, mesh_shape):
            found.setdefault((outputs, inputs), cand)
    return tuple(found.values())


def _valid(cand: Candidate, ins, outs, mesh_shape) -> bool:
    pairs = list(zip(cand.inputs, ins))
    pairs += [(ps, t) for ps, t in zip(cand.outputs, outs) if ps is not None]
    for placements, t in pairs:
        if t is None or not _fits(t.shape, placements, mesh_shape):
            return False
        if any(type(p) is _StridedShard for p in placements):
            return False
        # Partials of different kinds on one tensor do not commute (sum and avg do)
        kinds = {(type(p), p.reduce_op) for p in placements if p.is_partial()}
        types, ops = {k[0] for k in kinds}, {k[1] for k in kinds}
        if len(kinds) > 1 and not (len(types) == 1 and ops == {"sum", "avg"}):
            return False
    return True


def _fits(shape, placements, mesh_shape) -> bool:
    """Every sharded dim exists and has at least one element per shard."""
    shards = [1] * len(shape)
    for p, n in zip(placements, mesh_shape):
        if p.is_shard():
            if not 0 <= p.dim < len(shape):
                return False
            shards[p.dim] *= n
            if shape[p.dim] < shards[p.dim]:
                return False
    return True


def _exemplars(ins, mesh_shape) -> list[Placements]:
    """Every placement (Replicate, Partial("sum"), Shard(d) per axis) that fits some input."""
    per_axis_max = max((len(t.shape) for t in ins), default=0)
    per_axis = [Replicate(), Partial("sum")] + [Shard(d) for d in range(per_axis_max)]
    return [
        ps
        for ps in itertools.product(per_axis, repeat=len(mesh_shape))
        if any(_fits(t.shape, ps, mesh_shape) for t in ins)
    ]


def _restrict(ps: Placements, t: _TensorSig, mesh_shape) -> Placements:
    """``ps`` as offered to input ``t``: shards of missing dims become Replicate."""
    ps = tuple(Replicate() if p.is_shard() and p.dim >= len(t.shape) else p for p in ps)
    return ps if _fits(t.shape, ps, mesh_shape) else (Replicate(),) * len(ps)


def _classic(prop, op, args, kwargs, ins, outs, mesh_shape) -> tuple[Candidate, ...]:
    """Ask an ``op_strategy_funcs`` entry, once per exemplar input placement.

    Classic strategy functions derive their strategies from the placements the
    inputs arrive in (a view maps its input's shards, cat follows one input,
    nll_loss zips its inputs' options). We offer every tensor input one
    placement at a time, the same exemplar for all inputs, and collect the
    union. One option per call also keeps DTensor's redistribute-cost
    bookkeeping (options x options per input) from dominating the time.
    """
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy

    mesh = _mesh(mesh_shape)
    func = prop.op_strategy_funcs[op]
    schema_info = prop.op_to_schema_info.get(op)
    found: dict[tuple, Candidate] = {}
    first_error: Exception | None = None
    for exemplar in _exemplars(ins, mesh_shape) or [(Replicate(),) * len(mesh_shape)]:

        def wrap(sig):
            if isinstance(sig, _TensorSig):
                placements = _restrict(exemplar, sig, mesh_shape)
                return OpStrategy([OpSpec(DTensorSpec(mesh, placements, tensor_meta=sig.meta()))])
            if isinstance(sig, tuple):
                if sig and all(isinstance(x, _TensorSig) for x in sig):
                    return TupleStrategy([wrap(x) for x in sig])
                return [wrap(x) for x in sig]
            return sig

        wrapped = tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs}
        schema = OpSchema(op, *wrapped, schema_info=schema_info)
        try:
            result = func(schema)
        except Exception as e:  # e.g. a view that cannot unflatten this sharding
            logger.debug("%s rejects exemplar %s: %s", op, exemplar, e)
            first_error = first_error or e
            continue
        if not isinstance(result, OpStrategy):  # e.g. TupleStrategy of foreach/split ops: not modelled
            first_error = first_error or TypeError(f"{op}: {type(result).__name__} strategies are not modelled")
            continue
        for spec in result.strategies:
            cand = _from_op_spec(spec, ins, outs)
            if _valid(cand, ins, outs, mesh_shape):
                found.setdefault((cand.outputs, cand.inputs), cand)
    if not found and first_error is not None:
        raise first_error
    return tuple(found.values())


def _from_op_spec(spec, ins, outs) -> Candidate:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    out_specs = spec.output_specs
    if isinstance(out_specs, DTensorSpec) or out_specs is None:
        out_specs = (out_specs,) * len(outs)  # DTensor reuses a lone spec for every output
    outputs = tuple(
        None if o is None or s is None else tuple(s.placements) for o, s in zip(outs, out_specs)
    )
    if spec.input_specs is None:  # DTensor: inputs follow the output
        inputs = (outputs[0],) * len(ins)
    else:
        inputs = tuple(tuple(s.placements) for s in spec.input_specs)
    if len(inputs) != len(ins) or any(i is None for i in inputs):
        raise AssertionError(f"strategy has {len(inputs)} input specs for {len(ins)} tensor inputs")
    return Candidate(outputs, inputs, "dtensor")


# ---------------------------------------------------------------------------
# autopar's own rules, in DTensor's single-axis form: (args, kwargs, ins, outs)
# -> list of [out..., in...] placement rows (all-Replicate is implied).


def _aligned(t: _TensorSig, out_shape, d: int) -> Placement:
    """Placement of input ``t`` when an output of ``out_shape`` is Shard(d) (broadcast-aligned)."""
    td = d - (len(out_shape) - len(t.shape))
    if td < 0 or t.shape[td] != out_shape[d]:
        return Replicate()
    return Shard(td)


def _sdpa_cpu_rule(args, kwargs, ins, outs):
    # forward ins: q, k, v[, attn_mask]; outs: out (B, H, L, E), logsumexp (B, H, L)
    # backward ins: grad_out, q, k, v, out, logsumexp[, attn_mask]; outs: grad_q, grad_k, grad_v
    n_core = 3 if len(outs) == 2 else 6
    rows = []
    for d in (0, 1):  # batch, heads; as DTensor's rule for the GPU variants
        mask = [_aligned(t, ins[0].shape, d) for t in ins[n_core:]]
        rows.append([Shard(d)] * (len(outs) + n_core) + mask)
    return rows


def _fill_factory_rule(args, kwargs, ins, outs):
    # Every rank fills its own shard of a constant tensor: any dim may be sharded.
    return [[Shard(d)] for d in range(len(outs[0].shape))]


def _fill_rule(args, kwargs, ins, outs):
    # fill(self, value): the output is constant, so it may take any sharding of self.
    return [[Shard(d), Shard(d)] for d in range(len(outs[0].shape))]


def _experts_rule(args, kwargs, ins, outs):
    # autopar.experts.moe_experts(x, counts, w_gate (E, d, f), w_up (E, d, f), w_down (E, f, d)):
    # each expert's SwiGLU split over its hidden width f, Megatron's MLP split per expert: the
    # tokens and counts whole, w_gate/w_up by f (dim 2), w_down by f (dim 1); each rank's rows
    # are a partial sum. Backward (grad_y, x, counts, weights) -> (grad_x partial, the weight
    # gradients split like their weights).
    split = [Replicate(), Replicate(), Shard(2), Shard(2), Shard(1)]
    if len(outs) == 1:
        return [[Partial()] + split]
    return [[Partial(), Shard(2), Shard(2), Shard(1), Replicate()] + split]


_OWN_RULES = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_cpu_rule,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_cpu_rule,
    aten.full.default: _fill_factory_rule,
    aten.zeros.default: _fill_factory_rule,
    aten.ones.default: _fill_factory_rule,
    aten.empty.memory_format: _fill_factory_rule,
    aten.fill.Scalar: _fill_rule,
    torch.ops.autopar.moe_experts.default: _experts_rule,
    torch.ops.autopar.moe_experts_backward.default: _experts_rule,
}


# ops whose DTensor rule lacks a strategy autopar runs (on some releases, or on all): their candidates
# are DTensor's plus these. The cross-entropy's ops keep their classes split
# (:mod:`autopar.passes.loss_parallel`: DTensor keeps that rule in a context manager of its own, outside
# its registry); a scatter keeps its rows split where DTensor before 2.13 would gather them
# (:mod:`autopar.passes.scatter_rows`).
_EXTRA_RULES = {**{op: (loss_rules, "loss_parallel") for op in LOSS_OPS},
                **{op: (scatter_rule, "autopar") for op in SCATTER_OPS}}


def _fallback_rules(op, ins, outs):
    """All-Replicate, plus Shard(d) on every output dim of a pointwise op."""
    tensors = [o for o in outs if o is not None]
    if torch.Tag.pointwise not in op.tags or not tensors:
        return []
    shape = tensors[0].shape
    if any(o.shape != shape for o in tensors):
        return []
    return [
        [None if o is None else Shard(d) for o in outs] + [_aligned(t, shape, d) for t in ins]
        for d in range(len(shape))
    ]

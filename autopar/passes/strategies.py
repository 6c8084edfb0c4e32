"""From an annotated joint graph to the planner's compact strategy problem.

``build_strategy_graph`` turns the graph into plain data (:class:`StrategyGraph`):
one :class:`SNode` per op (``getitem`` nodes fold into their producer), with its
candidate placements on the tensor-parallel mesh axis read from DTensor's rules
(:mod:`autopar.passes.dtensor_rules`), its costs as affine functions of the
micro-batch size, and one :class:`SEdge` per tensor that flows between ops.
The planner never sees fx or tensors.

Batch scaling: the model is traced at two batch sizes (``gm`` and ``gm_double``
at twice the batch); every node's FLOPs and bytes are then exactly affine in the
batch, ``a + b * batch`` (attention's ``b * s^2`` terms included), so costs at
any micro-batch size come from two traces rather than one per size. (sympy
symbolic shapes would do the same; two concrete traces are simpler and cannot
hit a guard on a symbolic size.)

Placements are strings on the single axis: "R" (replicate), "P" (partial sum;
DTensor's masked partial of a row-sharded embedding included), "S<d>" (shard
tensor dim d). Only even shards are kept (dim size divisible by the axis size).

Repeated layers: a layer that stands for ``count`` identical blocks weighs
``count`` in the objective, and "virtual" edges of weight ``count - 1`` join its
outputs to its own inputs (block i's output feeds block i+1), so tied blocks
pay for the resharding between consecutive copies.

Phases: forward ops are "F"; a backward op is "B" (input gradient, on the
pipeline's critical path) when an earlier layer reads a value that depends on it,
and "W" (weight gradients, deferrable by zero-bubble schedules) otherwise: the
runtime's rule for stages (:mod:`autopar.passes.backward_split`) with layers as
the groups, so a tied output head's weight gradient is W here as there.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, replace

import torch
from torch import fx
from torch.distributed.tensor.placement_types import Partial, Shard

from autopar.passes import meta_keys as mk
from autopar.passes.annotate import kernel_of, tensor_bytes
from autopar.passes.backward_split import split_backward, tied_gradient_sums
from autopar.passes.dtensor_rules import op_candidates, tensor_inputs
from autopar.passes.loss_parallel import LOSS_OPS, REDUCES, row_count

__all__ = ["Affine", "SNode", "SEdge", "Skeleton", "Strategy", "StrategyGraph", "build_strategy_graph",
           "strategy_skeleton", "TwinFacts", "twin_facts"]


@dataclass(frozen=True)
class Affine:
    """``at_zero + per_sample * batch``."""

    at_zero: float
    per_sample: float

    def __call__(self, batch: float) -> float:
        return max(0.0, self.at_zero + self.per_sample * batch)


@dataclass(frozen=True)
class Strategy:
    outs: tuple[str | None, ...]
    """Placement of each output (None for non-tensor outputs)."""
    ins: tuple[str, ...]
    """Placement required of each tensor input, in edge ``dst_in`` order."""
    reduces: int = 0
    """All-reduces of one fp32 value per row (``SNode.rows``) the op runs inside under this
    strategy: a cross-entropy op with its classes split (:mod:`autopar.passes.loss_parallel`)."""


@dataclass(frozen=True, kw_only=True)
class SNode:
    name: str
    layer: str
    weight: int
    """How many instances the node stands for (the layer's repeat count)."""
    kind: str
    """"op", "param", "input", "tangent" or "sink" (the loss leaves the graph)."""
    phase: str
    """"F", "B", "W" for ops; "" otherwise."""
    flops: Affine
    bytes_moved: Affine
    out_bytes: tuple[Affine, ...]
    """Global (unsharded) bytes of each output."""
    saved: tuple[bool, ...]
    """Per output: does the backward keep it (an activation)?"""
    dtype: str
    candidates: tuple[Strategy, ...]
    fqn: str = ""
    """Parameter name for "param" nodes, input name for "input" nodes."""
    module: str = ""
    """For an op: the dotted path of the innermost module that made it (``NodeTrace.module_path``;
    the recompute policy "moe" drops the forward ops of each MoE layer's module)."""
    shape: tuple[int, ...] = ()
    """Global shape of the (first) output."""
    kernel: str = "other"
    """Kind of kernel for pricing: "gemm", "attention", "causal_attention" or "other" (``annotate.kernel_of``)."""
    gemm: tuple | None = None
    """For a GEMM: ``(m, n, k, a_in, b_in, a_rank, b_rank)``, global m/n/k as :class:`Affine`
    in the batch (batch folded into m), the operands' positions in ``Strategy.ins`` and ranks."""
    tie: str = ""
    """For an op: a name for its target, the Python call stack that made it, its place among
    the ops of that target one call made and its layer's signature (:func:`_tie_keys`). Ops
    with the same ``tie``, phase, weight and candidates are the iterations of an unrolled
    Python loop (a state-space model's scan over time steps, a loop over alike layers); the
    sharding MIP may give them one strategy (:func:`autopar.planner.ilp.solve`)."""
    tie_line: str = ""
    """For an op: a name for its target, call stack and layer path (:func:`_line_keys`); ops with
    the same ``tie_line``, sizes, phase, weight and candidates tie as well."""
    rows: Affine | None = None
    """For a cross-entropy op: the rows (tokens) of its class-dim reduction, the size of the
    all-reduces a strategy with ``reduces`` runs."""


@dataclass(frozen=True)
class SEdge:
    src: int
    src_out: int
    dst: int
    dst_in: int
    weight: int
    virtual: bool = False


@dataclass(frozen=True, kw_only=True)
class StrategyGraph:
    nodes: tuple[SNode, ...]
    edges: tuple[SEdge, ...]
    axis_size: int
    global_batch: int


_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _pstr(p) -> str:
    if isinstance(p, Shard):
        return f"S{p.dim}"
    if isinstance(p, Partial):
        return "P"
    return "R"


def _vals(val) -> tuple:
    return tuple(val) if isinstance(val, (tuple, list)) else (val,)


def _even(placement: str, val, n: int) -> bool:
    if not placement or placement[0] != "S" or not isinstance(val, torch.Tensor):
        return True
    d = int(placement[1:])
    return d < val.dim() and int(val.shape[d]) % n == 0


def _tensor_candidates(val, n: int) -> tuple[Strategy, ...]:
    """A placeholder may start replicated or evenly sharded on any dim."""
    outs = ["R"] + [f"S{d}" for d in range(val.dim()) if int(val.shape[d]) % n == 0 and val.shape[d] > 0]
    return tuple(Strategy(outs=(p,), ins=()) for p in outs)


def _affine(a: float, b: float, batch: int) -> Affine:
    """From values at ``batch`` and ``2 * batch``."""
    slope = (b - a) / batch
    return Affine(a - slope * batch, slope)


@dataclass(frozen=True, kw_only=True)
class Skeleton:
    """What the strategy graphs of one traced pair share at every axis size: the nodes (without
    candidates), their costs and the edges. :func:`build_strategy_graph` adds each axis size's
    candidates; the planner builds one per tensor-parallel degree from one skeleton (the shared
    part was about 40% of each build: RWKV tiny, 8,773 ops, 4 builds)."""

    graph: StrategyGraph
    """Ops' and placeholders' ``candidates`` empty (the loss sink's are fixed)."""
    sources: tuple
    """Per node of ``graph``: (fx node, its twin's :class:`TwinFacts` or None), or None (the sink)."""
    batch_dims: dict
    """fx node -> (batch dims of each output, of each tensor input): dims whose size differs
    between the two traces (empty without a twin)."""


def strategy_skeleton(gm: fx.GraphModule, gm_double: fx.GraphModule | tuple[TwinFacts, ...] | None = None
                      ) -> Skeleton:
    """The axis-independent part of :func:`build_strategy_graph` (same contract; ``gm_double``
    may also be its :func:`twin_facts`)."""
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    batch = info.global_batch
    counts = {layer.path: layer.count for layer in gm.meta[mk.LAYERS]}
    twin = _twin_nodes(gm, gm_double)
    phases = _phases(gm)
    ties = _tie_keys(gm)
    index: dict[fx.Node, int] = {}
    nodes: list[SNode] = []
    sources: list = []
    batch_dims: dict[fx.Node, tuple] = {}
    lines = _line_keys(gm)

    for node in gm.graph.nodes:
        role = node.meta[mk.TRACE].role
        if node.op == "output" or node.target is operator.getitem:
            continue
        vals = _vals(node.meta.get("val"))
        twin_outs = twin[node].outs if twin else tuple((None, 2 * tensor_bytes(v)) for v in vals)
        out_bytes = tuple(_affine(tensor_bytes(v), w_bytes, batch) for v, (_, w_bytes) in zip(vals, twin_outs))
        if twin:
            batch_dims[node] = (tuple(_batch_dims(a, shape) for a, (shape, _) in zip(vals, twin_outs)),
                                tuple(_batch_dims(a.meta.get("val"), shape)
                                      for a, shape in zip(tensor_inputs(node), twin[node].ins))
                                if node.op == "call_function" else ())
        if node.op == "placeholder":
            kind = {mk.Role.PARAM: "param", mk.Role.BUFFER: "param", mk.Role.TANGENT: "tangent"}.get(role, "input")
            if kind == "param":  # parameter sizes do not depend on the batch
                out_bytes = tuple(Affine(tensor_bytes(v), 0.0) for v in vals)
            flops = bytes_moved = Affine(0.0, 0.0)
        elif node.op == "get_attr":  # a graph constant: the same value on every rank
            kind = "input"
            out_bytes = tuple(Affine(tensor_bytes(v), 0.0) for v in vals)
            flops = bytes_moved = Affine(0.0, 0.0)
        else:
            kind = "op"
            cost = node.meta[mk.COST]
            flops = _affine(cost.flops, twin[node].flops if twin else 2 * cost.flops, batch)
            moved = cost.bytes_read + cost.bytes_written
            bytes_moved = _affine(moved, twin[node].moved if twin else 2 * moved, batch)
        saved = _saved_outputs(node)
        layer = node.meta[mk.LAYER]
        kernel, gemm = ("other", None) if kind != "op" else _gemm_affine(node, twin[node].gemm if twin else None, batch)
        index[node] = len(nodes)
        sources.append((node, twin[node] if twin else None))
        nodes.append(SNode(
            name=node.name, layer=layer, weight=counts.get(layer, 1), kind=kind, phase=phases.get(node, ""),
            flops=flops, bytes_moved=bytes_moved, out_bytes=out_bytes, saved=saved,
            dtype=_DTYPES.get(getattr(vals[0], "dtype", None), "fp32"), candidates=(),
            fqn=node.meta[mk.TRACE].fqn, module=node.meta[mk.TRACE].module_path if kind == "op" else "",
            shape=tuple(int(d) for d in vals[0].shape) if isinstance(vals[0], torch.Tensor) else (),
            kernel=kernel, gemm=gemm, tie=ties.get(node, "") if kind == "op" else "",
            tie_line=lines.get(node, "") if kind == "op" else "",
            rows=_affine(row_count(node), twin[node].rows if twin else 2 * row_count(node), batch)
            if kind == "op" and node.target in LOSS_OPS else None))
    edges = _edges(gm, index, nodes)
    sources += [None] * (len(nodes) - len(sources))  # (the loss sink _edges appends)
    return Skeleton(graph=StrategyGraph(nodes=tuple(nodes), edges=tuple(edges), axis_size=0, global_batch=batch),
                    sources=tuple(sources), batch_dims=batch_dims)


def build_strategy_graph(gm: fx.GraphModule, *, axis_size: int,
                         gm_double: fx.GraphModule | tuple[TwinFacts, ...] | None = None,
                         shard_batch: bool = True, skeleton: Skeleton | None = None) -> StrategyGraph:
    """The strategy problem of ``gm`` on a mesh axis of ``axis_size`` devices.

    Contract:
      needs: ``meta[TRACE]``, ``meta[COST]``, ``meta[LAYER]`` and ``gm.meta[LAYERS]``
        (trace_joint, annotate_cost, group_layers); ``gm_double``, when given,
        is the same model traced and annotated at twice the batch, node for node (or
        that graph's :func:`twin_facts`).
      ``shard_batch=False`` drops every candidate that shards a batch-derived dim
        (a dim whose size differs between the two traces): on a tensor-parallel
        axis the batch belongs to the data-parallel axis.
      ``skeleton``: :func:`strategy_skeleton` of the same ``gm`` and ``gm_double``, when
        the caller builds several axis sizes (else built here).
      produces: a :class:`StrategyGraph`; ``gm`` is not modified.
      raises: ValueError if ``gm_double`` does not match ``gm`` node for node.
    """
    sk = skeleton if skeleton is not None else strategy_skeleton(gm, gm_double)
    n = axis_size
    nodes = []
    for sn, src in zip(sk.graph.nodes, sk.sources):
        if src is None:
            nodes.append(sn)
            continue
        node, twin = src
        dims = sk.batch_dims.get(node) if not shard_batch and twin is not None else None
        nodes.append(replace(sn, candidates=_candidates(node, sn.kind, n, dims)))
    return StrategyGraph(nodes=tuple(nodes), edges=sk.graph.edges, axis_size=n, global_batch=sk.graph.global_batch)


def _candidates(node: fx.Node, kind: str, n: int, dims: tuple | None) -> tuple[Strategy, ...]:
    """A node's candidates on an axis of ``n``; ``dims``: its batch dims (outputs, inputs) when
    candidates that shard them are dropped, else None."""
    if node.op == "get_attr":
        return (Strategy(outs=("R",), ins=()),)
    if node.op == "placeholder":
        val = _vals(node.meta.get("val"))[0]
        cands = (Strategy(outs=("R",), ins=()),) if n == 1 or not isinstance(val, torch.Tensor) or val.dim() == 0 \
            else _tensor_candidates(val, n)
        if dims is not None:
            cands = tuple(c for c in cands if not _shards_any(c.outs[0], dims[0][0]))
        if kind == "param":  # the gradient must come back in the parameter's own layout
            cands = tuple(Strategy(outs=c.outs, ins=c.outs) for c in cands)
        return cands
    cands = _op_strategies(node, n)
    return cands if dims is None else _without_batch_shards(cands, *dims)


def _tie_keys(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Per op: target, call stack (file, line and code of every frame, as TorchDynamo recorded
    them; a backward op carries its forward op's) and the op's place among the ops of its
    target that one call made. Equal for the ops one source line makes in each pass of a loop;
    different for the ops one call decomposes into (``scaled_dot_product_attention``'s two
    ``bmm``s, a matmul's two backward ``mm``s). The layer enters by its signature, so the like
    ops of alike layers that were traced apart (a hybrid stack of 24 layers, whose repeats are
    not collapsed: :func:`autopar.passes.trace._find_repeats` wants all blocks alike) tie too.
    So does the module that made the op (:func:`_module_in_layer`): the stacks of torch before
    2.13 name a line but not the place on it, and ``self.w2(silu(self.w1(x)) * self.w3(x))``'s
    three matmuls are three calls, not a loop's passes (tied, Llama's MLP could not be Megatron's
    on 2.11). An op without a recorded stack ties with nothing."""
    seen: dict[tuple, int] = defaultdict(int)
    signature = {layer.path: layer.signature for layer in gm.meta[mk.LAYERS]}
    names: dict[tuple, str] = {}  # a short name per distinct key, numbered as met (hashing the stacks took 0.5 s)
    keys = {}
    for node in gm.graph.nodes:
        stack = node.meta.get("stack_trace")
        if node.op != "call_function" or not stack:
            continue
        call = _call_of(node)
        place = seen[call, node.target]
        seen[call, node.target] += 1
        layer = node.meta[mk.LAYER]
        keys[node] = names.setdefault((node.target, place, signature.get(layer, layer), stack, _module_in_layer(node)),
                                      f"t{len(names)}")
    return keys


def _module_in_layer(node: fx.Node) -> str:
    """The module that made ``node``, from its layer down, list indices masked (``experts.#.w1``): the
    passes of a loop over a module list stay alike, distinct modules called on one line do not."""
    path, layer = node.meta[mk.TRACE].module_path or "", node.meta[mk.LAYER]
    inner = "" if path == layer else path[len(layer) + 1:] if path.startswith(layer + ".") else path
    return ".".join("#" if part.isdigit() else part for part in inner.split("."))


def _line_keys(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Per op: target, call stack, layer path and the Python call that made it, without the op's
    place in that call: equal for the slices one call makes of a scan's steps (the backward of
    ``torch.stack`` over them), which :func:`_tie_keys` keeps apart. Only ties ops of equal sizes too
    (:func:`autopar.planner.ties.tie_loops`), so a call's differently shaped siblings stay apart."""
    names: dict[tuple, str] = {}
    keys = {}
    for node in gm.graph.nodes:
        stack = node.meta.get("stack_trace")
        if node.op == "call_function" and stack:
            keys[node] = names.setdefault((node.target, node.meta[mk.LAYER], stack, _call_of(node)), f"l{len(names)}")
    return keys


def _call_of(node: fx.Node) -> tuple:
    """The Python-level call an op comes from: TorchDynamo's node for a forward op, the forward
    call's for a backward op (else the autograd node's sequence number)."""
    role = node.meta[mk.TRACE].role
    stack = node.meta.get("fwd_source_fn_stack" if role is mk.Role.BACKWARD else "source_fn_stack")
    if stack:
        return role, stack[-1][0]
    return role, node.meta.get("seq_nr")


def _gemm_affine(node: fx.Node, other: tuple | None, batch: int) -> tuple[str, tuple | None]:
    """The node's kernel kind and, for a GEMM, its shape with each dim affine in the batch
    (``other``: the GEMM's shape in the double-batch trace, if there is one)."""
    kernel, shape = kernel_of(node)
    if shape is None:
        return kernel, None
    if other is not None:
        dims = tuple(_affine(a, b, batch) for a, b in zip(shape[:3], other[:3]))
    else:  # one trace: m (tokens) scales with the batch, n and k are weights' dims
        dims = (_affine(shape[0], 2 * shape[0], batch), Affine(float(shape[1]), 0.0), Affine(float(shape[2]), 0.0))
    return kernel, dims + tuple(shape[3:])


def _op_strategies(node: fx.Node, n: int) -> tuple[Strategy, ...]:
    ins = tensor_inputs(node)
    if n == 1:
        outs = tuple("R" if isinstance(v, torch.Tensor) else None for v in _vals(node.meta.get("val")))
        return (Strategy(outs=outs, ins=tuple("R" for _ in ins)),)
    out_vals = _vals(node.meta.get("val"))
    found = {}
    for cand in op_candidates(node, (n,)):
        outs = tuple(None if o is None else _pstr(o[0]) for o in cand.outputs)
        req = tuple(_pstr(p[0]) for p in cand.inputs)
        if not all(_even(p, v, n) for p, v in zip(outs, out_vals)):
            continue
        if not all(_even(p, a.meta.get("val"), n) for p, a in zip(req, ins)):
            continue
        reduces = REDUCES[node.target] if cand.source == "loss_parallel" else 0
        found.setdefault((outs, req), Strategy(outs=outs, ins=req, reduces=reduces))
    if not found:  # replicated execution is always valid
        outs = tuple("R" if isinstance(v, torch.Tensor) else None for v in out_vals)
        found[(outs, ())] = Strategy(outs=outs, ins=tuple("R" for _ in ins))
    return tuple(found.values())


def _batch_dims(a, shape: tuple[int, ...] | None) -> frozenset[int]:
    """The dims of ``a`` whose size differs in ``shape`` (its twin's)."""
    if not isinstance(a, torch.Tensor) or shape is None or a.dim() != len(shape):
        return frozenset()
    # each .shape of a FakeTensor goes through subclass dispatch: read it once
    return frozenset(d for d, (x, y) in enumerate(zip(a.shape, shape)) if int(x) != y)


def _shards_any(p: str | None, dims: frozenset[int]) -> bool:
    return p is not None and p.startswith("S") and int(p[1:]) in dims


def _without_batch_shards(cands: tuple[Strategy, ...], out_dims: tuple, in_dims: tuple) -> tuple[Strategy, ...]:
    kept = tuple(c for c in cands
                 if not any(_shards_any(p, d) for p, d in zip(c.outs, out_dims))
                 and not any(_shards_any(p, d) for p, d in zip(c.ins, in_dims)))
    return kept or (Strategy(outs=tuple(None if o is None else "R" for o in cands[0].outs),
                             ins=tuple("R" for _ in cands[0].ins)),)


def _saved_outputs(node: fx.Node) -> tuple[bool, ...]:
    vals = _vals(node.meta.get("val"))
    if node.op == "call_function" and len(vals) > 1:
        flags = [False] * len(vals)
        for user in node.users:
            if user.target is operator.getitem and user.meta[mk.COST].saved_bytes > 0:
                flags[user.args[1]] = True
        return tuple(flags)
    return (node.meta[mk.COST].saved_bytes > 0,) + (False,) * (len(vals) - 1)


def _source(arg: fx.Node) -> tuple[fx.Node, int]:
    if arg.target is operator.getitem:
        return arg.args[0], arg.args[1]
    return arg, 0


def _edges(gm: fx.GraphModule, index: dict[fx.Node, int], nodes: list[SNode]) -> list[SEdge]:
    edges: list[SEdge] = []
    for node in gm.graph.nodes:
        if node not in index or node.op != "call_function":
            continue
        dst = index[node]
        for k, arg in enumerate(tensor_inputs(node)):
            src, out = _source(arg)
            weight = nodes[dst].weight if nodes[index[src]].layer == nodes[dst].layer else 1
            edges.append(SEdge(src=index[src], src_out=out, dst=dst, dst_in=k, weight=weight))
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    out_node = gm.graph.find_nodes(op="output")[0]
    outputs = list(out_node.args[0])
    params = {nodes[i].fqn: i for i in range(len(nodes)) if nodes[i].kind == "param"}
    for fqn, pos in info.grad_outputs.items():  # gradient -> its parameter's layout
        if fqn in params and isinstance(outputs[pos], fx.Node):
            src, out = _source(outputs[pos])
            edges.append(SEdge(src=index[src], src_out=out, dst=params[fqn], dst_in=0,
                               weight=nodes[params[fqn]].weight))
    loss = outputs[info.loss_output]
    if isinstance(loss, fx.Node):  # the loss leaves replicated (a scalar all-reduce at most)
        src, out = _source(loss)
        nodes.append(SNode(name="loss", layer=nodes[index[src]].layer, weight=1, kind="sink", phase="",
                           flops=Affine(0, 0), bytes_moved=Affine(0, 0), out_bytes=(), saved=(),
                           dtype="fp32", candidates=(Strategy(outs=(), ins=("R",)),)))
        edges.append(SEdge(src=index[src], src_out=out, dst=len(nodes) - 1, dst_in=0, weight=1))
    edges.extend(_chain_edges(edges, nodes))
    return edges


def _chain_edges(edges: list[SEdge], nodes: list[SNode]) -> list[SEdge]:
    """Virtual edges from a repeated layer's outputs to its own inputs (copy i -> copy i+1)."""
    extra = []
    for layer in sorted({n.layer for n in nodes if n.weight > 1}):
        weight = next(n.weight for n in nodes if n.layer == layer)
        incoming = [e for e in edges if nodes[e.dst].layer == layer and nodes[e.src].layer != layer
                    and nodes[e.src].kind in ("op", "input")]
        outgoing = [e for e in edges if nodes[e.src].layer == layer and nodes[e.dst].layer != layer
                    and nodes[e.dst].kind == "op"]
        for e_in in incoming:
            for e_out in outgoing:
                same_phase = (nodes[e_in.src].phase == "F") == (nodes[e_out.src].phase == "F")
                a, b = nodes[e_in.src].out_bytes[e_in.src_out], nodes[e_out.src].out_bytes[e_out.src_out]
                if same_phase and a == b:
                    extra.append(SEdge(src=e_out.src, src_out=e_out.src_out, dst=e_in.dst, dst_in=e_in.dst_in,
                                       weight=weight - 1, virtual=True))
    return list(dict.fromkeys(extra))


@dataclass(frozen=True)
class TwinFacts:
    """What :func:`strategy_skeleton` reads of a node's twin in the double-batch trace, as plain
    numbers and strings (:func:`twin_facts`), so that a trace made in another process
    (:func:`autopar.planner.frontend.trace_and_twin`) can hand them over."""

    target: str
    flops: float = 0.0
    moved: float = 0.0
    """Bytes read and written."""
    outs: tuple = ()
    """Per output value (:func:`_vals`): (its shape, None where not a tensor; its bytes)."""
    ins: tuple = ()
    """Per tensor input (:func:`tensor_inputs`): its shape, None where its value is not a tensor."""
    gemm: tuple | None = None
    """A GEMM's shape (:func:`kernel_of`)."""
    rows: int = 0
    """A loss op's rows (:func:`row_count`)."""


def _shape(val) -> tuple[int, ...] | None:
    return tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) else None


def twin_facts(gm: fx.GraphModule) -> tuple[TwinFacts, ...]:
    """Per node of ``gm`` (traced, annotated and grouped), in order, what the skeleton reads of it as
    a twin."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "output" or node.target is operator.getitem:
            out.append(TwinFacts(target=str(node.target)))
            continue
        cost = node.meta.get(mk.COST)
        op = node.op == "call_function"
        out.append(TwinFacts(
            target=str(node.target), flops=cost.flops if cost else 0.0,
            moved=cost.bytes_read + cost.bytes_written if cost else 0.0,
            outs=tuple((_shape(v), tensor_bytes(v)) for v in _vals(node.meta.get("val"))),
            ins=tuple(_shape(a.meta.get("val")) for a in tensor_inputs(node)) if op else (),
            gemm=kernel_of(node)[1] if op else None,
            rows=row_count(node) if op and node.target in LOSS_OPS else 0))
    return tuple(out)


def _twin_nodes(gm: fx.GraphModule, gm_double: fx.GraphModule | tuple[TwinFacts, ...] | None
                ) -> dict[fx.Node, TwinFacts] | None:
    if gm_double is None:
        return None
    a, b = list(gm.graph.nodes), twin_facts(gm_double) if isinstance(gm_double, fx.GraphModule) else gm_double
    if len(a) != len(b) or any(str(x.target) != y.target for x, y in zip(a, b)):
        raise ValueError(f"the two traces differ ({len(a)} vs {len(b)} nodes): the model's graph depends "
                         f"on the batch size, so costs cannot be scaled between micro-batch sizes")
    return dict(zip(a, b))


def _phases(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """F for forward ops; B or W for backward ops by the runtime's rule, with layers as groups
    (:func:`autopar.passes.backward_split.split_backward`)."""
    position = {layer.path: i for i, layer in enumerate(gm.meta[mk.LAYERS])}
    group_of: dict[fx.Node, int] = {}
    backward: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta[mk.LAYER] not in position:
            continue
        group_of[node] = position[node.meta[mk.LAYER]]
        if node.meta[mk.TRACE].role is mk.Role.BACKWARD:
            backward[node] = group_of[node]
    tied = {n for tree, _ in tied_gradient_sums(gm, group_of).values() for n in tree}
    b_nodes = split_backward(backward, group_of, ignore_readers=tied)
    return {node: "F" if node not in backward else "B" if node in b_nodes else "W"
            for node in gm.graph.nodes if node.op == "call_function"}

"""Cut a program into pipeline stages, and each stage's backward into B and W.

The input is a graph whose compute nodes carry a stage and a side (forward or
backward) in ``node.meta["custom"]`` (keys :data:`STAGE_KEY`, :data:`BACKWARD_KEY`):
the joint graph tagged by :func:`tag_stages`, or the per-rank program that
:func:`autopar.passes.shard.shard_joint_graph` traces from it (``make_fx`` copies
``custom`` onto every node it records while interpreting a tagged node). The
output is, per stage, three graph modules:

- ``F`` (forward): reads parameters, batch inputs and what earlier stages sent;
  writes what later stages read, what this stage's backward reads, and the loss
  (last stage).
- ``B`` (gradient w.r.t. the stage's inputs): the backward nodes that what
  earlier stages wait for depends on — the critical path of the pipeline.
- ``W`` (gradient w.r.t. the stage's weights): every other backward node; it
  only feeds parameter gradients, so a schedule may defer it into a bubble
  (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 2). For a linear
  layer B holds ``dX = dY W`` and W holds ``dW = dY^T X``; ``dY`` is one of the
  values B hands to W. Except a forward op the backward makes again
  (:mod:`autopar.passes.recompute`, tagged :data:`RECOMPUTED_KEY`) from values B
  made: it runs in B even where only W reads it, as the planner prices recompute
  (in B), so W holds what it reads rather than what it would remake that from.

Every value a piece reads or writes has a name (the program node's name); a
runtime keeps, per stage and micro-batch, a store from names to tensors and
moves values between stages as :class:`Message` lists. A value read more than
one stage away travels through the stages between (a relay: Llama's rotary
tables, computed before the first block and read by every block); values flow
forward in stage order on the forward channel and backward on the backward
channel, and a value that would have to flow against its channel (a gradient
read by a later stage) is an error that names it. The lifetimes say what a
stage may drop after its F, B and W, so values saved only for W are freed by W
and nothing else outlives its last reader.

A parameter read by two stages (GPT's embedding tied to its output head) is held
by both; :func:`split_tied_gradients` rewrites the graph's gradient output, a sum
of per-stage contributions, into one output per stage, which the runtime adds
across the holding stages once per step (as Megatron-LM all-reduces the tied
embedding's gradient between its first and last stage).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import fx

from autopar.errors import PlanError
from autopar.passes import meta_keys as mk
from autopar.passes.backward_split import split_backward, tied_gradient_sums

__all__ = ["STAGE_KEY", "BACKWARD_KEY", "RECOMPUTED_KEY", "Piece", "Message", "StageProgram", "PipelineProgram",
           "stage_of_layers", "tag_stages", "split_tied_gradients", "split_program", "boundary_tensors"]

STAGE_KEY = "autopar_stage"
BACKWARD_KEY = "autopar_backward"
RECOMPUTED_KEY = "autopar_recomputed"
PARAM_PREFIX = "param:"
_aten = torch.ops.aten
PARAM_VIEWS = frozenset({
    _aten.t.default, _aten.view.default, _aten.permute.default, _aten.transpose.int, _aten.expand.default,
    _aten.slice.Tensor, _aten.select.int, _aten.unsqueeze.default, _aten.squeeze.dim, _aten._unsafe_view.default,
    _aten.alias.default, _aten.detach.default, _aten.reshape.default})
"""View ops: a chain of them from a parameter is re-made by every piece that reads it."""
INPUT_PREFIX = "input:"


@dataclass(frozen=True)
class Piece:
    """One of a stage's graphs: ``piece(values named by inputs) -> tuple named by outputs``.

    ``gm`` takes its inputs boxed where torch's fx has that calling convention (2.11-2.14 do:
    ``torch.fx.graph._BoxedCodeGen``, as AOTAutograd's compiled functions): one list, which the
    piece empties as it starts, so an input the caller no longer holds dies at its last use
    inside the piece rather than when the piece returns. Call it through ``piece(values)``."""

    gm: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __call__(self, values: list[torch.Tensor]) -> tuple:
        out = self.gm(values) if _boxed(self.gm) else self.gm(*values)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


_BOXED = getattr(fx.graph, "_BoxedCodeGen", None)


def _boxed(gm: fx.GraphModule) -> bool:
    return _BOXED is not None and isinstance(gm.graph._codegen, _BOXED)


@dataclass(frozen=True)
class Message:
    """What crosses one cut for one micro-batch, in order: names, shapes and dtypes."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    replicated: tuple[bool, ...] = ()
    """Per value, whether it is replicated on tp (``meta[TP_PLACEMENT] == "R"``; none when
    empty): the runtime sends such a value as 1/tp pieces, one per tp rank, and the
    receiving stage all-gathers them (:mod:`autopar.runtime.pipeline`)."""

    @property
    def nbytes(self) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = 1
            for d in shape:
                n *= d
            total += n * torch.empty((), dtype=dtype).element_size()
        return total


@dataclass
class StageProgram:
    stage: int
    forward: Piece
    backward_input: Piece
    backward_weight: Piece
    backward: Piece
    """B and W as one piece, their ops in the program's order (a layer's weight gradients right
    after its input gradients, so what they read dies layer by layer): what a schedule without a
    B/W split runs for its fused ``BW`` actions. Run as two pieces, B would hand W the output
    gradient of every linear of the stage at once (and under full recompute every activation it
    made again), which the 1F1B, GPipe and interleaved plans do not hold."""
    recv_forward: Message | None
    """From stage - 1 (None on the first stage)."""
    send_forward: Message | None
    """To stage + 1 (None on the last stage)."""
    recv_backward: Message | None
    send_backward: Message | None
    keep_after_forward: frozenset[str]
    """Store entries B, W or a later send still read once F (and its send) ran."""
    keep_after_backward: frozenset[str]
    """Store entries W still reads once B (and its send) ran."""
    grads: dict[str, str]
    """W output name -> parameter name (this stage's addend of its gradient)."""
    loss: str | None
    params: tuple[str, ...]
    """Parameters the stage reads or produces a gradient for."""


@dataclass
class PipelineProgram:
    stages: list[StageProgram]
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Parameter -> the stages that each produce an addend of its gradient (> 1 stage)."""


# ---------------------------------------------------------------- tagging the joint graph


def stage_of_layers(stage_layers: list[list[str]]) -> dict[str, int]:
    """Layer path -> stage, from a plan's per-stage layer lists."""
    out: dict[str, int] = {}
    for s, layers in enumerate(stage_layers):
        for path in layers:
            out[path] = s
    return out


def tag_stages(gm: fx.GraphModule, layer_stage: dict[str, int]) -> dict[fx.Node, int]:
    """Write each compute node's stage and side into ``meta["custom"]``; return the stages.

    Needs ``meta[LAYER]`` and ``meta[TRACE]`` (``group_layers``, ``trace_joint``). A
    layer missing from ``layer_stage`` is a plan for another model: PlanError.
    """
    stages: dict[fx.Node, int] = {}
    recomputed = gm.meta.get(mk.RECOMPUTED, {})  # copy name -> original's (autopar.passes.recompute)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        layer = node.meta[mk.LAYER]
        if layer not in layer_stage:
            raise PlanError(f"the plan's stages do not place layer {layer!r} (node {node.name}); it was made "
                            f"for another model: re-plan for this one")
        stages[node] = layer_stage[layer]
        backward = node.meta[mk.TRACE].role is mk.Role.BACKWARD
        node.meta["custom"] = {**node.meta.get("custom", {}), STAGE_KEY: stages[node], BACKWARD_KEY: backward,
                               **({RECOMPUTED_KEY: True} if node.name in recomputed else {})}
    for node in gm.graph.find_nodes(op="placeholder"):  # the loss tangent seeds the last stage's backward
        if node.meta[mk.TRACE].role is mk.Role.TANGENT:
            node.meta["custom"] = {**node.meta.get("custom", {}), STAGE_KEY: max(layer_stage.values()),
                                   BACKWARD_KEY: True}
    return stages


def split_tied_gradients(gm: fx.GraphModule, stages: dict[fx.Node, int]) -> dict[str, list[tuple[int, int]]]:
    """Give a parameter whose gradient sums addends from several stages one output per stage.

    Rewrites ``gm`` in place: the gradient output of such a parameter becomes the
    first stage's addend and the other stages' addends are appended as new outputs.
    Returns ``{fqn: [(stage, output index), ...]}`` for the rewritten parameters.
    Raises PlanError when the cross-stage gradient is not a plain sum (nothing
    else can be split without changing the numbers).
    """
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    outputs = list(out_node.args[0])
    rewritten: dict[str, list[tuple[int, int]]] = {}
    for fqn, (_, leaves) in tied_gradient_sums(gm, stages).items():
        idx = info.grad_outputs[fqn]
        by_stage: dict[int, list[fx.Node]] = defaultdict(list)
        for leaf in leaves:
            by_stage[stages.get(leaf, -1)].append(leaf)
        if -1 in by_stage:
            raise PlanError(f"the gradient of {fqn} sums values from several pipeline stages in a way autopar "
                            f"cannot split; untie the parameter or plan with pp=1")
        sums = {}
        for s in sorted(by_stage):
            acc = by_stage[s][0]
            for other in by_stage[s][1:]:
                with gm.graph.inserting_before(out_node):
                    acc = gm.graph.call_function(torch.ops.aten.add.Tensor, (acc, other))
                acc.meta.update(by_stage[s][0].meta)
                stages[acc] = s
            sums[s] = acc
        first, *rest = sorted(by_stage)
        outputs[idx] = sums[first]
        rewritten[fqn] = [(first, idx)]
        for s in rest:
            rewritten[fqn].append((s, len(outputs)))
            outputs.append(sums[s])
    if rewritten:
        out_node.args = (tuple(outputs),)
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return rewritten


# ---------------------------------------------------------------- splitting a tagged program


def _tags(gm: fx.GraphModule, params: set[fx.Node]) -> tuple[dict[fx.Node, tuple[int, bool]], set[fx.Node]]:
    """(stage, backward) of every compute node, and the "free" nodes.

    Free nodes depend on nothing computed (factories, slices of the batch, constants,
    views of a parameter such as the ``t(w)`` a linear layer reads): every piece that
    reads one gets its own copy instead of a message. A parameter's view is free even
    when tracing tagged it with a stage, so a backward piece re-makes it from its own
    parameter input instead of reading the forward's copy from the store: under ZeRO-3
    that input is the backward's own gather, and no gathered weight lives from F to B
    (as in the pp = 1 program, :mod:`autopar.runtime.zero_program`). Other untagged
    nodes (the gradient reshaping after the joint graph, the loss gather) inherit
    the latest stage among their inputs, and the backward side if any input has it.
    """
    tags: dict[fx.Node, tuple[int, bool]] = {}
    free: set[fx.Node] = set()
    param_views: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        custom = n.meta.get("custom") or {}
        ins = n.all_input_nodes
        if n.target in PARAM_VIEWS and ins and (ins[0] in param_views or ins[0] in params) \
                and all(a.op == "get_attr" for a in ins[1:]):
            free.add(n)
            param_views.add(n)
        elif all(a.op in ("placeholder", "get_attr") or a in free for a in ins) and STAGE_KEY not in custom:
            free.add(n)
        elif STAGE_KEY in custom:
            tags[n] = (int(custom[STAGE_KEY]), bool(custom[BACKWARD_KEY]))
        else:
            known = [tags[a] for a in ins if a in tags]
            if not known:
                raise PlanError(f"cannot place {n.format_node()} in a pipeline stage")
            tags[n] = (max(s for s, _ in known), any(b for _, b in known))
    return tags, free


def _message(names: list[fx.Node]) -> Message:
    return Message(names=tuple(n.name for n in names),
                   shapes=tuple(tuple(int(d) for d in n.meta["val"].shape) for n in names),
                   dtypes=tuple(n.meta["val"].dtype for n in names),
                   replicated=tuple(n.meta.get(mk.TP_PLACEMENT) == "R" for n in names))


def split_program(gm: fx.GraphModule, *, n_stages: int, placeholder_keys: list[str], loss_output: int,
                  grad_outputs: dict[int, str]) -> PipelineProgram:
    """Cut a tagged program into per-stage F, B and W pieces (see the module docstring).

    ``placeholder_keys`` names the program's placeholders in order ("param:<fqn>",
    "input:<name>"); ``loss_output`` is the index of the loss in its output tuple,
    ``grad_outputs`` maps other output indices to parameter names.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(placeholder_keys):
        raise ValueError(f"{len(placeholder_keys)} placeholder keys for {len(placeholders)} placeholders")
    key_of = dict(zip(placeholders, placeholder_keys))
    tags, free = _tags(gm, {p for p, k in key_of.items() if k.startswith(PARAM_PREFIX)})
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    outputs = list(out_node.args[0])
    bad = sorted({s for s, _ in tags.values() if not 0 <= s < n_stages})
    if bad:
        raise PlanError(f"nodes are tagged with stages {bad}, outside 0..{n_stages - 1}")

    stage_of = {n: s for n, (s, _) in tags.items()}
    # B/W: a stage's backward nodes that what earlier stages read depends on are B (the planner
    # prices its layers by the same rule), and the forward ops made again from what B makes (the
    # module docstring)
    b_nodes = split_backward({n: s for n, (s, b) in tags.items() if b}, stage_of,
                             remade={n for n in tags if (n.meta.get("custom") or {}).get(RECOMPUTED_KEY)})
    piece: dict[fx.Node, tuple[str, int]] = {
        n: ("B" if n in b_nodes else "W", s) if b else ("F", s) for n, (s, b) in tags.items()}

    reads: dict[tuple[str, int], set[fx.Node]] = defaultdict(set)  # store values a piece reads
    fwd: dict[int, set[fx.Node]] = defaultdict(set)  # cut c (stage c -> c + 1) -> values
    bwd: dict[int, set[fx.Node]] = defaultdict(set)  # cut c (stage c + 1 -> c) -> values
    for v, pv in piece.items():
        for u in v.all_input_nodes:
            pu = piece.get(u)
            if pu is None or pu == pv:
                continue  # placeholders, constants and free nodes are the piece's own
            (ku, a), (kv, b) = pu, pv
            if a == b:
                if (ku, kv) not in (("F", "B"), ("F", "W"), ("B", "W")):
                    raise PlanError(f"{v.format_node()} ({kv} of stage {b}) reads {u.name} from the stage's "
                                    f"{ku}, which runs later")
            elif a < b:
                if ku != "F":
                    raise PlanError(f"{v.format_node()} on stage {b} reads the gradient {u.name} of the earlier "
                                    f"stage {a}: a pipeline cannot send it forward; plan with other cuts or pp=1")
                for c in range(a, b):
                    fwd[c].add(u)
            else:
                if kv == "F":
                    raise PlanError(f"{v.format_node()} in the forward of stage {b} reads {u.name} from the later "
                                    f"stage {a}; plan with other cuts or pp=1")
                if ku == "W":
                    raise AssertionError(f"{u.name} is read by an earlier stage but was put in W")
                for c in range(b, a):
                    bwd[c].add(u)
            reads[pv].add(u)

    grads_of: dict[tuple[str, int], dict[str, str]] = defaultdict(dict)
    loss_piece = None
    for i, value in enumerate(outputs):
        if i == loss_output:
            loss_piece = piece.get(value)
            if loss_piece is None or loss_piece[0] != "F":
                raise PlanError("the loss is not computed in a stage's forward")
            continue
        fqn = grad_outputs.get(i)
        if fqn is None or value is None:
            continue
        p = piece.get(value)
        if p is None:
            raise PlanError(f"the gradient of {fqn} ({getattr(value, 'name', value)}) belongs to no stage")
        grads_of[p][value.name] = fqn

    def by_order(nodes) -> list[fx.Node]:
        return sorted(nodes, key=order.__getitem__)

    stages = []
    for s in range(n_stages):
        pieces = {}
        for kind in ("F", "B", "W"):
            members = [n for n, p in piece.items() if p == (kind, s)]
            # what the piece writes to the store: values other pieces read or that are sent,
            # the loss, and gradients
            exported = {n for n in members if any(piece.get(u) not in (None, (kind, s)) for u in n.users)
                        or (kind == "F" and n in fwd[s]) or (s > 0 and n in bwd[s - 1])}
            if loss_piece == (kind, s):
                exported.add(outputs[loss_output])
            exported |= {n for n in members if n.name in grads_of[(kind, s)]}
            pieces[kind] = _build_piece(gm, members, by_order(reads[(kind, s)]), by_order(exported), key_of, free,
                                        order)
        members = [n for n, p in piece.items() if p in (("B", s), ("W", s))]
        exported = {n for n in members if s > 0 and n in bwd[s - 1]}
        exported |= {n for n in members if n.name in grads_of[("B", s)] or n.name in grads_of[("W", s)]}
        fused = _build_piece(gm, members, by_order((reads[("B", s)] | reads[("W", s)]) - set(members)),
                             by_order(exported), key_of, free, order)
        grads = {**grads_of[("F", s)], **grads_of[("B", s)], **grads_of[("W", s)]}
        params = {k[len(PARAM_PREFIX):] for p in pieces.values() for k in p.inputs if k.startswith(PARAM_PREFIX)}
        keep_f = reads[("B", s)] | reads[("W", s)] | (bwd[s - 1] if s > 0 else set())
        stages.append(StageProgram(
            stage=s, forward=pieces["F"], backward_input=pieces["B"], backward_weight=pieces["W"], backward=fused,
            recv_forward=_message(by_order(fwd[s - 1])) if s > 0 else None,
            send_forward=_message(by_order(fwd[s])) if s + 1 < n_stages else None,
            recv_backward=_message(by_order(bwd[s])) if s + 1 < n_stages else None,
            send_backward=_message(by_order(bwd[s - 1])) if s > 0 else None,
            keep_after_forward=frozenset(n.name for n in keep_f),
            keep_after_backward=frozenset(n.name for n in reads[("W", s)]),
            grads=grads, loss=outputs[loss_output].name if loss_piece == ("F", s) else None,
            params=tuple(sorted(params | set(grads.values())))))
    holders: dict[str, set[int]] = defaultdict(set)
    for st in stages:
        for fqn in st.grads.values():
            holders[fqn].add(st.stage)
    tied = {fqn: tuple(sorted(h)) for fqn, h in holders.items() if len(h) > 1}
    return PipelineProgram(stages=stages, tied=tied)


def _build_piece(gm: fx.GraphModule, members: list[fx.Node], reads: list[fx.Node], exported: list[fx.Node],
                 key_of: dict[fx.Node, str], free: set[fx.Node], order: dict[fx.Node, int]) -> Piece:
    """A graph module of ``members`` (plus copies of the free nodes and constants they read)."""
    own = set(members)
    extra: set[fx.Node] = set()
    todo = [a for n in members for a in n.all_input_nodes]
    while todo:
        a = todo.pop()
        if (a in free or a.op == "get_attr") and a not in extra:
            extra.add(a)
            todo.extend(a.all_input_nodes)
    body = sorted(own | extra, key=order.__getitem__)
    phs = sorted({a for n in body for a in n.all_input_nodes if a.op == "placeholder"}, key=order.__getitem__)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for i, (node, key) in enumerate([(u, u.name) for u in reads] + [(p, key_of[p]) for p in phs]):
        env[node] = graph.placeholder(f"in{i}_" + re.sub(r"\W", "_", key))
        env[node].meta.update(node.meta)
        inputs.append(key)
    for n in body:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[n] for n in exported))
    if _BOXED is not None:
        graph.set_codegen(_BOXED())
    return Piece(gm=fx.GraphModule(gm, graph), inputs=tuple(inputs), outputs=tuple(n.name for n in exported))


def boundary_tensors(gm: fx.GraphModule, left: set[str], *, batch: int, microbatch: int) -> dict[str, list[dict]]:
    """What crosses a cut between the layers in ``left`` and the rest, for one micro-batch.

    ``{"forward": [...], "backward": [...]}``: activations (and values such as rotary
    tables) that later layers read, and the gradients earlier layers wait for; each
    entry names the tensor, the module that makes it and the one that first reads it,
    its shape (the batch dimension at ``microbatch``), dtype and bytes. Read off the
    joint graph's ``meta[LAYER]``; nodes of the loss tangent and constants are left out.
    """
    out: dict[str, list[dict]] = {"forward": [], "backward": []}
    for node in gm.graph.nodes:
        if node.op != "call_function" or "val" not in node.meta or not isinstance(node.meta["val"], torch.Tensor):
            continue
        role = node.meta[mk.TRACE].role
        on_left = node.meta[mk.LAYER] in left
        if role is mk.Role.FORWARD and on_left:
            readers = [u for u in node.users if u.op == "call_function" and u.meta[mk.LAYER] not in left]
            side = "forward"
        elif role is mk.Role.BACKWARD and not on_left:
            readers = [u for u in node.users if u.op == "call_function" and u.meta[mk.LAYER] in left]
            side = "backward"
        else:
            continue
        if not readers:
            continue
        val = node.meta["val"]
        shape = [microbatch if i == 0 and d == batch else int(d) for i, d in enumerate(val.shape)]
        n = 1
        for d in shape:
            n *= d
        source = node.meta[mk.TRACE].module_path if side == "forward" else node.meta[mk.LAYER]
        out[side].append({"tensor": node.name, "from": source or "<model>",
                          "to": readers[0].meta[mk.TRACE].module_path or "<model>", "shape": shape,
                          "dtype": str(val.dtype).removeprefix("torch."), "bytes": n * val.element_size()})
    return out

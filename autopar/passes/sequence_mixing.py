"""Which ops of a joint graph work along a sequence, per sequence: what context parallelism breaks.

Under cp each rank holds two chunks of every sequence of its batch group, stacked as rows of
their own (:mod:`autopar.runtime.context`), and the runtime rewrites only attention (the K/V
exchange) and the token-numbering ``arange`` (global positions). Every other op runs on the
rank's chunks as if each were a sequence. That is right for an op that treats tokens alone
(a matmul over features, a norm over the hidden dim, an elementwise op) and for one that
reduces over *all* tokens of the batch (the token-mean loss, a weight gradient: dp sums their
addends), and wrong for one that works along a sequence while keeping sequences apart: a
per-sequence mean (a mixture-of-experts balance loss taken per sequence), a softmax or a
matmul over the sequence (attention written out by hand), a cumulative sum over it (positions
counted from a padding mask), a convolution over time, a shift or a pooled token (``x[:, 0]``);
and positions read off a table sliced to the sequence length (``cos[:T]``, ``pos_emb[:, :T]``,
BERT's ``position_ids[:, :T]``), which every rank would slice from position 0.
Run under cp, those compute on chunks what the model computes on sequences: a different
model, and nothing fails. :func:`sequence_mixing` finds them so the planner can refuse cp.

How: each tensor's dims carry what they index, as factors (outer to inner, each with its
size): ``B`` (sequences), ``T`` (positions within a sequence), or nothing; the token inputs
start as ``(B, T, ...)`` and the tags follow every op (a view regroups the factors by size,
so ``(B, T, C) -> (B T, C) -> (B, T, C)`` keeps them; a broadcast aligns dims from the right;
a matmul keeps its rows and contracts its inner dim). An op mixes sequences' tokens per
sequence when the dims it reduces, scans, sorts, contracts, concatenates, pads or slices
along carry ``T`` but not ``B``; along ``B`` and ``T`` together (a merged ``(B T)`` dim, or
both) it is a reduction over all the rank's tokens, which dp sums correctly. A slice from 0 to
the sequence length of a tensor that indexes no tokens is a position table (``P``): an
elementwise op that aligns it with ``T`` is flagged. A tensor of one nonzero value made at the
sequence length (``torch.ones(B, T)``: the padding mask a Hugging Face model builds when none is
passed) has that dim tagged ``C``; a cumulative op along it counts positions (OPT's
``cumsum(mask, 1) - 1``), from 0 on every rank's chunks under cp, and is flagged. Attention ops
are left out (cp runs them), and so is the scatter-add of an embedding's backward (a weight
gradient by token value). Unknown ops keep the tags of a same-shaped input (else none): the
analysis errs towards missing an op, never towards refusing a model for an op it cannot read.

Why written here: DTensor's sharding rules answer a related question (which ops need a
sequence-sharded input gathered), but a sequence split there is a placement of the ``T`` dim
alone, and every flatten of ``(B, T)`` into rows (the loss, mixture-of-experts routing)
would count as a gather: the merged dim needs the ``B``/``T`` distinction kept here.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from autopar.passes import meta_keys as mk

__all__ = ["SequenceMixing", "sequence_mixing", "described", "position_collisions", "numbering_aranges",
           "labels_shifted_outside"]

_aten = torch.ops.aten
Factor = tuple[str | None, int]  # (what it indexes: "B", "T", "P", "C" or None, size)
Dims = tuple[tuple[Factor, ...], ...]


@dataclass(frozen=True)
class SequenceMixing:
    node: str
    op: str
    module_path: str
    why: str

    def __str__(self) -> str:
        where = f" in {self.module_path}" if self.module_path else " in the model's own forward or the loss"
        return f"{self.op} ({self.node}){where} {self.why}"


def _plain(shape) -> Dims:
    return tuple(((None, int(s)),) for s in shape)


def _tags(dim: tuple[Factor, ...]) -> set[str]:
    return {t for t, _ in dim if t is not None}


def _per_sequence(tags: set[str]) -> bool:
    return "T" in tags and "B" not in tags


def _reshape(dims: Dims, shape) -> Dims | None:
    """The factors regrouped into ``shape`` (None where the sizes do not align)."""
    flat = [f for d in dims for f in d if f[1] != 1 or f[0] is not None]
    out, i = [], 0
    for size in map(int, shape):
        got, prod = [], 1
        while i < len(flat) and (prod < size or flat[i][1] == 1):
            tag, s = flat[i]
            if s == 1 or (size % (prod * s) == 0):
                got.append(flat[i])
                prod *= s
                i += 1
            elif size % prod == 0 and s % (size // prod) == 0:  # one factor split over two dims
                need = size // prod
                got.append((tag, need))
                flat[i] = (tag, s // need)
                prod *= need
            else:
                return None
        if prod != size:
            return None
        out.append(tuple(got) if got else ((None, size),))
    if i < len(flat):  # (tagged size-1 factors left: on the last dim)
        if any(s != 1 for _, s in flat[i:]) or not out:
            return None
        out[-1] = out[-1] + tuple(flat[i:])
    return tuple(out)


def _broadcast(values: list[Dims], shape) -> Dims:
    """Dims of an elementwise result: per output dim, the input dim (aligned from the right) with
    the most tagged factors."""
    n = len(shape)
    out = []
    for k in range(n):
        best = ((None, int(shape[k])),)
        for d in values:
            j = k - (n - len(d))
            if 0 <= j < len(d) and _weight(d[j]) > _weight(best):
                best = d[j]
        out.append(best)
    return tuple(out)


def _weight(dim: tuple[Factor, ...]) -> tuple[int, int]:
    """Which of two aligned dims an elementwise result keeps: tokens and tables before constants."""
    tags = _tags(dim)
    return len(tags - {"C"}), len(tags)


def _val_shapes(node: fx.Node) -> list:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in vals]


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """Argument ``name`` of an ATen op node by its schema, defaults filled in."""
    bound = node.normalized_arguments(node.graph.owning_module, normalize_to_only_use_kwargs=True)
    return bound.kwargs.get(name, default) if bound is not None else default


_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.alias.default,
          _aten.detach.default, _aten.clone.default, _aten._to_copy.default, _aten.contiguous.default,
          _aten.lift_fresh_copy.default, _aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default,
          _aten.unsqueeze.default, _aten.view.dtype, _aten.copy.default, _aten.native_dropout.default}
_REDUCTIONS = {_aten.sum.dim_IntList, _aten.mean.dim, _aten.amax.default, _aten.amin.default, _aten.max.dim,
               _aten.min.dim, _aten.var.correction, _aten.std.correction, _aten.var_mean.correction,
               _aten.logsumexp.default, _aten.prod.dim_int, _aten.argmax.default, _aten.argmin.default,
               _aten.any.dim, _aten.all.dim, _aten.linalg_vector_norm.default, _aten.any.dims, _aten.all.dims}
_ALONG = {  # ops along one dim (their "dim" argument), as the error says it
    _aten._softmax.default: "a softmax", _aten._safe_softmax.default: "a softmax",
    _aten._softmax_backward_data.default: "a softmax", _aten._log_softmax.default: "a log-softmax",
    _aten._log_softmax_backward_data.default: "a log-softmax", _aten.cumsum.default: "a cumulative sum",
    _aten.cumprod.default: "a cumulative product", _aten.logcumsumexp.default: "a cumulative log-sum-exp",
    _aten.cummax.default: "a cumulative max", _aten.cummin.default: "a cumulative min", _aten.sort.default: "a sort",
    _aten.sort.stable: "a sort", _aten.topk.default: "a top-k", _aten.index_select.default: "an index",
    _aten.gather.default: "a gather", _aten.roll.default: "a roll", _aten.flip.default: "a flip",
    _aten.select.int: "a select", _aten.split.Tensor: "a split", _aten.split_with_sizes.default: "a split",
    _aten.unbind.int: "an unbind", _aten.cat.default: "a concatenation", _aten.slice.Tensor: "a slice"}
_LEFT_OUT = {"scaled_dot_product", "embedding_dense_backward", "cp_attention"}
_SCANS = {_aten.cumsum.default, _aten.cumprod.default, _aten.logcumsumexp.default, _aten.cummax.default,
          _aten.cummin.default}
_CONSTANTS = {_aten.ones.default: None, _aten.new_ones.default: None, _aten.full.default: 1,
              _aten.new_full.default: 2}
"""Factories of one value -> the position of that value's argument (None: it is 1)."""


def _flows(node: fx.Node, env: dict[fx.Node, list[Dims | None]]) -> list[Dims]:
    """The tags of the node's tensor arguments, in order."""
    out = []
    for a in node.all_input_nodes:
        for d in env.get(a, ()):
            if d is not None:
                out.append(d)
    return out


def sequence_mixing(gm: fx.GraphModule, seq: int, *, untagged: frozenset[str] = frozenset()) -> list[SequenceMixing]:
    """The ops of ``gm`` that work along a sequence of ``seq`` tokens per sequence (see the module
    docstring), in graph order. ``untagged``: input names not to follow (Hugging Face's ``labels``,
    which the runtime shifts on the whole sequence before cp splits it)."""
    env: dict[fx.Node, list[Dims | None]] = {}
    found: list[SequenceMixing] = []

    def flag(node: fx.Node, why: str) -> None:
        trace = node.meta.get(mk.TRACE)
        found.append(SequenceMixing(node=node.name, op=str(node.target).removeprefix("aten."),
                                    module_path=getattr(trace, "module_path", ""), why=why))

    for node in gm.graph.nodes:
        shapes = _val_shapes(node)
        plain = [_plain(s) if s is not None else None for s in shapes]
        if node.op == "placeholder":
            trace = node.meta.get(mk.TRACE)
            s = shapes[0]
            if trace is not None and trace.role is mk.Role.INPUT and s is not None and len(s) >= 2 \
                    and s[1] == seq and trace.fqn not in untagged:
                env[node] = [(((("B", s[0]),), (("T", s[1]),)) + _plain(s[2:]))]
            else:
                env[node] = plain
            continue
        if node.op != "call_function":
            env[node] = plain
            continue
        if node.target is operator.getitem:
            src = env.get(node.args[0], [])
            i = node.args[1]
            env[node] = [src[i] if isinstance(i, int) and i < len(src) else None]
            continue
        ins = _flows(node, env)
        table = _position_table(node, ins, shapes[0], seq)
        if table is None:
            table = _constant_along(node, shapes[0], seq)
        if table is not None:
            env[node] = [table]
            continue
        if not any(_tags(d) for x in ins for d in x) or not isinstance(node.target, torch._ops.OpOverload):
            env[node] = plain
            continue
        env[node] = _follow(node, env, ins, shapes, plain, flag)
    return found


def _position_table(node: fx.Node, ins: list[Dims], out, seq: int) -> Dims | None:
    """A slice of a tensor that does not index tokens, from 0 to the sequence length along a longer
    dim (``cos[:T]`` of a table for the longest sequence, ``pos_emb[:, :T]``): its dims, that one
    tagged ``P`` (positions as a table has them, not as cp renumbers them); else None."""
    if node.target is not _aten.slice.Tensor or not ins or out is None or any(_tags(d) for d in ins[0]):
        return None
    x = ins[0]
    d = _dim(_arg(node, "dim", 0), len(x))
    start = _arg(node, "start")
    if d >= len(x) or start not in (None, 0) or out[d] != seq or math.prod(s for _, s in x[d]) <= seq:
        return None
    return tuple(x[k] if k != d else (("P", seq),) for k in range(len(x)))


def _constant_along(node: fx.Node, out, seq: int) -> Dims | None:
    """A tensor of one nonzero value made with a dim of the sequence length (``torch.ones(B, T)``):
    its dims, those of that length tagged ``C``; else None. (Zeros count nothing.)"""
    if node.target not in _CONSTANTS or out is None or seq not in out:
        return None
    k = _CONSTANTS[node.target]
    if k is not None and (len(node.args) <= k or not isinstance(node.args[k], (int, float)) or node.args[k] == 0):
        return None
    return tuple((("C", seq),) if s == seq else ((None, int(s)),) for s in out)


def _follow(node: fx.Node, env: dict, ins: list[Dims], shapes: list, plain: list, flag) -> list[Dims | None]:
    """The tags of ``node``'s outputs, flagging it where it mixes tokens per sequence."""
    t = node.target
    x, out = ins[0], shapes[0]

    def of(arg: Any) -> Dims | None:  # one tensor argument's tags
        got = env.get(arg, [None])[0] if isinstance(arg, fx.Node) else None
        return got if got is not None and any(_tags(d) for d in got) else None

    if any(k in str(t) for k in _LEFT_OUT):  # outputs shaped like the first input keep its tags
        return [x if s is not None and len(s) == len(x) else p for s, p in zip(shapes, plain)]
    if t is _aten.expand.default:
        pad = len(out) - len(x)
        return [tuple(x[k - pad] if k >= pad and math.prod(f for _, f in x[k - pad]) == out[k]
                      else ((None, int(out[k])),) for k in range(len(out)))]
    if t in _VIEWS:
        got = _reshape(x, out) if out is not None else None
        return [got if got is not None else plain[0]] + plain[1:]
    if t in (_aten.permute.default, _aten.transpose.int, _aten.t.default):
        order = list(range(len(x)))
        if t is _aten.permute.default:
            order = [_dim(d, len(x)) for d in node.args[1]]
        elif t is _aten.transpose.int:
            a, b = (_dim(d, len(x)) for d in node.args[1:3])
            order[a], order[b] = order[b], order[a]
        else:
            order = order[::-1]
        return [tuple(x[d] for d in order)]
    if torch.Tag.pointwise in t.tags:
        if out is not None and any({"P", "T"} <= set().union(*(_tags(d[k - (len(out) - len(d))]) for d in ins
                                                             if 0 <= k - (len(out) - len(d)) < len(d)))
                                   for k in range(len(out))):
            flag(node, "meets the sequence with a position table sliced to its length (cos[:T], pos_emb[:, :T]), "
                       "whose first positions every rank would take for its chunks'; compute the table from "
                       "torch.arange(T), which cp renumbers per rank")
        return [_broadcast(ins, out)] if out is not None else plain
    if t is _aten.view_as_complex.default:  # (..., 2) -> complex: RoPE written on complex numbers
        return [x[:-1]]
    if t is _aten.view_as_real.default:
        return [x + (((None, 2),),)]
    if t in _REDUCTIONS or t in (_aten.sum.default, _aten.mean.default):
        dims = _arg(node, "dim")
        dims = list(range(len(x))) if dims is None or dims == [] else [dims] if isinstance(dims, int) else dims
        dims = {_dim(d, len(x)) for d in dims}
        if _per_sequence(set().union(*(_tags(x[d]) for d in dims))):
            flag(node, "reduces over the positions of each sequence apart")
        kept = tuple(x[d] for d in range(len(x)) if d not in dims)
        same = tuple(x[d] if d not in dims else ((None, 1),) for d in range(len(x)))  # (keepdim)
        return [kept if s is not None and len(s) == len(kept) else same if s is not None and len(s) == len(x)
                else p for s, p in zip(shapes, plain)]
    if t in _ALONG:
        if t in (_aten.roll.default, _aten.flip.default):  # (along "dims"; a roll without dims: all of them)
            along = [_dim(d, len(x)) for d in (_arg(node, "dims") or range(len(x)))]
            d = along[0]
        else:
            d = _dim(_arg(node, "dim", 0), len(x))
            along = [d]
        whole = out is not None and d < len(out) and out[d] == math.prod(s for _, s in x[d])
        if any(k < len(x) and _per_sequence(_tags(x[k])) for k in along) and not (t is _aten.slice.Tensor and whole):
            flag(node, f"runs {_ALONG[t]} along each sequence's positions")
        elif t in _SCANS and d < len(x) and _tags(x[d]) == {"C"}:
            flag(node, f"counts positions with {_ALONG[t]} along a constant made at the sequence length "
                       f"(cumsum(ones(B, T))), which every rank would count from 0 on its chunks; number "
                       f"positions with torch.arange(T), which cp renumbers per rank")
        if t is _aten.cat.default:
            return [_broadcast(ins, out)]
        return [tuple(x[k] if k != d else ((None, int(s[k])),) for k in range(len(x)))
                if s is not None and len(s) == len(x) else p for s, p in zip(shapes, plain)]
    if t is _aten.constant_pad_nd.default:
        pads = node.args[1]
        for k in range(len(pads) // 2):
            d = len(x) - 1 - k
            if (pads[2 * k] or pads[2 * k + 1]) and _per_sequence(_tags(x[d])):
                flag(node, "pads each sequence (a shift, or a causal convolution's padding)")
        return plain
    if t in (_aten.convolution.default, _aten.convolution_backward.default):
        if any(_per_sequence(_tags(x[d])) for d in range(2, len(x))):
            flag(node, "convolves along each sequence's positions")
        if t is _aten.convolution.default and out is not None and len(out) == len(x):
            # (batch, channels, positions...): the positions stay positions (a causal convolution's
            # output trimmed back to the sequence is then a slice along them, not a position table)
            return [(x[0], ((None, int(out[1])),)) + tuple(
                ((sorted(_tags(x[d]))[0], int(out[d])),) if len(_tags(x[d])) == 1 else ((None, int(out[d])),)
                for d in range(2, len(x)))]
        return plain
    if t in (_aten.mm.default, _aten.bmm.default, _aten.addmm.default, _aten.baddbmm.default):
        a, b = (node.args[1], node.args[2]) if t in (_aten.addmm.default, _aten.baddbmm.default) else node.args[:2]
        da, db = of(a), of(b)
        batched = len(out) == 3
        inner = (_tags(da[-1]) if da else set()) | (_tags(db[-2]) if db else set())
        if _per_sequence(inner):  # (a batch dim keeps its rows apart: sequences stay apart there)
            flag(node, "contracts over each sequence's positions (attention written out, not an SDPA op)")
        rows = da[-2] if da else ((None, int(out[-2])),)
        cols = db[-1] if db else ((None, int(out[-1])),)
        lead = _broadcast([d[:1] for d in (da, db) if d], out[:1]) if batched else ()
        return [tuple(lead) + (rows, cols)]
    if t is _aten.embedding.default:
        idx = of(node.args[1])
        return [(idx if idx else _plain(out[:-1])) + (((None, int(out[-1])),),)]
    if t in (_aten.index.Tensor, _aten._unsafe_index.Tensor):  # x[i, j, ...]: tensor indices on leading dims
        if any(i is not None and d < len(x) and _per_sequence(_tags(x[d])) for d, i in enumerate(node.args[1])):
            flag(node, "reads positions of each sequence by index")
        return plain
    # anything else: the tags of an input of the output's shape, if one has it
    same = next((d for d in ins if out is not None and tuple(math.prod(s for _, s in dim) for dim in d)
                 == tuple(out)), None)
    return [same if same is not None else plain[0]] + plain[1:]


def described(found: list[SequenceMixing]) -> str:
    """The first op found, and how many more, for an error or a plan."""
    return f"{found[0]}" + (f" (and {len(found) - 1} more such ops)" if len(found) > 1 else "")


def labels_shifted_outside(gm: fx.GraphModule) -> frozenset[str]:
    """``{"labels"}`` for a Hugging Face causal LM given labels: under cp the runtime shifts them on
    the whole sequence before splitting it (:func:`autopar.runtime.context.shift_hf_labels`), so the
    shift traced inside its loss does not run on chunks."""
    info = gm.meta.get(mk.GRAPH)
    if info is not None and info.module_classes.get("", "").endswith("ForCausalLM") and "labels" in info.input_names:
        return frozenset({"labels"})
    return frozenset()


def position_collisions(gm: fx.GraphModule, seq: int, cp: int) -> list[str]:
    """``arange`` ops of ``gm`` (traced at sequence ``seq``) that are ``seq / cp`` long although
    they do not number the sequence: under cp the runtime takes any step-1 ``arange`` of
    ``seq / cp`` elements in the rank's program for token numbering (the program is traced at
    ``seq / cp``), so these would be rewritten to positions (the experts' ``arange(E)`` of a
    mixture of experts with E = seq / cp). Their names, for the error."""
    return [n.name for n, _ in numbering_aranges(gm, seq // cp)] if cp > 1 else []


def numbering_aranges(gm: fx.GraphModule, length: int) -> list[tuple[fx.Node, int]]:
    """The step-1 ``arange`` ops of ``gm`` with ``length`` elements and no tensor input, each with its
    start: what the cp runtime renumbers as token positions in a program traced at ``length``
    tokens a row (:func:`autopar.runtime.context.apply_cp`)."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (_aten.arange.default, _aten.arange.start,
                                                       _aten.arange.start_step):
            continue
        if any(isinstance(a, fx.Node) for a in (*n.args, *n.kwargs.values())):
            continue
        start, end, step = (0, n.args[0], 1) if n.target is _aten.arange.default else (
            n.args[0], n.args[1], n.args[2] if len(n.args) > 2 else 1)
        if step == 1 and end - start == length:
            out.append((n, start))
    return out

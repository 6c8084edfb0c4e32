"""Context parallelism in :func:`autopar.parallelize`: each rank runs on its own chunks of every sequence.

The layout is the plan's (:mod:`autopar.planner.context`): ``cp`` folds over the ``dp``
ranks, ``dp = G x cp`` where the global batch is split over ``G`` batch groups of ``cp``
consecutive dp ranks, and each sequence of a group over its ``cp`` ranks, two chunks per
rank in the load-balanced order of :mod:`autopar.context` (rank ``r``: chunks ``r`` and
``2 cp - 1 - r`` of ``2 cp``)::

    rank        0         1         2         3          (dp = 4, cp = 2, G = 2)
    sequences   s0, s1    s0, s1    s2, s3    s2, s3     each group half the batch
    chunks      c0 + c3   c1 + c2   c0 + c3   c1 + c2    of 4 chunks per sequence
    cp group    {0, 1}              {2, 3}               K/V exchange (ring or all-gather)
    dp          {0, 1, 2, 3}                             every gradient summed here

How, without a second sharding machinery: the runtime *stacks* each micro-batch
(:func:`stack_sequences`): ``G x mbs`` sequences of ``S`` tokens become ``G x cp x mbs``
rows of ``S / cp`` tokens, ordered (group, cp rank, sequence), so splitting rows evenly over
the ``dp`` ranks, what the shard pass does with any batch, hands each rank exactly its
chunks. The model is traced at that shape; to the shard pass, the gradient buckets and ZeRO,
cp ranks are data-parallel ranks (the gradients of different tokens of one sequence add up
like those of different sequences, over dp, as the plan prices). The token-mean loss has the
global denominator already: the shard pass divides every rank's loss sum by the token count
summed over dp (:func:`autopar.passes.shard.interpret`, ``nll_loss_forward``).

What is not token-local is rewritten in each rank's step program (:func:`apply_cp`):

1. **Attention.** Each SDPA forward and its backward (the CPU flash kernels, or CUDA's flash
   and memory-efficient ones) become ``autopar::cp_attention`` / ``cp_attention_backward``
   over the rank's cp group, with the plan's variant; the local queries meet every rank's
   keys. A mask argument must be the causal mask (it is evaluated once at build time: Hugging
   Face's mask helpers build it from positions alone); padding masks and attention dropout
   are refused with a clear error.
2. **Positions.** Traced at ``S / cp`` tokens, the model numbers its tokens ``0 .. S/cp - 1``
   (``torch.arange``: learned position embeddings, RoPE tables, Hugging Face's
   ``cache_position``). Each such ``arange`` (step 1, ``S / cp`` long, no tensor input) is
   replaced by the rank's global positions (:func:`autopar.context.sequence_positions`).
   A position table sliced from a longer buffer (``cos[:T]``) is not renumbered, and the
   planner refuses cp for a model that uses one (:mod:`autopar.passes.sequence_mixing`):
   compute tables from ``arange`` (as examples/llama.py and Hugging Face's causal LMs do).

Any other op that works along a sequence (a per-sequence mean, a softmax or a convolution over
positions, a shift) would run on chunks as if they were sequences; the planner finds such ops
and refuses cp for the model (:mod:`autopar.passes.sequence_mixing`), and refuses a cp whose
``S / cp`` is also the length of an ``arange`` that numbers something else (step 2 would take
it for positions).

Hugging Face causal LMs shift their labels inside the loss (token ``t`` predicts ``t + 1``),
which across a split sequence would pair the last token of a chunk with the first of the
rank's next chunk; :func:`shift_hf_labels` shifts them on the whole sequence first and passes
them as ``shift_labels``, which transformers' loss uses as given.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn

from autopar.context import VARIANTS, sequence_positions, shard_sequence
from autopar.errors import InputError, PlanError
from autopar.passes.sequence_mixing import numbering_aranges

__all__ = ["check_cp_runnable", "cp_group", "stack_sequences", "local_rows", "shift_hf_labels", "apply_cp", "runtime_variant"]

_aten = torch.ops.aten
# forward SDPA kernels -> their backward; arguments are read by schema name
_ATTENTION = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default:
        _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    _aten._scaled_dot_product_flash_attention.default: _aten._scaled_dot_product_flash_attention_backward.default,
    _aten._scaled_dot_product_efficient_attention.default:
        _aten._scaled_dot_product_efficient_attention_backward.default,
}
_PASS_THROUGH = {_aten.view.default, _aten._unsafe_view.default, _aten.detach.default, _aten.alias.default,
                 _aten.reshape.default, _aten.clone.default, _aten.contiguous.default}


def check_cp_runnable(cp: int | None, *, compile: bool, variants=()) -> None:
    """What ``parallelize`` runs under cp > 1 (the compiled step program, autopar's own K/V
    exchange: ``variants``, the pinned one or the plan's, among :data:`VARIANTS`): a clear error
    before any collective for the rest."""
    if not cp or cp == 1:
        return
    variants = [variants] if isinstance(variants, str) else list(variants or ())
    alien = [v for v in variants if v not in VARIANTS]
    if alien:
        raise PlanError(f"cp={cp} with cp_variant={alien[0]!r}: that prices another program's K/V exchange "
                        f"(torch's context_parallel or Transformer Engine's, "
                        f"for comparing with runs made with them) and autopar does not run "
                        f"it; pin cp_variant to one of {', '.join(VARIANTS)} or leave it to the planner")
    if not compile:
        raise PlanError(f"cp={cp} needs the compiled step program (its attention and positions are rewritten "
                        f"there); drop compile=False")


def cp_group(mesh_ranks: torch.Tensor, cp: int, rank: int):
    """This rank's cp group for a mesh of global ranks ``mesh_ranks`` ((dp, tp), or (pp, dp, tp)):
    ``cp`` consecutive dp ranks of one tp column of one pipeline stage. Every rank creates every
    group, in the same order (``new_group`` is collective)."""
    import torch.distributed as dist

    dp, tp = mesh_ranks.shape[-2:]
    mine = None
    for stage in mesh_ranks.reshape(-1, dp, tp):
        for t in range(tp):
            for g in range(dp // cp):
                ranks = [int(r) for r in stage[g * cp:(g + 1) * cp, t]]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine = group
    return mine


def runtime_variant(context: dict) -> str:
    """The K/V exchange the runtime runs: the plan's when it chose one kind for every attention op,
    else the ring (which the plan prices wherever it does not choose the all-gather)."""
    variants = [v for v in context.get("variants", []) if v in VARIANTS]
    return variants[0] if len(variants) == 1 else "ring"


def stack_sequences(values: dict[str, Any], *, cp: int, seq: int, rows: int, groups: int,
                    balanced: bool = True) -> dict[str, Any]:
    """A micro-batch of ``rows = groups x mbs`` sequences of ``seq`` tokens as ``groups x cp x mbs``
    rows of ``seq / cp`` tokens, ordered (group, cp rank, sequence): row block ``g cp + r`` is
    cp rank ``r``'s two chunks of group ``g``'s sequences (see the module docstring).

    Every batched tensor must carry the sequence as its dim 1; a batched input without it (a
    per-sequence label) cannot be split over the sequence and is refused."""
    out = {}
    for name, v in values.items():
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != rows:
            out[name] = v
            continue
        if v.dim() < 2 or v.shape[1] != seq:
            raise InputError(f"cp={cp} splits every sequence over the cp ranks, but input {name!r} of shape "
                             f"{tuple(v.shape)} has no sequence dim of {seq} tokens at dim 1 (batch first, then "
                             f"sequence); feed per-token inputs only, or drop cp")
        if seq % (2 * cp):
            raise InputError(f"cp={cp} cuts each sequence into 2 x cp = {2 * cp} equal chunks, but input {name!r} "
                             f"has {seq} tokens; pad sequences to a multiple of {2 * cp}, or choose another cp")
        per = v.reshape(groups, rows // groups, *v.shape[1:])
        parts = [shard_sequence(per, 2, cp, r, balanced) for r in range(cp)]
        out[name] = torch.stack(parts, dim=1).reshape(rows * cp, seq // cp, *v.shape[2:])
    return out


def local_rows(value: torch.Tensor, *, cp: int, dp: int, dp_rank: int, balanced: bool = True) -> torch.Tensor:
    """This rank's part of a global batch tensor (B, S, ...): its batch group's sequences, its two chunks."""
    group = value.chunk(dp // cp)[dp_rank // cp]
    return shard_sequence(group, 1, cp, dp_rank % cp, balanced)


def shift_hf_labels(model: nn.Module, values: dict[str, Any], ignore_index: int = -100) -> dict[str, Any]:
    """For a Hugging Face causal LM given ``labels``: ``shift_labels`` made on the whole sequence
    (label of token ``t`` is token ``t + 1``'s, the last one ignored), as transformers' loss
    would make them, so that each rank's chunks keep their true next tokens under cp."""
    labels = values.get("labels")
    is_causal_lm = type(model).__name__.endswith("ForCausalLM") and hasattr(model, "loss_function")
    if not is_causal_lm or not isinstance(labels, torch.Tensor) or "shift_labels" in values:
        return values
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
    return {**values, "shift_labels": shifted}


# -- the program rewrite ---------------------------------------------------------


def _arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """Argument ``name`` of an ATen op node, positional or keyword, by the op's schema."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, default)
    return default


def _source(node: Any, *, slices: bool = False) -> Any:
    """``node`` before any chain of views, detaches and copies (``slices``: and of the local slices
    a Replicate -> Shard placement change takes: ``split`` then one piece)."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target in _PASS_THROUGH:
            node = node.args[0]
        elif slices and node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and node.args[0].target is _aten.split.Tensor:
            node = node.args[0].args[0]
        else:
            break
    return node


def _constant_value(node: fx.Node, gm: fx.GraphModule) -> torch.Tensor | None:
    """The value of ``node`` when it depends on no placeholder (factories, constants), evaluated
    here on real tensors; None otherwise."""
    order, seen = [], set()

    def visit(n: fx.Node) -> bool:
        if n in seen:
            return True
        seen.add(n)
        if n.op == "placeholder":
            return False
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        order.append(n)
        return True

    if not visit(node):
        return None
    env: dict[fx.Node, Any] = {}
    for n in order:
        if n.op == "get_attr":
            env[n] = getattr(gm, n.target)
        elif n.op == "call_function":
            kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in n.kwargs.items()}
            env[n] = n.target(*fx.node.map_arg(n.args, env.__getitem__), **fx.node.map_arg(kwargs, env.__getitem__))
    return env[node]


def _mask_is_causal(mask: torch.Tensor, q_len: int, k_len: int) -> bool | None:
    """True for the causal mask, False for an all-open one, None for anything else. Boolean masks
    keep True entries; float masks add, -inf (or very negative) closes an entry."""
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    allowed = allowed.reshape(-1, q_len, k_len)
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril()
    if torch.equal(allowed, causal.expand_as(allowed)):
        return True
    if bool(allowed.all()):
        return False
    return None


def _attention_pairs(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node | None]]:
    pairs = []
    for fwd in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _ATTENTION]:
        lse = next((u for u in fwd.users if u.target is operator.getitem and u.args[1] == 1), None)
        bwd = None
        if lse is not None:
            bwd = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target is _ATTENTION[fwd.target]
                        and _source(_arg(n, "logsumexp"), slices=True) is lse), None)
        pairs.append((fwd, bwd))
    return pairs


def _grouped(kv: fx.Node) -> fx.Node | None:
    """The K or V before a grouped-query head repeat (``repeat_interleave`` on heads, or Hugging
    Face's ``repeat_kv``: unsqueeze(2), expand, copy, view to H heads), or None."""
    n = kv
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _PASS_THROUGH:
        n = n.args[0]
    if not (isinstance(n, fx.Node) and n.target is _aten.expand.default):
        return None
    u = n.args[0]
    if not (isinstance(u, fx.Node) and u.target is _aten.unsqueeze.default and u.args[1] == 2):
        return None
    src, want = u.args[0].meta.get("val"), kv.meta.get("val")
    if src is None or want is None or src.dim() != 4 or want.shape[1] % src.shape[1] or \
            (want.shape[0], want.shape[2], want.shape[3]) != tuple(src.shape[i] for i in (0, 2, 3)):
        return None
    return u.args[0]


def _fold(grad: fx.Node, like: fx.Node) -> fx.Node | None:
    """The node summing a repeated K/V's gradient ``grad`` back onto the grouped heads (views, then a
    sum over the repeat dim 2 with its squeeze), shaped like ``like``; None when it is not found."""
    n = grad
    while len(n.users) == 1:
        n = next(iter(n.users))
        if n.target in _PASS_THROUGH:
            continue
        if n.target is _aten.sum.dim_IntList and list(n.args[1]) == [2]:
            keep = len(n.args) > 2 and n.args[2]
            if keep:
                if len(n.users) != 1:
                    return None
                n = next(iter(n.users))
                dims = n.args[1] if n.target is _aten.squeeze.dims else [n.args[1]] \
                    if n.target is _aten.squeeze.dim else None
                if dims is None or list(dims) != [2]:
                    return None
            val, want = n.meta.get("val"), like.meta.get("val")
            return n if val is not None and want is not None and val.shape == want.shape else None
        return None
    return None


def _check_attention(fwd: fx.Node, gm: fx.GraphModule, where: str) -> bool:
    """Whether the attention at ``fwd`` is causal (its flag or its mask), refusing what cp cannot run."""
    if float(_arg(fwd, "dropout_p", 0.0) or 0.0) != 0.0:
        raise PlanError(f"{where}: attention dropout ({_arg(fwd, 'dropout_p')}) cannot run under context "
                        f"parallelism (each rank sees a block of the scores at a time); set the attention "
                        f"dropout to 0, or drop cp")
    causal = bool(_arg(fwd, "is_causal", False))
    mask = _arg(fwd, "attn_mask") if _arg(fwd, "attn_mask") is not None else _arg(fwd, "attn_bias")
    if mask is None:
        return causal
    q, k = fwd.args[0].meta["val"], fwd.args[1].meta["val"]
    value = _constant_value(mask, gm)
    kind = None if value is None else _mask_is_causal(value, q.shape[-2], k.shape[-2])
    if kind is None:
        raise PlanError(f"{where}: the attention mask depends on the inputs or is not causal (a padding or "
                        f"document mask); context parallelism runs causal or unmasked attention only: drop the "
                        f"attention_mask (pack sequences without padding), or drop cp")
    return causal or kind


def apply_cp(gm: fx.GraphModule, *, cp: int, group: str, rank: int, seq: int, variant: str,
             balanced: bool = True) -> int:
    """Rewrite this rank's step program for cp (see the module docstring): attention over the cp
    group ``group`` (this rank is ``rank`` in it), positions global. Returns how many attention
    ops were rewritten; raises PlanError when the program has none."""
    g = gm.graph
    pairs = _attention_pairs(gm)
    if not pairs:
        raise PlanError(f"cp={cp}: the step program has no scaled-dot-product attention op to split over the "
                        f"sequence (context parallelism rewrites torch.nn.functional.scaled_dot_product_attention "
                        f"and the kernels it calls; with attention dropout, SDPA runs as separate ops on CPU): use "
                        f"SDPA attention without dropout, or drop cp")
    for fwd, bwd in pairs:
        where = f"attention op {fwd.name}"
        causal = _check_attention(fwd, gm, where)
        q, k, v = (_arg(fwd, n) for n in ("query", "key", "value"))
        # Grouped-query K/V travel grouped (as the plan prices them): the op takes the K/V before
        # the head repeat, and its backward returns their gradients already summed over each group.
        grouped = [_grouped(k), _grouped(v)]
        folds = [None, None]
        # a backward on a head slice of its forward (the plan split the heads of the backward only)
        # runs on its own slices of the saved tensors and of K/V (repeated, so it exchanges them
        # ungrouped), its gradients folded by the program as they are
        sliced = bwd is not None and _source(_arg(bwd, "logsumexp")) is not _source(
            next(u for u in fwd.users if u.target is operator.getitem and u.args[1] == 1))
        if bwd is not None and all(grouped) and not sliced:
            got = [next((u for u in bwd.users if u.target is operator.getitem and u.args[1] == i), None) for i in (1, 2)]
            folds = [_fold(g_, src) if g_ is not None else None for g_, src in zip(got, grouped)]
        if all(grouped) and (bwd is None or sliced or all(folds)):
            k, v = grouped
        else:
            folds = [None, None]
        scale = _arg(fwd, "scale")
        scale = float(scale) if scale is not None else q.meta["val"].shape[-1] ** -0.5
        extra = (causal, scale, cp, group, variant, balanced)
        with g.inserting_before(fwd):
            new = g.call_function(torch.ops.autopar.cp_attention.default, (q, k, v, *extra))
            out, lse = (g.call_function(operator.getitem, (new, i)) for i in (0, 1))
        for n in (new, out, lse):  # (the pipeline pass reads the stage tags in meta["custom"])
            n.meta.update({key: val for key, val in fwd.meta.items() if key != "val"})
        if isinstance(fwd.meta.get("val"), (tuple, list)):  # same shapes: (B, H, S, D) and (B, H, S)
            out.meta["val"], lse.meta["val"] = fwd.meta["val"][:2]
        for u in list(fwd.users):
            if u.target is operator.getitem and u.args[1] in (0, 1):
                u.replace_all_uses_with(out if u.args[1] == 0 else lse)
        if bwd is None:
            continue
        grad = _arg(bwd, "grad_out") if _arg(bwd, "grad_out") is not None else _arg(bwd, "grad_out_")
        k_b, v_b = (_arg(bwd, "key"), _arg(bwd, "value")) if sliced else (k, v)
        args = (grad, _arg(bwd, "query"), k_b, v_b, *(_arg(bwd, n) for n in ("out", "logsumexp")), *extra)
        with g.inserting_before(bwd):
            new_b = g.call_function(torch.ops.autopar.cp_attention_backward.default, args)
        new_b.meta.update({key: val for key, val in bwd.meta.items() if key != "val"})
        for u in list(bwd.users):
            if u.target is operator.getitem and u.args[1] in (0, 1, 2):
                fold = folds[u.args[1] - 1] if u.args[1] else None
                with g.inserting_before(u):
                    got = g.call_function(operator.getitem, (new_b, u.args[1]))
                got.meta.update((fold or u).meta)
                (fold or u).replace_all_uses_with(got)
    g.eliminate_dead_code()  # the replaced gradients' folds, the K/V repeats
    for fwd, bwd in pairs:  # (SDPA kernels count as impure, random for dropout: dead code elimination keeps them)
        for old in (bwd, fwd):
            if old is None or old._erased:  # (a backward kernel counts as pure: already gone)
                continue
            for u in list(old.users):
                if u.target is operator.getitem and not u.users:
                    g.erase_node(u)
            if not old.users:
                g.erase_node(old)
    g.eliminate_dead_code()  # any mask the old kernels read
    leftover = [n.name for n in g.nodes if n.op == "call_function" and (n.target in _ATTENTION or
                                                                         n.target in _ATTENTION.values())]
    if leftover:
        raise PlanError(f"cp={cp}: attention ops {leftover} are still read after the rewrite (an attention "
                        f"output used in an unexpected way); drop cp")
    _global_positions(gm, cp=cp, rank=rank, seq=seq, balanced=balanced)
    g.lint()
    gm.recompile()
    return len(pairs)


def _global_positions(gm: fx.GraphModule, *, cp: int, rank: int, seq: int, balanced: bool) -> None:
    """Every token-numbering ``arange`` (step 1, ``seq / cp`` long, no tensor input) -> this rank's global
    positions, kept as a constant of the program."""
    positions = sequence_positions(seq, cp, rank, balanced)
    for n, start in numbering_aranges(gm, seq // cp):
        val = n.meta.get("val")
        dtype = val.dtype if isinstance(val, torch.Tensor) else n.kwargs.get("dtype", torch.int64)
        device = n.kwargs.get("device") or torch.device("cpu")
        name = f"_cp_positions_{n.name}"
        gm.register_buffer(name, (positions + start).to(dtype=dtype, device=device), persistent=False)
        with gm.graph.inserting_before(n):
            const = gm.graph.get_attr(name)
        const.meta = dict(n.meta)
        n.replace_all_uses_with(const)
        gm.graph.erase_node(n)

"""Context parallelism in the planner: check ``cp``, price it per layer, record it in the plan.

``cp`` folds over the data-parallel ranks, like ``ep`` (:mod:`autopar.planner.experts`):
``dp = batch groups x cp``, a cp group is ``cp`` consecutive dp ranks (stride tp in the
world), the global batch is split over the ``dp / cp`` groups and each sequence over the
``cp`` ranks of its group, two chunks per rank in the load-balanced layout of
:mod:`autopar.context`. Parameters stay replicated over all dp ranks, so gradient
reduction and ZeRO work over ``dp`` as before (the cp ranks of a group hold gradients of
different tokens: they are summed like any other data-parallel gradients).

What a rank computes under cp: every op outside attention works on ``1/cp`` of each
sequence's tokens, and attention (balanced causal layout, or any non-causal one) does
``1/cp`` of the sequence's attention work. Every cost in the strategy graph is affine in the
batch (``a + b x batch``; attention's ``b`` term carries its ``s^2``), so a rank of a plan
with micro-batch ``mbs`` costs what a plan without cp costs at ``mbs / cp``: compute,
activation memory, tp collectives and pipeline messages (each rank sends its own tokens)
all scale so. On top: each attention op exchanges keys and values around the cp group
(:func:`autopar.cost.comm.context_attention_cost`, ring or all-gather, whichever leaves less
exposed), charged to the layer's forward and backward as its exposed time.

Refused: a model with an op that works along each sequence apart other than attention (a
per-sequence mean, a hand-written softmax over positions, a causal convolution, a shift), which
the runtime would run on chunks (:func:`autopar.passes.sequence_mixing.sequence_mixing`: a
pinned cp is one line naming the op and its module; the search does not weigh cp), and a cp
whose ``S / cp`` collides with another ``arange``'s length (:func:`position_collisions`).

Not modelled, stated: the position-dependent work (RoPE tables, masks) is charged as the
traced graph does at the smaller batch; the contiguous layout's causal imbalance (the plan
uses the balanced one).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
from torch import fx

from autopar.cluster import Cluster
from autopar.cost.comm import (ContextAttentionCost, context_attention_cost, te_context_attention_cost,
                               torch_context_attention_cost)
from autopar.errors import PlanError
from autopar.passes import meta_keys as mk
from autopar.passes.sequence_mixing import described, labels_shifted_outside, position_collisions, sequence_mixing

__all__ = ["AttentionSite", "find_attention", "sequence_length", "check_cp", "cp_options", "cp_weighing",
           "attention_costs",
           "cp_costs", "cp_decision", "apply_cp", "cp_kernel_ratio", "cp_working_sets", "repeat_savings",
           "context_record", "CP_DEGREES", "MIN_SEQUENCE", "MIN_TOKENS_PER_RANK"]

CP_DEGREES = (2, 4, 8, 16, 32)
"""cp degrees the search tries (Llama 3 405B trained its 128k-token stage with cp = 16)."""
MIN_SEQUENCE = 16384
"""Sequences shorter than this are not split: below it, activation memory is what tp, sp,
recompute and pipelining already handle, and each cp degree tried costs a search."""
MIN_TOKENS_PER_RANK = 4096
"""Fewest tokens per rank a cp degree may leave: shorter chunks make each ring step's
attention too small to hide its K/V hop (the exchange is priced either way; this only keeps
hopeless degrees out of the search)."""


@dataclass(frozen=True, kw_only=True)
class AttentionSite:
    """One attention op of the traced graph (forward node and its backward node)."""

    layer: str
    forward: str
    """Strategy-graph (and fx) name of the forward SDPA node."""
    backward: str | None
    kv_bytes: int
    """Bytes of its K and V together at the traced (global) batch, whole sequence, all heads."""
    repeated_bytes: int = 0
    """Bytes of the K and V the traced op reads beyond ``kv_bytes``: a grouped-query head repeat's
    copies, which the traced graph keeps for the backward and cp's op does not (it saves the
    grouped K/V), at the traced batch."""
    elem_bytes: int
    """Bytes of one K/V element (the gradient blocks travel in fp32, 4 bytes)."""
    query_elems: int = 0
    """Elements of its queries (= of its output) at the traced batch: the fp32 accumulators cp's op
    keeps are this size."""


def _attention_nodes(gm: fx.GraphModule, phase_forward: bool) -> list[fx.Node]:
    from autopar.passes.annotate import kernel_of

    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or mk.TRACE not in n.meta:
            continue
        if kernel_of(n)[0] in ("attention", "causal_attention") and \
                ("backward" not in str(n.target)) == phase_forward:
            out.append(n)
    return out


def find_attention(gm: fx.GraphModule) -> list[AttentionSite]:
    """The SDPA ops of ``gm`` in graph order, each with the backward op that reads its output."""
    sites = []
    backward = _attention_nodes(gm, phase_forward=False)
    for n in _attention_nodes(gm, phase_forward=True):
        k, v = (a.meta.get("val") for a in n.args[1:3])
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            continue
        kv_bytes = _source_bytes(n.args[1]) + _source_bytes(n.args[2])
        outputs = {n, *(u for u in n.users if u.target is operator.getitem)}  # its output, log-sum-exp, ...
        bwd = next((b for b in backward if outputs & set(b.all_input_nodes)), None)
        sites.append(AttentionSite(layer=n.meta.get(mk.LAYER, ""), forward=n.name,
                                   backward=bwd.name if bwd is not None else None,
                                   kv_bytes=kv_bytes,
                                   repeated_bytes=max(0, k.numel() * k.element_size() + v.numel() * v.element_size()
                                                      - kv_bytes),
                                   elem_bytes=k.element_size(), query_elems=_numel(n.args[0])))
    return sites


def _numel(node) -> int:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return int(v.numel()) if isinstance(v, torch.Tensor) else 0


# Ops that only copy or broadcast their input: grouped-query attention's K/V head repeat is
# one of them (``repeat_interleave`` lowers to expand + clone + view), and cp exchanges the
# K/V before it (autopar.context takes grouped K/V), so the bytes priced are its input's.
_BROADCASTS = ("expand", "clone", "view", "_unsafe_view", "reshape", "unsqueeze", "repeat_interleave", "repeat",
               "contiguous", "alias")


def _source_bytes(node: fx.Node) -> int:
    """Bytes of ``node``'s value before any chain of broadcasts and copies that produced it."""
    best = None
    while isinstance(node, fx.Node):
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor):
            size = int(v.numel() * v.element_size())
            best = size if best is None else min(best, size)
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if node.op != "call_function" or name not in _BROADCASTS or not node.args:
            break
        node = node.args[0]
    return best or 0


def sequence_length(gm: fx.GraphModule) -> int | None:
    """Tokens per sequence: dim 1 of the first integer (B, S) model input (token ids)."""
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta.get("val")
        if n.meta[mk.TRACE].role is mk.Role.INPUT and isinstance(v, torch.Tensor) and v.dim() == 2 \
                and not v.dtype.is_floating_point:
            return int(v.shape[1])
    return None


def check_cp(cp: int | None, gm: fx.GraphModule, *, cluster: Cluster, dp: int | None) -> None:
    """Refuse a pinned cp that cannot work, in one line, before any solving."""
    if not cp or cp == 1:
        return
    problems = []
    seq = sequence_length(gm)
    if seq is None:
        problems.append("the model has no (batch, sequence) token input to split")
    elif seq % (2 * cp):
        problems.append(f"the sequence of {seq} tokens does not split into 2 x cp = {2 * cp} equal chunks "
                        f"(the balanced layout gives each rank one early and one late chunk); pad the sequence "
                        f"to a multiple of {2 * cp} or choose a cp with {seq} divisible by 2 x cp")
    if not find_attention(gm):
        problems.append("the model has no attention op (scaled_dot_product_attention) for cp to split")
    if seq is not None:
        mixing = sequence_mixing(gm, seq, untagged=labels_shifted_outside(gm))
        if mixing:
            problems.append(f"{described(mixing)}: under cp each rank holds chunks of every sequence and only "
                            f"attention and positions are made whole-sequence, so this op would compute on chunks "
                            f"what the model computes on sequences; compute it over all tokens (or per token), "
                            f"or drop cp")
        if seq % (2 * cp) == 0:
            clash = position_collisions(gm, seq, cp)
            if clash:
                problems.append(f"the program numbers something other than positions with {seq // cp} = seq / cp "
                                f"elements ({', '.join(clash)}), which cp would take for the rank's token "
                                f"positions; choose a cp or a sequence length with another seq / cp")
    if dp and dp % cp:
        problems.append(f"cp={cp} does not divide dp={dp} (cp folds over the data-parallel ranks)")
    if cluster.world_size % cp:
        problems.append(f"cp={cp} does not divide the {cluster.world_size} devices")
    if problems:
        raise PlanError(f"cp={cp}: " + "; ".join(problems))


def cp_options(gm: fx.GraphModule, world: int) -> tuple[int, ...]:
    """The cp degrees > 1 the search weighs for ``gm`` (:func:`cp_weighing`)."""
    return cp_weighing(gm, world)[0]


def cp_weighing(gm: fx.GraphModule, world: int) -> tuple[tuple[int, ...], str | None]:
    """The cp degrees > 1 the search weighs for ``gm``, none for short sequences or a model
    without attention (see :data:`MIN_SEQUENCE`, :data:`MIN_TOKENS_PER_RANK`); and, for long
    sequences, why none: the first op that works along each sequence apart
    (:func:`sequence_mixing`), which the plan's context says."""
    seq = sequence_length(gm)
    if seq is None or seq < MIN_SEQUENCE or not find_attention(gm):
        return (), None
    found = sequence_mixing(gm, seq, untagged=labels_shifted_outside(gm))
    if found:
        return (), f"{described(found)}, which cp would run on chunks as if they were sequences"
    return tuple(c for c in CP_DEGREES if world % c == 0 and seq % (2 * c) == 0 and seq // c >= MIN_TOKENS_PER_RANK
                 and not position_collisions(gm, seq, c)), None


def attention_costs(sites: list[AttentionSite], *, problem, sol_choice, sg_index: dict[str, int], cp: int,
                    tp_split: dict[str, bool], tp: int, microbatch_size: float, global_batch: int, link,
                    overlap_slowdown: float = 1.0, variants: tuple[str, ...] = ("ring", "allgather"),
                    memory_bytes_per_s: float | None = None,
                    kernel_ratio: float = 1.0) -> dict[str, list[ContextAttentionCost]]:
    """Layer path -> what cp adds to each of its attention ops on one rank, per micro-batch: the
    K/V exchange attention does not hide, the op's eager kernels at ``memory_bytes_per_s`` (eager
    PyTorch's rate; None: not priced), and its blocks' kernel time beyond the attention priced in
    the graph (``kernel_ratio``: the cp op's kernel time over that, :func:`cp_kernel_ratio`).
    ``variants == ("torch",)`` prices torch's own context parallelism instead (pinned only,
    :func:`autopar.cost.comm.torch_context_attention_cost`; its kernel is the graph's SDPA), and
    ``("te",)`` Transformer Engine's (:func:`autopar.cost.comm.te_context_attention_cost`).

    ``problem`` is the sharding problem at the per-rank batch (``microbatch_size / cp``): its node
    times are the busiest rank's attention compute, which the ring's hops hide behind.
    """
    from autopar.planner.ilp import node_cost_s

    out: dict[str, list[ContextAttentionCost]] = {}
    for site in sites:
        v = sg_index.get(site.forward)
        if v is None:
            continue
        node = problem.graph.nodes[v]
        fwd_s = node_cost_s(problem, v, node.candidates[sol_choice[v]])
        b = sg_index.get(site.backward) if site.backward else None
        bwd_s = node_cost_s(problem, b, problem.graph.nodes[b].candidates[sol_choice[b]]) if b is not None else 0.0
        scale = (microbatch_size / global_batch) / cp / (tp if tp_split.get(site.forward) else 1)
        kv = site.kv_bytes * scale
        dkv = kv * 4 / site.elem_bytes  # the gradient blocks travel as fp32 accumulators
        if variants == ("te",):  # pinned only: TE's p2p ring, grouped K/V, blocks on the SDPA kernel
            out.setdefault(site.layer, []).append(te_context_attention_cost(
                cp=cp, kv_bytes=kv, query_elems=site.query_elems * scale, elem_bytes=site.elem_bytes,
                forward_s=fwd_s, backward_s=bwd_s, link=link, memory_bytes_per_s=memory_bytes_per_s,
                overlap_slowdown=overlap_slowdown))
            continue
        if variants == ("torch",):  # pinned only: torch's program exchanges the repeated heads
            out.setdefault(site.layer, []).append(torch_context_attention_cost(
                cp=cp, kv_bytes=(site.kv_bytes + site.repeated_bytes) * scale, elem_bytes=site.elem_bytes,
                forward_s=fwd_s, backward_s=bwd_s, link=link, memory_bytes_per_s=memory_bytes_per_s,
                overlap_slowdown=overlap_slowdown))
            continue
        best = min((context_attention_cost(variant=var, cp=cp, kv_bytes=kv, dkv_bytes=dkv,
                                           forward_s=fwd_s * kernel_ratio, backward_s=bwd_s * kernel_ratio,
                                           link=link, overlap_slowdown=overlap_slowdown,
                                           query_elems=site.query_elems * scale, memory_bytes_per_s=memory_bytes_per_s)
                    for var in variants), key=lambda c: (c.exposed_s, c.variant))
        slower = kernel_ratio - 1.0
        out.setdefault(site.layer, []).append(replace(best, forward_exposed_s=best.forward_exposed_s + slower * fwd_s,
                                                      backward_exposed_s=best.backward_exposed_s + slower * bwd_s,
                                                      kernel_s=slower * (fwd_s + bwd_s)))
    return out


def apply_cp(units: list, costs: dict[str, list[ContextAttentionCost]], names: dict[str, list[str]],
             unsaved: dict[str, float] | None = None, working: dict[str, float] | None = None) -> list:
    """Units with each layer's exposed K/V exchange added to its forward and backward, less
    saved by the bytes in ``unsaved`` (per layer: the grouped-query repeat copies cp's op does
    not keep, :func:`repeat_savings`; zero-FLOP copies, so counted among the cheap activations
    too, which selective recompute already leaves unsaved), and a largest op's working set of at
    least ``working`` (per layer: its attention op's under cp, :func:`cp_working_sets`)."""
    extra = {}
    for layer, cs in costs.items():
        f = sum(c.forward_exposed_s for c in cs)
        b = sum(c.backward_exposed_s for c in cs)
        comm = sum(c.exchange_exposed_s for c in cs)  # (the rest of f + b is compute)
        for name in names.get(layer, [layer]):
            extra[name] = (f, b, comm, (unsaved or {}).get(layer, 0.0), (working or {}).get(layer, 0.0))
    out = []
    for u in units:
        if u.path not in extra:
            out.append(u)
            continue
        f, b, comm, less, ws = extra[u.path]
        less = min(less, u.cheap_act_bytes)
        out.append(replace(u, f_s=u.f_s + f, b_s=u.b_s + b, comm_s=u.comm_s + comm,
                           act_bytes=u.act_bytes - less, cheap_act_bytes=u.cheap_act_bytes - less,
                           transient_bytes=max(u.transient_bytes, ws)))
    return out


def cp_working_sets(attention: list[AttentionSite], costs: dict[str, list[ContextAttentionCost]], problem, sg,
                    sol) -> dict[str, float]:
    """Per layer, the largest working set of its attention ops under cp: each op's own (its
    outputs and unsaved inputs, as :mod:`autopar.planner.evaluation` counts every op's) plus what
    the K/V exchange keeps live inside it (``ContextAttentionCost.*_working_bytes``)."""
    from autopar.planner.evaluation import _working_sets

    ws = _working_sets(problem, sol)
    index = {n.name: v for v, n in enumerate(sg.nodes)}
    out: dict[str, float] = {}
    for layer, cs in costs.items():
        sites = [s for s in attention if s.layer == layer and s.forward in index]
        for site, c in zip(sites, cs):
            fwd = ws.get(index[site.forward], 0.0) + c.forward_working_bytes
            bwd = ws.get(index.get(site.backward, -1), 0.0) + c.backward_working_bytes
            out[layer] = max(out.get(layer, 0.0), fwd, bwd)
    return out


def repeat_savings(attention, sg, sol, *, cp: int, tp: int, mbs: int, batch: int) -> dict[str, float]:
    """Per layer, the saved bytes of grouped-query K/V repeat copies one rank does not keep under cp
    (at its micro-batch, 1/cp of each sequence, its tp share of the heads)."""
    split = _tp_split(attention, sg, sol)
    out: dict[str, float] = {}
    for site in attention:
        scale = (mbs / batch) / cp / (tp if split.get(site.forward) else 1)
        out[site.layer] = out.get(site.layer, 0.0) + site.repeated_bytes * scale
    return out


def _tp_split(attention, sg, sol) -> dict[str, bool]:
    """Whether each attention op's heads are split over tp in the sharding MIP's solution."""
    from autopar.planner.ilp import _splits

    index = {n.name: v for v, n in enumerate(sg.nodes)}
    return {a.forward: _splits(sg.nodes[index[a.forward]].candidates[sol.choice[index[a.forward]]])
            for a in attention if a.forward in index}


def context_record(costs: dict[str, list[ContextAttentionCost]], *, cp: int, seq: int, counts: dict[str, int],
                   microbatches: int) -> dict:
    """The plan's ``context`` record: the cp degree, the layout, and the K/V exchange per step."""
    variants = sorted({c.variant for cs in costs.values() for c in cs})
    n = sum(len(cs) * counts.get(layer, 1) for layer, cs in costs.items())
    comm = sum((c.forward_comm_s + c.backward_comm_s) * counts.get(layer, 1) for layer, cs in costs.items() for c in cs)
    exposed = sum(c.exposed_s * counts.get(layer, 1) for layer, cs in costs.items() for c in cs)
    count = sum(c.messages * counts.get(layer, 1) for layer, cs in costs.items() for c in cs)
    sent = sum(c.sent_bytes * counts.get(layer, 1) for layer, cs in costs.items() for c in cs)
    eager = sum(c.eager_s * counts.get(layer, 1) for layer, cs in costs.items() for c in cs)
    kernel = sum(c.kernel_s * counts.get(layer, 1) for layer, cs in costs.items() for c in cs)
    return {"cp": cp, "layout": "balanced", "sequence": seq, "tokens_per_rank": seq // cp,
            "variants": variants, "attention_ops": n,
            "kv_exchange": {"count": count * microbatches, "bytes": sent * microbatches,
                            "time_s": comm * microbatches, "exposed_s": exposed * microbatches,
                            "eager_s": eager * microbatches, "kernel_s": kernel * microbatches}}


def cp_decision(best, other, cps: tuple[int, ...], *, seq: int) -> dict:
    """Why the search split sequences or not: the degrees weighed and the best plan of the other
    side (None: none fits there)."""
    alt = None if other is None else {"cp": other.config.cp, "step_time_s": other.step_time_s,
                                      "peak_memory_bytes": other.peak_memory_bytes}
    out = {"considered": list(cps), "other_side": alt}
    if best.config.cp == 1:
        out.update(cp=1, sequence=seq, tokens_per_rank=seq)
    return out


def cp_kernel_ratio(device) -> float:
    """The cp op's attention kernel time over the graph's SDPA's on ``device``: autopar's op runs
    FlashAttention-2 on CUDA (:mod:`autopar.context_blocks`), SDPA the device's default kernel
    (``DeviceSpec.flash_attention_efficiency`` against ``attention_efficiency``; 1 where they agree)."""
    from autopar.cost.compute import ATTENTION_EFFICIENCY

    if device.flash_attention_efficiency is None:
        return 1.0
    return (device.attention_efficiency or ATTENTION_EFFICIENCY) / device.flash_attention_efficiency


def cp_costs(attention, problem, sg, sol, *, cp: int, tp: int, mbs: int, batch: int,
              cluster: Cluster, variant: str | None = None) -> dict[str, list[ContextAttentionCost]]:
    """Per layer, the K/V exchange of its attention ops under cp, on the cp group's link (each op's
    cheaper variant, or the pinned ``variant``)."""
    from autopar.cost.compute import kernel_time_s
    from autopar.cost.step import OVERLAP_SLOWDOWN

    index = {n.name: v for v, n in enumerate(sg.nodes)}
    split = _tp_split(attention, sg, sol)
    eager = 1e9 / kernel_time_s(kind="other", flops=0.0, bytes_moved=1e9, device=cluster.device)  # bytes per s
    # (hops hidden behind attention slow it as the step program's overlapped collectives slow compute)
    return attention_costs(attention, problem=problem, sol_choice=sol.choice, sg_index=index, cp=cp, tp_split=split,
                           tp=tp, microbatch_size=mbs, global_batch=batch,
                           link=cluster.link_for_group(cp, stride=tp), overlap_slowdown=OVERLAP_SLOWDOWN,
                           variants=(variant,) if variant else ("ring", "allgather"), memory_bytes_per_s=eager,
                           kernel_ratio=cp_kernel_ratio(cluster.device))

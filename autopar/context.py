"""Attention over a sequence split across a context-parallel (cp) group, as one traceable op.

``cp_attention(q, k, v, causal, scale, cp, group, variant)`` computes
``softmax(q k^T * scale + mask) v`` for the local queries of a sequence that is split over
the ``cp`` ranks of ``group`` (``q``: (B, H, S_local, D); ``k``, ``v``: (B, H_kv, S_local, D)
with ``H`` a multiple of ``H_kv``: grouped-query attention), against the keys and values of
every rank. It returns the local output and the log-sum-exp of each query's scores
((B, H, S_local), as SDPA's kernels return it; fp32 or wider), which the backward needs.

Layout (:func:`chunk_ids`). The sequence is cut into ``2 cp`` equal chunks; with the
load-balanced layout rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (one early, one late),
so under a causal mask every rank has the same work (seeds 000/001, the CP section; Llama 3
trained 128k-token sequences so). ``balanced=False`` gives rank ``r`` chunks ``2r, 2r + 1``
(contiguous), whose causal work grows with ``r``: the cost model prices its busiest rank.

Two ways to meet the other ranks' keys (``variant``):

- ``"ring"``: the K/V blocks travel around the group (p2p to the next rank, from the
  previous), ``cp - 1`` hops, each sent while the block that arrived before it is being
  computed; the partial results merge by their log-sum-exps (online softmax). Backward:
  the K/V blocks travel again with their gradient accumulators, which take one more hop
  home. Memory: two K/V blocks at a time.
- ``"allgather"``: all of K and V are gathered first (one all-gather each), then the same
  block computation; backward reduce-scatters the K/V gradients to their owners. Fewer,
  larger messages and no overlap: for short rings or short chunks.

Inside a block, the work is done per pair of (query chunk, key chunk): a key chunk after the
query chunk is skipped under a causal mask, the same chunk gets the triangular mask, an
earlier one is full. So a rank computes only the pairs the mask leaves, the FLOPs
:func:`attention_flops` counts. Each pair runs on the device's fused attention kernel
(:mod:`autopar.context_blocks`: FlashAttention-2 on CUDA for fp16/bf16, ATen's flash kernel on
CPU for any float dtype, fp64 included), which returns the pair's log-sum-exp; the pairs merge
in fp32 (fp64). The backward is FlashAttention's: each pair's kernel gets the merged output
and log-sum-exp of its query chunk and recomputes its probabilities from them, so no
(S x S) matrix is ever held (the explicit-matmul fallback, for fp32 on CUDA, holds one pair's).

Why own ops rather than DTensor's context parallel (``torch.distributed.tensor.experimental.
context_parallel``): that one patches SDPA in eager mode around a module, while autopar needs
one node in its traced joint graph that the planner can price and the runtime runs with the
plan's group; and it does not take fp64 or grouped-query K/V without expansion.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.flop_counter import register_flop_formula

from autopar.context_blocks import acc_dtype, block_backward, block_forward

__all__ = ["cp_attention", "chunk_ids", "shard_sequence", "unshard_sequence", "sequence_positions",
           "attention_flops", "VARIANTS"]

VARIANTS = ("ring", "allgather")


def chunk_ids(cp: int, rank: int, balanced: bool = True) -> tuple[int, int]:
    """The two chunks (of ``2 cp``) of the sequence that ``rank`` holds, in order."""
    return (rank, 2 * cp - 1 - rank) if balanced else (2 * rank, 2 * rank + 1)


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int, balanced: bool = True) -> torch.Tensor:
    """``rank``'s part of ``x`` along its sequence dim ``dim`` (its two chunks, concatenated)."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"a sequence of {x.shape[dim]} does not split into 2 x cp = {2 * cp} equal chunks; "
                         f"pad it to a multiple of {2 * cp} or choose another cp")
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp, rank, balanced)], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int, balanced: bool = True) -> torch.Tensor:
    """The whole sequence from every rank's part (rank order): :func:`shard_sequence`'s inverse."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        a, b = part.chunk(2, dim=dim)
        i, j = chunk_ids(cp, r, balanced)
        chunks[i], chunks[j] = a, b
    return torch.cat(chunks, dim=dim)


def sequence_positions(seq_len: int, cp: int, rank: int, balanced: bool = True) -> torch.Tensor:
    """Global positions of ``rank``'s tokens (what RoPE and position embeddings must use)."""
    return shard_sequence(torch.arange(seq_len), 0, cp, rank, balanced)


def _check(group: str, cp: int, variant: str):
    """The cp process group named ``group`` (None for ``""``: cp must be 1), checked against ``cp``."""
    if variant not in VARIANTS:
        raise ValueError(f"context-parallel attention variant {variant!r} is not one of {VARIANTS}")
    if not group:
        if cp != 1:
            raise ValueError(f"cp={cp} needs the process group of the cp ranks; got none (group='')")
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    g = _resolve_process_group(group)
    if dist.get_world_size(g) != cp:
        raise ValueError(f"cp={cp}, but process group {group!r} has {dist.get_world_size(g)} ranks")
    return g


def _mode(q_chunk: int, k_chunk: int, causal: bool) -> str:
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diag" if k_chunk == q_chunk else "skip"


def _like(ref: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in ``ref``'s dtype and memory layout (the fake impls promise ``empty_like`` results,
    and the traced program's views after attention rely on SDPA's (B, S, H, D)-major layout)."""
    return torch.empty_like(ref).copy_(value)


def _forward_block(q, k, v, out, lse, q_chunks, k_chunks, causal, scale):
    """Merge the attention of the local queries on one rank's K/V block into ``out`` and ``lse``
    (in place: the fp32 accumulators are updated chunk by chunk, with no copy of them)."""
    qs, ks, vs = q.chunk(2, dim=2), k.chunk(2, dim=2), v.chunk(2, dim=2)
    outs, lses = out.chunk(2, dim=2), lse.chunk(2, dim=2)
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(k_chunks):
            mode = _mode(qc, kc, causal)
            if mode == "skip":
                continue
            block_out, block_lse = block_forward(qs[i], ks[j], vs[j], mode == "diag", scale)
            new = torch.logaddexp(lses[i], block_lse)
            outs[i].mul_(torch.exp(lses[i] - new)).addcmul_(block_out, torch.exp(block_lse - new))
            lses[i].copy_(new)


def _backward_block(q, k, v, do, out, lse, dq, q_chunks, k_chunks, causal, scale):
    """This block's share: dq accumulated in place; returns (dk, dv) of the block (grouped heads)."""
    acc = lse.dtype
    qs, ks, vs = q.chunk(2, dim=2), k.chunk(2, dim=2), v.chunk(2, dim=2)
    dos, outs, lses = do.chunk(2, dim=2), out.chunk(2, dim=2), lse.chunk(2, dim=2)
    dqs = dq.chunk(2, dim=2)  # views: accumulated in place
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    dks, dvs = dk.chunk(2, dim=2), dv.chunk(2, dim=2)
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(k_chunks):
            mode = _mode(qc, kc, causal)
            if mode == "skip":
                continue
            dqi, dki, dvi = block_backward(dos[i], qs[i], ks[j], vs[j], outs[i], lses[i], mode == "diag", scale)
            dqs[i].add_(dqi)  # (the kernel's dtype, added into the fp32 accumulators in one pass)
            dks[j].add_(dki)
            dvs[j].add_(dvi)
    return dk, dv


class _Ring:
    """Sends to the next rank of the cp group, receives from the previous (async)."""

    def __init__(self, group) -> None:
        self.group = group
        me, n = dist.get_rank(group), dist.get_world_size(group)
        self.rank, self.size = me, n
        self.next = dist.get_global_rank(group, (me + 1) % n)
        self.prev = dist.get_global_rank(group, (me - 1) % n)

    def start(self, tensors: list[torch.Tensor]):
        recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # (contiguous: gloo)
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
        return dist.batch_isend_irecv(ops), recv


@torch.library.custom_op("autopar::cp_attention", mutates_args=())
def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, cp: int,
                 group: str, variant: str, balanced: bool) -> tuple[torch.Tensor, torch.Tensor]:
    acc = acc_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((*q.shape[:3], 1), float("-inf"), dtype=acc, device=q.device)
    g = _check(group, cp, variant)
    if g is None:  # cp == 1: the whole sequence is here
        _forward_block(q, k, v, out, lse, (0, 1), (0, 1), causal, scale)
        return _like(q, out), lse.squeeze(-1)
    rank = dist.get_rank(g)
    mine = chunk_ids(cp, rank, balanced)
    if variant == "allgather":
        ks, vs = _all_gather(k, g), _all_gather(v, g)
        for src in range(cp):
            _forward_block(q, ks[src], vs[src], out, lse, mine, chunk_ids(cp, src, balanced), causal, scale)
        return _like(q, out), lse.squeeze(-1)
    ring = _Ring(g)
    kv = [k, v]
    for step in range(cp):
        pending = ring.start(kv) if step < cp - 1 else None  # the next block travels while this one computes
        src = (rank - step) % cp
        _forward_block(q, kv[0], kv[1], out, lse, mine, chunk_ids(cp, src, balanced), causal, scale)
        if pending is not None:
            works, kv = pending
            for w in works:
                w.wait()
    return _like(q, out), lse.squeeze(-1)


@cp_attention.register_fake
def _(q, k, v, causal, scale, cp, group, variant, balanced):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("autopar::cp_attention_backward", mutates_args=())
def cp_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, cp: int, group: str,
                          variant: str, balanced: bool) -> list[torch.Tensor]:
    acc = lse.dtype
    lse = lse.unsqueeze(-1)  # (B, H, S, 1), as block_forward gives it
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    g = _check(group, cp, variant)
    if g is None:
        dk, dv = _backward_block(q, k, v, grad_out, out, lse, dq, (0, 1), (0, 1), causal, scale)
        return [_like(q, dq), _like(k, dk), _like(v, dv)]
    rank = dist.get_rank(g)
    mine = chunk_ids(cp, rank, balanced)
    if variant == "allgather":
        ks, vs = _all_gather(k, g), _all_gather(v, g)
        dks, dvs = [], []
        for src in range(cp):
            dk, dv = _backward_block(q, ks[src], vs[src], grad_out, out, lse, dq, mine,
                                     chunk_ids(cp, src, balanced), causal, scale)
            dks.append(dk)
            dvs.append(dv)
        dk, dv = _reduce_scatter(dks, g), _reduce_scatter(dvs, g)
        return [_like(q, dq), _like(k, dk), _like(v, dv)]
    ring = _Ring(g)
    kv, dkv = [k, v], None
    for step in range(cp):
        src = (rank - step) % cp
        pending = ring.start(kv) if step < cp - 1 else None  # K/V ahead; gradients follow their block
        dk, dv = _backward_block(q, kv[0], kv[1], grad_out, out, lse, dq, mine, chunk_ids(cp, src, balanced),
                                 causal, scale)
        if dkv is not None:
            works, got = dkv
            for w in works:
                w.wait()
            dk, dv = dk + got[0], dv + got[1]
        dkv = ring.start([dk, dv])  # to the next rank, which computes on this block next (or owns it)
        if pending is not None:
            works, kv = pending
            for w in works:
                w.wait()
    works, (dk, dv) = dkv  # after cp hops each accumulator is home
    for w in works:
        w.wait()
    return [_like(q, dq), _like(k, dk), _like(v, dv)]


@cp_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, causal, scale, cp, group, variant, balanced):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _reduce_scatter(parts: list[torch.Tensor], group) -> torch.Tensor:
    # (gloo has no reduce_scatter: an all-reduce of the stacked parts, then this rank's row;
    # NCCL's would send 1/cp of it. Correct either way; the cost model prices the reduce-scatter.)
    if dist.get_backend(group) == "nccl":
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, [p.contiguous() for p in parts], group=group)
        return out
    stacked = torch.stack(parts)
    dist.all_reduce(stacked, group=group)
    return stacked[dist.get_rank(group)]


def _setup(ctx, inputs, output):
    q, k, v, causal, scale, cp, group, variant, balanced = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # (an auxiliary output: the backward reads it, no loss should)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (causal, scale, cp, group, variant, balanced)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = cp_attention_backward(grad_out.contiguous(), q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


cp_attention.register_autograd(_backward, setup_context=_setup)


def _pairs(cp: int, causal: bool, balanced: bool) -> float:
    """Chunk pairs the busiest rank computes, a diagonal pair counting half."""
    most = 0.0
    for r in range(cp):
        mine = chunk_ids(cp, r, balanced)
        work = sum({"full": 1.0, "diag": 0.5, "skip": 0.0}[_mode(a, b, causal)]
                   for a in mine for s in range(cp) for b in chunk_ids(cp, s, balanced))
        most = max(most, work)
    return most


def attention_flops(q_shape, k_shape, causal: bool, cp: int, balanced: bool = True, backward: bool = False) -> int:
    """FLOPs of the busiest rank: 2 matmuls forward (scores, output), 5 backward (scores
    recomputed, dV, dP, dQ, dK), each 2 x rows x keys x D per (query chunk, key chunk) pair."""
    b, h, s_local, d = q_shape
    chunk = s_local // 2
    per_pair = 2 * b * h * chunk * chunk * d
    return int((5 if backward else 2) * per_pair * _pairs(max(cp, 1), causal, balanced))


@register_flop_formula(torch.ops.autopar.cp_attention)
def _cp_flops(q_shape, k_shape, v_shape, causal, scale, cp, group, variant, balanced, *args, **kwargs) -> int:
    return attention_flops(q_shape, k_shape, causal, cp, balanced)


@register_flop_formula(torch.ops.autopar.cp_attention_backward)
def _cp_backward_flops(grad_out_shape, q_shape, k_shape, *args, **kwargs) -> int:
    causal, scale, cp, group, variant, balanced = args[3:9]
    return attention_flops(q_shape, k_shape, causal, cp, balanced, backward=True)

"""One rank of torch's context-parallel ring attention, its compute timed on one GPU.

Part (d) of ``bench/gpu_check.py``. The context-parallel rows of ``bench/fidelity.py`` (Llama 3.1 8B
at 32k tokens per rank, cp 1-8, torch's ``context_parallel`` with the "allgather" rotation) are
priced within 1-11% at cp 1 and 2 but 31-37% optimistic at cp 4 and 8, although every ring step
computes a block of the same shape at every cp. What the model leaves out must then be in the
steps themselves, or outside attention. This part settles which, without a second GPU: it runs
what one cp rank computes, in the order torch's ``_templated_ring_attention`` and its backward
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``) compute it, with the
communication taken out (the other ranks' K/V blocks are local tensors, and the K/V gradient
accumulator a rank receives is the one it sent):

- forward, step ``i`` of ``cp`` (K/V of rank ``rank - i``): step 0 the rank's own two chunks under
  the causal mask; a step from an earlier rank (``i <= rank``) every query against the first half
  of the keys, a later one (``i > rank``) the second half of the queries against all keys (the
  load-balanced layout: rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``); each step's output
  merged into an fp32 accumulator by log-sum-exp; the send buffer concatenated at every step but
  the last.
- backward: the SDPA backward of each step on the merged output and log-sum-exp, the gradients
  added into fp32 accumulators (half-chunk updates rebuilt by concatenation, as torch does), the
  K/V gradients concatenated into the buffer passed on.

For each cp and for rank 0 and rank cp - 1 (the two kinds of off-diagonal step), the forward
and backward are timed whole and with the SDPA calls alone, next to what autopar prices for the
same work (the rank's 1/cp of the sequence's causal attention at the device's attention
efficiency, and the eager traffic of :func:`autopar.cost.comm.torch_context_attention_cost`).
``check(...)`` runs every rank of a small ring in lockstep on CPU and compares the output and
every gradient with whole-sequence SDPA (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SHAPE = (1, 32, 32768, 128)
"""(batch, heads, tokens per rank, head dim): the 8B rows' rank (K/V repeated to every head)."""
CPS = (2, 4, 8)
TINY_SHAPE = (1, 2, 16, 8)
TINY_CPS = (2, 4)


def _ops(device: torch.device):
    """(forward, backward) of the SDPA kernel torch's ring calls on this device: FlashAttention on
    CUDA (the runs' kernel), its CPU counterpart elsewhere. ``forward(q, k, v, causal) -> (out,
    lse, saved)``; ``backward(dout, q, k, v, out, lse, saved, causal) -> (dq, dk, dv)``."""
    aten = torch.ops.aten
    if device.type == "cuda":
        def forward(q, k, v, causal):
            r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
            return r[0], r[1], r[2:8]

        def backward(dout, q, k, v, out, lse, saved, causal):
            cq, ck, mq, mk, seed, offset = saved
            return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0,
                                                                     causal, seed, offset)
        return forward, backward

    def forward(q, k, v, causal):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse, ()

    def backward(dout, q, k, v, out, lse, saved, causal):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    return forward, backward


def _halves(x: torch.Tensor, dim: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = x.chunk(2, dim=dim)
    return a, b


def _update_half(whole: torch.Tensor, part: torch.Tensor, idx: int, add: bool) -> torch.Tensor:
    """``whole`` with half ``idx`` (of its sequence dim) replaced by or increased by ``part``, rebuilt
    by concatenation (a copy of the whole, as torch's ring does it)."""
    halves = list(_halves(whole))
    if add:
        halves[idx] += part
    else:
        halves[idx] = part
    return torch.cat(halves, dim=2)


class RankRing:
    """One rank of a load-balanced ring of ``cp`` ranks: its queries ``q`` and every rank's K/V
    ``blocks`` (``blocks[j]`` = (k, v) of rank j); (B, H, S_local, D) each."""

    def __init__(self, cp: int, rank: int, q: torch.Tensor, blocks, ops, *, count_only_sdpa: bool = False):
        self.cp, self.rank, self.q, self.blocks = cp, rank, q, blocks
        self.fwd, self.bwd = ops
        self.sdpa_only = count_only_sdpa

    def _step_inputs(self, i: int):
        """(q, k, v, causal, partial) of step ``i``."""
        k, v = self.blocks[(self.rank - i) % self.cp]
        if i == 0:
            return self.q, k, v, True, False
        if i <= self.rank:
            return self.q, _halves(k)[0], _halves(v)[0], False, False
        return _halves(self.q)[1], k, v, False, True

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = lse = None
        self.saved = []
        for i in range(self.cp):
            k, v = self.blocks[(self.rank - i) % self.cp]
            if i < self.cp - 1 and not self.sdpa_only:
                torch.cat([k.flatten(), v.flatten()])  # the send buffer torch builds at each step
            q, k, v, causal, partial = self._step_inputs(i)
            o, l_, saved = self.fwd(q, k, v, causal)
            self.saved.append(saved)
            if self.sdpa_only:
                continue
            o, l_ = o.float(), l_.unsqueeze(-1)
            if out is None:
                out, lse = o, l_
                continue
            cur_out, cur_lse = (_halves(out)[1], _halves(lse)[1]) if partial else (out, lse)
            new_out = cur_out - torch.sigmoid(l_ - cur_lse) * (cur_out - o)
            new_lse = cur_lse - F.logsigmoid(cur_lse - l_)
            out, lse = ((_update_half(out, new_out, 1, False), _update_half(lse, new_lse, 1, False)) if partial
                        else (new_out, new_lse))
        if self.sdpa_only:
            return self.q, self.q.new_zeros(self.q.shape[:3], dtype=torch.float32)
        return out.to(self.q.dtype), lse.squeeze(-1)

    def backward_start(self):
        f32 = torch.float32
        k, _ = self.blocks[self.rank]
        self.grad_q = torch.zeros_like(self.q, dtype=f32)
        self.grad_kv = (torch.zeros_like(k, dtype=f32), torch.zeros_like(k, dtype=f32))

    def backward_step(self, i: int, dout, out, lse, received: torch.Tensor | None) -> torch.Tensor:
        """Step ``i``: returns the K/V gradient buffer this rank passes on (``received`` is the one it
        got from the previous rank, None at step 0)."""
        k, v = self.blocks[(self.rank - i) % self.cp]
        if i != self.cp - 1 and not self.sdpa_only:
            torch.cat([k.flatten(), v.flatten()])
        q, k, v, causal, partial = self._step_inputs(i)
        out_, dout_, lse_ = ((_halves(out)[1], _halves(dout)[1], _halves(lse)[1].contiguous()) if partial
                             else (out, dout, lse))
        dq, dk, dv = self.bwd(dout_, q, k, v, out_, lse_, self.saved[i], causal)
        if self.sdpa_only:
            return dk
        grad_k, grad_v = self.grad_kv
        if i > 0:
            n = grad_k.numel()
            grad_k, grad_v = received[:n].view(grad_k.shape), received[n:].view(grad_v.shape)
        if 0 < i <= self.rank:
            grad_k, grad_v = _update_half(grad_k, dk, 0, True), _update_half(grad_v, dv, 0, True)
        else:
            grad_k, grad_v = grad_k + dk, grad_v + dv
        self.grad_q = self.grad_q + dq if i <= self.rank else _update_half(self.grad_q, dq, 1, True)
        return torch.cat([grad_k.flatten(), grad_v.flatten()])

    def backward_finish(self, received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, _ = self.blocks[self.rank]
        n, dtype = k.numel(), self.q.dtype
        return (self.grad_q.to(dtype), received[:n].view(k.shape).to(dtype), received[n:].view(k.shape).to(dtype))


def check(cp: int = 2, shape=TINY_SHAPE, seed: int = 0) -> dict:
    """Every rank of a ring of ``cp`` on CPU in lockstep (each receiving its neighbour's buffer)
    against causal SDPA on the whole sequence: the largest difference of the output and of the
    gradients of q, k and v (fp64)."""
    batch, heads, local, dim = shape
    g = torch.Generator().manual_seed(seed)
    whole = [torch.randn(batch, heads, cp * local, dim, generator=g, dtype=torch.float64) for _ in range(4)]
    q, k, v, dout = whole
    chunk = local // 2

    def mine(x, r):  # rank r's chunks r and 2 cp - 1 - r, along the sequence
        return torch.cat([x[:, :, c * chunk:(c + 1) * chunk] for c in (r, 2 * cp - 1 - r)], dim=2)

    ops = _ops(torch.device("cpu"))
    blocks = [(mine(k, r), mine(v, r)) for r in range(cp)]
    ranks = [RankRing(cp, r, mine(q, r), blocks, ops) for r in range(cp)]
    outs = [r.forward() for r in ranks]
    for r in ranks:
        r.backward_start()
    sent = [None] * cp
    for i in range(cp):
        sent = [r.backward_step(i, mine(dout, r.rank), *outs[r.rank], sent[(r.rank - 1) % cp]) for r in ranks]
    grads = [r.backward_finish(sent[(r.rank - 1) % cp]) for r in ranks]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True)
    ref_grads = torch.autograd.grad(ref, leaves, dout)

    def worst(a_of_rank, whole_ref):
        return max(float((a_of_rank(r) - mine(whole_ref, r)).abs().max()) for r in range(cp))

    return {"out": worst(lambda r: outs[r][0], ref.detach()),
            **{f"d{name}": worst(lambda r, j=j: grads[r][j], ref_grads[j]) for j, name in enumerate("qkv")}}


def _predicted(cp: int, shape, device_spec) -> dict:
    """autopar's price of one rank's share: 1/cp of the whole sequence's causal attention (forward,
    backward at 2.5x the counted FLOPs), and torch's eager traffic per layer at the device's rate."""
    from autopar.cost.comm import Link, torch_context_attention_cost
    from autopar.cost.compute import kernel_time_s

    batch, heads, local, dim = shape
    counted = 4.0 * batch * heads * (cp * local) ** 2 * dim / cp
    fwd = kernel_time_s(kind="causal_attention", flops=counted, bytes_moved=0.0, device=device_spec)
    bwd = kernel_time_s(kind="causal_attention", flops=2.5 * counted, bytes_moved=0.0, device=device_spec)
    eager_rate = 1e9 / kernel_time_s(kind="other", flops=0.0, bytes_moved=1e9, device=device_spec)
    free = Link(bytes_per_s=1e30, latency_s=0.0)  # no link: what is left is the eager kernels
    c = torch_context_attention_cost(cp=cp, kv_bytes=2 * batch * heads * local * dim * 2, elem_bytes=2,
                                     forward_s=fwd, backward_s=bwd, link=free, memory_bytes_per_s=eager_rate)
    return {"forward_s": fwd + c.forward_exposed_s, "backward_s": bwd + c.backward_exposed_s,
            "sdpa_forward_s": fwd, "sdpa_backward_s": bwd}


def ring_steps(device: torch.device, specs: dict, *, tiny: bool, time_s) -> dict:
    """Part (d): per cp and rank, measured and predicted seconds of one attention layer's ring."""
    shape, cps = (TINY_SHAPE, TINY_CPS) if tiny else (SHAPE, CPS)
    iters, warmup = (2, 1) if tiny else (3, 1)
    dtype = torch.bfloat16
    ops = _ops(device)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand():
        return torch.randn(*shape, dtype=dtype, device=device, generator=gen)

    q, dout = rand(), rand()
    own, other = (rand(), rand()), (rand(), rand())
    out: dict = {"shape": list(shape), "check_cp2": check(2), "rows": []}
    for cp in cps:
        blocks = [own if j == 0 else other for j in range(cp)]  # (timing: every other rank's block alike)
        for rank in sorted({0, cp - 1}):
            row = {"cp": cp, "rank": rank}
            for label, sdpa_only in (("", False), ("sdpa_", True)):
                ring = RankRing(cp, rank, q, [blocks[(j - rank) % cp] for j in range(cp)], ops,
                                count_only_sdpa=sdpa_only)
                row[f"{label}forward_s"] = time_s(ring.forward, device, warmup=warmup, iters=iters)
                o, lse = ring.forward()

                def backward(ring=ring, o=o, lse=lse):
                    ring.backward_start()
                    sent = None
                    for i in range(cp):
                        sent = ring.backward_step(i, dout, o, lse, sent)
                    if not ring.sdpa_only:
                        ring.backward_finish(sent)

                row[f"{label}backward_s"] = time_s(backward, device, warmup=warmup, iters=iters)
            for name, spec in specs.items():
                row[f"predicted_{name}"] = _predicted(cp, shape, spec)
            out["rows"].append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


OP_SHAPE = (1, 32, 8, 32768, 128)
"""(batch, query heads, K/V heads, tokens, head dim): Llama 3.1 8B's grouped-query attention at 32k."""
TINY_OP_SHAPE = (1, 4, 2, 16, 8)


def autopar_op(device: torch.device, *, tiny: bool, time_s) -> dict:
    """Part (e): autopar's own cp attention op (:mod:`autopar.context`) on this device, at cp 1 (its
    chunk pairs on the kernel :mod:`autopar.context_blocks` picks, no process group): the output
    and gradients against SDPA on repeated heads (largest error over largest entry), and the
    forward and forward + backward timed beside SDPA's (the ring adds merges of fp32 partial
    outputs; the kernels' work is the same)."""
    from autopar.context import cp_attention
    from autopar.context_blocks import kernel_for

    batch, heads, kv_heads, tokens, dim = TINY_OP_SHAPE if tiny else OP_SHAPE
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(h):
        return torch.randn(batch, h, tokens, dim, dtype=torch.bfloat16, device=device, generator=gen).requires_grad_()

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    grad = torch.randn(batch, heads, tokens, dim, dtype=torch.bfloat16, device=device, generator=gen)
    groups = heads // kv_heads
    scale = dim ** -0.5

    def ours():
        return cp_attention(q, k, v, True, scale, 1, "", "ring", True)[0]

    def theirs():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                              is_causal=True)

    b = theirs()
    errors = _errors(ours(), b, (q, k, v), grad)
    iters, warmup = (2, 1) if tiny else (5, 2)
    row = {"shape": [batch, heads, kv_heads, tokens, dim], "kernel": kernel_for(q), "relative_error": errors}
    if row["kernel"] == "cuda_flash":  # the flash kernel on grouped K/V directly (context_blocks repeats them)
        try:  # (a failure is the finding: recorded, and the rest of the check goes on)
            row["native_gqa_relative_error"] = _native_gqa_errors(q, k, v, grad, b, scale)
        except Exception as e:
            row["native_gqa_relative_error"] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        row["cudnn"] = _cudnn_blocks(ours, theirs, q, k, v, grad, device, time_s, warmup=warmup, iters=iters)
    for label, fn in (("autopar", ours), ("sdpa", theirs)):
        with torch.no_grad():
            row[f"{label}_forward_s"] = time_s(fn, device, warmup=warmup, iters=iters)
        row[f"{label}_forward_backward_s"] = time_s(lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), grad),
                                                    device, warmup=warmup, iters=iters)
    return row


def _native_gqa_errors(q, k, v, grad, ref, scale) -> dict:
    """PyTorch's CUDA flash kernel given grouped K/V (fewer heads than the queries), forward and
    backward, against SDPA on repeated heads: whether :mod:`autopar.context_blocks` could skip its
    repeat of K/V to the query heads."""
    d = {}
    with torch.no_grad():
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        out, lse = res[0], res[1]
        d["out"] = _rel(out, ref)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, True, res[6], res[7], scale=scale)
    groups = q.shape[1] // k.shape[1]
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                                              v.repeat_interleave(groups, 1), is_causal=True,
                                                              scale=scale), (q, k, v), grad)
    for name, x, y in zip("qkv", grads, want):
        d[f"d{name}"] = _rel(x, y)
    return d


def _cudnn_blocks(ours, theirs, q, k, v, grad, device, time_s, *, warmup: int, iters: int) -> dict:
    """The op again with its blocks on cuDNN's kernel (``context_blocks.CUDNN_BLOCKS``, off by
    default): errors against SDPA and times, to decide whether to turn it on."""
    from autopar import context_blocks

    context_blocks.CUDNN_BLOCKS = True
    try:
        d = {"kernel": context_blocks.kernel_for(q), "relative_error": _errors(ours(), theirs(), (q, k, v), grad)}
        with torch.no_grad():
            d["forward_s"] = time_s(ours, device, warmup=warmup, iters=iters)
        d["forward_backward_s"] = time_s(lambda: torch.autograd.grad(ours(), (q, k, v), grad), device,
                                         warmup=warmup, iters=iters)
        return d
    except Exception as e:  # (a failure is the finding: recorded, and the rest of the check goes on)
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    finally:
        context_blocks.CUDNN_BLOCKS = False


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest error over the largest entry of the reference."""
    x, y = x.detach().float(), y.detach().float()
    return float((x - y).abs().max() / y.abs().max())


def _errors(out: torch.Tensor, ref: torch.Tensor, inputs: tuple, grad: torch.Tensor) -> dict:
    """``out`` against ``ref``, and the gradients of ``inputs`` through each (``ref``'s graph kept)."""
    errors = {"out": _rel(out, ref)}
    theirs = torch.autograd.grad(ref, inputs, grad, retain_graph=True)
    for name, x, y in zip("qkv", torch.autograd.grad(out, inputs, grad), theirs):
        errors[f"d{name}"] = _rel(x, y)
    return errors

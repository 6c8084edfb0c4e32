"""One block of context-parallel attention: a query chunk against a key/value chunk, forward and
backward, on the fused attention kernel of the device when it has one.

:mod:`autopar.context` computes a rank's attention as (query chunk, key chunk) pairs and merges
them by their log-sum-exps. Each pair goes through:

- ``block_forward(q, k, v, causal, scale) -> (out, lse)``: the pair's attention and the
  log-sum-exp of each query's scores (``lse``: (B, H, S_q, 1), fp32, fp64 for fp64 inputs);
- ``block_backward(do, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``: the pair's share of
  the gradients, given the *merged* output and log-sum-exp of the query chunk (FlashAttention's
  backward recomputes each probability as ``exp(s - lse)`` and uses ``rowsum(dO * O)``, so a
  block computed with the global ``out`` and ``lse`` is exactly its share of the whole
  attention's gradient), in the kernel's dtype (the caller adds them into its fp32 accumulators
  in one pass); ``dk``, ``dv`` with ``k``'s (grouped) heads.

Which kernel (:func:`kernel_for`):

- ``"cpu_flash"``: ATen's CPU flash kernels (``_scaled_dot_product_flash_attention_for_cpu`` and
  its backward), which return the log-sum-exp, take fp64/fp32/bf16/fp16 and grouped-query K/V
  (forward and backward checked against SDPA on repeated heads in ``tests/test_context_blocks.py``).
- ``"cuda_flash"``: the FlashAttention-2 kernels PyTorch ships (``_scaled_dot_product_flash_attention``
  and its backward) for fp16/bf16 with a head dim that is a multiple of 8 up to 256, what the
  cost model prices attention at. K/V are repeated to the query heads first (and their
  gradients summed back): the planner's grouped-query transfer is unchanged, and the kernel
  needs no grouped-query support.
- ``"exact"``: explicit matmuls in fp32 (fp64), for anything else (fp32 on CUDA). This one holds
  the (S_q x S_k) score matrix of the pair; the fused kernels hold none.

``"cuda_cudnn"`` (cuDNN's fused attention, which SDPA runs on Hopper and which also returns the
log-sum-exp, in the (B, H, S_q, 1) layout used here) is written but off (:data:`CUDNN_BLOCKS`):
it runs only where ``bench/gpu_check.py`` part (e) forces it, until a GPU run shows its output
and gradients match SDPA's. On Hopper it would make the blocks as fast as the SDPA they replace
(0.50 of peak against FlashAttention-2's 0.29; :func:`autopar.planner.context.cp_kernel_ratio`
prices the blocks at FlashAttention-2 meanwhile).

Why not ``F.scaled_dot_product_attention``: it returns no log-sum-exp, which the merge needs.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["CUDNN_BLOCKS", "acc_dtype", "block_backward", "block_forward", "kernel_for"]

CUDNN_BLOCKS = False
"""Whether CUDA bf16/fp16 blocks run on cuDNN's kernel (see the module docstring): off until checked."""


def kernel_for(q: torch.Tensor) -> str:
    """The kernel a block of ``q``'s device, dtype and head dim runs on (see the module docstring)."""
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 \
            and q.shape[-1] <= 256:
        return "cuda_cudnn" if CUDNN_BLOCKS and q.shape[-1] <= 128 else "cuda_flash"
    return "exact"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = kernel_for(q)
    if kernel == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    elif kernel == "cuda_flash":
        groups = q.shape[1] // k.shape[1]
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, _expand(k, groups), _expand(v, groups), 0.0, causal, False, scale=scale)
    elif kernel == "cuda_cudnn":
        groups = q.shape[1] // k.shape[1]
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, _expand(k, groups), _expand(v, groups), None, True, 0.0, causal, False, scale=scale)
        return out, lse.view(*q.shape[:3], 1).to(acc_dtype(q.dtype))
    else:
        return _exact_forward(q, k, v, causal, scale)
    return out, lse.to(acc_dtype(q.dtype)).unsqueeze(-1)


def block_backward(do, q, k, v, out, lse, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    acc = acc_dtype(q.dtype)
    kernel = kernel_for(q)
    if kernel == "exact":
        return _exact_backward(do, q, k, v, out, lse, causal, scale)
    if kernel == "cuda_cudnn":
        groups = q.shape[1] // k.shape[1]
        seed, offset = _rng_state(q.device, q.dtype, "cudnn")
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do.contiguous(), q, _expand(k, groups), _expand(v, groups), out.contiguous(), lse.float().contiguous(),
            seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)
        return dq, _fold(dk, groups, acc), _fold(dv, groups, acc)
    lse = lse.squeeze(-1).contiguous()
    if kernel == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse.to(acc), 0.0, causal, scale=scale)
    groups = q.shape[1] // k.shape[1]
    rng, unused = _rng_state(q.device, q.dtype, "flash")
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, _expand(k, groups), _expand(v, groups), out, lse.float(), None, None, q.shape[2], k.shape[2], 0.0,
        causal, rng, unused, scale=scale)
    return dq, _fold(dk, groups, acc), _fold(dv, groups, acc)


@functools.cache
def _rng_state(device: torch.device, dtype: torch.dtype, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The dropout RNG state tensors a CUDA kernel's backward takes, as its forward makes them. With
    no dropout the kernel never reads them; taking them from a tiny forward keeps their dtype and
    shape whatever this torch version expects (they changed across releases)."""
    x = torch.zeros(1, 1, 8, 8, device=device, dtype=dtype)
    if kernel == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
    return res[6], res[7]


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The gradient of :func:`_expand`: sum each K/V head's query group (in ``dtype``)."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2, dtype=dtype)


def _scores(q, k, scale, causal):
    acc = acc_dtype(q.dtype)
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _exact_forward(q, k, v, causal, scale):
    groups = q.shape[1] // k.shape[1]
    s = _scores(q, _expand(k, groups), scale, causal)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.exp(s - lse) @ _expand(v, groups).to(s.dtype), lse


def _exact_backward(do, q, k, v, out, lse, causal, scale):
    groups = q.shape[1] // k.shape[1]
    acc = lse.dtype
    ke, ve = _expand(k, groups).to(acc), _expand(v, groups).to(acc)
    do = do.to(acc)
    delta = (do * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O)
    p = torch.exp(_scores(q, ke, scale, causal) - lse)  # probabilities, recomputed
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ ve.transpose(-1, -2) - delta)
    dq = ds @ ke * scale
    dk = ds.transpose(-1, -2) @ q.to(acc) * scale
    return dq, _fold(dk, groups), _fold(dv, groups)

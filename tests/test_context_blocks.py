"""One block of context-parallel attention (autopar.context_blocks) on each kernel: against SDPA on
repeated heads, forward and backward, in fp64 (1e-12 relative to the largest entry, as
tests/test_context.py); bf16 on the CPU flash kernel against fp64 (bf16 rounding: 2e-2); the CUDA
flash path's calls checked on meta tensors (argument lists and shapes; its numbers need a GPU:
bench/gpu_check.py)."""

import pytest
import torch
import torch.nn.functional as F

from autopar import context_blocks
from autopar.context_blocks import block_backward, block_forward, kernel_for


def _close(a, b, rel=1e-12):
    assert (a - b).abs().max() <= rel * max(b.abs().max(), 1), (a - b).abs().max()


def _tensors(sq=6, sk=10, h=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def mk(heads, s):
        return torch.randn(2, heads, s, d, dtype=torch.float64, generator=g).to(dtype).requires_grad_()

    return mk(h, sq), mk(hkv, sk), mk(hkv, sk)


def _reference(q, k, v, causal, scale):
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          is_causal=causal, scale=scale)


@pytest.mark.parametrize("kernel", ["cpu_flash", "exact"])
@pytest.mark.parametrize("causal,hkv,sq,sk", [(True, 4, 8, 8), (True, 1, 8, 8), (False, 2, 6, 10), (False, 4, 10, 6)])
def test_block_equals_sdpa_forward_and_backward(monkeypatch, kernel, causal, hkv, sq, sk):
    monkeypatch.setattr(context_blocks, "kernel_for", lambda q: kernel)
    q, k, v = _tensors(sq=sq, sk=sk, hkv=hkv)
    scale = 0.3
    ref = _reference(q, k, v, causal, scale)
    with torch.no_grad():
        out, lse = block_forward(q, k, v, causal, scale)
    _close(out, ref.detach())
    assert lse.shape == (*q.shape[:3], 1) and lse.dtype == torch.float64
    grad = torch.randn_like(ref)
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    mine = block_backward(grad, q.detach(), k.detach(), v.detach(), ref.detach(), lse, causal, scale)
    for a, b in zip(mine, theirs):
        assert a.shape == b.shape and a.dtype == torch.float64
        _close(a, b)


def test_bf16_on_the_cpu_kernel_keeps_an_fp32_log_sum_exp():
    q, k, v = _tensors(dtype=torch.bfloat16)
    assert kernel_for(q) == "cpu_flash"
    with torch.no_grad():
        out, lse = block_forward(q, k, v, False, 0.3)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    _close(out.double(), _reference(q.double(), k.double(), v.double(), False, 0.3).detach(), rel=2e-2)


def test_the_kernel_is_chosen_by_device_and_dtype():
    assert kernel_for(torch.empty(1, 1, 4, 8)) == "cpu_flash"
    assert kernel_for(torch.empty(1, 1, 4, 8, dtype=torch.float64)) == "cpu_flash"
    assert kernel_for(torch.empty(1, 1, 4, 8, device="meta")) == "exact"
    assert not context_blocks.CUDNN_BLOCKS  # (cuDNN's blocks stay off until a GPU run checks them)


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_cudnn"])
def test_the_cuda_calls_fit_their_schemas(monkeypatch, kernel):
    """The CUDA path run on meta tensors (ATen's meta kernels check the arguments and give the
    shapes): K/V repeated to the query heads and their gradients summed back to the grouped heads
    in fp32; the query gradient in the kernel's dtype, for the caller's fp32 accumulator."""
    monkeypatch.setattr(context_blocks, "kernel_for", lambda q: kernel)
    q = torch.empty(2, 8, 16, 64, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(2, 2, 32, 64, device="meta", dtype=torch.bfloat16)
    out, lse = block_forward(q, k, v, False, 0.125)
    assert out.shape == q.shape and lse.shape == (2, 8, 16, 1) and lse.dtype == torch.float32
    dq, dk, dv = block_backward(torch.empty_like(out), q, k, v, out, lse, False, 0.125)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == torch.bfloat16 and dk.dtype == dv.dtype == torch.float32  # (group sums in fp32)

"""Context-parallel attention (autopar.context), one process: the op at cp = 1 against
SDPA, the sequence layouts, and the FLOPs each rank computes.

Tolerance: fp64 inputs, and the op's blockwise softmax differs from SDPA's only in the
order of a few exp/sum roundings: 1e-12 relative to the largest entry."""

import pytest
import torch
import torch.nn.functional as F

from autopar.context import (attention_flops, chunk_ids, cp_attention, sequence_positions, shard_sequence,
                             unshard_sequence)


def _qkv(b=2, h=4, hkv=2, s=16, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda heads: torch.randn(b, heads, s, d, dtype=torch.float64, generator=g, requires_grad=True)
    return mk(h), mk(hkv), mk(hkv)


def reference(q, k, v, causal):
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          is_causal=causal)


def _close(a, b):
    assert (a - b).abs().max() <= 1e-12 * max(b.abs().max(), 1), (a - b).abs().max()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_whole_sequence_op_equals_sdpa_forward_and_backward(causal, hkv):
    q, k, v = _qkv(hkv=hkv)
    out, lse = cp_attention(q, k, v, causal, q.shape[-1] ** -0.5, 1, "", "ring", True)
    ref = reference(q, k, v, causal)
    _close(out, ref)
    assert lse.shape == q.shape[:3] and not lse.requires_grad
    grad = torch.randn_like(ref)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(mine, theirs):
        _close(a, b)


@pytest.mark.parametrize("balanced", [True, False])
def test_layouts_cover_the_sequence_once_and_invert(balanced):
    x = torch.arange(2 * 24).view(2, 24)
    for cp in (1, 2, 3, 4):
        if 24 % (2 * cp):
            continue
        parts = [shard_sequence(x, 1, cp, r, balanced) for r in range(cp)]
        assert torch.equal(unshard_sequence(parts, 1, balanced), x)
        positions = torch.cat([sequence_positions(24, cp, r, balanced) for r in range(cp)])
        assert sorted(positions.tolist()) == list(range(24))
        assert torch.equal(parts[cp - 1][0], x[0, sequence_positions(24, cp, cp - 1, balanced)])
    assert chunk_ids(4, 1) == (1, 6) and chunk_ids(4, 1, balanced=False) == (2, 3)


def test_a_sequence_that_does_not_split_evenly_is_refused():
    with pytest.raises(ValueError, match="does not split into 2 x cp = 4 equal chunks"):
        shard_sequence(torch.zeros(1, 10), 1, 2, 0)


def test_balanced_causal_layout_gives_every_rank_the_same_flops():
    b, h, s, d = 1, 8, 4096, 128
    for cp in (2, 4, 8):
        local = (b, h, s // cp, d)
        whole = 2 * 2 * b * h * s * s * d  # QK^T and PV over the full square
        balanced = attention_flops(local, local, True, cp)
        assert balanced * cp == pytest.approx(whole / 2, rel=1 / s)  # the causal half, spread evenly
        contiguous = attention_flops(local, local, True, cp, balanced=False)
        assert contiguous > balanced  # the last rank sees every earlier key
        assert attention_flops(local, local, False, cp) * cp == whole
        assert attention_flops(local, local, True, cp, backward=True) == 5 * balanced // 2


def test_bad_arguments_are_refused_in_one_line():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="variant 'ulysses' is not one of"):
        cp_attention(q, k, v, True, 1.0, 1, "", "ulysses", True)
    with pytest.raises(ValueError, match="cp=2 needs the process group"):
        cp_attention(q, k, v, True, 1.0, 2, "", "ring", True)

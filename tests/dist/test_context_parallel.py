"""Context-parallel attention (autopar.context) on spawned gloo worlds of 2 and 4 ranks.

Each rank holds its part of a sequence (both layouts: load-balanced, chunks r and
2cp-1-r; contiguous) and runs ``cp_attention`` over the world (ring and all-gather K/V;
causal and not; grouped-query K/V). Its output and the gradients of its q, k and v must
equal its part of full-sequence SDPA's output and gradients, computed on the whole
sequence in the same process.

Tolerance: fp64, and the blockwise merge reorders a few exp/sum roundings against SDPA's
one softmax: 1e-12 of the largest entry. A K/V block attended under the wrong mask, merged
twice, or a gradient returned to the wrong rank is off by O(1).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.testing import spawn_world

CASES = [(causal, hkv, variant, balanced) for causal in (True, False) for hkv in (4, 1)
         for variant in ("ring", "allgather") for balanced in (True, False)]


def _run(rank, world, cases):
    from autopar.context import cp_attention, shard_sequence

    dist.init_process_group("gloo")
    group = dist.group.WORLD.group_name
    worst = {}
    for causal, hkv, variant, balanced in cases:
        g = torch.Generator().manual_seed(7)
        b, h, s, d = 2, 4, 8 * world, 8
        q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64, generator=g) for n in (h, hkv, hkv))
        grad = torch.randn(b, h, s, d, dtype=torch.float64, generator=g)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        groups = h // hkv
        ref = F.scaled_dot_product_attention(whole[0], whole[1].repeat_interleave(groups, 1),
                                             whole[2].repeat_interleave(groups, 1), is_causal=causal)
        ref_grads = torch.autograd.grad(ref, whole, grad)
        part = lambda t: shard_sequence(t, 2, world, rank, balanced)
        local = [part(t).requires_grad_() for t in (q, k, v)]
        out, _ = cp_attention(*local, causal, d ** -0.5, world, group, variant, balanced)
        grads = torch.autograd.grad(out, local, part(grad))
        errors = [(out - part(ref)).abs().max() / part(ref).abs().max()]
        errors += [(a - part(r)).abs().max() / r.abs().max() for a, r in zip(grads, ref_grads)]
        worst[(causal, hkv, variant, balanced)] = max(float(e.detach()) for e in errors)
    return worst


def _check(results):
    for rank, worst in enumerate(results):
        assert len(worst) == len(CASES)
        for case, err in worst.items():
            assert err <= 1e-12, (rank, case, err)


def test_two_ranks_equal_full_attention():
    _check(spawn_world(_run, 2, CASES))


def test_four_ranks_equal_full_attention():
    _check(spawn_world(_run, 4, CASES))

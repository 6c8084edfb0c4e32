"""torch's own context-parallel ring, run on meta tensors over a fake process group: the bytes its
eager kernels move on each rank, against what ``cp_variant="torch"`` prices
(:func:`autopar.cost.comm.torch_context_attention_cost`: the busiest rank's, per attention layer).

The price was read from torch's ``_templated_ring_attention`` and its backward; this runs them
(torch's private ``_context_parallel._attention``, as torchtitan's ``context_parallel`` calls it:
flash SDPA, load-balanced, the all-gather rotation) and counts every ATen op that is not a view,
a collective or the attention kernel: the bytes of its tensor inputs and outputs (allocations
without reads: outputs only). Skipped where a torch version has no such module."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel import _attention as A

    VIEWS = {"view", "_unsafe_view", "reshape", "split", "slice", "select", "t", "transpose", "permute", "expand",
             "unsqueeze", "squeeze", "as_strided", "alias", "detach", "split_with_sizes", "unbind", "narrow"}
    ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided", "zeros", "zeros_like", "new_zeros"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if name in VIEWS or "attention" in name or func.namespace == "_c10d_functional":
                return out
            size = lambda x: sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))
            self.bytes += size(out) + (0 if name in ALLOCATIONS else size((args, kwargs)))
            return out

    def block():  # one rank's queries, K and V (K/V repeated to every head), bf16
        return torch.empty(1, 8, 512, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)

    counts = {}
    for cp in map(int, sys.argv[1:]):
        counts[cp] = []
        for rank in range(cp):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
            mesh = init_device_mesh("cpu", (cp,))
            q, k, v = block(), block(), block()
            with Count() as forward:
                out = A._scaled_dot_product_ring_flash_attention(mesh, q, k, v, dropout_p=0.0, is_causal=True)
            with torch.no_grad(), Count() as backward:
                A._scaled_dot_product_ring_flash_attention_backward(
                    mesh, torch.empty_like(out[0]), q, k, v, out[0], out[1], *out[2:6], 0.0, True, out[6], out[7])
            counts[cp].append({"n": q.numel(), "forward": forward.bytes, "backward": backward.bytes})
            dist.destroy_process_group()
    print(json.dumps(counts))
''')


CPS = (2, 4, 8)


@pytest.fixture(scope="module")
def counted() -> dict:
    """Per cp, per rank: elements of a query block and the bytes forward and backward (one process:
    each rank in turn on its own fake process group)."""
    import json

    done = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, CPS)], capture_output=True, text=True,
                          timeout=600)
    if "No module named 'torch.distributed.tensor.experimental._context_parallel'" in done.stderr:
        pytest.skip("this torch has no torch.distributed.tensor.experimental._context_parallel")
    assert done.returncode == 0, done.stderr[-3000:]
    return {int(cp): ranks for cp, ranks in json.loads(done.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("cp", CPS)
def test_torch_ring_moves_what_its_price_counts(counted, cp):
    from autopar.cost.comm import Link, torch_context_attention_cost

    counts = counted[cp]
    n, e = counts[0]["n"], 2
    priced = torch_context_attention_cost(cp=cp, kv_bytes=2 * n * e, elem_bytes=e, forward_s=1.0, backward_s=1.0,
                                          link=Link(bytes_per_s=1e11, latency_s=0.0), memory_bytes_per_s=1.0)
    # (memory_bytes_per_s = 1 B/s: the exposed seconds beyond the hidden exchange are the bytes)
    forward_priced = priced.forward_exposed_s
    backward_priced = priced.eager_s - forward_priced
    busiest = max(counts, key=lambda c: c["forward"] + c["backward"])
    assert busiest is counts[-1]  # (rank cp - 1: every step merges its whole output)
    # within 2%: the price leaves out the log-sum-exp's own small tensors (one value per query row)
    assert busiest["forward"] == pytest.approx(forward_priced, rel=0.02), (busiest, forward_priced)
    assert busiest["backward"] == pytest.approx(backward_priced, rel=0.02), (busiest, backward_priced)
    assert all(c["forward"] <= busiest["forward"] and c["backward"] <= busiest["backward"] for c in counts)

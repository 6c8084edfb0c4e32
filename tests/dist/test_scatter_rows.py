"""``scatter`` with its rows split (autopar.passes.scatter_rows), run on a (dp=2, tp=2) gloo mesh:
each rank scatters its own rows with no collective, and the result is ATen's scatter of the whole
tensors. Where no argument is split off the scatter dim the op is left to DTensor (None).

Under dp a top-k's gradient is such a scatter (Mixtral's router; tests/dist/test_hf_models.py
checks its program gathers nothing over dp); torch 2.11's and 2.12's DTensor would gather it."""

import torch

from autopar.testing import spawn_world

aten = torch.ops.aten


def _run(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from autopar.passes.scatter_rows import run_scatter_rows

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    R, S0, S2 = Replicate(), Shard(0), Shard(2)
    index2 = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)])  # (8, 2): a top-2 of 4
    index3 = torch.stack([torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(5)], 1)
                          for _ in range(4)])  # (4, 3, 5), distinct positions along dim 1
    cases = {  # name: (op, whole arguments, their placements (None: not a tensor))
        "topk-grad": (aten.scatter.src, (torch.zeros(8, 4), -1, index2, torch.randn(8, 2, generator=g)),
                      ((R, R), None, (S0, R), (S0, R))),
        "value": (aten.scatter.value, (torch.zeros(8, 4), 1, index2, 2.5), ((R, R), None, (S0, R), None)),
        "two-axes": (aten.scatter.src, (torch.randn(4, 6, 5, generator=g), 1, index3,
                                        torch.randn(4, 3, 5, generator=g)), ((S0, R), None, (R, S2), (S0, S2))),
    }
    report = {}
    for name, (op, whole, pls) in cases.items():
        args = tuple(a if p is None else distribute_tensor(a, mesh, list(p), src_data_rank=None)
                     for a, p in zip(whole, pls))
        with CommDebugMode() as comms:
            out = run_scatter_rows(op, args, {})
        report[name] = {"comms": comms.get_total_counts(), "placements": out.placements,
                        "error": (out.full_tensor() - op(*whole)).abs().max().item()}
    # split on the scatter dim only (all three the same size there): nothing for autopar to run,
    # DTensor's dispatch does it
    perms = torch.stack([torch.randperm(2, generator=g) for _ in range(8)])
    on_dim = tuple(distribute_tensor(t, mesh, [R, Shard(1)], src_data_rank=None) if isinstance(t, torch.Tensor)
                   else t for t in (torch.zeros(8, 2), 1, perms, torch.randn(8, 2, generator=g)))
    report["on-scatter-dim"] = run_scatter_rows(aten.scatter.src, on_dim, {})
    return report


def test_scatter_runs_on_each_ranks_rows():
    from torch.distributed.tensor import Replicate, Shard

    results = spawn_world(_run, 4)
    expected = {"topk-grad": (Shard(0), Replicate()), "value": (Shard(0), Replicate()),
                "two-axes": (Shard(0), Shard(2))}
    for rank, report in enumerate(results):
        for name, placements in expected.items():
            assert report[name]["comms"] == 0, (rank, name, report[name])
            assert tuple(report[name]["placements"]) == placements, (rank, name, report[name])
            assert report[name]["error"] == 0.0, (rank, name, report[name])
        assert report["on-scatter-dim"] is None, rank

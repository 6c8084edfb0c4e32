"""The runtime's bucketed tp gradient returns (``ShardedParams.finish_tp``) on 2 gloo ranks.

Partial addends must come back summed and Shard(dim) pieces whole, for shapes that do
not split evenly (DTensor's torch.chunk pieces: 5 rows over 2 ranks are 3 + 2, one row
is 1 + 0), two dtypes in separate buckets, one bucket per (collective, dtype).
"""

import torch
from torch import nn
from torch.distributed.tensor import Shard

from autopar.passes.meta_keys import GradReturn
from autopar.runtime.tp_buckets import _piece_shape, tp_buckets
from autopar.testing import spawn_world

SHAPES = {"a": (5, 3), "b": (1,), "c": (4, 2), "d": (3,)}
KINDS = {"a": ("all_gather", 0), "b": ("all_gather", 0), "c": ("all_reduce", None), "d": ("all_gather", 0)}
DTYPES = {"a": torch.float32, "b": torch.float32, "c": torch.float32, "d": torch.float64}


def _returns():
    return [GradReturn(fqn=f, kind=KINDS[f][0], dim=KINDS[f][1], shape=SHAPES[f],
                       nbytes=torch.Size(SHAPES[f]).numel() * torch.empty((), dtype=DTYPES[f]).element_size())
            for f in SHAPES]


def _finish(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.zero import ShardedParams

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    model = nn.Module()
    for f, shape in SHAPES.items():
        model.register_parameter(f, nn.Parameter(torch.zeros(shape, dtype=DTYPES[f])))
    params = ShardedParams(model, mesh=mesh, tp_placements={}, zero=0, trainable=list(SHAPES))
    full = {f: torch.arange(torch.Size(s).numel(), dtype=DTYPES[f]).reshape(s) + 1 for f, s in SHAPES.items()}
    partials = {}
    for f, value in full.items():
        if KINDS[f][0] == "all_reduce":  # addends that sum to the whole, exactly (2 ranks)
            partials[f] = value * (0.25 if rank == 0 else 0.75)
        else:  # this rank's torch.chunk piece (empty when there is none)
            pieces = list(torch.chunk(value, world, dim=0))
            pieces += [value[:0]] * (world - len(pieces))
            partials[f] = pieces[rank].clone()
    out = params.finish_tp(partials, _returns())
    return {f: (out[f] - full[f]).abs().max().item() if out[f].shape == full[f].shape else out[f].shape
            for f in SHAPES}


def test_finish_tp_sums_and_gathers_uneven_pieces():
    for errors in spawn_world(_finish, 2):
        assert errors == {f: 0.0 for f in SHAPES}, errors


def test_buckets_are_one_per_collective_and_dtype():
    buckets = tp_buckets(_returns(), DTYPES)
    assert [(b.kind, b.dtype, [r.fqn for r in b.grads]) for b in buckets] == [
        ("all_gather", torch.float32, ["a", "b"]), ("all_reduce", torch.float32, ["c"]),
        ("all_gather", torch.float64, ["d"])]
    assert buckets[0].nbytes == (15 + 1) * 4


def test_gathered_pieces_are_dtensor_shards():
    for size in (1, 3, 5, 6, 7, 64):
        for world in (2, 3, 4):
            r = GradReturn(fqn="w", kind="all_gather", dim=1, shape=(2, size), nbytes=0)
            assert [_piece_shape(r, world, k) for k in range(world)] == [
                (2, Shard.local_shard_size_and_offset(size, world, k)[0]) for k in range(world)]

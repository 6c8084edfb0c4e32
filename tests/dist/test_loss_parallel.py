"""The cross-entropy's ops with their classes split over tp (autopar.passes.loss_parallel), each
run alone on a (dp=2, tp=2) gloo mesh and compared with ATen's kernel on the whole tensors.

Every op is checked on its own (the planner may split the classes of one op and not of the
next), in float64 so that the only difference from ATen is summation order (1e-12): even and
uneven class splits, ignored targets, class weights and the three reductions. Whole models
training under loss parallelism are in tests/dist/test_parallel.py (the tp_sp and dp2xtp2
plans choose it there: test_loss_parallel_is_chosen)."""

from types import SimpleNamespace

import pytest
import torch

from autopar.testing import spawn_world

aten = torch.ops.aten
IGNORE = -100


def _cases():
    for classes in (10, 9):  # 5 + 5, and torch.chunk's 5 + 4
        for weighted in (False, True):
            for reduction in (0, 1, 2):  # none, mean, sum
                yield classes, weighted, reduction


def _run(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from autopar.passes.loss_parallel import run_loss_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_dim, tp_dim = 0, 1
    errors = {}
    for classes, weighted, reduction in _cases():
        g = torch.Generator().manual_seed(classes * 10 + reduction)
        z = torch.randn(8, classes, generator=g, dtype=torch.float64)
        target = torch.randint(0, classes, (8,), generator=g)
        target[[1, 6]] = IGNORE  # one ignored row on each dp rank
        target[3] = classes - 1  # a target in the last (short) shard
        weight = torch.rand(classes, generator=g, dtype=torch.float64) + 0.5 if weighted else None

        def split(t, *pls):
            return distribute_tensor(t, mesh, list(pls), src_data_rank=None)

        def run(op, *args):
            return run_loss_parallel(SimpleNamespace(target=op, format_node=lambda: str(op)), args, mesh, tp_dim,
                                     dp_dim)

        # whole-tensor reference (ATen's kernels), then each op on class shards of the same values
        logp = aten._log_softmax.default(z, 1, False)
        loss, total = aten.nll_loss_forward.default(logp, target, weight, reduction, IGNORE)
        seed = torch.rand(8, generator=g, dtype=torch.float64) if reduction == 0 else torch.tensor(0.7, dtype=torch.float64)
        glogp = aten.nll_loss_backward.default(seed, logp, target, weight, reduction, IGNORE, total)
        gz = aten._log_softmax_backward_data.default(glogp, logp, 1, torch.float64)

        rows, cls = Shard(0), Shard(1)
        w = split(weight, Replicate(), Replicate()) if weighted else None
        t = split(target, rows, Replicate())
        my_logp = run(aten._log_softmax.default, split(z, rows, cls), 1, False)
        my_loss, my_total = run(aten.nll_loss_forward.default, split(logp, rows, cls), t, w, reduction, IGNORE)
        my_seed = split(seed, rows, Replicate()) if reduction == 0 else split(seed, Replicate(), Replicate())
        my_glogp = run(aten.nll_loss_backward.default, my_seed, split(logp, rows, cls), t, w, reduction, IGNORE,
                       split(total, Replicate(), Replicate()))
        my_gz = run(aten._log_softmax_backward_data.default, split(glogp, rows, cls), split(logp, rows, cls), 1,
                    torch.float64)
        got = {"log_softmax": my_logp.full_tensor(), "nll": my_loss.full_tensor(),
               "nll_backward": my_glogp.full_tensor(), "log_softmax_backward": my_gz.full_tensor()}
        want = {"log_softmax": logp, "nll": loss, "nll_backward": glogp, "log_softmax_backward": gz}
        if reduction != 0:  # the count of weighted targets, over the whole (dp-split) batch
            got["total_weight"], want["total_weight"] = my_total.full_tensor(), total
        errors[classes, weighted, reduction] = {k: (got[k] - want[k]).abs().max().item() for k in want}
    dist.barrier()
    return errors


@pytest.fixture(scope="module")
def results():
    return spawn_world(_run, 4)


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: f"classes{c[0]}-w{int(c[1])}-red{c[2]}")
def test_each_op_matches_aten_on_the_whole_tensor(results, case):
    for rank, errors in enumerate(results):
        bad = {k: e for k, e in errors[case].items() if not e <= 1e-12}
        assert not bad, (rank, case, bad)

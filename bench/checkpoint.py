"""Checkpoint save and load: time, bytes each rank writes, synchronous vs asynchronous save.

    python bench/checkpoint.py                          # 2 gloo ranks on CPU, GPT "125m", 5 repeats
    python bench/checkpoint.py --size small --repeats 3

For each plan (ZeRO-3 over dp=2, tensor parallel tp=2): compile with one AdamW step
(so the optimizer state exists), then per repeat, between barriers:
  sync save    save_checkpoint(...) until it returns (published)
  async block  save_checkpoint(..., async_save=True) until it returns (the copy of the shards)
  async total  until its handle's wait() returns (written and published)
  load         load_checkpoint(...) into the compiled model (DCP reads and reshards)
Reported: the medians over the repeats (rank 0's clock; every rank waits in the same
collectives), and the bytes of the DCP data file each rank wrote, plus the checkpoint total.
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from autopar.testing import spawn_world, tp_friendly_cluster  # noqa: E402

PLANS = [("ZeRO-3 dp=2", "1x2xcpu", {"dp": 2, "zero": 3}), ("TP tp=2", tp_friendly_cluster("1x2xcpu"), {"tp": 2})]


def _bench(rank, world, size, repeats, root):
    import torch.distributed as dist

    import autopar
    import gpt

    out = {}
    for name, cluster, fixed in PLANS:
        torch.manual_seed(0)
        model, inputs, loss_fn, target = gpt.build(size=size, batch=2 * world, seq=64)
        n_params = sum(p.numel() for p in model.parameters())
        pm = autopar.parallelize(model, cluster=cluster, loss_fn=loss_fn, fixed=fixed,
                                 optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
        pm.train_step(inputs, target)
        times = {"sync save": [], "async block": [], "async total": [], "load": []}
        for i in range(repeats):
            where = f"{root}/{name.split()[0]}-{i}"
            dist.barrier()
            t0 = time.perf_counter()
            pm.save_checkpoint(f"{where}-sync")
            times["sync save"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            handle = pm.save_checkpoint(f"{where}-async", async_save=True)
            times["async block"].append(time.perf_counter() - t0)
            handle.wait()
            times["async total"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            pm.load_checkpoint(f"{where}-sync")
            times["load"].append(time.perf_counter() - t0)
            if i == 0:
                step_dir = next(Path(f"{where}-sync").glob("step-*"))
                files = {p.name: p.stat().st_size for p in step_dir.iterdir()}
            dist.barrier()
            if rank == 0:  # (disk space: one checkpoint of 125m with AdamW state is ~1.5 GB)
                shutil.rmtree(f"{where}-sync")
                shutil.rmtree(f"{where}-async")
        out[name] = {"median_s": {k: statistics.median(v) for k, v in times.items()}, "params": n_params,
                     "bytes": files.get(f"__{rank}_0.distcp", 0), "total": sum(files.values())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="125m")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        results = spawn_world(_bench, 2, args.size, args.repeats, root, timeout_s=3600)
    print(f"GPT {args.size}, 2 gloo ranks on CPU, AdamW state, median of {args.repeats}")
    print(f"{'plan':14} {'params':>8} {'MB rank0':>9} {'MB rank1':>9} {'MB total':>9} "
          f"{'sync s':>7} {'async blk s':>11} {'async tot s':>11} {'load s':>7}")
    for name in results[0]:
        r0, r1 = results[0][name], results[1][name]
        m = r0["median_s"]
        print(f"{name:14} {r0['params'] / 1e6:7.1f}M {r0['bytes'] / 1e6:9.1f} {r1['bytes'] / 1e6:9.1f} "
              f"{r0['total'] / 1e6:9.1f} {m['sync save']:7.2f} {m['async block']:11.2f} {m['async total']:11.2f} "
              f"{m['load']:7.2f}")


if __name__ == "__main__":
    main()

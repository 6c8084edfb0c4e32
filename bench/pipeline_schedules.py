"""Measured step time of the same pipeline plan under different schedules (gloo on CPU).

    python bench/pipeline_schedules.py                           # 4 stages, GPT small, 8 micro-batches
    python bench/pipeline_schedules.py --schedules 1f1b zb-h1 gpipe --steps 15

Every schedule gets its own ParallelModule from a plan pinned to the same pp, dp,
tp and micro-batching (so the same stage cuts); only the action lists differ.
Steps run round robin (one step of each schedule in turn, between barriers), so
machine noise hits all alike; the first ``--warmup`` rounds are dropped. Reported:
median step time per schedule, the ratio to the first, the bubble the planner's
simulator predicts for that schedule on this plan, and the most activation bytes each
stage held at once (measured on the runtime's stores).

CPU caveat: with more ranks than cores, a rank that waits gives its core to another
rank, so bubbles cost less than on GPUs, where an idle device is idle.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from autopar.testing import spawn_world  # noqa: E402


def _bench(rank, world, schedules, size, n_layer, batch, micro, steps, warmup):
    import torch.distributed as dist

    import autopar
    import gpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # (parallelize would start it on the first step; the barriers need it now)
    modules = {}
    for kind in schedules:
        torch.manual_seed(0)
        model, inputs, loss_fn, target = gpt.build(size=size, batch=batch, n_layer=n_layer)
        fixed = {"pp": world, "dp": 1, "tp": 1, "schedule": kind, "microbatches": micro}
        modules[kind] = autopar.parallelize(model, cluster=f"1x{world}xcpu", loss_fn=loss_fn, fixed=fixed,
                                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    times = {k: [] for k in schedules}
    for step in range(warmup + steps):
        for kind, pm in modules.items():
            dist.barrier()
            t0 = time.perf_counter()
            pm.train_step(inputs, target)
            dist.barrier()
            if step >= warmup:
                times[kind].append(time.perf_counter() - t0)
    peaks = {k: [None] * world for k in schedules}
    for k, pm in modules.items():
        dist.all_gather_object(peaks[k], pm.runner.peak_stored_bytes)
    return {k: {"times": v, "stages": [s["layers"] for s in modules[k].plan.stages],
                "bubble": modules[k].plan.predicted["bubble_fraction"], "peak_bytes": peaks[k]}
            for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1"])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--size", default="small")
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = spawn_world(_bench, args.stages, args.schedules, args.size, args.n_layer, args.batch, args.micro,
                         args.steps, args.warmup)[0]
    print(f"GPT {args.size} with {args.n_layer} blocks, batch {args.batch}, {args.micro} micro-batches, "
          f"{args.stages} stages on {args.stages} gloo ranks ({args.steps} timed rounds, median):")
    print(f"  stages: {result[args.schedules[0]]['stages']}")
    base = statistics.median(result[args.schedules[0]]["times"])
    for kind in args.schedules:
        med = statistics.median(result[kind]["times"])
        print(f"  {kind:<12} {med * 1e3:8.1f} ms/step  x{med / base:.3f}  "
              f"(predicted bubble {result[kind]['bubble']:.1%}; min {min(result[kind]['times']) * 1e3:.1f}, "
              f"max {max(result[kind]['times']) * 1e3:.1f} ms)")
        print(f"  {'':<12} activations held at peak per stage: "
              + ", ".join(f"{b / 2**20:.1f}" for b in result[kind]["peak_bytes"]) + " MiB")
    print(f"  wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

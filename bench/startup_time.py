"""Start-up time of ``autopar.parallelize`` for the Llama example at its test size and at 4x, on 2 gloo ranks.

    PYTHONPATH=. python bench/startup_time.py                  # ZeRO-3 dp=2, from meta, 3 repeats
    PYTHONPATH=. python bench/startup_time.py --plans zero3,pp2 --repeat 5
    PYTHONPATH=. python bench/startup_time.py --plans zero3,pp2 --sizes "1x,20x depth" --repeat 1

Sizes (``examples/llama.py``): "1x" is the size the distributed tests run (``size="tiny"``,
4 blocks: dim 64, 4 heads); "4x depth" has 16 blocks (4x the graph, 4x the parameters);
"4x width" has dim 256 and 16 heads with 4 blocks (the same graph, ~13x the parameters);
"20x depth" (not run by default: ``--sizes "1x,20x depth"``) has 80 blocks, Llama 70B's depth.

Start-up is what the first ``train_step`` does before its compute: rank 0 plans (traces the
model on FakeTensors, solves) while rank 1 waits, then every rank traces its program (on
FakeTensors), materialises its pieces from ``meta`` and cuts its per-rank program. Each rank
reports the wall seconds and the CPU seconds of its process (``time.process_time``: all its
threads, gloo's included) of the whole start-up and of its parts: ``plan`` (rank 0's
planning; the other rank's wait), ``trace`` (the build's trace, or the planner's reused),
``materialize``, ``program`` (sharding the joint graph into the per-rank program and
inserting the ZeRO calls). Every size runs in the same two processes, in turn, after one
discarded warm-up start (imports, first-call caches), and the median of ``--repeat`` starts
is reported, so the comparison between sizes is side by side under the same machine load.

Results go to stdout and, as JSON, to ``--out`` (default bench/startup_time.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

SIZES = {"1x": {"n_layers": 4}, "4x depth": {"n_layers": 16}, "4x width": {"n_layers": 4, "dim": 256, "n_heads": 16},
         "20x depth": {"n_layers": 80}}
DEFAULT_SIZES = ("1x", "4x depth", "4x width")  # ("20x depth", Llama 70B's 80 blocks: about a minute a start)
PLANS = {"zero3": {"dp": 2, "zero": 3}, "pp2": {"pp": 2, "microbatches": 2}, "tp2": {"tp": 2}}


class _Clock:
    """Wall and CPU seconds spent inside named parts (patched methods), summed per part."""

    def __init__(self):
        self.parts: dict[str, list[float]] = {}

    @contextmanager
    def part(self, name):
        w, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            got = self.parts.setdefault(name, [0.0, 0.0])
            got[0] += time.perf_counter() - w
            got[1] += time.process_time() - c

    def wrap(self, owner, attr, name):
        original = getattr(owner, attr)

        def timed(*a, **k):
            with self.part(name):
                return original(*a, **k)

        setattr(owner, attr, timed)
        return original


def _model(size):
    from dataclasses import replace

    import llama

    config = replace(llama.SIZES["tiny"], **SIZES[size])
    with torch.device("meta"):
        model = llama.Transformer(config, init=False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (8, 64), generator=g)  # (B, T)
    target = torch.randint(0, config.vocab_size, (8, 64), generator=g)  # (B, T)
    return model, tokens, target, llama.cross_entropy_loss, llama.count_params(config)


def _start(plan, size, cluster):
    """One meta start of ``size`` under ``plan``: {part: (wall s, cpu s)}, with "total"."""
    import autopar
    import autopar.passes.shard as shard
    import autopar.runtime.zero_program as zero_program
    from autopar.parallel import ParallelModule

    model, tokens, target, loss_fn, n_params = _model(size)
    clock = _Clock()
    patched = [(ParallelModule, "_compile", "total"), (ParallelModule, "_make_plan", "plan"),
               (ParallelModule, "_trace", "trace"), (ParallelModule, "_materialize", "materialize"),
               (shard, "shard_joint_graph", "program"), (zero_program, "insert_zero_calls", "program")]
    originals = [(owner, attr, clock.wrap(owner, attr, name)) for owner, attr, name in patched]
    try:
        pm = autopar.parallelize(model, cluster=cluster, loss_fn=loss_fn, fixed=PLANS[plan], init_seed=0)
        pm.train_step((tokens,), target)  # start-up, then the first step (its compute is not in "total")
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)
    return {"n_params": n_params, **{k: tuple(v) for k, v in clock.parts.items()}}


def _rank(rank, world, plans, sizes, repeat):
    from autopar.testing import tp_only_cluster

    out = {}
    clusters = {p: tp_only_cluster("1x2xcpu") if p == "tp2" else "1x2xcpu" for p in plans}
    _start(plans[0], sizes[0], clusters[plans[0]])  # warm-up: imports and first-call caches
    for plan in plans:
        for _ in range(repeat):
            for size in sizes:
                got = _start(plan, size, clusters[plan])
                out.setdefault(plan, {}).setdefault(size, []).append(got)
                print(f"rank {rank}: {plan} {size}: " + ", ".join(
                    f"{k} {v[0]:.2f}/{v[1]:.2f} s" for k, v in got.items() if k != "n_params"), flush=True)
    return out


def _median(runs, part, i):
    return statistics.median(r.get(part, (0.0, 0.0))[i] for r in runs)


def main() -> None:
    from autopar.testing import spawn_world

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default="zero3")
    ap.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"of {list(SIZES)}")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "startup_time.json"))
    args = ap.parse_args()
    plans, sizes = args.plans.split(","), args.sizes.split(",")
    ranks = spawn_world(_rank, 2, plans, sizes, args.repeat, timeout_s=3600)
    rows = []
    parts = ("total", "plan", "trace", "materialize", "program")
    for plan in plans:
        base = None
        for size in sizes:
            row = {"plan": plan, "size": size, "n_params": ranks[0][plan][size][0]["n_params"], "ranks": []}
            for rank, r in enumerate(ranks):
                runs = r[plan][size]
                row["ranks"].append({p: {"wall_s": _median(runs, p, 0), "cpu_s": _median(runs, p, 1)} for p in parts})
            rows.append(row)
            # the slowest rank's wall clock, and the most CPU a rank used (rank 0's, which plans, while
            # the other waits: the two ranks end their start-up together, so the wall clock alone
            # would pick either and compare one rank's CPU with the other's between sizes)
            worst = {k: max(x["total"][k] for x in row["ranks"]) for k in ("wall_s", "cpu_s")}
            base = base or worst
            per_rank = "; ".join(
                f"rank {k}: " + ", ".join(f"{p} {x[p]['wall_s']:.2f}/{x[p]['cpu_s']:.2f}" for p in parts)
                for k, x in enumerate(row["ranks"]))
            print(f"{plan} {size:>8} ({row['n_params'] / 1e6:.2f}M params): start-up {worst['wall_s']:.2f} s wall "
                  f"({worst['wall_s'] / base['wall_s']:.2f}x), {worst['cpu_s']:.2f} s CPU on the busiest rank "
                  f"({worst['cpu_s'] / base['cpu_s']:.2f}x); wall/CPU s per part: {per_rank}", flush=True)
    Path(args.out).write_text(json.dumps({"repeat": args.repeat, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

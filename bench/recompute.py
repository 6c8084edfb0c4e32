"""Activation recompute at run time: what each policy costs in step time and saves in memory,
measured beside the plan's predictions.

    python bench/recompute.py                          # Llama "small", batch 8 x 256 tokens, 1 process
    python bench/recompute.py --size tiny --steps 6
    python bench/recompute.py --pp 1f1b                # 2 pipeline ranks: each one's peak against its plan
    python bench/recompute.py --pp interleaved --virtual 2
    python bench/recompute.py --pp zb-h1 --model gpt   # GPT tiny (tied head), 16 x 64 tokens

One process on CPU (a world of 1, so the figures are the runtime's, not gloo's) builds the same
model four times, pinned to each policy (``none``, ``selective``, ``sac``, ``full``; the rest of
the plan is the search's and the same for all four), and runs their steps in turn (round robin),
so machine noise hits all alike; the first step of each is warm-up. Reported per policy:

- step: median seconds, and its ratio to ``none`` beside the plan's predicted ratio (the plan
  prices the re-run forward ops on the cluster's device model, here the catalog's CPU);
- memory: the step program's peak of live intermediate bytes, measured op by op
  (:meth:`autopar.parallel.ParallelModule.measure_step`), against the plan's activation bytes,
  and what is alive when the backward starts (what the forward keeps).
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

POLICIES = ("none", "selective", "sac", "full")


def _run(rank, world, size, batch, seq, steps):
    sys.path.insert(0, str(ROOT / "examples"))
    import llama

    import autopar

    pms, data = {}, {}
    for policy in POLICIES:
        torch.manual_seed(0)
        model, inputs, loss_fn, target = llama.build(size=size, batch=batch, seq=seq)
        pms[policy] = autopar.parallelize(model, cluster="1x1xcpu", loss_fn=loss_fn, fixed={"recompute": policy})
        data[policy] = (inputs, target)
    times = {p: [] for p in POLICIES}
    for step in range(steps + 1):
        for policy, pm in pms.items():
            start = time.perf_counter()
            pm.train_step(*data[policy])
            if step > 0:  # (the first builds the program)
                times[policy].append(time.perf_counter() - start)
    out = {}
    for policy, pm in pms.items():
        measured = pm.measure_step(*data[policy])
        out[policy] = {"step_s": statistics.median(times[policy]), "predicted_s": pm.plan.predicted["step_time_s"],
                       "peak": measured["peak_bytes"], "kept": measured["activation_bytes"],
                       "planned": pm.plan.stages[0]["predicted"]["memory_bytes"]["activations"],
                       "loss": measured["loss"], "plan": f"{pm.plan.mesh} zero={pm.plan.zero}"}
    return out


PIPELINE_MODELS = {"llama": ("Llama tiny, 4 layers, 8 x 256 tokens", dict(size="tiny", batch=8, seq=256, n_layers=4)),
                   "gpt": ("GPT tiny, tied head, 16 x 64 tokens", dict(size="tiny", batch=16, seq=64))}


def _stages(rank, world, schedule, virtual, model_name="llama"):
    """Each pipeline rank's measured peak against its stages' plan, per policy (``--pp``)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import importlib

    import autopar

    example = importlib.import_module(model_name)
    out = {}
    for policy in POLICIES:
        torch.manual_seed(0)
        model, inputs, loss_fn, target = example.build(**PIPELINE_MODELS[model_name][1])
        fixed = {"dp": 1, "tp": 1, "pp": world, "schedule": schedule, "microbatches": 4, "zero": 0,
                 "recompute": policy, **({"virtual_stages": virtual} if virtual > 1 else {})}
        pm = autopar.parallelize(model, cluster=f"1x{world}xcpu", loss_fn=loss_fn, fixed=fixed)
        pm.train_step(inputs, target)
        mine = range(pm.pp_mesh.get_local_rank("pp"), len(pm.plan.stages), world)
        out[policy] = (pm.measure_step(inputs, target)["peak_bytes"],
                       sum(pm.plan.stages[s]["predicted"]["memory_bytes"]["activations"] for s in mine))
    return out


def pipeline_main(schedule: str, virtual: int, model_name: str = "llama") -> None:
    ranks = spawn_world(_stages, 2, schedule, virtual, model_name)
    print(f"{PIPELINE_MODELS[model_name][0]}, pp=2 {schedule} (stages per rank {virtual}), 4 micro-batches; "
          f"torch {torch.__version__}")
    print("| rank | recompute | peak MB | planned MB | error |")
    print("|---|---|---|---|---|")
    for rank, out in enumerate(ranks):
        for policy, (peak, planned) in out.items():
            print(f"| {rank} | {policy} | {peak / 1e6:.2f} | {planned / 1e6:.2f} | {(peak - planned) / planned:+.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--pp", metavar="SCHEDULE", help="instead: 2 pipeline ranks under SCHEDULE (1f1b, zb-h1, "
                    "interleaved, ...), each rank's measured peak against its stages' plan")
    ap.add_argument("--virtual", type=int, default=1, help="with --pp: stages per rank")
    ap.add_argument("--model", choices=sorted(PIPELINE_MODELS), default="llama", help="with --pp: the example model")
    a = ap.parse_args()
    if a.pp:
        return pipeline_main(a.pp, a.virtual, a.model)
    out = spawn_world(_run, 1, a.size, a.batch, a.seq, a.steps)[0]
    base = out["none"]
    print(f"Llama {a.size}, batch {a.batch} x {a.seq} tokens, 1 process, {a.steps} steps per policy "
          f"(medians); plan {base['plan']}; torch {torch.__version__}")
    print("| recompute | step (s) | vs none | predicted vs none | peak MB | planned MB | error | kept at backward MB |")
    print("|---|---|---|---|---|---|---|---|")
    for policy, r in out.items():
        print(f"| {policy} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | "
              f"{r['predicted_s'] / base['predicted_s']:.2f} | {r['peak'] / 1e6:.1f} | {r['planned'] / 1e6:.1f} | "
              f"{(r['peak'] - r['planned']) / r['planned']:+.1%} | {r['kept'] / 1e6:.1f} |")
    assert all(r["loss"] == base["loss"] for r in out.values()), {p: r["loss"] for p, r in out.items()}


if __name__ == "__main__":
    main()

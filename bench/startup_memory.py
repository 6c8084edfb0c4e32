"""Start-up memory and time of a GPT started from ``meta`` versus from a CPU copy, on 4 gloo ranks.

    PYTHONPATH=. python bench/startup_memory.py                      # GPT 350m (width 1024) with 12 blocks
    PYTHONPATH=. python bench/startup_memory.py --n-layer 24 --only meta

For each start (``meta``: the model built on meta, each rank materialising its own
pieces module by module; ``cpu``: every rank builds the whole model on CPU, as before
issue 11) and each plan (ZeRO-3 over dp=4; pp=4), a 4-rank world (autopar.testing.spawn_world)
runs ``parallelize`` and two training steps, and every rank reports its peak resident set
(``VmHWM`` of /proc/self/status: the kernel's high-water mark of the process's RSS, so it
includes torch's own ~0.3-0.4 GB) at the end of start-up (planning, tracing, sharding,
materialising: right before the first step's compute) and after two steps (the step's
gathered weights, gradient buckets and activations on top), its RSS right after importing
torch and building the model, and the seconds from ``parallelize`` to the end of start-up
and of the first ``train_step``.

The yardstick is one full copy of the fp32 AdamW training state, 16 bytes per parameter
(4 weights + 4 gradients + 8 for Adam's two moments). Under ZeRO-3 dp=4 a rank owns a
quarter of it, under pp=4 its stage's share; the meta start must keep each rank well below
one full copy, where the CPU start holds the whole model on every rank beside its shards.

Results go to stdout and, as JSON, to ``--out`` (default bench/startup_memory.json; a row of
the same plan and start replaces the one there, others are kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rank(rank, world, size, n_layer, start, fixed, batch, seq):
    import gpt

    import autopar

    torch.manual_seed(0)
    model, _, loss_fn, _ = gpt.build(size=size, n_layer=n_layer, batch=batch, seq=seq, dtype="fp32",
                                     device="meta" if start == "meta" else "cpu")
    n_params = sum(p.numel() for p in model.parameters())
    rss_model = _rss_bytes("VmRSS")
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)  # (B, T)
    target = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)  # (B, T)
    from autopar.parallel import ParallelModule

    built = {}
    compile_original = ParallelModule._compile

    def compile_and_measure(self, *a):  # start-up ends here: the first step's compute follows
        compile_original(self, *a)
        built.update(peak_rss_startup=_rss_bytes("VmHWM"), startup_s=time.perf_counter() - t0)

    ParallelModule._compile = compile_and_measure
    t0 = time.perf_counter()
    pm = autopar.parallelize(model, cluster="1x4xcpu", loss_fn=loss_fn, fixed=fixed,
                             optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    loss0 = pm.train_step(idx, target)
    ParallelModule._compile = compile_original
    first_s = time.perf_counter() - t0
    loss1 = pm.train_step(idx, target)
    state = pm.memory_bytes()
    return {"rank": rank, "n_params": n_params, "peak_rss": _rss_bytes("VmHWM"), "rss_after_model": rss_model,
            "first_step_s": first_s, "losses": [loss0, loss1], "plan_mesh": pm.plan.mesh, "zero": pm.plan.zero,
            "state_bytes": state.params + state.grads + state.optimizer, **built}


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def main() -> None:
    from autopar.testing import spawn_world

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="350m")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--only", choices=["meta", "cpu"], help="run one start only")
    ap.add_argument("--plans", default="zero3,pp4")
    ap.add_argument("--out", default=str(ROOT / "bench" / "startup_memory.json"))
    args = ap.parse_args()
    plans = {"zero3": {"dp": 4, "zero": 3}, "pp4": {"pp": 4, "microbatches": 4}}
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else []  # rows of other runs are kept
    for plan in args.plans.split(","):
        for start in ([args.only] if args.only else ["meta", "cpu"]):
            ranks = spawn_world(_rank, 4, args.size, args.n_layer, start, plans[plan], args.batch, args.seq,
                                timeout_s=3600)
            n = ranks[0]["n_params"]
            full = 16 * n
            row = {"plan": plan, "start": start, "n_params": n, "full_state_bytes": full, "ranks": ranks,
                   "sum_peak_rss": sum(r["peak_rss"] for r in ranks),
                   "max_peak_rss": max(r["peak_rss"] for r in ranks),
                   "first_step_s": max(r["first_step_s"] for r in ranks)}
            results = [r for r in results if (r["plan"], r["start"]) != (plan, start)] + [row]
            print(f"{plan:>5} from {start:<4}: GPT {args.size} x{args.n_layer} blocks, {n / 1e6:.0f}M params, full "
                  f"training state {_gb(full)}; peak RSS per rank "
                  f"{', '.join(_gb(r['peak_rss']) for r in ranks)} (max {row['max_peak_rss'] / full:.0%} of one full "
                  f"copy), sum {_gb(row['sum_peak_rss'])}; at the end of start-up (before the first step's "
                  f"compute) {', '.join(_gb(r['peak_rss_startup']) for r in ranks)}, after "
                  f"{max(r['startup_s'] for r in ranks):.0f} s; RSS after import and model build "
                  f"{', '.join(_gb(r['rss_after_model']) for r in ranks)}; rank's live training state "
                  f"{', '.join(_gb(r['state_bytes']) for r in ranks)}; first step after "
                  f"{row['first_step_s']:.0f} s; losses {ranks[0]['losses'][0]:.3f} -> {ranks[0]['losses'][1]:.3f}",
                  flush=True)
            out.write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()

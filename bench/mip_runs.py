"""The sharding MIPs of one automatic plan, solved with and without run elimination.

    python bench/mip_runs.py                                   # Llama tiny on the gloo 1x2 cluster
    python bench/mip_runs.py llama 70b 64x8xH100 --batch 512 --seq 4096

Plans the example with ``autopar.plan``; every MIP the planner solves is solved twice in
this process, with every op in the MIP (``eliminate=False``) and with runs of single-reader
ops eliminated (the default), each from scratch (no memo, no disk cache), and the CPU
seconds (``time.process_time``), branch-and-bound nodes and objectives are printed per MIP.
The objectives must be equal (the elimination is exact); the plan uses the second answer.
"""

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["AUTOPAR_SOLVE_CACHE"] = "0"

import autopar  # noqa: E402
from autopar.planner import ilp, make  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("example", nargs="?", default="llama")
    ap.add_argument("size", nargs="?", default="tiny")
    ap.add_argument("cluster", nargs="?", default="1x2xcpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location(f"bench_{args.example}", ROOT / "examples" / f"{args.example}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (the trace imports the model's module by name)
    spec.loader.exec_module(module)
    kwargs = {"size": args.size, "batch": args.batch, **({"seq": args.seq} if args.seq else {})}
    model, inputs, loss_fn, target = module.build(**kwargs)

    totals = {False: 0.0, True: 0.0}

    def both(problem, **kw):
        got = {}
        for eliminate in (False, True):
            ilp._SOLVED.clear()
            start = time.process_time()
            got[eliminate] = ilp.solve(problem, eliminate=eliminate, **{"gap": 0, **kw})  # (gap 0: exact optima compare)
            totals[eliminate] += time.process_time() - start
            got[eliminate, "cpu"] = time.process_time() - start
        whole, runs = got[False], got[True]
        print(f"tp={problem.graph.axis_size:<2} ops={len(problem.graph.nodes):<5} "
              f"whole: {got[False, 'cpu']:6.2f} CPU-s {whole.nodes:4d} nodes  "
              f"runs out: {got[True, 'cpu']:6.2f} CPU-s {runs.nodes:4d} nodes  "
              f"objective {whole.objective_s:.9g} / {runs.objective_s:.9g}", flush=True)
        return runs

    make.solve = both
    autopar.plan(model, inputs, cluster=args.cluster, loss_fn=loss_fn, example_target=target)
    print(f"total: whole {totals[False]:.1f} CPU-s, runs out {totals[True]:.1f} CPU-s")


if __name__ == "__main__":
    main()

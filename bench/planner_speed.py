"""Planner speed: trace, sharding MIP and search time for GPT/Llama shapes on clusters of 8 to 3072 GPUs.

    python bench/planner_speed.py                 # the full table (several minutes on 2 cores)
    python bench/planner_speed.py --quick         # 70B Llama on 64x8xH100 only
    python bench/planner_speed.py --repeat 3      # medians of 3 runs
    python bench/planner_speed.py --targets       # issue 16's rows: 70B/64x8, 405B/1024x8, 1T/384x8

Each row plans one model for one cluster end to end (autopar.plan) in this process
and reports the planner's own timings (Plan.timings): trace_s (two traces, at the
global batch and twice it, side by side in a forked child where the planner may fork),
solve_s (strategy graphs + one sharding MIP per tp degree, shared with a forked child the
same way), search_s (mesh x cuts x micro-batching x ZeRO x recompute x schedule, with
schedule simulation), the wall time and the CPU time of the process and its forked children
(less sensitive to a loaded machine than wall time); plus the plan it chose and its objective
(the predicted step time, printed in full so runs can be compared exactly). The global batch
is one sequence per GPU (at least 8) so that every cluster can use data parallelism.
Peak RSS of the process is printed at the end. Every run is a first plan: the solved-MIP
disk cache (autopar/planner/solve_cache.py) is off unless --cache is given, and the
in-process memos (solved MIPs, schedules, timing orders, collective prices) are emptied
before each repeat, so a median of repeats is not a median of memo hits.
"""

import argparse
import importlib.util
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar.testing import forget_planner_memos  # noqa: E402


def _example(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


CASES = [  # (label, example, kwargs, clusters)
    ("GPT 1.3B", "gpt", {"size": "1.3b", "seq": 2048}, ["1x8xH100", "2x8xH100", "8x8xH100"]),
    ("Llama 7B", "llama", {"size": "7b", "seq": 4096}, ["1x8xH100", "8x8xH100", "32x8xH100"]),
    ("Llama 70B", "llama", {"size": "70b", "seq": 4096}, ["8x8xH100", "64x8xH100", "384x8xH100"]),
    ("GPT 1T (128 layers)", "gpt", {"size": "1t", "seq": 2048}, ["64x8xH100", "384x8xH100"]),
]
QUICK = [("Llama 70B", "llama", {"size": "70b", "seq": 4096}, ["64x8xH100"])]
TARGETS = [  # issue 16: automatic plans in < 5 s, < 30 s and < 30 s on a quiet 2-core machine
    ("Llama 70B", "llama", {"size": "70b", "seq": 4096}, ["64x8xH100"]),
    ("Llama 405B", "llama", {"size": "405b", "seq": 4096}, ["1024x8xH100"]),
    ("GPT 1T (128 layers)", "gpt", {"size": "1t", "seq": 2048}, ["384x8xH100"]),
]


def _cpu_s() -> float:
    """CPU seconds of this process and of its ended children (the planner's forked ones)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def run(label, example, kwargs, cluster, repeat):
    nodes, per_node, _ = cluster.split("x")
    world = int(nodes) * int(per_node)
    rows = []
    for _ in range(repeat):
        model, inputs, loss_fn, target = _example(example).build(batch=max(8, world), **kwargs)
        forget_planner_memos()
        start, cpu = time.perf_counter(), _cpu_s()
        plan = autopar.plan(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
        rows.append((time.perf_counter() - start, plan, _cpu_s() - cpu))
    wall = statistics.median(r[0] for r in rows)
    cpu = statistics.median(r[2] for r in rows)
    plan = rows[0][1]
    objectives = {r[1].predicted["step_time_s"] for r in rows}
    assert len(objectives) == 1, f"repeated plans differ: {objectives}"  # results never depend on timing
    t = {k: statistics.median(r[1].timings.get(k, 0.0) for r in rows) for k in ("trace_s", "solve_s", "search_s")}
    mesh = "x".join(f"{k}{v}" for k, v in plan.mesh.items())
    print(f"| {label:<20} | {cluster:<11} | {max(8, world):>5} | {t['trace_s']:6.1f} | {t['solve_s']:6.1f} | "
          f"{t['search_s']:6.1f} | {wall:6.1f} | {cpu:6.1f} | {mesh:<15} | z{plan.zero} {plan.schedule['kind']:<6} "
          f"m={plan.schedule['microbatches']:<3} | {plan.predicted['mfu']:5.1%} | "
          f"{plan.predicted['step_time_s']!r} | {_counts(plan)} |", flush=True)


def _counts(plan):
    """Configurations / simulated / mesh shapes pruned by the bound, and the search's split."""
    s = plan.solver["search"]
    t = plan.timings
    split = " ".join(f"{k[len('search_'):-2]} {t[k]:.1f}" for k in sorted(t)
                     if k.startswith("search_") and k not in ("search_s", "search_wall_s"))
    return (f"{s.get('configurations')} / {s.get('simulated')} / {s.get('shapes_pruned', '-')} of "
            f"{s.get('shapes', '-')}; {split}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--targets", action="store_true", help="the three issue-16 target rows")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--cache", action="store_true", help="read and write the solved-MIP disk cache")
    args = parser.parse_args()
    if not args.cache:
        os.environ["AUTOPAR_SOLVE_CACHE"] = "0"
    print("| model                | cluster     | batch | trace  | solve  | search | wall s | cpu s  | mesh            | "
          "zero/sched/micro | MFU   | step s | configurations / simulated / shapes pruned; search split s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, example, kwargs, clusters in (QUICK if args.quick else TARGETS if args.targets else CASES):
        for cluster in clusters:
            run(label, example, kwargs, cluster, args.repeat)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"peak RSS {rss:.2f} GB")


if __name__ == "__main__":
    main()

"""Predicted step time with the step program (overlapped communication) against the golden plans.

    PYTHONPATH=. python bench/overlap_predictions.py            # the default cases below
    PYTHONPATH=. python bench/overlap_predictions.py gpt-1.3b:2x8xH100 llama-8b:16x8xH100

Plans each case exactly as ``tests/test_golden_plans.py`` does (same model, batch and cluster)
and prints, next to the golden file's predicted step time (the planner before the step
program, until the goldens are regenerated), the new prediction and, summed over pipeline
ranks, the dp/tied communication in flight, hidden behind compute and exposed. The times are
the cost model's, not measurements.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

DEFAULT = ("gpt-1.3b:2x8xH100", "llama-8b:2x8xH100", "llama-8b:16x8xH100")


def _config(p: dict) -> str:
    m, s = p["mesh"], p["schedule"]
    return f"pp{m['pp']} dp{m['dp']} tp{m['tp']} zero{p['zero']} {s['kind']} m={s['microbatches']}"


def main(cases: list[str]) -> None:
    import test_golden_plans as golden

    print("| model | cluster | golden step | golden plan | step program | plan | in flight | hidden | exposed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        name, _, cluster = case.partition(":")
        old = json.loads((ROOT / "tests" / "golden" / f"{name}-{cluster}.json").read_text())
        plan = json.loads(golden.plan_for(name, cluster).to_json())
        rows = plan["predicted"]["overlap"]
        total = {k: sum(r[k] for r in rows) for k in ("collectives_s", "hidden_s", "exposed_s")}
        print(f"| {name} | {cluster} | {old['predicted']['step_time_s'] * 1e3:.2f} ms | {_config(old)} | "
              f"{plan['predicted']['step_time_s'] * 1e3:.2f} ms | {_config(plan)} | "
              f"{total['collectives_s'] * 1e3:.2f} ms | {total['hidden_s'] * 1e3:.2f} ms | "
              f"{total['exposed_s'] * 1e3:.2f} ms |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(DEFAULT))

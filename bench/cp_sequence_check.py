"""What context parallelism's sequence check finds across Hugging Face architectures.

    python bench/cp_sequence_check.py              # every 3rd causal-LM architecture (66; ~4 min on 2 cores)
    python bench/cp_sequence_check.py --every 1    # all of them
    python bench/cp_sequence_check.py --only llama,mixtral,falcon_h1

Each architecture is built tiny on ``meta`` as ``bench/hf_coverage.py`` builds it, traced into
its joint graph (``autopar.analysis.build_graph``), and read by
:func:`autopar.passes.sequence_mixing.sequence_mixing`: the ops that work along each sequence
apart, which cp would run on chunks (the planner refuses cp for such a model). One line per
architecture: whether the graph has an SDPA op (what cp splits), and the ops found, counted by
kind; then the totals. An architecture that cannot be built or traced is counted apart.
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hf_coverage  # noqa: E402

from autopar.analysis import build_graph  # noqa: E402
from autopar.cluster import Cluster  # noqa: E402
from autopar.passes.sequence_mixing import labels_shifted_outside, sequence_mixing  # noqa: E402
from autopar.planner.context import find_attention, sequence_length  # noqa: E402


def _alarm(*_):
    raise TimeoutError("over the time limit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per architecture")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    cluster = Cluster.from_spec("1x8xH100")
    signal.signal(signal.SIGALRM, _alarm)
    totals = collections.Counter()
    for kind, model_type, class_name in hf_coverage.architectures(["causal"], only, args.every):
        signal.alarm(args.timeout)
        try:
            model, inputs = hf_coverage.build(kind, model_type, class_name)[:2]
            gm = build_graph(model, inputs, cluster=cluster, loss_fn=None, example_target=None)
        except Exception as e:  # (the architecture's own config or constructor, or a trace error)
            totals["not built or traced"] += 1
            print(f"{model_type:26s} not built or traced: {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        finally:
            signal.alarm(0)
        seq = sequence_length(gm)
        sdpa = bool(find_attention(gm))
        found = sequence_mixing(gm, seq, untagged=labels_shifted_outside(gm)) if seq else []
        kinds = collections.Counter(f"{f.op} ({f.why.split(' (')[0]})" for f in found)
        totals[("SDPA" if sdpa else "no SDPA", "found" if found else "none")] += 1
        print(f"{model_type:26s} {'SDPA' if sdpa else 'no SDPA':8s} "
              + ("; ".join(f"{n} x {k}" for k, n in kinds.items()) or "nothing found")
              + (f"; first: {found[0]}" if found else ""), flush=True)
    print()
    for key, n in sorted(totals.items(), key=str):
        print(f"{' / '.join(key) if isinstance(key, tuple) else key}: {n}")


if __name__ == "__main__":
    main()

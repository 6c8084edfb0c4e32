"""The ``autopar`` command line: analyze, plan, diff.

    autopar analyze examples/gpt.py:build --cluster 2x8xH100
    autopar analyze examples/llama.py:build --arg size=70b --cluster 64x8xH100 --json out.json
    autopar plan examples/llama.py:build --arg size=70b --cluster 8x8xH100 --timeline t.png --html plan.html
    autopar diff old_plan.json new_plan.json --tolerance 0.01

``diff`` exits 0 when the plans match, 1 when they differ.

User mistakes (a bad cluster spec, a missing model file, an untraceable model)
print one line, ``autopar: error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from autopar import progress
from autopar.errors import AutoparError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other user error
        print(f"autopar: error: {message} (see autopar {self.prog.split()[-1]} --help)", file=sys.stderr)
        raise SystemExit(2)


def _key_values(pairs: Sequence[str], flag: str) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {pair!r} is not of the form key=value")
        out[key] = value
    return out


def _load(args):
    from autopar.modelspec import load_model_spec

    model, inputs, loss_fn, target = load_model_spec(args.model, _key_values(args.arg, "--arg"))
    return model, inputs, loss_fn, target


def cmd_analyze(args) -> int:
    from autopar.analysis import analyze
    from autopar.cluster import parse_cluster

    cluster = parse_cluster(args.cluster)
    model, inputs, loss_fn, target = _load(args)
    report = analyze(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2, sort_keys=True)
        print(f"wrote {args.json}")
    return 0


def cmd_plan(args) -> int:
    from autopar.api import plan
    from autopar.cluster import parse_cluster

    cluster = parse_cluster(args.cluster)
    fixed = _key_values(args.fix, "--fix")
    if args.timeline and not args.timeline.lower().endswith((".png", ".svg", ".pdf")):
        raise ValueError(f"--timeline {args.timeline!r} needs a .png, .svg or .pdf file name")
    model, inputs, loss_fn, target = _load(args)
    result = plan(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target, fixed=fixed)
    print(result.summary())
    if args.out:
        result.save(args.out)
        print(f"wrote {args.out}")
    if args.timeline:
        from autopar.report import save_timeline

        save_timeline(result, args.timeline)
        print(f"wrote {args.timeline}")
    if args.html:
        from autopar.report import save_html

        save_html(result, args.html)
        print(f"wrote {args.html}")
    if args.emit:
        from autopar.runtime.emit import emit_programs

        paths = emit_programs(args.model, _key_values(args.arg, "--arg"), plan=result, cluster=cluster,
                              out_dir=args.emit)
        print(f"wrote {len(paths)} rank program(s) to {args.emit}: {', '.join(p.name for p in paths)}")
    return 0


def cmd_diff(args) -> int:
    from autopar.plan_diff import diff_plans, load_plan_file

    if not args.tolerance >= 0:
        raise ValueError(f"--tolerance {args.tolerance} must be >= 0 (a relative tolerance such as 0.01)")
    old, new = load_plan_file(args.old), load_plan_file(args.new)
    diff = diff_plans(old, new, rtol=args.tolerance)
    print(diff.render(old_label=args.old, new_label=args.new, limit=args.limit))
    return 0 if diff.equal else 1


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description="Auto-parallelism compiler for PyTorch training.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what each pass does")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def model_args(p):
        p.add_argument("model", help="model spec FILE.py:FN; FN returns (model, example_inputs[, loss_fn[, target]])")
        p.add_argument("--cluster", required=True, help="NODESxDEVICESxDEVICE (e.g. 2x8xH100) or a JSON/YAML file")
        p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="keyword argument for FN (repeatable)")

    p = sub.add_parser("analyze", help="per-layer costs of a model on one device of a cluster")
    model_args(p)
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("plan", help="choose mesh, sharding, pipeline cuts and schedule; print and save the plan")
    model_args(p)
    p.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE",
                   help="pin a decision: tp, pp, dp, zero, schedule, microbatch_size, microbatches, recompute")
    p.add_argument("--out", metavar="FILE", help="write the plan file (JSON)")
    p.add_argument("--timeline", metavar="FILE",
                   help="draw one step's pipeline schedule as a Gantt chart (.png, .svg or .pdf; needs matplotlib)")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report of the plan with its timeline")
    p.add_argument("--emit", metavar="DIR", help="write each rank's generated program (Python) into DIR")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("diff", help="what changed between two plan files; exit 0 if they match, 1 if not")
    p.add_argument("old", help="plan file (JSON) to compare against")
    p.add_argument("new", help="plan file (JSON) to compare")
    p.add_argument("--tolerance", type=float, default=0.01, metavar="RTOL",
                   help="relative tolerance for predicted numbers (default 0.01); structure must match exactly")
    p.add_argument("--limit", type=int, default=20, metavar="N",
                   help="print at most N changes per group (default 20; 0 prints all)")
    p.set_defaults(func=cmd_diff)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    progress.enable(sys.stderr)
    try:
        return args.func(args)
    except (AutoparError, ValueError, TypeError, FileNotFoundError, ImportError) as e:
        message = " ".join(str(e).split())
        print(f"autopar: error: {message}", file=sys.stderr)
        return 2
    finally:
        progress.enable(None)


if __name__ == "__main__":
    sys.exit(main())

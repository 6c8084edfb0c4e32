"""The ``autopar`` command line: analyze, plan, diff.

    autopar analyze examples/gpt.py:build --cluster 2x8xH100
    autopar analyze examples/llama.py:build --arg size=70b --cluster 64x8xH100 --json out.json
    autopar plan examples/llama.py:build --arg size=70b --cluster 8x8xH100 --timeline t.png --html plan.html
    autopar diff old_plan.json new_plan.json --tolerance 0.01

``diff`` exits 0 when the plans match, 1 when they differ.

User mistakes (a bad cluster spec, a missing model file, an untraceable model,
an exception raised by the user's own model spec, an output path that cannot be
written) print one line, ``autopar: error: ...``, and exit with status 2;
``-v`` also prints the traceback. Output paths are checked before any planning.
Ctrl-C prints ``autopar: interrupted`` and exits 130.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from autopar import progress
from autopar.errors import AutoparError, OutputPathError
from autopar.planner.fixed import FIXED_KEYS

PRECISION_CHOICES = ("fp32", "bf16-mixed", "bf16-mixed-bf16-reduce", "bf16")
"""``autopar.precision.PRECISIONS`` and its alias, spelled out so ``autopar diff`` need not import torch
(tests/test_precision.py checks they agree)."""

INTERRUPTED = 130
"""Exit status after Ctrl-C: 128 + SIGINT, as shells report it."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other user error
        print(f"autopar: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _check_output_file(flag: str, path: str) -> None:
    """Fail before planning, not after minutes of it, when ``path`` cannot be written."""
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(f"{flag} {path!r} is a directory; give a file name, e.g. {str(p / 'plan.json')!r}")
    parent = p.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist (create it first)"
        raise OutputPathError(f"{flag} {path!r}: the directory {str(parent)!r} {what}")
    existed = p.exists()
    try:  # opening for append creates nothing new in an existing file and truncates nothing
        with open(p, "a"):
            pass
    except OSError as e:
        raise OutputPathError(f"{flag} {path!r} cannot be written: {e.strerror or e}; "
                              f"choose a writable location") from None
    if not existed:
        p.unlink(missing_ok=True)


def _check_output_dir(flag: str, path: str) -> None:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputPathError(f"{flag} {path!r} is an existing file, not a directory; name a new or existing directory")
    probe = p
    while not probe.exists():  # the directory is created later (with its parents): test where it will be
        probe = probe.parent
    if not probe.is_dir():
        raise OutputPathError(f"{flag} {path!r}: {str(probe)!r} is a file, so no directory can be created under it")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise OutputPathError(f"{flag} {path!r} cannot be written ({str(probe)!r}: {e.strerror or e}); "
                              f"choose a writable location") from None


def _write(flag: str, path: str, write: Callable[[], object]) -> None:
    """Run ``write``; a failure while writing (a full disk) names the flag and the path."""
    try:
        write()
    except OSError as e:
        raise OutputPathError(f"could not write {flag} {path!r}: {e.strerror or e}") from None
    print(f"wrote {path}")


def _check_reports(*flags: tuple[str, str | None]) -> None:
    """--timeline and --html draw with matplotlib: say it is missing before planning, not after."""
    import importlib.util

    given = [f for f, value in flags if value]
    if given and importlib.util.find_spec("matplotlib") is None:
        raise ImportError(f"{' and '.join(given)} need matplotlib: pip install 'autopar[report]'")


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
    if args.json:
        _check_output_file("--json", args.json)
    model, inputs, loss_fn, target = _load(args)
    report = analyze(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target)
    print(report.table())
    if args.json:
        def write_json():
            with open(args.json, "w") as f:
                json.dump(report.to_dict(), f, indent=2, sort_keys=True)

        _write("--json", args.json, write_json)
    return 0


def cmd_plan(args) -> int:
    from autopar.api import plan
    from autopar.cluster import parse_cluster
    from autopar.planner.search import Fixed

    # Everything the user typed is checked before the model spec runs and the planner starts.
    cluster = parse_cluster(args.cluster)
    fixed = _key_values(args.fix, "--fix")
    Fixed.from_dict(fixed)
    if args.timeline and not args.timeline.lower().endswith((".png", ".svg", ".pdf")):
        raise ValueError(f"--timeline {args.timeline!r} needs a .png, .svg or .pdf file name")
    for flag in ("out", "timeline", "html"):
        if getattr(args, flag):
            _check_output_file(f"--{flag}", getattr(args, flag))
    if args.emit:
        _check_output_dir("--emit", args.emit)
    _check_reports(("--timeline", args.timeline), ("--html", args.html))
    model, inputs, loss_fn, target = _load(args)
    result = plan(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target, fixed=fixed,
                  precision=args.precision)
    print(result.summary())
    if args.out:
        _write("--out", args.out, lambda: result.save(args.out))
    if args.timeline:
        from autopar.report import save_timeline

        _write("--timeline", args.timeline, lambda: save_timeline(result, args.timeline))
    if args.html:
        from autopar.report import save_html

        _write("--html", args.html, lambda: save_html(result, args.html))
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
    parser.add_argument("-v", "--verbose", action="store_true", help="log what each pass does; on an error, also print its traceback")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.set_defaults(commands=sub.choices)  # main() sends an unknown option to its command's usage line

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
                   help=f"pin a decision, repeatable: {', '.join(FIXED_KEYS)} (cuts: the layers where pipeline "
                        f"stages 1, 2, ... begin, comma-separated, e.g. cuts=layers.16,layers.32,layers.48)")
    p.add_argument("--precision", choices=PRECISION_CHOICES, default=None,
                   help="training precision: fp32 (no casts), bf16-mixed (fp32 masters, bf16 compute, fp32 "
                        "gradient reduction; 'bf16' for short) or bf16-mixed-bf16-reduce; default bf16-mixed on "
                        "GPU clusters, the model's dtype on cpu")
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
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # argparse would blame the top-level parser: point at the command's own --help instead
        args.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    progress.enable(sys.stderr)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return INTERRUPTED
    except (AutoparError, ValueError, TypeError, OSError, ImportError) as e:
        if args.verbose:  # the whole story, the user's own frames included, above the one line
            traceback.print_exception(e, file=sys.stderr)
        message = " ".join(str(e).split())
        print(f"autopar: error: {message}", file=sys.stderr)
        return 2
    finally:
        progress.enable(None)


if __name__ == "__main__":
    sys.exit(main())

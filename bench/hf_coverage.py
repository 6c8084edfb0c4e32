"""Hugging Face coverage: which architectures autopar plans, built as users build them.

    python bench/hf_coverage.py                                  # every 5th architecture (68), 10-12 min of 2 cores
    python bench/hf_coverage.py --every 4                        # every 4th (83): the README's table
    python bench/hf_coverage.py --every 1                        # every architecture (327; about 50-60 min of 2 cores)
    python bench/hf_coverage.py --kinds causal --every 1          # every causal-LM architecture
    python bench/hf_coverage.py --only gpt2,llama,t5 --train gpt2,llama
    python bench/hf_coverage.py --out coverage.jsonl             # one JSON line per architecture
    python bench/hf_coverage.py --jobs 1 --timeout 120           # 1 worker process, 120 CPU seconds each at most

For every architecture in transformers' causal-LM, masked-LM, seq2seq and
image-classification auto mappings (every ``--every``-th of each mapping, in the mapping's
order: 5 by default, a sample that keeps every mapping and fits 15 minutes of this 2-core
machine): take its default config, scale its size fields down
(``examples/hf.py``'s ``tiny_config``: 2 layers, hidden 64, 4 heads, vocab 512, ...; nothing
else changes, so caches, dropout and the attention implementation stay as configured),
build it with ``AutoModelFor*.from_config`` on ``meta``, and plan it on 1x8xH100 with
``autopar.plan`` (the full planner: every tp degree, mesh, schedule; nothing pinned).
Each architecture lands in one of:

- planned: a plan came back;
- refused: autopar raised one of its own errors (``AutoparError``: a trace error naming the
  cause and line, an input error, ...), specific by construction;
- crashed: anything else escaped autopar (a TypeError, AttributeError, ... from inside it):
  a bug to fix;
- not tiny: no model could be built from the scaled-down config (the architecture's own
  config or constructor refused it, or it stayed above 50M parameters): not autopar's;
- over time: planning used more than ``--timeout`` CPU seconds (no verdict either way).
  The budget is CPU time, not wall time, so a verdict does not depend on how loaded the
  machine is. It is checked when Python regains control: a long call into C++ (a MIP solve,
  a torch kernel) finishes first (Falcon-Mamba stopped at 98 CPU seconds of its 60).

Architectures are planned by ``--jobs`` worker processes (default 2, one per core here),
each importing torch, transformers and autopar once and planning one architecture after
another. Each row says the wall and CPU seconds that architecture took (CPU: the worker's
``time.process_time``, building the model included).

``--train A,B`` then runs those planned architectures on 2 gloo ranks under dp=2 and tp=2
against the same model in one process (2 steps; losses, gradients and parameters judged by
``tests/dist/parallel_compare.py``), counted as trained equal or not.
"""

import argparse
import json
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests" / "dist")]

import transformers  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402

import autopar  # noqa: E402
import hf  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402

KINDS = {  # kind -> (auto mapping of model_type -> class name, inputs kind of examples/hf.py)
    "causal": (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "causal"),
    "masked": (modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, "masked"),
    "seq2seq": (modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "seq2seq"),
    "image": (modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES, "image"),
}
MAX_PARAMS = 50_000_000
TIMEOUT_CPU_S = 60.0  # a tiny model that plans takes 5-40 CPU seconds here
BATCH, SEQ = 8, 32


def architectures(kinds: list[str], only: set[str] | None, every: int) -> list[tuple[str, str, str]]:
    """(kind, model_type, class name), in the mappings' order; every ``every``-th per kind."""
    out = []
    for kind in kinds:
        mapping, _ = KINDS[kind]
        rows = [(kind, t, c if isinstance(c, str) else c[0]) for t, c in mapping.items()]
        rows = [r for r in rows if only is None or r[1] in only]
        out += rows[::every] if only is None else rows
    return out


def build(kind: str, model_type: str, class_name: str, device: str = "meta"):
    """The tiny model and its inputs; raises when the architecture cannot be made tiny."""
    config_cls = transformers.CONFIG_MAPPING[model_type]
    config = hf.tiny_config(config_cls)
    if kind == "image" and isinstance(getattr(config, "image_size", None), int):
        config.num_labels = 10
    model_cls = getattr(transformers, class_name)
    with torch.device(device):
        model = model_cls(config)
    model.train()
    n = sum(p.numel() for p in model.parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{n / 1e6:.0f}M parameters after scaling the config down")
    sizes = config if kind == "image" else config.get_text_config()  # (multimodal: the text model's vocab)
    inputs = hf._inputs(KINDS[kind][1], sizes, BATCH, SEQ, torch.device(device), 0)
    return model, inputs


class _OverTime(BaseException):
    """Raised by the CPU-time alarm in the middle of planning (a BaseException: torch's and
    the model's own ``except Exception`` handlers must not swallow it)."""


_RETRY_S = 0.1
"""After the budget runs out, the alarm fires again every this many CPU seconds: an exception
raised while Python runs a weakref or garbage-collector callback is printed and dropped (seen
in CI: gpt_neo went on to plan), so one alarm is not enough."""
_fired = [False]
_armed = [False]
"""Whether the alarm may raise: cleared first thing when planning ends, so a repeat alarm that
lands while the row is being finished (seen: inside the ``finally`` that stops the timer,
killing the worker) is ignored."""


def _alarm(signum, frame):
    if not _armed[0]:
        return
    _fired[0] = True
    raise _OverTime


def _error_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:300] if str(e) else ""


def plan_one(kind: str, model_type: str, class_name: str, timeout_s: float = 0) -> dict:
    """One architecture's row: outcome, the error's first line or the mesh, wall and CPU
    seconds. With ``timeout_s`` > 0 (main thread only), planning stops once this process has
    used that many CPU seconds on it (``ITIMER_PROF``: user + system time of all its threads)."""
    row = {"kind": kind, "model_type": model_type, "class": class_name}
    start, cpu = time.perf_counter(), time.process_time()

    def timed(**fields) -> dict:
        row.update(fields, seconds=round(time.perf_counter() - start, 1), cpu_s=round(time.process_time() - cpu, 1))
        return row

    try:
        model, inputs = build(kind, model_type, class_name)
    except Exception as e:  # the architecture's own code refused the tiny config: not autopar's
        return timed(outcome="not tiny", error=f"{type(e).__name__}: {_error_line(e)}")
    if timeout_s > 0:
        handler = signal.signal(signal.SIGPROF, _alarm)
        _fired[0], _armed[0] = False, True
        signal.setitimer(signal.ITIMER_PROF, timeout_s, _RETRY_S)
    try:
        plan = autopar.plan(model, inputs, cluster="1x8xH100")
        if _fired[0]:  # every alarm was dropped before planning ended: still over the budget
            raise _OverTime
        fields = dict(outcome="planned", mesh=plan.mesh)
    except _OverTime:
        fields = dict(outcome="over time", error=f"still planning after {timeout_s:g} CPU seconds")
    except AutoparError as e:
        fields = dict(outcome="refused", error=f"{type(e).__name__}: {str(e)[:400]}")
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        inner = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "/autopar/" in f.filename), "")
        fields = dict(outcome="crashed", error=f"{type(e).__name__} at {inner}: {_error_line(e)}")
    finally:
        _armed[0] = False
        if timeout_s > 0:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.signal(signal.SIGPROF, handler)
    return timed(**fields)


def _quiet() -> None:
    """One line per architecture: use_cache notes and Hugging Face warnings off."""
    import logging
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()


def _plan_job(job: tuple[str, str, str, float]) -> dict:
    try:
        return plan_one(*job)
    except _OverTime:  # the alarm landed between the end of planning and the disarm: over time all the same
        _armed[0] = False
        signal.setitimer(signal.ITIMER_PROF, 0)
        kind, model_type, class_name, timeout_s = job
        return {"kind": kind, "model_type": model_type, "class": class_name, "outcome": "over time",
                "error": f"still planning after {timeout_s:g} CPU seconds"}


def plan_all(rows: list[tuple[str, str, str]], *, jobs: int, timeout_s: float) -> Iterator[dict]:
    """Rows in the order of ``rows``, planned by ``jobs`` worker processes (1: in this one)."""
    work = [(*r, timeout_s) for r in rows]
    if jobs <= 1:
        yield from map(_plan_job, work)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # (not multiprocessing.Pool: a worker that dies leaves Pool.imap waiting for ever; the
    # executor raises BrokenProcessPool instead)
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=_quiet) as pool:
        yield from pool.map(_plan_job, work)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)  # eps: see tests/dist/test_parallel.py


def _train_world(rank, world, rows):
    """On each of 2 ranks: every architecture under dp=2 and tp=2 against one process."""
    from autopar.testing import tp_friendly_cluster
    from parallel_compare import Reference, errors, train_alongside

    out = {}
    for kind, model_type, class_name in rows:
        for name, cluster, fixed in (("dp", "1x2xcpu", {"dp": 2, "tp": 1, "microbatches": 1}),
                                     ("tp", tp_friendly_cluster("1x2xcpu"), {"tp": 2, "microbatches": 1})):
            try:
                torch.manual_seed(0)
                model, inputs = build(kind, model_type, class_name, device="cpu")
                reference = Reference(model, _optimizer)
                pm = autopar.parallelize(model, cluster=cluster, fixed=fixed, optimizer=_optimizer)
                seed = [0]

                def run(pm):
                    seed[0] += 1
                    torch.manual_seed(seed[0])  # the same dropout masks in both runs
                    return pm.train_step(inputs)

                def run_reference(ref, like):
                    torch.manual_seed(seed[0])
                    return ref(**like(inputs)).loss

                losses = train_alongside(pm, reference, steps=2, run=run, run_reference=run_reference)
                grad_err, param_err = errors(pm, reference)
                bad = [k for k, g in [*grad_err.items(), *param_err.items()] if not g.ok] + \
                      [f"loss {i}" for i, g in enumerate(losses) if not g.ok]
                out[model_type, name] = "equal" if not bad else f"differs: {bad[:3]}"
            except Exception as e:
                out[model_type, name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="causal,masked,seq2seq,image")
    ap.add_argument("--only", default=None, help="comma-separated model types (e.g. gpt2,llama)")
    ap.add_argument("--every", type=int, default=5,
                    help="plan every N-th architecture of each mapping (1: all of them)")
    ap.add_argument("--train", default="", help="comma-separated planned model types to run on 2 gloo ranks")
    ap.add_argument("--out", default=None, help="append one JSON line per architecture to this file")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes planning architectures side by side")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_CPU_S,
                    help="CPU seconds one architecture may plan (0: no limit)")
    args = ap.parse_args()
    _quiet()
    only = set(args.only.split(",")) if args.only else None
    rows = architectures(args.kinds.split(","), only, args.every)
    print(f"{len(rows)} architectures; planning each on 1x8xH100 ({args.jobs} job(s))", flush=True)
    start = time.perf_counter()
    results = []
    for row in plan_all(rows, jobs=args.jobs, timeout_s=args.timeout):
        results.append(row)
        detail = row.get("mesh") or row.get("error", "")
        print(f"{row['kind']:8} {row['model_type']:28} {row['outcome']:9} {row['seconds']:6.1f}s "
              f"{row['cpu_s']:5.1f} cpu-s  {detail}", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")
    trained = {}
    wanted = [r for r in results if r["model_type"] in set(filter(None, args.train.split(",")))
              and r["outcome"] == "planned"]
    if wanted:
        from autopar.testing import spawn_world

        trained = spawn_world(_train_world, 2, [(r["kind"], r["model_type"], r["class"]) for r in wanted])[0]
        for (model_type, config), verdict in sorted(trained.items()):
            print(f"trained  {model_type:28} {config}: {verdict}", flush=True)
    outcomes = ("planned", "refused", "crashed", "not tiny", "over time")
    print("\n| kind | architectures | planned | refused (specific error) | crashed | not tiny | over time |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        mine = [r for r in results if r["kind"] == kind]
        count = {o: sum(r["outcome"] == o for r in mine) for o in outcomes}
        print(f"| {kind} | {len(mine)} | " + " | ".join(str(count[o]) for o in outcomes) + " |")
    if trained:
        equal = sum(v == "equal" for v in trained.values())
        print(f"\ntrained equal to one process on 2 gloo ranks: {equal} of {len(trained)} (architecture, dp|tp) runs")
    cpu = sum(r["cpu_s"] for r in results)
    print(f"total {time.perf_counter() - start:.0f} s wall; {cpu:.0f} CPU seconds planning "
          f"({args.jobs} job(s); process start and imports not included)", flush=True)


if __name__ == "__main__":
    main()

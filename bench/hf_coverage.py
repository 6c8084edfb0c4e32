"""Hugging Face coverage: which architectures autopar plans, built as users build them.

    python bench/hf_coverage.py                                  # every 5th architecture (68 of 327; 3.5 min on 2 cores)
    python bench/hf_coverage.py --every 1                        # every architecture: the README's table (12 min on 2 cores)
    python bench/hf_coverage.py --kinds causal --every 1          # every causal-LM architecture
    python bench/hf_coverage.py --only gpt2,llama,t5 --train gpt2,llama
    python bench/hf_coverage.py --out coverage.jsonl             # one JSON line per architecture
    python bench/hf_coverage.py --jobs 1 --timeout 120           # 1 architecture at a time, 120 CPU seconds each at most

For every architecture in transformers' causal-LM, masked-LM, seq2seq and
image-classification auto mappings (every ``--every``-th of each mapping, in the mapping's
order: 5 by default, a sample that keeps every mapping): take its default config, scale its size fields down
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
  machine is, and the kernel enforces it (``RLIMIT_CPU``), so a long call into C++ (a SCIP
  solve, a trace) is stopped on time too.

Each architecture is planned in its own child process forked from the bench (torch,
transformers and autopar imported once, the tracer warmed up by one plan of GPT-2 where the
torch build lets a child run autograd after its parent traced: not the CUDA builds), at most
``--jobs`` at a time (default 2, one per core here). Each row says the wall and CPU seconds
that architecture took (CPU: the child's, building the model included; ``build_s`` of it the
build) and, when planned, ``plan.timings`` (where the planner's time went: trace, MIPs, search). Solved MIPs are not
kept on disk (``AUTOPAR_SOLVE_CACHE=0``) unless ``--cache``: a second run costs what the first did.

``--train A,B`` then runs those planned architectures on 2 gloo ranks under dp=2 and tp=2
against the same model in one process (2 steps; losses, gradients and parameters judged by
``tests/dist/parallel_compare.py``), counted as trained equal or not.
"""

import argparse
import inspect
import json
import math
import os
import resource
import select
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests" / "dist")]

import transformers  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402

import autopar  # noqa: E402
import hf  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402
from autopar.testing import forget_planner_memos  # noqa: E402

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


def _error_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:300] if str(e) else ""


def plan_one(kind: str, model_type: str, class_name: str, on_built: Callable[[], None] | None = None) -> dict:
    """One architecture's row: outcome, the error's first line or the mesh, wall and CPU
    seconds (this process's, model build included). ``on_built`` runs between the build and
    the plan (the bench's children start their CPU budget there)."""
    row = {"kind": kind, "model_type": model_type, "class": class_name}
    start, cpu = time.perf_counter(), time.process_time()

    def timed(**fields) -> dict:
        row.update(fields, seconds=round(time.perf_counter() - start, 1), cpu_s=round(time.process_time() - cpu, 1))
        return row

    try:
        model, inputs = build(kind, model_type, class_name)
    except Exception as e:  # the architecture's own code refused the tiny config: not autopar's
        return timed(outcome="not tiny", error=f"{type(e).__name__}: {_error_line(e)}")
    row["build_s"] = round(time.process_time() - cpu, 1)
    if on_built is not None:
        on_built()
    try:
        plan = autopar.plan(model, inputs, cluster="1x8xH100")
        fields = dict(outcome="planned", mesh=plan.mesh,
                      timings={k: round(v, 2) for k, v in plan.timings.items()})
    except AutoparError as e:
        fields = dict(outcome="refused", error=f"{type(e).__name__}: {str(e)[:400]}")
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        inner = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "/autopar/" in f.filename), "")
        fields = dict(outcome="crashed", error=f"{type(e).__name__} at {inner}: {_error_line(e)}")
    return timed(**fields)


def _quiet() -> None:
    """One line per architecture: use_cache notes and Hugging Face warnings off."""
    import logging
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()


def _cpu_limit(timeout_s: float) -> Callable[[], None]:
    """Start the budget: the kernel stops this process once it has used ``timeout_s`` more CPU
    seconds (``RLIMIT_CPU``: SIGXCPU at the soft limit, which kills, SIGKILL a second later),
    wherever it is, a SCIP solve or a torch kernel included. (Whole seconds: rounded up.)"""
    def start() -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = math.ceil(usage.ru_utime + usage.ru_stime + timeout_s)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))
    return start


def _child(job: tuple[str, str, str], timeout_s: float, out: int) -> None:
    """In a forked child: plan one architecture, write its row to ``out``, exit (never return
    into the parent's code: an exception here must not run the parent's ``finally`` blocks)."""
    start = time.perf_counter()
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # (SIGXCPU dumps core by default)
        row = plan_one(*job, on_built=_cpu_limit(timeout_s) if timeout_s > 0 else None)
        os.write(out, json.dumps(row).encode())
    except BaseException as e:  # noqa: BLE001 (a bug of the bench itself: report it, do not hang)
        kind, model_type, class_name = job
        os.write(out, json.dumps({"kind": kind, "model_type": model_type, "class": class_name,
                                  "seconds": round(time.perf_counter() - start, 1),
                                  "cpu_s": round(time.process_time(), 1), "outcome": "crashed",
                                  "error": f"bench: {type(e).__name__}: {e}"[:300]}).encode())
    finally:
        os._exit(0)


def _dead_row(job: tuple[str, str, str], status: int, cpu_s: float, wall_s: float, timeout_s: float) -> dict:
    """The row of a child that died before writing one: over its budget, or killed by a signal."""
    kind, model_type, class_name = job
    row = {"kind": kind, "model_type": model_type, "class": class_name, "seconds": round(wall_s, 1),
           "cpu_s": round(cpu_s, 1)}
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    if sig in (signal.SIGXCPU, signal.SIGKILL) and timeout_s > 0 and cpu_s >= timeout_s:
        return {**row, "outcome": "over time", "error": f"still planning after {timeout_s:g} CPU seconds"}
    why = f"killed by {signal.Signals(sig).name}" if sig else f"exited with status {os.WEXITSTATUS(status)}"
    return {**row, "outcome": "crashed", "error": f"the process planning it was {why} without a row"}


def _forked_backward_runs(after_trace: bool) -> bool:
    """Whether a child forked from this process can run a backward (``after_trace``: a child forked
    from one that traced a backward first; the probe does that in a child of its own, so this
    process stays as it is). torch's CUDA builds (2.11, 2.12 and 2.14 checked, on a host without a
    GPU; 2.13's CPU build does not) mark every child forked after a traced backward (one on fake
    tensors, as every trace runs) as unable to run one: "Unable to handle autograd's threading in
    combination with fork-based multiprocessing"."""
    def status(body) -> int:
        try:
            body()
            return 0
        except BaseException:  # noqa: BLE001 (the probe's answer, not an error)
            return 1

    def backward() -> None:
        torch.ones(1, requires_grad=True).sum().backward()

    def traced_backward() -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            x = torch.empty(2, requires_grad=True)
            torch.autograd.grad(x.sum(), x)

    def forked(body) -> bool:
        pid = os.fork()
        if pid == 0:
            os._exit(body())
        _, st = os.waitpid(pid, 0)
        return os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0

    if after_trace:
        return forked(lambda: status(traced_backward) or (0 if forked(lambda: status(backward)) else 1))
    return forked(lambda: status(backward))


def plan_all(rows: list[tuple[str, str, str]], *, jobs: int, timeout_s: float, warm: bool = False) -> Iterator[dict]:
    """Rows in the order of ``rows``. Each architecture is planned in its own child process,
    forked from this one (torch, transformers and autopar imported once; with ``warm``, after one
    plan of GPT-2 here, so each child skips the tracer's first-use cost; the planner's memos are
    then emptied, so no row finds its MIPs solved), at most ``jobs`` at a
    time. A child gets ``timeout_s`` CPU seconds after building its model (0: no limit), enforced
    by the kernel; a child that dies (a segfault in native code, the out-of-memory killer) costs
    its row, not the run. Why not a pool of long-lived workers: a budget checked from Python (a
    signal handler) waits until a long SCIP solve or trace call returns (Falcon-Mamba ran to 138
    CPU-s of a 60 s budget), and a worker killed mid-row breaks the whole pool.

    On torch builds whose children cannot run autograd once their parent has (the CUDA builds:
    :func:`_forked_backward_runs`) there is no warm-up, and a parent that has traced already (a
    test worker) is told on stderr that its children's traces will fail: plan from a fresh process."""
    if rows and not _forked_backward_runs(after_trace=False):
        print(f"hf_coverage: torch {torch.__version__} cannot run autograd in a child of this process, which "
              "has traced already: every trace will fail; run plan_all from a fresh process", file=sys.stderr)
    elif warm and rows and _forked_backward_runs(after_trace=True):
        plan_one("causal", "gpt2", "GPT2LMHeadModel")
        forget_planner_memos()  # (or GPT-2's own row would find its MIPs solved)
    pending = list(enumerate(rows))
    running: dict[int, tuple[int, int, float]] = {}  # read end -> (child pid, row index, start)
    done: dict[int, dict] = {}
    emitted = 0
    while emitted < len(rows):
        while pending and len(running) < max(1, jobs):
            i, job = pending.pop(0)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _child(job, timeout_s, w)
            os.close(w)
            running[r] = (pid, i, time.perf_counter())
        ready, _, _ = select.select(list(running), [], [])
        for r in ready:
            data = b""
            while chunk := os.read(r, 65536):  # (the child writes its row, then exits: EOF)
                data += chunk
            os.close(r)
            pid, i, start = running.pop(r)
            _, status, usage = os.wait4(pid, 0)
            cpu_s = usage.ru_utime + usage.ru_stime
            done[i] = (json.loads(data) if data else
                       _dead_row(rows[i], status, cpu_s, time.perf_counter() - start, timeout_s))
        while emitted in done:
            yield done.pop(emitted)
            emitted += 1


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
                # the reference runs as autopar traces: without the key/value cache (eager Qwen3-Next
                # with it fails in its own mask code when every layer of the tiny model is linear attention)
                no_cache = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
                pm = autopar.parallelize(model, cluster=cluster, fixed=fixed, optimizer=_optimizer)
                seed = [0]

                def run(pm):
                    seed[0] += 1
                    torch.manual_seed(seed[0])  # the same dropout masks in both runs
                    return pm.train_step(inputs)

                def run_reference(ref, like):
                    torch.manual_seed(seed[0])
                    return ref(**like(inputs), **no_cache).loss

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
    ap.add_argument("--jobs", type=int, default=2, help="architectures planned side by side (one process each)")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_CPU_S,
                    help="CPU seconds one architecture may plan (0: no limit)")
    ap.add_argument("--cache", action="store_true", help="keep solved MIPs on disk (a re-run then skips them)")
    args = ap.parse_args()
    if not args.cache:
        os.environ["AUTOPAR_SOLVE_CACHE"] = "0"
    _quiet()
    only = set(args.only.split(",")) if args.only else None
    rows = architectures(args.kinds.split(","), only, args.every)
    print(f"{len(rows)} architectures; planning each on 1x8xH100 ({args.jobs} job(s))", flush=True)
    start = time.perf_counter()
    results = []
    for row in plan_all(rows, jobs=args.jobs, timeout_s=args.timeout, warm=len(rows) > 1):
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

"""One-GPU check of autopar's CUDA path and compute model: a prepared script, 1-2 minutes on an H200.

    python bench/gpu_check.py                         # on a machine with one CUDA GPU
    python bench/gpu_check.py --out /tmp/gpu.json     # where the figures go (default: $OUT/gpu_check.json,
                                                      # else bench/gpu_check.json)
    python bench/gpu_check.py --device cpu --tiny     # dry run of the same code on CPU (tests/test_gpu_check.py)

(a) ``autopar.parallelize`` on a ~1.3B-parameter GPT (examples/gpt.py size "1.3b", seq 1024)
    in bf16 mixed precision at world size 1 (NCCL, one rank): predicted vs measured step
    time and peak memory (``torch.cuda.max_memory_allocated``).
(b) bf16 GEMMs (``torch.mm``) and attention (``F.scaled_dot_product_attention``) of
    several shapes, timed with CUDA events: achieved TFLOP/s against
    ``autopar.cost.compute.kernel_time_s`` for the GPU found (H200 or H100 in the catalog)
    and for H100, so the efficiency constants there can be recalibrated; then the GEMMs of
    the fidelity rows the model misses (Llama 3.1 8B's linears at 16,384 tokens, forward and both
    gradients) beside Qwen3-32B's, their causal attention forward and
    backward, and one GEMM run for 5 s to show clock throttling under sustained load.
(c) Whole blocks of the same rows (:mod:`gpu_blocks`): Llama 3.1 8B and Qwen3-32B at one and three
    layers, eager bf16, forward and backward timed and profiled by kernel kind, against the sums
    of autopar's per-node prices of the same graphs.

(d) One rank of torch's context-parallel ring attention (:mod:`gpu_ring`): the compute of one
    attention layer's ring at 32k tokens per rank, cp 2, 4 and 8, against autopar's price (the
    context-parallel fidelity rows are 31-37% optimistic at cp 4 and 8 and not at cp 2).
(e) autopar's own cp attention op at cp 1 on the GPU's fused kernel (``gpu_ring.autopar_op``):
    its output and gradients against SDPA's, and its time beside SDPA's (Llama 3.1 8B, 32k tokens);
    then the flash kernel on grouped K/V, and the op with its blocks on cuDNN's kernel (off by
    default: ``autopar.context_blocks.CUDNN_BLOCKS``), to decide whether to turn either on.

The parts run (b), (c), (d), (e), (a) (then the compiled blocks, with ``--compiled-blocks``), and the JSON
file is rewritten after each, so a run cut short keeps what it measured; when (a)'s first step
fails, the step program's and joint graph's code are written beside it. The four H200 runs of
2026-12-04 are in ``bench/gpu_check_h200.json``.

No OR-tools (the GPU machine has torch only): at world size 1 with tp=1 every op has
exactly one useful strategy (nothing is sharded), so the sharding MIP has one answer;
the script then stands in a solver that returns first allowed candidate of every op and says so
in the output (``plan_source``). ``--plan FILE`` runs a plan file instead.

Exits 2 with one line when CUDA is missing (unless ``--device cpu``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_blocks  # noqa: E402
import gpu_ring  # noqa: E402
import torch  # noqa: E402

GEMMS = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 4096, 256), (4096, 4096, 512), (1024, 4096, 4096),
         (2048, 2048, 2048), (1024, 2048, 2048), (8192, 2048, 8192), (8192, 8192, 2048), (256, 512, 4096)]
"""(m, n, k): XLA's H100 table points compute.py cites, a GPT-1.3B layer's shapes (tokens 8192, d 2048), a skinny one."""
ATTENTION = [(4, 16, 2048, 128), (8, 16, 1024, 128), (1, 32, 8192, 128), (16, 32, 512, 64)]
"""(batch, heads, seq, head dim), non-causal: flop_counter counts 4*B*H*S^2*D forward."""
LINEARS = {"llama3-8b": (16384, [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]),
           "qwen3-32b": (8192, [(5120, 8192), (5120, 1024), (8192, 5120), (5120, 25600), (25600, 5120)])}
"""bench/fidelity.py's rows whose errors are not explained (tokens of one micro-batch, linears (in, out)):
Llama 3.1 8B at 2 x 8192 tokens (+23-29%) and, for contrast, Qwen3-32B at 2 x 4096 (within 9%). Each is
timed forward (T, out, in), input gradient (T, in, out) and weight gradient (in, out, T)."""
CAUSAL_ATTENTION = [(2, 32, 8192, 128), (2, 64, 4096, 128)]
"""(batch, heads, seq, head dim) of the same rows' attention (keys and values repeated to every query
head, as torchtitan's repeat_kv does), causal, forward and backward."""
SUSTAINED = ((8192, 8192, 8192), 5.0)
"""A GEMM run back to back for this many seconds: its last calls against its first show clock throttling
under sustained load (torchtitan's runs were on 500 W parts; the catalog's peak is the datasheet's)."""
TINY_GEMMS = [(64, 64, 64), (128, 64, 32)]
TINY_ATTENTION = [(2, 2, 32, 16)]
TINY_LINEARS = {"tiny": (64, [(32, 48)])}
TINY_SUSTAINED = ((64, 64, 64), 0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_rank_env() -> None:
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def _without_ortools() -> bool:
    """Stand a one-answer solver in for OR-tools when it is missing (world size 1, tp=1 only)."""
    try:
        import ortools.linear_solver.pywraplp  # noqa: F401
        return False
    except ImportError:
        pass
    stub = types.ModuleType("ortools")
    stub.linear_solver = types.ModuleType("ortools.linear_solver")
    stub.linear_solver.pywraplp = types.ModuleType("ortools.linear_solver.pywraplp")
    sys.modules.update({"ortools": stub, "ortools.linear_solver": stub.linear_solver,
                        "ortools.linear_solver.pywraplp": stub.linear_solver.pywraplp})
    from autopar.planner import ilp, make

    def one_answer(problem, **_):
        choice = tuple(next(i for i in range(len(node.candidates)) if (v, i) not in problem.forbidden)
                       for v, node in enumerate(problem.graph.nodes))
        return ilp.Solution(choice=choice, status="OPTIMAL (one device: first allowed candidate)",
                            objective_s=0.0, bound_s=0.0, wall_s=0.0)

    ilp.solve = make.solve = one_answer
    return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_s(fn, device: torch.device, *, warmup: int, iters: int) -> float:
    """Median seconds per call (CUDA events on a GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def calibrate(device: torch.device, specs: dict, *, tiny: bool) -> dict:
    """(b): measured vs predicted time of bf16 GEMMs and attention."""
    import torch.nn.functional as F

    from autopar.cost.compute import kernel_time_s

    dtype = torch.bfloat16
    iters, warmup = (3, 1) if tiny else (20, 5)
    rows = []
    for m, n, k in TINY_GEMMS if tiny else GEMMS:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        rows.append(_gemm_row("gemm", m, n, k, _time_s(lambda: torch.mm(a, b), device, warmup=warmup, iters=iters),
                              specs))
        del a, b
    for bsz, heads, seq, dim in TINY_ATTENTION if tiny else ATTENTION:
        q, k_, v = (torch.randn(bsz, heads, seq, dim, dtype=dtype, device=device) for _ in range(3))
        measured = _time_s(lambda: F.scaled_dot_product_attention(q, k_, v), device, warmup=warmup, iters=iters)
        flops = 4.0 * bsz * heads * seq * seq * dim
        moved = 2.0 * 4 * bsz * heads * seq * dim
        rows.append({"kind": "attention", "shape": [bsz, heads, seq, dim], "flops": flops, "measured_s": measured,
                     "measured_tflops": flops / measured / 1e12,
                     **{f"predicted_s_{name}": kernel_time_s(kind="attention", flops=flops, bytes_moved=moved,
                                                              device=spec, dtype="bf16")
                        for name, spec in specs.items()}})
        del q, k_, v
    rows += _fidelity_shapes(device, specs, tiny=tiny, warmup=warmup, iters=iters)
    for r in rows:
        for name in specs:
            r[f"measured_over_predicted_{name}"] = r["measured_s"] / r[f"predicted_s_{name}"]
    return {"rows": rows, "sustained": _sustained(device, *(TINY_SUSTAINED if tiny else SUSTAINED))}


def _gemm_row(kind: str, m: int, n: int, k: int, measured: float, specs: dict, **extra) -> dict:
    from autopar.cost.compute import kernel_time_s

    flops, moved = 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n)
    return {"kind": kind, "shape": [m, n, k], "flops": flops, "measured_s": measured,
            "measured_tflops": flops / measured / 1e12, **extra,
            **{f"predicted_s_{name}": kernel_time_s(kind="gemm", flops=flops, bytes_moved=moved, device=spec,
                                                     dtype="bf16", gemm=(m, n, k)) for name, spec in specs.items()}}


def _fidelity_shapes(device: torch.device, specs: dict, *, tiny: bool, warmup: int, iters: int) -> list[dict]:
    """The GEMMs and causal attention of the fidelity rows (:data:`LINEARS`, :data:`CAUSAL_ATTENTION`),
    each against the price autopar gives it: a causal attention's backward is priced on 2.5x the
    forward's counted FLOPs (``torch.utils.flop_counter``), each on half of them executed
    (``CAUSAL_WORK_FRACTION``)."""
    import torch.nn.functional as F

    from autopar.cost.compute import kernel_time_s

    dtype, rows = torch.bfloat16, []
    for model, (tokens, linears) in (TINY_LINEARS if tiny else LINEARS).items():
        for d_in, d_out in linears:
            for role, (m, n, k) in (("forward", (tokens, d_out, d_in)), ("input grad", (tokens, d_in, d_out)),
                                    ("weight grad", (d_in, d_out, tokens))):
                a = torch.randn(m, k, dtype=dtype, device=device)
                b = torch.randn(k, n, dtype=dtype, device=device)
                measured = _time_s(lambda: torch.mm(a, b), device, warmup=warmup, iters=iters)
                rows.append(_gemm_row("gemm", m, n, k, measured, specs, model=model, role=role))
    for bsz, heads, seq, dim in TINY_ATTENTION if tiny else CAUSAL_ATTENTION:
        q, k_, v = (torch.randn(bsz, heads, seq, dim, dtype=dtype, device=device, requires_grad=True)
                    for _ in range(3))
        grad = torch.randn(bsz, heads, seq, dim, dtype=dtype, device=device)

        def forward():
            return F.scaled_dot_product_attention(q, k_, v, is_causal=True)

        def both():
            torch.autograd.grad(forward(), (q, k_, v), grad)

        fwd = _time_s(forward, device, warmup=warmup, iters=iters)
        bwd = max(_time_s(both, device, warmup=warmup, iters=iters) - fwd, 1e-9)
        counted = 4.0 * bsz * heads * seq * seq * dim  # flop_counter's forward figure (causal counted full)
        moved = 2.0 * 4 * bsz * heads * seq * dim
        for kind, flops, measured in (("causal attention fwd", counted, fwd),
                                      ("causal attention bwd", 2.5 * counted, bwd)):
            rows.append({"kind": kind, "shape": [bsz, heads, seq, dim], "flops": flops, "measured_s": measured,
                         "measured_tflops": flops / 2 / measured / 1e12,  # FlashAttention's convention: half counted
                         **{f"predicted_s_{name}": kernel_time_s(kind="causal_attention", flops=flops,
                                                                  bytes_moved=moved, device=spec, dtype="bf16")
                            for name, spec in specs.items()}})
    return rows


def _sustained(device: torch.device, shape: tuple[int, int, int], seconds: float) -> dict:
    """Seconds per call of one GEMM run back to back for ``seconds``: the median of its first 20 calls
    and of its last 20 (each timed alone with CUDA events), and their ratio."""
    m, n, k = shape
    a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    b = torch.randn(k, n, dtype=torch.bfloat16, device=device)
    first = _time_s(lambda: torch.mm(a, b), device, warmup=2, iters=20)
    state = {"first": gpu_blocks.gpu_state(device)}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            torch.mm(a, b)
        _sync(device)
    last = _time_s(lambda: torch.mm(a, b), device, warmup=0, iters=20)
    state["last"] = gpu_blocks.gpu_state(device)
    flops = 2.0 * m * n * k
    return {"shape": [m, n, k], "seconds": seconds, "first_s": first, "last_s": last, "last_over_first": last / first,
            "gpu_state": state,
            "first_tflops": flops / first / 1e12, "last_tflops": flops / last / 1e12}


def run_model(device: torch.device, cluster: str, *, tiny: bool, plan_file: str | None, steps: int,
              dump_dir: Path | None = None) -> dict:
    """(a): parallelize a GPT in bf16 mixed at world size 1; predicted vs measured."""
    import gpt

    import autopar

    size, batch, seq = ("tiny", 4, 32) if tiny else ("1.3b", 8, 1024)
    t0 = time.perf_counter()
    model, inputs, loss_fn, target = gpt.build(size=size, batch=batch, seq=seq, device="cpu", dtype="fp32")
    built_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = lambda params: torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")  # noqa: E731
    pm = autopar.parallelize(model, cluster=cluster, loss_fn=loss_fn, optimizer=optimizer, plan=plan_file,
                             device=device.type, precision=None if plan_file else "bf16-mixed",
                             fixed=None if plan_file else {"microbatches": 1})
    t0 = time.perf_counter()
    try:
        first_loss = pm.train_step(inputs, target)  # plans, traces, shards, compiles, then one step
    except Exception:  # keep the programs that failed, to read them where there is no GPU
        if dump_dir is not None:
            for name in ("step_program", "gm"):
                if (gm := getattr(pm, name, None)) is not None:
                    (dump_dir / f"{name}.py").write_text(gm.code)
        raise
    _sync(device)
    first_s = time.perf_counter() - t0
    pm.train_step(inputs, target)  # warm-up
    _sync(device)
    pm.peak_memory_bytes(reset=True)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(pm.train_step(inputs, target))  # returns a float: the step is synchronised
        _sync(device)
        times.append(time.perf_counter() - t0)
    measured_step = sorted(times)[len(times) // 2]
    predicted = pm.plan.predicted
    peak = pm.peak_memory_bytes()
    state = pm.memory_bytes()
    flops = predicted["model_flops_per_step"]
    return {
        "model": f"gpt {size}", "n_params": n_params, "batch": batch, "seq": seq, "cluster": cluster,
        "precision": pm.plan.model.get("precision"), "plan_mesh": pm.plan.mesh, "zero": pm.plan.zero,
        "recompute": pm.plan.recompute, "microbatches": pm.plan.schedule["microbatches"],
        "build_model_s": built_s, "first_step_s": first_s, "first_loss": first_loss, "losses": losses,
        "predicted_step_s": predicted["step_time_s"], "measured_step_s": measured_step,
        "measured_over_predicted_step": measured_step / predicted["step_time_s"],
        "predicted_peak_bytes": predicted["peak_memory_bytes"], "measured_peak_bytes": peak,
        "measured_over_predicted_peak": peak / predicted["peak_memory_bytes"],
        "peak_source": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "tracked runtime buffers",
        "state_bytes": {"params": state.params, "grads": state.grads, "optimizer": state.optimizer},
        "predicted_state_bytes": {k: sum(st["predicted"]["memory_bytes"][k] for st in pm.plan.stages)
                                  for k in ("params", "grads", "optimizer")},
        "model_flops_per_step": flops, "measured_tflops": flops / measured_step / 1e12,
    }


def _part(result: dict, key: str, fn) -> bool:
    """``result[key] = fn()``; on an exception record it under ``key + "_error"`` and go on (one GPU
    session should give every answer it can)."""
    import traceback

    try:
        result[key] = fn()
        return True
    except Exception as e:
        result[f"{key}_error"] = f"{type(e).__name__}: {e}"
        result[f"{key}_traceback"] = traceback.format_exc()
        print(f"{key} failed: {type(e).__name__}: {str(e)[:2000]}", file=sys.stderr)
        return False
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _out_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return ROOT / "bench" / "gpu_check.json"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny GPT and tiny shapes (for --device cpu)")
    p.add_argument("--out", help="JSON file for the figures")
    p.add_argument("--plan", help="a plan file to run instead of planning")
    p.add_argument("--steps", type=int, default=5, help="timed training steps (after one warm-up)")
    p.add_argument("--skip-model", action="store_true", help="only calibrate the kernels")
    p.add_argument("--attention-backend", choices=("default", "flash", "cudnn", "efficient"), default="default",
                   help="SDPA backend of the kernels and blocks (torch.nn.attention.sdpa_kernel); default: torch's "
                        "choice, which (a) always runs with")
    p.add_argument("--hot", type=float, default=0.0, metavar="S",
                   help="first run a GEMM back to back for S seconds, so that every figure is at sustained clocks")
    p.add_argument("--sustain-step", type=float, default=0.0, metavar="S",
                   help="after timing each deepest block model, run its step S seconds and time it again")
    p.add_argument("--compiled-blocks", action="store_true",
                   help="last, the Llama blocks again with each block through torch.compile")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_check.py needs a CUDA GPU (torch.cuda.is_available() is False); run it on a GPU "
              "machine, or dry-run it on CPU with --device cpu --tiny", file=sys.stderr)
        return 2
    from autopar.cost.devices import lookup_device

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    out = _out_path(args.out)
    if args.device == "cuda":
        name = torch.cuda.get_device_name(device)
        catalog = "H200" if "H200" in name else "H100"
        specs = {catalog: lookup_device(catalog), **({"H100": lookup_device("H100")} if catalog != "H100" else {})}
        cluster = f"1x1x{catalog}"
    else:
        name, specs, cluster = "cpu", {"cpu": lookup_device("cpu")}, "1x1xcpu"
    _single_rank_env()
    stub = _without_ortools() if args.plan is None else False
    result = {"device": name, "torch": torch.__version__, "cluster": cluster,
              "plan_source": args.plan or ("world size 1 without OR-tools: first allowed candidate of every op" if stub
                                           else "autopar planner (OR-tools)")}
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after each part: a run cut short by its time limit keeps what it measured
        result["wall_s"] = time.perf_counter() - t0
        out.write_text(json.dumps(result, indent=1, sort_keys=True, default=str) + "\n")

    result["attention_backend"] = args.attention_backend
    backend_only = contextlib.ExitStack()  # (b) and (c) run under the backend asked for; (a) as torch chooses
    if args.attention_backend != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION}[args.attention_backend]
        backend_only.enter_context(sdpa_kernel(backend))
    if args.hot > 0:
        result["hot_start"] = _sustained(device, (TINY_SUSTAINED if args.tiny else SUSTAINED)[0], args.hot)
    result["kernels"] = calibrate(device, specs, tiny=args.tiny)
    save()
    failed = not _part(result, "blocks", lambda: gpu_blocks.blocks(device, specs, tiny=args.tiny, time_s=_time_s,
                                                                   sustain_s=args.sustain_step))
    save()
    failed |= not _part(result, "ring", lambda: gpu_ring.ring_steps(device, specs, tiny=args.tiny, time_s=_time_s))
    save()
    failed |= not _part(result, "cp_op", lambda: gpu_ring.autopar_op(device, tiny=args.tiny, time_s=_time_s))
    save()
    backend_only.close()
    if not args.skip_model:
        failed |= not _part(result, "model", lambda: run_model(device, cluster, tiny=args.tiny, plan_file=args.plan,
                                                               steps=args.steps, dump_dir=out.parent))
        save()
    if args.compiled_blocks:
        failed |= not _part(result, "blocks_compiled", lambda: gpu_blocks.blocks(
            device, specs, tiny=args.tiny, time_s=_time_s, compiled=True))
        save()
    m = result.get("model")
    if m:
        print(f"{m['model']} ({m['n_params'] / 1e9:.2f}B params, {m['precision']}) on {name}: step "
              f"{m['measured_step_s'] * 1e3:.1f} ms measured vs {m['predicted_step_s'] * 1e3:.1f} ms predicted "
              f"(x{m['measured_over_predicted_step']:.2f}); peak {m['measured_peak_bytes'] / 2**30:.2f} GiB measured "
              f"vs {m['predicted_peak_bytes'] / 2**30:.2f} GiB predicted; {m['measured_tflops']:.1f} TFLOP/s")
    for r in result["kernels"]["rows"]:
        ratios = ", ".join(f"{k.removeprefix('measured_over_predicted_')} x{v:.2f}" for k, v in r.items()
                           if k.startswith("measured_over_predicted_") and math.isfinite(v))
        what = f"{r['kind']} {r.get('model', '')} {r.get('role', '')}".strip()
        print(f"  {what:<36} {str(tuple(r['shape'])):<24} {r['measured_tflops']:8.1f} TFLOP/s; measured/predicted: "
              f"{ratios}")
    sus = result["kernels"]["sustained"]
    print(f"  sustained {tuple(sus['shape'])} for {sus['seconds']:g} s: {sus['first_tflops']:.1f} -> "
          f"{sus['last_tflops']:.1f} TFLOP/s (last/first time x{sus['last_over_first']:.3f})")
    for model, b in [(m + tag, b) for key, tag in (("blocks", ""), ("blocks_compiled", " compiled"))
                     for m, b in result.get(key, {}).items()]:
        if "error" in b:
            print(f"  {model} blocks: {b['error'][:200]}")
            continue
        sm = b["summary"]
        ratios = ", ".join(f"{k.removeprefix('block_measured_over_predicted_')} x{v:.2f}" for k, v in sm.items()
                           if k.startswith("block_measured_over_predicted_"))
        print(f"  {model} block: forward {sm['block_forward_s'] * 1e3:.1f} ms, backward "
              f"{sm['block_backward_s'] * 1e3:.1f} ms; measured/predicted: {ratios or 'no prediction'}")
    for r in result.get("ring", {}).get("rows", []):
        pred = "; ".join(f"{n.removeprefix('predicted_')} {p['forward_s'] * 1e3:.1f} + {p['backward_s'] * 1e3:.1f} ms"
                         for n, p in r.items() if n.startswith("predicted_"))
        print(f"  ring cp={r['cp']} rank {r['rank']}: forward {r['forward_s'] * 1e3:.1f} ms (SDPA alone "
              f"{r['sdpa_forward_s'] * 1e3:.1f}), backward {r['backward_s'] * 1e3:.1f} ms (SDPA alone "
              f"{r['sdpa_backward_s'] * 1e3:.1f}); predicted {pred}")
    if "cp_op" in result:
        c = result["cp_op"]
        errs = ", ".join(f"{k} {v:.1e}" for k, v in c["relative_error"].items())
        print(f"  cp op ({c['kernel']}): forward {c['autopar_forward_s'] * 1e3:.1f} ms (SDPA "
              f"{c['sdpa_forward_s'] * 1e3:.1f}), forward + backward {c['autopar_forward_backward_s'] * 1e3:.1f} ms "
              f"(SDPA {c['sdpa_forward_backward_s'] * 1e3:.1f}); error against SDPA: {errs}")
        for key in ("native_gqa_relative_error", "cudnn"):
            if key in c:
                print(f"  cp op, {key}: {c[key]}")
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

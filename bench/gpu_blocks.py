"""Whole transformer blocks of the fidelity rows, timed on a GPU against autopar's per-op prices.

Part (c) of ``bench/gpu_check.py``. The kernel rows there time GEMMs and attention alone; the
Llama 3.1 8B fidelity rows are 19-29% optimistic while Qwen3-32B's are within 10%, and a block
also runs memory-bound ops (fp32 RMSNorm, rotary, SwiGLU's pointwise, repeat_kv, the loss
over a 128k vocabulary) whose prices come from bytes alone. So each model is built at one and
at three layers at its row's micro-batch (Llama 3.1 8B: 2 x 8192 tokens; Qwen3-32B: 2 x 4096),
in bf16, eager, and its forward and forward+backward are timed with CUDA events (the
difference of the two depths is one block; the one-layer model less one block is the
embedding, head and loss). One three-layer step is profiled and its kernel time summed by
kind (GEMM, attention, other), next to the sums of ``annotate_cost``'s per-node prices of the
same model traced on meta (no repeat collapsing), by kind and by forward/backward.

Predicted figures need only the CPU (``predicted(...)``); measured ones a GPU (``measured(...)``;
``--device cpu --tiny`` runs the same code on a tiny Llama).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

MODELS = {"llama3-8b": (2, 8192), "qwen3-32b": (2, 4096)}
"""Model -> (micro-batch, sequence) of its fidelity rows (bench/fidelity.py)."""
TINY_MODELS = {"llama-tiny": (2, 64)}
DEPTHS = (1, 3)
GEMM_WORDS = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "gemv", "matmul")
ATTENTION_WORDS = ("flash", "fmha", "attention", "attn", "sdpa")


def build(model: str, n_layers: int, device: str):
    """``(module, call)``: the model with ``n_layers`` blocks (bf16; initialised unless on meta) and
    a function running its loss on one micro-batch (the example inputs for tracing on meta)."""
    from fidelity import qwen3_32b  # (imported late: the GPU machine stands OR-tools in first)
    from planner_speed import _example

    batch, seq = (TINY_MODELS | MODELS)[model]
    if model.startswith("llama"):
        size = "8b" if model == "llama3-8b" else "tiny"
        m, (tokens,), loss_fn, target = _example("llama").build(size=size, batch=batch, seq=seq, n_layers=n_layers,
                                                                device=device, dtype="bf16")
        return m, {"inputs": (tokens,), "loss_fn": loss_fn, "target": target,
                   "run": lambda: loss_fn(m(tokens), target)}
    m, inputs, _, _ = qwen3_32b(batch, seq, n_layers=n_layers, device=device)
    if device != "meta":
        ids = torch.randint(0, m.config.vocab_size, (batch, seq), device=device)
        inputs = {"input_ids": ids, "labels": ids}
    return m, {"inputs": inputs, "loss_fn": None, "target": None, "run": lambda: m(**inputs).loss}


def predicted(model: str, n_layers: int, devices: dict, *, compiled: bool = False) -> dict:
    """Sums of autopar's per-node prices (seconds) of the model's joint graph, by device name, role
    (forward/backward) and kernel kind; and the graph's FLOPs. ``compiled``: each block's
    memory-bound ops priced as TorchInductor fuses them (:mod:`autopar.passes.fuse`)."""
    from autopar.passes import meta_keys as mk
    from autopar.passes.annotate import annotate_cost, kernel_of
    from autopar.passes.fuse import fuse_memory_bound
    from autopar.passes.layers import group_layers
    from autopar.passes.trace import trace_joint
    from fidelity import _in_a_block

    m, spec = build(model, n_layers, "meta")
    gm = trace_joint(m, spec["inputs"], loss_fn=spec["loss_fn"], example_target=spec["target"],
                     collapse_repeats=False)
    out = {"flops": 0.0}
    for name, device in devices.items():
        annotate_cost(gm, device=device)
        if compiled:
            fuse_memory_bound(group_layers(gm), device=device, compiled=_in_a_block)
        sums = {}
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            role = node.meta[mk.TRACE].role.value
            kind = kernel_of(node)[0].replace("causal_", "")
            key = f"{role} {kind}"
            sums[key] = sums.get(key, 0.0) + node.meta[mk.COST].time_s
            if name == next(iter(devices)):
                out["flops"] += node.meta[mk.COST].flops
        out[name] = {**dict(sorted(sums.items())), "total": sum(sums.values())}
    return out


def _kind(kernel: str) -> str:
    name = kernel.lower()
    if any(w in name for w in ATTENTION_WORDS):
        return "attention"
    return "gemm" if any(w in name for w in GEMM_WORDS) else "other"


def _profile(run, device: torch.device) -> dict:
    """Kernel time of one forward+backward by kind, and its 12 longest kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run().backward()
        torch.cuda.synchronize(device)
    by_name = {}
    for evt in prof.events():
        if evt.device_type.name == "CUDA":
            by_name[evt.name] = by_name.get(evt.name, 0.0) + evt.device_time * 1e-6
    kinds = {}
    for name, s in by_name.items():
        kinds[_kind(name)] = kinds.get(_kind(name), 0.0) + s
    top = sorted(by_name.items(), key=lambda kv: -kv[1])
    return {"by_kind_s": kinds, "total_s": sum(by_name.values()), "top": [[n[:160], s] for n, s in top]}


def measured(model: str, n_layers: int, device: torch.device, *, time_s, compiled: bool = False,
             sustain_s: float = 0.0) -> dict:
    """Forward and forward+backward seconds of one micro-batch (median, CUDA events on a GPU),
    the peak memory, and on a GPU a profile of one step by kernel kind (every kernel, longest
    first). ``compiled``: each block through ``torch.compile(fullgraph=True)``, as torchtitan's
    ``apply_compile``. ``sustain_s``: then steps run back to back that long, and the step is timed
    again (clocks under sustained load, as in training)."""
    m, spec = build(model, n_layers, str(device))
    if compiled:
        for i, layer in enumerate(m.layers):
            m.layers[i] = torch.compile(layer, fullgraph=True)
    run = spec["run"]
    params = list(m.parameters())

    def step():
        for p in params:
            p.grad = None
        run().backward()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    fwd = time_s(run, device, warmup=2, iters=5)
    both = time_s(step, device, warmup=1, iters=5)
    out = {"forward_s": fwd, "forward_backward_s": both, "backward_s": both - fwd}
    if device.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        for p in params:
            p.grad = None
        out["profile"] = _profile(run, device)
    if sustain_s > 0:
        end = time.perf_counter() + sustain_s
        while time.perf_counter() < end:
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        out["sustained"] = {"seconds": sustain_s, "forward_backward_s": time_s(step, device, warmup=0, iters=5),
                            **gpu_state(device)}
    return out


def gpu_state(device: torch.device) -> dict:
    """SM clock (MHz), power draw (W) and temperature (C) now, from NVML (nvidia-ml-py); {} off a GPU
    or without it."""
    if device.type != "cuda":
        return {}
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        return {"sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                "temperature_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)}
    except Exception as e:  # a reading, not a result: say why it is missing
        return {"nvml_error": f"{type(e).__name__}: {e}"}


def blocks(device: torch.device, specs: dict, *, tiny: bool, time_s, compiled: bool = False,
           sustain_s: float = 0.0) -> dict:
    """Part (c) of gpu_check: for each model and depth, measured and predicted; then per block
    (three layers less one, halved) and the rest (one layer less one block). ``compiled``: the
    Llama models only (the compiled rows that are off), blocks compiled."""
    out = {}
    for model in TINY_MODELS if tiny else MODELS:
        if compiled and not model.startswith("llama"):
            continue
        try:
            out[model] = _model_blocks(model, device, specs, time_s, compiled, sustain_s)
        except Exception as e:  # the next model's figures are still worth having
            out[model] = {"error": f"{type(e).__name__}: {str(e)[:1000]}"}
            print(f"blocks of {model} failed: {out[model]['error']}", file=sys.stderr)
    return out


def _model_blocks(model: str, device: torch.device, specs: dict, time_s, compiled: bool, sustain_s: float) -> dict:
    rows = {}
    for n in DEPTHS:
        t0 = time.perf_counter()
        row = {"measured": measured(model, n, device, time_s=time_s, compiled=compiled,
                                    sustain_s=sustain_s if n == DEPTHS[-1] else 0.0)}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            row["predicted"] = predicted(model, n, specs, compiled=compiled)
        except Exception as e:  # measured figures are the scarce ones: keep them
            row["predicted_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        row["wall_s"] = time.perf_counter() - t0
        rows[n] = row
    lo, hi = rows[DEPTHS[0]], rows[DEPTHS[-1]]
    span = DEPTHS[-1] - DEPTHS[0]
    summary = {}
    for key in ("forward_s", "backward_s", "forward_backward_s"):
        block = (hi["measured"][key] - lo["measured"][key]) / span
        summary[f"block_{key}"] = block
        summary[f"rest_{key}"] = lo["measured"][key] - block
    if "predicted" in lo and "predicted" in hi:
        for name in specs:
            block = (hi["predicted"][name]["total"] - lo["predicted"][name]["total"]) / span
            summary[f"block_predicted_s_{name}"] = block
            summary[f"block_measured_over_predicted_{name}"] = summary["block_forward_backward_s"] / block
            rest = lo["predicted"][name]["total"] - block
            summary[f"rest_predicted_s_{name}"] = rest
        summary["block_flops"] = (hi["predicted"]["flops"] - lo["predicted"]["flops"]) / span
        summary["block_measured_tflops"] = summary["block_flops"] / summary["block_forward_backward_s"] / 1e12
    return {"depths": rows, "summary": summary}


def reprice(path: Path) -> list[tuple[str, str, float, float]]:
    """Every block measured in ``path`` (``bench/gpu_check.py``'s JSON, one run or a ``{"runs": ...}``
    record) against the current prices on an H200, with the attention efficiency of the kernel its
    profile shows (cuDNN's or FlashAttention-2's): (run, model, measured s, predicted s) per block."""
    import json

    from autopar.cost.devices import (HOPPER_CUDNN_ATTENTION_EFFICIENCY, HOPPER_FLASH2_ATTENTION_EFFICIENCY,
                                      lookup_device)

    data = json.loads(Path(path).read_text())
    runs = data.get("runs", {"run": data})
    rows, prices = [], {}
    for run_name, run in runs.items():
        for key, compiled in (("blocks", False), ("blocks_compiled", True)):
            for model, b in run.get(key, {}).items():
                if "summary" not in b:
                    continue
                kernels = [name for name, _ in b["depths"][str(DEPTHS[-1])]["measured"]["profile"]["top"]]
                cudnn = any("cudnn" in k and "sdpa" in k for k in kernels)
                eff = HOPPER_CUDNN_ATTENTION_EFFICIENCY if cudnn else HOPPER_FLASH2_ATTENTION_EFFICIENCY
                device = lookup_device("H200").with_overrides(attention_efficiency=eff)
                for n in DEPTHS:
                    if (model, n, compiled, eff) not in prices:
                        prices[model, n, compiled, eff] = predicted(model, n, {"H200": device},
                                                                    compiled=compiled)["H200"]["total"]
                block = (prices[model, DEPTHS[-1], compiled, eff] - prices[model, DEPTHS[0], compiled, eff]) / (
                    DEPTHS[-1] - DEPTHS[0])
                label = f"{model}{' compiled' if compiled else ''} ({'cuDNN' if cudnn else 'FlashAttention-2'})"
                rows.append((run_name, label, b["summary"]["block_forward_backward_s"], block))
    return rows


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    parser = argparse.ArgumentParser(description="Blocks recorded by bench/gpu_check.py against the current prices")
    parser.add_argument("json", nargs="?", default=str(ROOT / "bench" / "gpu_check_h200.json"))
    for run_name, label, measured_s, predicted_s in reprice(Path(parser.parse_args().json)):
        print(f"{run_name:<22} {label:<40} block {measured_s * 1e3:6.1f} ms measured, {predicted_s * 1e3:6.1f} ms "
              f"predicted: x{measured_s / predicted_s:.2f}")

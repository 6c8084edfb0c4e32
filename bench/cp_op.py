"""autopar's cp attention op on this machine's fused kernel against the explicit-matmul blocks it had.

    PYTHONPATH=. python bench/cp_op.py                  # 4096 tokens, 8 query / 2 K/V heads, dim 64
    PYTHONPATH=. python bench/cp_op.py --tokens 8192 --repeat 5

Runs ``autopar.context.cp_attention`` at cp 1 (its (query chunk, key chunk) pairs merged by
log-sum-exp, as every cp rank computes its blocks), forward and backward, fp32, causal, once per
kernel of :mod:`autopar.context_blocks` ("cpu_flash" on CPU, or "cuda_flash" with ``--device cuda
--dtype bf16``; "exact": the explicit matmuls, which hold each pair's score matrix), each in its
own process so that the peak resident memory is its own. Prints the median of the repeats (the
first run, a warm-up, left out) and the ratio.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def measure(kernel: str, tokens: int, repeat: int, device: str, dtype: str) -> dict:
    from autopar import context_blocks
    from autopar.context import cp_attention

    if kernel == "exact":
        context_blocks.kernel_for = lambda q: "exact"
    gen = torch.Generator(device=device).manual_seed(0)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]

    def rand(h):
        return torch.randn(1, h, tokens, 64, generator=gen, device=device).to(dt).requires_grad_()

    q, k, v = rand(8), rand(2), rand(2)
    grad = torch.randn(1, 8, tokens, 64, generator=gen, device=device).to(dt)
    times = []
    for _ in range(repeat + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out, _ = cp_attention(q, k, v, True, 0.125, 1, "", "ring", True)
        torch.autograd.grad(out, (q, k, v), grad)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"kernel": context_blocks.kernel_for(q), "median_s": statistics.median(times[1:]), "peak_bytes": peak}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--one", choices=("fused", "exact"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.tokens, args.repeat, args.device, args.dtype)))
        return 0
    rows = {}
    for kernel in ("fused", "exact"):
        cmd = [sys.executable, __file__, "--one", kernel, "--tokens", str(args.tokens), "--repeat", str(args.repeat),
               "--device", args.device, "--dtype", args.dtype]
        rows[kernel] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    for name, r in rows.items():
        print(f"{name:<6} ({r['kernel']}): forward + backward {r['median_s']:.3f} s (median of {args.repeat}), "
              f"peak {r['peak_bytes'] / 2**20:.0f} MiB")
    print(f"fused / exact: time {rows['fused']['median_s'] / rows['exact']['median_s']:.2f}, "
          f"peak {rows['fused']['peak_bytes'] / rows['exact']['peak_bytes']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

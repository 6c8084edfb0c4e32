"""autopar's runtime against hand-written PyTorch, same model, same world, interleaved.

    python bench/runtime_overhead.py                      # 2 gloo ranks on CPU, Llama "small"
    python bench/runtime_overhead.py --steps 20 --size tiny

Pairs (autopar plan pinned with fixed= | the hand-written baseline):
  DP      {"dp": 2, "zero": 0}             | DistributedDataParallel
  ZeRO-3  {"dp": 2, "zero": 3}             | fully_shard (FSDP2) per block and root
  TP      {"tp": 2} (Megatron from the MIP) | parallelize_module: Colwise wq/wk/wv/w1/w3,
                                              Rowwise wo/w2 (torchtitan's Llama plan)
and one row of autopar against itself, the same ZeRO-3 plan run twice:
  overlap      parallelize(...)                | parallelize(..., overlap=False): every
                                                 collective waited for as soon as issued
Each step of every variant runs in turn (round robin), between barriers, so machine
noise hits all variants alike; the first steps are warm-up. Reported: median step
time per variant and the ratio autopar / hand-written (1.00 = equal, target <= 1.10).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from autopar.testing import spawn_world, tp_friendly_cluster  # noqa: E402


def _adam(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _handwritten(kind, model, mesh1d):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    if kind == "DP":
        return DistributedDataParallel(model), True
    if kind == "ZeRO-3":
        for block in model.layers:
            fully_shard(block, mesh=mesh1d)
        fully_shard(model, mesh=mesh1d)
        return model, True
    tp = dist.get_world_size()
    for block in model.layers:
        block.attention.n_heads //= tp
        block.attention.n_kv_heads //= tp
        parallelize_module(block, mesh1d, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()})
    return model, False


def _bench(rank, world, size, batch, seq, steps, warmup):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    import llama

    dist.init_process_group("gloo")
    mesh1d = init_device_mesh("cpu", (world,))
    variants = {}
    one = {"microbatches": 1}  # the hand-written versions run the batch in one go too
    fixed = {"DP": ({"dp": world, "zero": 0, **one}, f"1x{world}xcpu"),
             "ZeRO-3": ({"dp": world, "zero": 3, **one}, f"1x{world}xcpu"),
             "TP": ({"tp": world, **one}, tp_friendly_cluster(f"1x{world}xcpu"))}
    data = None
    for kind, (fix, cluster) in fixed.items():
        torch.manual_seed(0)
        model, inputs, loss_fn, target = llama.build(size=size, batch=batch, seq=seq)
        data = (inputs, target, loss_fn)
        pm = autopar.parallelize(model, cluster=cluster, loss_fn=loss_fn, optimizer=_adam, fixed=fix)
        pm.train_step(inputs, target)  # compile (trace, plan) outside the timing
        torch.manual_seed(0)
        ref, _, _, _ = llama.build(size=size, batch=batch, seq=seq)
        hand, split_batch = _handwritten(kind, ref, mesh1d)
        variants[f"autopar {kind}"] = ("autopar", pm)
        variants[f"torch {kind}"] = ("torch", (hand, _adam(hand.parameters()), split_batch))
        if kind == "ZeRO-3":  # the same plan without overlap: the runtime waits on each collective at once
            torch.manual_seed(0)
            model, _, _, _ = llama.build(size=size, batch=batch, seq=seq)
            serial = autopar.parallelize(model, cluster=cluster, loss_fn=loss_fn, optimizer=_adam, plan=pm.plan,
                                         overlap=False)
            serial.train_step(inputs, target)
            variants["autopar ZeRO-3 overlap=False"] = ("autopar", serial)
    inputs, target, loss_fn = data
    times = {name: [] for name in variants}
    for step in range(warmup + steps):
        for name, (who, obj) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            if who == "autopar":
                obj.train_step(inputs, target)
            else:
                hand, opt, split = obj
                x, y = (inputs[0].chunk(world)[rank], target.chunk(world)[rank]) if split else (inputs[0], target)
                opt.zero_grad()
                loss_fn(hand(x), y).backward()
                opt.step()
            dist.barrier()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    med = spawn_world(_bench, args.world, args.size, args.batch, args.seq, args.steps, args.warmup,
                      timeout_s=3600)[0]
    print(f"Llama {args.size}, batch {args.batch} x seq {args.seq}, {args.world} gloo ranks on CPU, "
          f"median of {args.steps} interleaved steps")
    print("| pair | autopar step | hand-written step | ratio |")
    print("|---|---|---|---|")
    for kind in ("DP", "ZeRO-3", "TP"):
        a, t = med[f"autopar {kind}"], med[f"torch {kind}"]
        print(f"| {kind} | {a * 1e3:.1f} ms | {t * 1e3:.1f} ms | {a / t:.2f} |")
    a, t = med["autopar ZeRO-3"], med["autopar ZeRO-3 overlap=False"]
    print(f"| ZeRO-3 overlap vs overlap=False (same plan) | {a * 1e3:.1f} ms | {t * 1e3:.1f} ms | {a / t:.2f} |")


if __name__ == "__main__":
    main()

"""Train a small GPT with a plan autopar chooses by itself, under torchrun.

    torchrun --nproc-per-node 4 examples/train.py --cluster 1x4xcpu
    torchrun --nproc-per-node 2 examples/train.py --cluster 1x2xcpu --steps 50 --fix zero=3

The data is a fixed synthetic "language": each sequence counts upward from a
random start modulo the vocabulary, so the next token is predictable and the loss
falls fast from ln(vocab). Every rank builds the same model from the same seed and
passes the same global batch; autopar gives each data-parallel rank its slice.
Rank 0 prints the plan, a progress bar and the loss.
"""

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import autopar  # noqa: E402
import autopar.progress  # noqa: E402
import gpt  # noqa: E402


def batches(*, batch: int, seq: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)  # (B, 1)
        tokens = (start + torch.arange(seq + 1)) % vocab  # (B, T+1)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="1x4xcpu")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="seconds a rank waits on a dead or stuck peer before it stops with an error naming it")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    fixed = dict(kv.split("=", 1) for kv in args.fix)
    if rank == 0:
        autopar.progress.enable()  # "autopar: planning GPT for 1x4xcpu ..." while the first step compiles

    torch.manual_seed(0)
    model, _, loss_fn, _ = gpt.build(size=args.size, batch=args.batch, seq=args.seq)
    vocab = model.config.vocab_size if hasattr(model, "config") else 256
    pm = autopar.parallelize(model, cluster=args.cluster, loss_fn=loss_fn, fixed=fixed or None,
                             optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr), timeout_s=args.timeout_s)
    data = batches(batch=args.batch, seq=args.seq, vocab=vocab, seed=1)
    first = None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens, target = next(data)
        loss = pm.train_step((tokens,), target)
        if step == 1 and rank == 0:
            print(pm.plan.summary(), flush=True)
            print(f"loss at start {loss:.3f} (ln vocab = {math.log(vocab):.3f})", flush=True)
        first = loss if first is None else first
        if rank == 0:
            done = int(30 * step / args.steps)
            rate = step / (time.perf_counter() - start)
            print(f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{args.steps} loss {loss:.4f} "
                  f"({rate:.1f} steps/s)", end="", flush=True)
    if rank == 0:
        print(f"\nloss {first:.3f} -> {loss:.3f}")


if __name__ == "__main__":
    main()

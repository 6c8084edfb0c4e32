"""Train a small GPT with a plan autopar chooses by itself, under torchrun.

    torchrun --nproc-per-node 4 examples/train.py --cluster 1x4xcpu
    torchrun --nproc-per-node 2 examples/train.py --cluster 1x2xcpu --steps 50 --fix zero=3
    torchrun --nproc-per-node 4 examples/train.py --cluster 1x4xcpu --size 350m --meta --fix zero=3 --fix dp=4
    torchrun --nproc-per-node 2 examples/train.py --cluster 1x2xcpu --precision bf16-mixed --fix zero=3
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/train.py --cluster 1x2xcpu \
        --checkpoint-dir ckpt --checkpoint-every 10     # a killed rank restarts the job from ckpt/

The data is a fixed synthetic "language": each sequence counts upward from a
random start modulo the vocabulary, so the next token is predictable and the loss
falls fast from ln(vocab). Every rank builds the same model from the same seed and
passes the same global batch; autopar gives each data-parallel rank its slice.
Rank 0 prints the plan, a progress bar and the loss.

With ``--checkpoint-dir`` the run saves a sharded checkpoint every
``--checkpoint-every`` steps (with the data position) and, when it starts, resumes
from the newest complete one there: under ``torchrun --max-restarts K`` a job whose
rank was killed restarts and continues where its last checkpoint left it.
"""

import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import autopar  # noqa: E402
import autopar.progress  # noqa: E402
import gpt  # noqa: E402
from autopar.precision import PRECISIONS  # noqa: E402


class Batches:
    """The synthetic batches, with a data position a checkpoint saves (``state_dict``)."""

    def __init__(self, *, batch: int, seq: int, vocab: int, seed: int):
        self.batch, self.seq, self.vocab = batch, seq, vocab
        self.g = torch.Generator().manual_seed(seed)
        self.drawn = 0

    def __next__(self):
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=self.g)  # (B, 1)
        tokens = (start + torch.arange(self.seq + 1)) % self.vocab  # (B, T+1)
        self.drawn += 1
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"rng": self.g.get_state(), "drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.g.set_state(state["rng"])
        self.drawn = state["drawn"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="1x4xcpu")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--meta", action="store_true",
                        help="build the model on meta: each rank materialises only its own shards (fp32)")
    parser.add_argument("--precision", choices=PRECISIONS,
                        help="fp32 masters and optimizer state with bf16 compute (bf16-mixed; gradients reduced in "
                             "fp32, or in bf16 with bf16-mixed-bf16-reduce), or fp32 throughout; default: "
                             "bf16-mixed on a GPU cluster, the model's dtype (fp32) on a cpu one")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="seconds a rank waits on a dead or stuck peer before it stops with an error naming it")
    parser.add_argument("--checkpoint-dir", help="save checkpoints here, and resume from the newest one at start")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="save every N steps")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints kept in --checkpoint-dir")
    parser.add_argument("--kill-at-step", type=int, default=0, metavar="N",
                        help="(for restart tests) on the job's first attempt, the last rank kills itself with "
                             "SIGKILL after step N")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    fixed = dict(kv.split("=", 1) for kv in args.fix)
    if rank == 0:
        autopar.progress.enable()  # "autopar: planning GPT for 1x4xcpu ..." while the first step compiles

    torch.manual_seed(0)
    if args.meta:  # no rank builds the whole model: each initialises its own pieces, module by module
        model, _, loss_fn, _ = gpt.build(size=args.size, batch=args.batch, seq=args.seq, device="meta", dtype="fp32")
    else:
        model, _, loss_fn, _ = gpt.build(size=args.size, batch=args.batch, seq=args.seq)
    vocab = model.config.vocab_size if hasattr(model, "config") else 256
    pm = autopar.parallelize(model, cluster=args.cluster, loss_fn=loss_fn, fixed=fixed or None,
                             optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr), timeout_s=args.timeout_s,
                             precision=args.precision)
    data = Batches(batch=args.batch, seq=args.seq, vocab=vocab, seed=1)
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    if args.checkpoint_dir:
        from autopar.runtime.checkpoint import latest

        if latest(args.checkpoint_dir) is not None:
            pm.load_checkpoint(args.checkpoint_dir, state={"data": data})
            if rank == 0:
                print(f"resumed from {latest(args.checkpoint_dir)} at step {pm.steps}", flush=True)
    first = None
    start = time.perf_counter()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(pm.steps + 1, args.steps + 1):
        tokens, target = next(data)
        loss = pm.train_step((tokens,), target)
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            pm.save_checkpoint(args.checkpoint_dir, state={"data": data}, keep=args.keep)
        if step == args.kill_at_step and first_attempt and rank == int(os.environ.get("WORLD_SIZE", "1")) - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if first is None and rank == 0:
            print(pm.plan.summary(), flush=True)
            print(f"first step after {time.perf_counter() - start:.1f} s (planning, tracing, sharding included)",
                  flush=True)
            print(f"loss at start {loss:.3f} (ln vocab = {math.log(vocab):.3f})", flush=True)
        first = loss if first is None else first
        if rank == 0:
            done = int(30 * step / args.steps)
            rate = step / (time.perf_counter() - start)
            print(f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{args.steps} loss {loss:.4f} "
                  f"({rate:.1f} steps/s)", end="", flush=True)
    if first is not None and args.meta:  # every rank: its peak resident set (the kernel's high-water mark)
        hwm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                   if line.startswith("VmHWM:")) if Path("/proc/self/status").exists() else 0
        n = sum(p.numel() for p in model.parameters())
        print(f"\nrank {rank}: peak RSS {hwm / 1e9:.2f} GB; one full fp32 AdamW training state is "
              f"{16 * n / 1e9:.2f} GB ({n / 1e6:.0f}M parameters)", flush=True)
    if rank == 0 and first is not None:
        print(f"\nloss {first:.3f} -> {loss:.3f}")
        print(f"final loss {loss!r}", flush=True)


if __name__ == "__main__":
    main()

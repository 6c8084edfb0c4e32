"""Checkpoints survive killed ranks.

1. ``examples/train.py --checkpoint-dir D --checkpoint-every 2`` under ``torchrun
   --max-restarts 1``: the last rank SIGKILLs itself after step 5 (on the first attempt
   only); torchrun restarts both ranks, they resume from step 4's checkpoint (parameters,
   AdamW state, data position) and finish with the same final loss, to the bit, as a run
   that was never interrupted.
2. A rank killed in the middle of a save (inside DCP's write) leaves the half-written
   ``step-N.tmp`` unpublished: the previous checkpoint is still the newest and loads, and
   the surviving rank gets an error instead of hanging.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from autopar.testing import spawn_world

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = str(REPO / "examples")


def _train(tmp_path: Path, name: str, *extra: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", str(REPO / "examples" / "train.py"), "--cluster", "1x2xcpu", "--steps", "6",
           "--batch", "8", "--seq", "16", "--fix", "dp=2", "--fix", "zero=1",
           "--checkpoint-dir", str(tmp_path / name), "--checkpoint-every", "2", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # (a bound against a hang only, as spawn_world's: a normal run takes well under a minute)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _final_loss(out: str) -> float:
    lines = [line for line in out.splitlines() if line.startswith("final loss ")]
    assert len(lines) == 1, out[-2000:]
    return float(lines[0].split()[-1])


def test_killed_rank_restarts_and_finishes_with_the_same_loss(tmp_path):
    whole = _train(tmp_path, "whole")
    killed = _train(tmp_path, "killed", "--kill-at-step", "5")
    assert "resumed" not in whole
    assert "resumed from" in killed and "step-00000004 at step 4" in killed, killed[-2000:]
    assert _final_loss(killed) == _final_loss(whole)


def _die_in_save(rank, world, root):
    sys.path.insert(0, EXAMPLES)
    import autopar
    import gpt
    from autopar.runtime import checkpoint

    torch.manual_seed(0)
    model, inputs, loss_fn, target = gpt.build(size="tiny", batch=8)
    pm = autopar.parallelize(model, cluster="1x2xcpu", loss_fn=loss_fn, fixed={"dp": 2, "zero": 3}, timeout_s=120)
    pm.train_step(inputs, target)
    pm.save_checkpoint(root)
    if rank == 0:  # (a file: tensors returned across processes need the sender alive)
        torch.save(pm.state_dict(), f"{root}/saved.pt")
    else:
        pm.state_dict()
    pm.train_step(inputs, target)
    if rank == 1:
        def dying_save(state_dict, *, storage_writer, **kwargs):  # half a data file, then SIGKILL
            (Path(storage_writer.path) / "__1_0.distcp").write_bytes(b"\0" * 1000)
            os.kill(os.getpid(), signal.SIGKILL)

        checkpoint.dcp.save = dying_save
    try:
        pm.save_checkpoint(root)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_rank_killed_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    from autopar.runtime.checkpoint import export_state_dict, latest

    outcomes = spawn_world(_die_in_save, 2, str(tmp_path), allow_failures=True)
    assert outcomes[1].exitcode == -signal.SIGKILL, outcomes[1]
    error = outcomes[0].value
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    assert error is not None, "rank 0's save returned although rank 1 died in it"
    assert latest(tmp_path).name == "step-00000001"
    assert (tmp_path / "step-00000002.tmp").is_dir() and not (tmp_path / "step-00000002").exists()
    plain = torch.load(export_state_dict(tmp_path, tmp_path / "m.pt"), weights_only=True)
    for k in saved:
        assert torch.equal(plain[k], saved[k]), k

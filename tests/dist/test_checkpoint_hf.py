"""Hugging Face weights (``save_pretrained``, safetensors) into a 4-rank run.

A Llama built from one seed is saved with ``save_pretrained``; every rank builds the same
architecture from another seed, ``parallelize(..., resume_from=DIR)`` copies into each
rank's shards only the slices it owns (tp x dp = 2 x 2, ZeRO-1: row ranges of flat chunks),
and the first step's loss and gradients, and the parameters after it, must be those of
the saved model trained in one process (the ``parallel_compare`` rule).
"""

import sys
from pathlib import Path

import pytest
import torch

from autopar.testing import spawn_world, tp_friendly_cluster
from parallel_compare import Reference, assert_matches, train_judged

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)  # eps: see test_parallel.py


def _first_step(rank, world, weights):
    sys.path.insert(0, EXAMPLES)
    import autopar
    import hf

    saved, inputs, _, _ = hf.build(model="llama", batch=8, seed=0)
    reference = Reference(saved, _optimizer) if rank == 0 else None  # (judged on rank 0: train_judged)
    other, _, _, _ = hf.build(model="llama", batch=8, seed=1)
    pm = autopar.parallelize(other, cluster=tp_friendly_cluster("1x4xcpu"), fixed={"dp": 2, "tp": 2, "zero": 1},
                             optimizer=_optimizer, resume_from=weights)
    raw, losses, grad_err, param_err = train_judged(pm, reference, steps=1, run=lambda pm: pm.train_step(inputs),
                                                    run_reference=lambda ref, like: ref(**like(inputs)).loss)
    return raw, losses, grad_err, param_err, pm.plan.mesh


def test_save_pretrained_weights_load_into_four_ranks(tmp_path):
    sys.path.insert(0, EXAMPLES)
    import hf

    model, *_ = hf.build(model="llama", batch=8, seed=0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert list(tmp_path.glob("*.safetensors"))
    ranks = spawn_world(_first_step, 4, str(tmp_path))
    raw, losses, grad_err, param_err, _ = ranks[0]  # rank 0 trained the reference (train_judged)
    assert len(grad_err) == len(list(model.parameters()))
    assert_matches(losses, grad_err, param_err, "rank 0")
    for rank, (rank_raw, _, _, _, mesh) in enumerate(ranks):
        assert (mesh["dp"], mesh["tp"]) == (2, 2)
        assert rank_raw == raw, f"rank {rank}'s loss {rank_raw} != rank 0's {raw}"

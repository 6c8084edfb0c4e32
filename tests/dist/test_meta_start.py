"""A model started from ``meta`` trains exactly as the same weights started on CPU, and no
rank ever allocates more than its own pieces plus one module.

For each plan (pure DP, ZeRO-3, TP, pp=2 on the GPT example; ZeRO-3 on the Llama example,
whose initialisation is per module: ``Transformer._init_weights`` and RMSNorm's
``reset_parameters``; ep=2 at ZeRO-1 on the MoE example, with an ``init_fn``, where each rank
cuts its half of each stacked expert tensor out of the whole one its module initialises; ep=2
folded over tp=2) on 2 gloo ranks, and ep=4 folded over tp=2 x dp=2 on 4 (each dp pair's half of
the experts, then each tp rank's share of it: a wrong half fails the comparison): the CPU-started
run gets the
model :func:`autopar.materialize` built whole from seed 5; the meta-started run gets the
same model on ``meta`` and ``init_seed=5``, so both start from the same weights and run the
same program; losses, gradients and parameters after 2 AdamW steps must be equal (to fp32
rounding: the runs do the same operations in the same order, so the tolerance is tight, and
one module initialised from a wrong seed or slice differs by O(1) of its values).

Allocations are checked while the meta-started run builds, not only at the end: a
``TorchDispatchMode`` counts every CPU tensor any op creates (each storage once, until it is
freed, :class:`~autopar.runtime.memtrack.LiveBytes`) during the first ``train_step``'s
compile. Its peak must stay below this rank's own parameter pieces plus the buffers plus the
largest module whole (materialisation holds one module at a time) plus a small slack; the
whole model is larger than that bound under ZeRO-3 and pp=2 (the model has 6 blocks of
equal size and a small vocabulary, so no one module dominates). With pp=2 a rank must hold
only its stages' parameters.
"""

import sys
from pathlib import Path

import pytest
import torch

from autopar.testing import spawn_world, tp_only_cluster

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
SEED = 5
CONFIGS = [
    ("dp", "1x2xcpu", {"dp": 2, "zero": 0}),
    ("zero3", "1x2xcpu", {"dp": 2, "zero": 3}),
    ("tp", tp_only_cluster("1x2xcpu"), {"tp": 2}),
    ("pp2", "1x2xcpu", {"pp": 2, "microbatches": 2}),
    ("llama-zero3", "1x2xcpu", {"dp": 2, "zero": 3}),
    # the MoE example under ep=2: each rank keeps its half of each stacked expert tensor, cut out
    # of the whole tensor its module initialises (the rows one process has there)
    ("moe-ep2", "1x2xcpu", {"dp": 2, "ep": 2, "zero": 1, "microbatches": 1}),
    # and folded over tp (etp=1): each tp rank keeps its tp share of every expert, whole experts
    ("moe-fold", tp_only_cluster("1x2xcpu"), {"tp": 2, "ep": 2, "etp": 1, "sp": True, "microbatches": 1}),
]
CONFIGS_4 = [
    # folded over tp and dp (ep=4 over tp=2 x dp=2, etp=1): a rank's model keeps the experts of its dp
    # pair's half, and it stores its tp share of those, each cut from the whole tensor its module initialises
    ("moe-fold-ep4", tp_only_cluster("1x4xcpu"), {"dp": 2, "tp": 2, "ep": 4, "etp": 1, "sp": True,
                                                   "microbatches": 1}),
]
"""Configurations run on 4 ranks (the others on 2)."""
SHARDED = ("zero3", "pp2", "llama-zero3")
"""Plans under which a rank holds less than the whole model."""


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


def _normal_init(module):
    """Every parameter a module owns directly, normal(0, 0.02) (the MoE example's experts too)."""
    for p in module.parameters(recurse=False):
        torch.nn.init.normal_(p, std=0.02)


def _allocation_tracker():
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from autopar.runtime.memtrack import LiveBytes

    class Allocations(TorchDispatchMode):
        """Live bytes of every plain CPU tensor an op returns (views share their storage's count)."""

        def __init__(self):
            super().__init__()
            self.live = LiveBytes()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu":
                    self.live.track(t, "all")
            return out

    return Allocations()


def _run(rank, world, configs):
    sys.path.insert(0, EXAMPLES)
    import gpt
    import llama
    import moe

    import autopar
    from autopar.parallel import ParallelModule

    config = gpt.GPTConfig(n_layer=6, n_head=4, n_embd=64, vocab_size=128, block_size=32)

    def on_meta_gpt():
        with torch.device("meta"):
            return gpt.GPT(config, init=False)

    def on_meta_llama():  # 6 blocks of dim 64, vocab 256: no module dominates either
        return llama.build(size="tiny", n_layers=6, device="meta", dtype="fp32")[0]

    def on_meta_moe():
        return moe.build(size="tiny", n_layers=2, batch=8, shared_expert=True, device="meta", dtype="fp32")[0]

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (8, 16), generator=g)  # (B, T)
    target = torch.randint(0, config.vocab_size, (8, 16), generator=g)  # (B, T)
    report = {}
    compile_original = ParallelModule._compile
    for name, cluster, fixed in configs:
        on_meta = on_meta_llama if name.startswith("llama") else on_meta_moe if name.startswith("moe") else on_meta_gpt
        loss_fn = moe.build(size="tiny", batch=8)[2] if name.startswith("moe") else gpt.cross_entropy_loss
        init_fn = _normal_init if name.startswith("moe") else None  # (its init_weights is the whole model's)
        runs, plan = {}, None
        for start in ("cpu", "meta"):
            model = autopar.materialize(on_meta(), seed=SEED, init_fn=init_fn) if start == "cpu" else on_meta()
            pm = autopar.parallelize(model, cluster=cluster, loss_fn=loss_fn, optimizer=_optimizer, init_fn=init_fn,
                                     fixed=fixed, init_seed=SEED if start == "meta" else None,
                                     plan=plan)  # (the meta run checks the CPU run's plan: no second solve)
            tracker = _allocation_tracker() if start == "meta" else None  # (only the meta start's is bounded)

            def compile_tracked(self, *a, tracker=tracker):
                with tracker:
                    return compile_original(self, *a)

            ParallelModule._compile = compile_tracked if tracker is not None else compile_original
            try:
                losses = [pm.train_step(idx, target)]
            finally:
                ParallelModule._compile = compile_original
            losses.append(pm.train_step(idx, target))
            plan = pm.plan
            own = sum(e.slice.numel() * e.slice.element_size() if e.flat is None else e.flat.numel()
                      * e.flat.element_size() for e in pm.params.entries.values())
            # (tensors go back to the parent as numpy arrays: pickled by value, not as shared memory)
            runs[start] = {"losses": losses,
                           "grads": {k: v.detach().numpy() for k, v in pm.full_gradients().items()},
                           "state": {k: v.detach().numpy() for k, v in pm.state_dict().items()},
                           "peak": tracker.live.peak if tracker is not None else None, "own": own,
                           "held": sorted(pm.params.entries),
                           "materialized": getattr(pm, "materialized", None)}
        whole = model_bytes = sum(p.numel() * p.element_size() for p in on_meta().parameters())
        largest = max(sum(t.numel() * t.element_size() for t in m.parameters(recurse=False))
                      for m in on_meta().modules())
        buffers = sum(b.numel() * b.element_size() for b in on_meta().buffers())
        report[name] = {**runs, "whole": whole, "largest": largest, "buffers": buffers, "model_bytes": model_bytes,
                        "all_params": sorted(n for n, _ in on_meta().named_parameters())}
    return report


@pytest.fixture(scope="module")
def results():
    return spawn_world(_run, 2, CONFIGS)


@pytest.fixture(scope="module")
def results_4():
    return spawn_world(_run, 4, CONFIGS_4)


def _results(request, name):
    """Every rank's report of the world that ran ``name``."""
    return request.getfixturevalue("results_4" if name in {c[0] for c in CONFIGS_4} else "results")


NAMES = [c[0] for c in CONFIGS + CONFIGS_4]


@pytest.mark.parametrize("name", NAMES)
def test_meta_start_equals_cpu_start(request, name):
    results = _results(request, name)
    for rank, r in enumerate(results):
        cpu, meta = r[name]["cpu"], r[name]["meta"]
        torch.testing.assert_close(meta["losses"], cpu["losses"], rtol=1e-6, atol=0,
                                   msg=lambda m: f"{name} rank {rank}: losses differ: {m}")
        assert sorted(meta["grads"]) == sorted(cpu["grads"]) and sorted(meta["state"]) == sorted(cpu["state"])
        for kind in ("grads", "state"):
            for k in cpu[kind]:
                torch.testing.assert_close(torch.from_numpy(meta[kind][k]), torch.from_numpy(cpu[kind][k]), rtol=1e-5, atol=1e-7,
                                           msg=lambda m, k=k: f"{name} rank {rank}: {kind} of {k} differ: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_meta_start_allocates_only_own_pieces(request, name):
    slack = 64 * 1024  # index tensors, the loss seed, gloo's small buffers
    for rank, r in enumerate(_results(request, name)):
        meta, case = r[name]["meta"], r[name]
        bound = meta["own"] + case["buffers"] + case["largest"] + slack
        assert meta["peak"] <= bound, (
            f"{name} rank {rank}: building from meta allocated up to {meta['peak']} bytes at once, more than its "
            f"own pieces ({meta['own']}) + buffers ({case['buffers']}) + the largest module ({case['largest']}) + "
            f"{slack}; the whole model is {case['whole']}")
        if name in SHARDED:
            assert bound < case["whole"], "the model is too small for the bound to mean anything"
            # the CPU-started run, for contrast, holds the whole model on every rank
            assert meta["peak"] < 0.75 * case["whole"]
        if name == "pp2":
            assert meta["held"] != case["all_params"] and set(meta["held"]) < set(case["all_params"]), (
                f"rank {rank} holds every parameter under pp=2: {meta['held']}")
            held_modules = {f.rsplit(".", 1)[0] for f in meta["held"]}
            assert set(meta["materialized"]) <= held_modules | {""}, (
                f"rank {rank} materialised modules of the other stage: "
                f"{sorted(set(meta['materialized']) - held_modules)}")


def test_train_example_starts_from_meta(tmp_path):
    """``examples/train.py --meta`` under torchrun: ZeRO-3 from meta, the loss falls, each rank
    reports its peak RSS."""
    import os
    import re
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(repo / "examples" / "train.py"), "--cluster", "1x2xcpu", "--steps", "8", "--batch", "8", "--seq",
           "16", "--fix", "dp=2", "--fix", "zero=3", "--meta"]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert last < first - 0.5, proc.stdout[-2000:]
    assert len(re.findall(r"rank \d: peak RSS", proc.stdout)) == 2, proc.stdout[-2000:]

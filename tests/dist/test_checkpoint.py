"""Checkpoints across plans (autopar.runtime.checkpoint) on spawned gloo worlds.

Train the GPT example (4 blocks, tied embedding) 3 AdamW steps under plan A, save, load
under plan B into a model built from another seed, train 2 more steps: every loss, the
last gradients and the final parameters must be as accurate as 5 uninterrupted steps of
one process (the ``parallel_compare`` rule; rank 0 trains the reference alongside across both
plans and judges, the other ranks' losses must equal its). AdamW's state must come along:
restarted moments would move every parameter by about lr on the 4th step, thousands of times
the tolerance. Pairs: DP4 -> TP2xDP2,
ZeRO-3 DP4 -> PP2xDP2 (ZeRO-1), TP2xDP2 -> ZeRO-1 DP4 and, for the MoE example, ep=2 over
dp=4 at ZeRO-3 -> ep=4 (each rank loads other experts' rows than it saved) and ep=4 -> ep=2 at
ZeRO-2 (expert state in chunks over the replicas), and ep=4 folded over tp=2 x dp=2 (etp=1, ZeRO-1)
-> ep=2 over dp=4, in one 4-rank world, and
PP4 -> one process (a 1-rank world). The 1-rank world also checks keep=, async_save (the checkpoint
holds the step it was taken at while training goes on) and export to one torch.save file
and back. Bad checkpoints are checked in this process: one CheckpointError line each.
"""

import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autopar.testing import spawn_world, tp_friendly_cluster
from parallel_compare import Reference, assert_matches, train_judged

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
BEFORE, AFTER = 3, 2


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)  # eps: see test_parallel.py


def _build(seed=0, name=""):
    """The GPT example; for pairs named moe_*, the MoE example (2 blocks of 8 experts, shared expert)."""
    sys.path.insert(0, EXAMPLES)
    if name.startswith("moe"):
        import moe

        return moe.build(size="tiny", batch=8, n_layers=2, shared_expert=True, aux_loss=0.01, seed=seed)
    import gpt

    return gpt.build(size="tiny", batch=8, n_layer=4, seed=seed)


def _resume(rank, world, root, pairs):
    """Per (name, A, B): A trains BEFORE steps and saves to root/name; B (from another seed)
    resumes and trains AFTER steps. A or B is None where another world runs that side.
    Rank 0 alone trains the one-process reference across both plans and judges
    (``train_judged``); every rank reports its raw losses, which must equal rank 0's."""
    import autopar

    out = {}
    for name, a, b in pairs:
        torch.manual_seed(0)
        model, inputs, loss_fn, target = _build(name=name)
        reference = Reference(model, _optimizer) if rank == 0 else None
        run = lambda pm: pm.train_step(inputs, target)  # noqa: E731
        run_ref = lambda ref, like: loss_fn(ref(*like(inputs)), like(target))  # noqa: E731
        r = out[name] = {}
        if a is not None:
            pm = autopar.parallelize(model, cluster=a[0], loss_fn=loss_fn, optimizer=_optimizer, fixed=a[1])
            r["raw_a"], r["losses_a"], _, _ = train_judged(pm, reference, steps=BEFORE, run=run,
                                                           run_reference=run_ref)
            pm.save_checkpoint(f"{root}/{name}")
            saved = pm.state_dict()  # (a file: tensors returned across processes need the sender alive)
            if rank == 0:
                torch.save(saved, f"{root}/{name}-saved.pt")
            r["mesh_a"], r["ep_a"] = pm.plan.mesh, pm.ep
            r["folded_a"] = (pm.plan.experts or {}).get("folded_over")
        elif reference is not None:
            for _ in range(BEFORE):
                reference.step(run_ref)
        if b is None:
            continue
        other, *_ = _build(seed=1, name=name)
        pm = autopar.parallelize(other, cluster=b[0], loss_fn=loss_fn, optimizer=_optimizer, fixed=b[1],
                                 resume_from=f"{root}/{name}")
        r["raw_b"], r["losses_b"], r["grad_err"], r["param_err"] = train_judged(
            pm, reference, steps=AFTER, run=run, run_reference=run_ref)
        r["adam_steps"] = sorted({float(s["step"]) for s in pm.optimizer.state.values()})
        r["steps"], r["mesh_b"], r["zero_b"], r["ep_b"] = pm.steps, pm.plan.mesh, pm.plan.zero, pm.ep
        if world == 1:
            r.update(_single_process_extras(pm, root, run))
    return out


def _single_process_extras(pm, root, run):
    """keep=, async_save and export/import on the resumed one-process run."""
    from autopar.runtime.checkpoint import export_state_dict

    out = {}
    for _ in range(3):
        run(pm)
        pm.save_checkpoint(f"{root}/keep", keep=2)
    out["kept"] = sorted(p.name for p in Path(f"{root}/keep").iterdir())
    at_save = {k: v.clone() for k, v in pm.state_dict().items()}  # (on one rank: views of the live tensors)
    handle = pm.save_checkpoint(f"{root}/async", async_save=True)
    run(pm)  # training goes on while the thread writes
    handle.wait()
    exported = export_state_dict(f"{root}/async", f"{root}/async.pt")
    plain = torch.load(exported, weights_only=True)
    out["async_diff"] = max(float((plain[k] - at_save[k]).abs().max()) for k in at_save)
    out["async_keys"] = sorted(plain) == sorted(at_save)
    pm.load_checkpoint(exported)  # and back: whole weights into the shards
    back = pm.state_dict()
    out["import_diff"] = max(float((back[k] - at_save[k]).abs().max()) for k in at_save)
    return out


FOUR = [
    ("dp4_to_tp2xdp2", ("1x4xcpu", {"dp": 4, "zero": 0}), (tp_friendly_cluster("1x4xcpu"), {"dp": 2, "tp": 2})),
    ("zero3_to_pp2xdp2", ("1x4xcpu", {"dp": 4, "zero": 3}),
     ("1x4xcpu", {"pp": 2, "dp": 2, "tp": 1, "zero": 1, "microbatches": 2})),
    ("tp2xdp2_to_zero1", (tp_friendly_cluster("1x4xcpu"), {"dp": 2, "tp": 2}), ("1x4xcpu", {"dp": 4, "zero": 1})),
    ("pp4_to_one", ("1x4xcpu", {"pp": 4, "dp": 1, "tp": 1, "microbatches": 4}), None),
    # experts cut in 2 parts (2 replicas each, ZeRO-3 chunks of each part over its replicas) -> in 4
    # parts: every rank loads other experts' rows
    ("moe_ep2_to_ep4", ("1x4xcpu", {"dp": 4, "ep": 2, "zero": 3, "microbatches": 1}),
     ("1x4xcpu", {"dp": 4, "ep": 4, "microbatches": 1})),
    # and back: whole parts saved, loaded as ZeRO-2 chunks (the optimizer's) of 2 parts
    ("moe_ep4_to_ep2", ("1x4xcpu", {"dp": 4, "ep": 4, "zero": 0, "microbatches": 1}),
     ("1x4xcpu", {"dp": 4, "ep": 2, "zero": 2, "microbatches": 1})),
    # ep folded over tp (each rank 2 whole experts: its dp part's tp share) -> ep=2 over dp=4
    ("moe_fold_to_ep2", (tp_friendly_cluster("1x4xcpu"), {"dp": 2, "tp": 2, "ep": 4, "etp": 1, "sp": True,
                                                          "zero": 1, "microbatches": 1}),
     ("1x4xcpu", {"dp": 4, "ep": 2, "microbatches": 1})),
]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    four = spawn_world(_resume, 4, str(root), FOUR)
    one = spawn_world(_resume, 1, str(root), [("pp4_to_one", None, ("1x1xcpu", None))])
    return root, four, one[0]


@pytest.mark.parametrize("name", [p[0] for p in FOUR])
def test_resume_under_another_plan_matches_one_process(worlds, name):
    root, four, one = worlds
    judged = four[0][name]  # rank 0 trained the reference across both plans (train_judged)
    assert_matches(judged["losses_a"], {}, {}, f"{name} before the save")
    for rank, result in enumerate(four):
        assert result[name]["raw_a"] == judged["raw_a"], f"{name}: rank {rank}'s losses before the save"
    b_side = four if name != "pp4_to_one" else [one]
    r = b_side[0][name]
    assert_matches(r["losses_b"], r["grad_err"], r["param_err"], f"{name} after resuming")
    for rank, result in enumerate(b_side):
        assert result[name]["raw_b"] == r["raw_b"], f"{name}: rank {rank}'s losses after resuming"
        assert result[name]["steps"] == BEFORE + AFTER
        assert result[name]["adam_steps"] == [float(BEFORE + AFTER)], \
            f"{name}: rank {rank}'s AdamW step counts {result[name]['adam_steps']}"


def test_plans_are_the_pinned_ones(worlds):
    root, four, one = worlds
    r = four[0]
    assert (r["dp4_to_tp2xdp2"]["mesh_b"]["dp"], r["dp4_to_tp2xdp2"]["mesh_b"]["tp"]) == (2, 2)
    assert (r["zero3_to_pp2xdp2"]["mesh_b"]["pp"], r["zero3_to_pp2xdp2"]["zero_b"]) == (2, 1)
    assert (r["tp2xdp2_to_zero1"]["mesh_b"]["dp"], r["tp2xdp2_to_zero1"]["zero_b"]) == (4, 1)
    assert r["pp4_to_one"]["mesh_a"]["pp"] == 4
    assert (r["moe_ep2_to_ep4"]["ep_a"], r["moe_ep2_to_ep4"]["ep_b"]) == (2, 4)
    assert (r["moe_ep4_to_ep2"]["ep_a"], r["moe_ep4_to_ep2"]["ep_b"], r["moe_ep4_to_ep2"]["zero_b"]) == (4, 2, 2)
    fold = r["moe_fold_to_ep2"]
    assert (fold["ep_a"], fold["mesh_a"]["tp"], fold["folded_a"], fold["ep_b"]) == (4, 2, "tp x dp", 2)


def test_keep_async_and_export_round_trip(worlds):
    root, four, one = worlds
    r = one["pp4_to_one"]
    assert r["kept"] == ["step-00000007", "step-00000008"], r["kept"]
    assert r["async_keys"]
    assert r["async_diff"] == 0.0, "the async checkpoint is not the state at the step it was taken"
    assert r["import_diff"] == 0.0


@pytest.mark.parametrize("name", ["pp4_to_one", "moe_ep2_to_ep4"])
def test_export_holds_the_saved_parameters(worlds, tmp_path, name):
    """The files hold whole parameters, experts included (saved under ep, each rank holding a
    part): exported to one torch.save file they equal ``state_dict()`` at the save."""
    from autopar.runtime.checkpoint import export_state_dict

    root, four, one = worlds
    saved = torch.load(root / f"{name}-saved.pt", weights_only=True)
    plain = torch.load(export_state_dict(root / name, tmp_path / "m.pt"), weights_only=True)
    assert sorted(plain) == sorted(saved)
    for k in saved:
        assert torch.equal(plain[k], saved[k]), k


# -- bad checkpoints: one CheckpointError line each, before any collective -----------------

def _pm(model, loss_fn):
    import autopar

    return autopar.parallelize(model, cluster="1x1xcpu", loss_fn=loss_fn, optimizer=_optimizer)


@pytest.fixture
def good(worlds, tmp_path):
    root, four, one = worlds
    src = next((root / "dp4_to_tp2xdp2").glob("step-*"))
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _error(path, model=None):
    from autopar.errors import CheckpointError

    if model is None:
        model, _, loss_fn, _ = _build()
    else:
        model, loss_fn = model, None
    with pytest.raises(CheckpointError) as e:
        _pm(model, loss_fn).load_checkpoint(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_truncated_file(good):
    f = good / "__1_0.distcp"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert f"is truncated: __1_0.distcp has {len(data) // 2} bytes, the save wrote {len(data)}" in _error(good)


def test_missing_file(good):
    (good / "__2_0.distcp").unlink()
    assert "is missing 1 of its" in _error(good) and "__2_0.distcp" in _error(good)


def test_interrupted_save(good):
    (good / "autopar.json").unlink()
    assert "is incomplete: no autopar.json" in _error(good)
    assert "is incomplete" in _error(good.parent)


def test_missing_directory(tmp_path):
    assert "does not exist" in _error(tmp_path / "nowhere")


def test_another_model(good):
    sys.path.insert(0, EXAMPLES)
    import llama

    model, *_ = llama.build(size="tiny")
    assert "is of another model" in _error(good, model)


def test_other_shapes(good):
    sys.path.insert(0, EXAMPLES)
    import gpt

    model = gpt.GPT(replace(gpt.SIZES["tiny"], n_layer=4, n_embd=32))
    message = _error(good, model)
    assert "holds transformer.wte.weight with shape (256, 64), this model's is (256, 32)" in message, message


def test_truncated_torch_save_file(tmp_path):
    model, *_ = _build()
    f = tmp_path / "model.pt"
    torch.save(model.state_dict(), f)
    f.write_bytes(f.read_bytes()[:1000])
    from autopar.errors import CheckpointError

    with pytest.raises(CheckpointError, match="is not a torch.save state dict that can be read"):
        from autopar.runtime.checkpoint_io import Source, full_source
        full_source(Source("torch", f), model)

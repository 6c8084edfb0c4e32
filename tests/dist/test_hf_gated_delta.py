"""A gated-delta-rule model (Hugging Face's Qwen3.5 text model: linear-attention layers
beside full attention) traced with the solver it trains with, on 2 gloo ranks under dp=2 and
tp=2 against one process.

Transformers' ``torch_chunk_gated_delta_rule`` solves each chunk's triangular system with
``torch.linalg.solve_triangular``, except under ``torch.export``, where it runs a 63-step
Python loop instead (for export targets without the solver). autopar's capture counts as an
export to that check, and traced the loop: about a thousand graph nodes per layer. It now
traces the solver (:func:`autopar.passes.hf_paths.training_kernels`); this checks the
traced step trains the model as eager does, and that the loop is gone from it.
"""

import sys
from pathlib import Path

import pytest
import torch

from autopar.testing import spawn_world, tp_friendly_cluster
from parallel_compare import Reference, assert_matches, train_judged

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("this transformers has no Qwen3.5", allow_module_level=True)

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
STEPS = 3
CONFIGS = [("dp", "1x2xcpu", {"dp": 2, "tp": 1}), ("tp", tp_friendly_cluster("1x2xcpu"), {"tp": 2})]


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


def _train(rank, world, configs):
    sys.path.insert(0, EXAMPLES)
    import autopar
    import hf

    report = {}
    for name, cluster, fixed in configs:
        torch.manual_seed(0)
        # (use_cache off: at 2 layers both are linear attention, and eager Qwen3.5 with a cache
        # then fails in its own mask code, Cache.get_seq_length; autopar traces without it anyway)
        config = hf.tiny_config(transformers.Qwen3_5TextConfig, use_cache=False)
        model = transformers.Qwen3_5ForCausalLM(config).train()
        inputs = hf._inputs("causal", config, 8, 32, torch.device("cpu"), 0)
        reference = Reference(model, _optimizer) if rank == 0 else None
        pm = autopar.parallelize(model, cluster=cluster, fixed=fixed, optimizer=_optimizer)
        raw, losses, grad_err, param_err = train_judged(
            pm, reference, steps=STEPS, run=lambda pm: pm.train_step(inputs),
            run_reference=lambda ref, like: ref(**like(inputs)).loss)
        code = pm.step_program.code
        report[name] = {"raw": raw, "losses": losses, "grad_err": grad_err, "param_err": param_err,
                        "mesh": pm.plan.mesh, "solves": code.count("linalg_solve_triangular"),
                        "nodes": len(pm.step_program.graph.nodes)}
    return report


@pytest.fixture(scope="module")
def results():
    return spawn_world(_train, 2, CONFIGS)


@pytest.mark.parametrize("config", [c[0] for c in CONFIGS])
def test_two_ranks_match_single_process(results, config):
    judged = results[0][config]
    assert_matches(judged["losses"], judged["grad_err"], judged["param_err"], f"qwen3_5 {config}")
    for rank_result in results:
        assert rank_result[config]["mesh"][config] == 2
        assert rank_result[config]["raw"] == judged["raw"]


def test_the_solver_is_traced_not_the_export_loop(results):
    """Each linear-attention layer solves two triangular systems in the forward and as many in
    the backward; the 63-step loop (hundreds of slicing ops per layer) is not in the program."""
    for config in ("dp", "tp"):
        r = results[0][config]
        assert r["solves"] >= 2, r["solves"]
        assert r["nodes"] < 4000, r["nodes"]

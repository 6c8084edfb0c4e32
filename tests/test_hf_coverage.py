"""A fast subset of bench/hf_coverage.py, through the bench's own code path (``plan_all``, as its
``main`` calls it, with its CPU-second budget): architectures not in examples/hf.py, built from
their default configs scaled down, plan on 1x8xH100; the bench sorts outcomes as it says
(autopar's own errors are "refused", anything else escaping autopar is "crashed", a plan past
its CPU budget is "over time")."""

import faulthandler
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from autopar.errors import TraceError  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "bench" / "hf_coverage.py"


@pytest.fixture(scope="module")
def coverage():
    spec = importlib.util.spec_from_file_location("hf_coverage", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Run in a new interpreter: with torch's CUDA builds a child forked from a process that has traced (this test
# worker, by now) cannot run autograd, so its trace would fail (bench/hf_coverage.py's plan_all)
FRESH_SCRIPT = f"""
import importlib.util, json, resource, sys
spec = importlib.util.spec_from_file_location("hf_coverage", {str(BENCH)!r})
coverage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(coverage)
before = resource.getrlimit(resource.RLIMIT_CPU)
default = coverage.architectures(["causal"], {{"gpt_neo"}}, 1) + coverage.architectures(["masked"], {{"roberta"}}, 1)
rows = {{"default": list(coverage.plan_all(default, jobs=1, timeout_s=coverage.TIMEOUT_CPU_S)),
        "budget": list(coverage.plan_all(coverage.architectures(["causal"], {{"gpt_neo"}}, 1), jobs=1, timeout_s=0.5))}}
rows["rlimit_kept"] = resource.getrlimit(resource.RLIMIT_CPU) == before
# the probe's answer, then what happens: this process traces (its first trace), a child runs a backward
rows["probe"] = coverage._forked_backward_runs(after_trace=True)
import os, torch
from autopar.passes.trace import trace_joint
trace_joint(torch.nn.Linear(4, 4), (torch.randn(2, 4),), loss_fn=lambda out, y: out.sum(), example_target=None)
pid = os.fork()
if pid == 0:
    try:
        torch.ones(1, requires_grad=True).sum().backward()
        os._exit(0)
    except BaseException:
        os._exit(1)
rows["forked_backward_ran"] = os.waitpid(pid, 0)[1] == 0
sys.stdout.write(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def fresh_rows():
    done = subprocess.run([sys.executable, "-c", FRESH_SCRIPT], capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("kind, model_type", [("causal", "gpt_neo"), ("masked", "roberta")])
def test_default_config_architecture_plans(coverage, fresh_rows, kind, model_type):
    (row,) = [r for r in fresh_rows["default"] if (r["kind"], r["model_type"]) == (kind, model_type)]
    assert row["outcome"] == "planned", row
    assert row["mesh"]["pp"] * row["mesh"]["dp"] * row["mesh"]["tp"] == 8, row
    assert 0 < row["cpu_s"] < coverage.TIMEOUT_CPU_S, row


def test_cpu_budget_stops_planning(fresh_rows):
    """Past its CPU seconds an architecture is "over time"; the budget is the child's, not ours."""
    (row,) = fresh_rows["budget"]
    assert row["outcome"] == "over time" and "0.5 CPU seconds" in row["error"], row
    assert 0.5 <= row["cpu_s"] < 5, row
    assert fresh_rows["rlimit_kept"]


def test_fork_probe_says_what_a_child_forked_after_a_trace_can_do(fresh_rows):
    """bench/hf_coverage.py's probe answers, without tracing in the asking process, what a child
    forked after a real trace then does: run a backward (CPU builds) or refuse (CUDA builds)."""
    assert fresh_rows["probe"] == fresh_rows["forked_backward_ran"], fresh_rows


@pytest.mark.parametrize("parent, after_trace", [(True, True), (True, False), (False, False)])
def test_warm_up_only_where_forked_children_still_run_autograd(coverage, monkeypatch, capsys, parent, after_trace):
    """The warm-up trace runs here only where a child forked after it can still run autograd; a
    process whose children cannot run it at all is told so on stderr, once."""
    here = []
    answers = {False: parent, True: after_trace}  # (the probe's answer, by its after_trace argument)
    monkeypatch.setattr(coverage, "_forked_backward_runs", lambda after_trace: answers[after_trace])
    monkeypatch.setattr(coverage, "plan_one", lambda kind, model_type, class_name, on_built=None: here.append(
        model_type) or {"kind": kind, "model_type": model_type, "class": class_name, "outcome": "planned"})
    rows = coverage.architectures(["causal"], {"gpt2", "llama"}, 1)
    got = list(coverage.plan_all(rows, jobs=1, timeout_s=60, warm=True))
    assert [r["model_type"] for r in got] == [r[1] for r in rows]
    assert here == (["gpt2"] if parent and after_trace else []), here  # (the rows run in children)
    assert ("cannot run autograd in a child of this process" in capsys.readouterr().err) == (not parent)


def test_budget_stops_a_call_that_never_returns_to_python(coverage, monkeypatch):
    """A long C call (a SCIP solve, a trace) is stopped on time: the kernel enforces the budget,
    not a Python signal handler (which runs only when the call returns: this one would take hours)."""
    monkeypatch.setattr(coverage.autopar, "plan", lambda *args, **kwargs: sum(range(10 ** 13)))
    (row,) = coverage.plan_all(coverage.architectures(["causal"], {"gpt2"}, 1), jobs=1, timeout_s=1)
    assert row["outcome"] == "over time" and row["model_type"] == "gpt2", row
    assert 1 <= row["cpu_s"] < 6, row


def test_a_child_killed_by_a_signal_costs_its_row_only(coverage, monkeypatch):
    """A segfault in native code while planning one architecture is that row's crash; the rows
    after it are planned, and rows come back in the order asked even when they end out of order."""
    def plan(model, *args, **kwargs):
        name = type(model).__name__
        if name.startswith("GPTNeo"):
            faulthandler.disable()  # (pytest's handler would print this child's stack)
            os.kill(os.getpid(), signal.SIGSEGV)
        if name.startswith("GPT2"):  # the first row ends last
            end = time.process_time() + 1.0
            while time.process_time() < end:
                pass
        return types.SimpleNamespace(mesh={"dp": 8, "name": name}, timings={"trace_s": 0.0})

    monkeypatch.setattr(coverage.autopar, "plan", plan)
    rows = coverage.architectures(["causal"], {"gpt2", "gpt_neo", "llama"}, 1)
    got = list(coverage.plan_all(rows, jobs=2, timeout_s=60))
    assert [r["model_type"] for r in got] == [r[1] for r in rows]
    by_type = {r["model_type"]: r for r in got}
    assert by_type["gpt_neo"]["outcome"] == "crashed" and "SIGSEGV" in by_type["gpt_neo"]["error"], by_type
    for _, t, class_name in rows:
        if t != "gpt_neo":
            assert by_type[t]["outcome"] == "planned" and by_type[t]["mesh"]["name"] == class_name, by_type


def test_an_error_of_the_bench_itself_is_a_whole_row(coverage, monkeypatch):
    """Whatever escapes plan_one in a child (here a KeyboardInterrupt) comes back as a crashed row
    with every field main() prints, not as a hang or a half row."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(coverage, "plan_one", interrupted)
    (row,) = coverage.plan_all(coverage.architectures(["causal"], {"gpt2"}, 1), jobs=1, timeout_s=60)
    assert row["outcome"] == "crashed" and "KeyboardInterrupt" in row["error"], row
    assert {"kind", "model_type", "class", "seconds", "cpu_s"} <= set(row), row


def test_tiny_config_is_tiny(coverage):
    model, inputs = coverage.build("causal", "gpt_neo", "GPTNeoForCausalLM")
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.vocab_size) == (2, 64, 4, 512)
    assert len(c.attention_layers) == 2  # its per-layer pattern follows the depth
    assert model.training and model.config.use_cache is True and inputs["input_ids"].shape == (coverage.BATCH, coverage.SEQ)


@pytest.mark.parametrize("raised, outcome", [(TraceError("could not trace X: unsupported op: ..."), "refused"),
                                             (TypeError("op_candidates needs an ATen op call"), "crashed")])
def test_outcomes_are_sorted_by_whose_error(coverage, monkeypatch, raised, outcome):
    def plan(*args, **kwargs):
        raise raised

    monkeypatch.setattr(coverage.autopar, "plan", plan)
    (row,) = [coverage.plan_one(k, t, c) for k, t, c in coverage.architectures(["causal"], {"gpt2"}, 1)]
    assert row["outcome"] == outcome and type(raised).__name__ in row["error"], row


@pytest.mark.parametrize("config_name, heads, kv_heads", [("LlamaConfig", 4, 2), ("MistralConfig", 4, 2),
                                                          ("DeepseekV3Config", 4, 4), ("Glm4MoeLiteConfig", 4, 4)])
def test_tiny_config_key_value_heads(coverage, config_name, heads, kv_heads):
    """Grouped-query attention gets 2 key/value heads; multi-head latent attention (DeepSeek-V3,
    GLM-4 MoE lite) expands keys and values to every head, so there they stay equal."""
    config = coverage.hf.tiny_config(getattr(coverage.transformers, config_name))
    assert (config.num_attention_heads, config.num_key_value_heads) == (heads, kv_heads)


@pytest.mark.parametrize("config_name, sizes", [
    ("GPTJConfig", {"rotary_dim": 16, "n_head": 4, "n_embd": 64}),  # rotary part no wider than a head
    ("CodeGenConfig", {"rotary_dim": 16}),
    ("DeepseekV3Config", {"qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "kv_lora_rank": 32,
                          "q_lora_rank": 32, "n_group": 1, "topk_group": 1}),
    ("AXK1Config", {"n_group": 1, "topk_group": 1, "n_routed_experts": 4}),  # groups of a non-empty expert set
])
def test_tiny_config_scales_rotary_latent_and_group_sizes(coverage, config_name, sizes):
    """Sizes that must follow the smaller heads and expert count: left at their defaults they broke
    the architectures' own shapes (GPT-J, CodeGen, DeepSeek-V3 and AXK1 were refused for it)."""
    config = coverage.hf.tiny_config(getattr(coverage.transformers, config_name))
    assert {k: getattr(config, k) for k in sizes} == sizes


def test_tiny_config_survives_a_config_that_refuses_global_reads(coverage):
    """Gemma 4 raises on a global read of its per-layer head_dim; tiny_config reads around it."""
    cls = getattr(coverage.transformers, "Gemma4TextConfig", None)
    if cls is None:
        pytest.skip("this transformers has no Gemma 4")
    config = coverage.hf.tiny_config(cls)
    assert config.num_hidden_layers == 2 and config.hidden_size == 64


def test_tiny_config_leaves_derived_sizes_to_follow(coverage):
    """A size the config computes (Falcon's head_dim: a property without a setter) is not passed:
    it follows the scaled fields (passing it made the config refuse itself: 'not tiny')."""
    config = coverage.hf.tiny_config(coverage.transformers.FalconConfig)
    assert (config.hidden_size, config.num_attention_heads, config.head_dim) == (64, 4, 16)

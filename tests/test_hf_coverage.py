"""A fast subset of bench/hf_coverage.py, through the bench's own code path (``plan_all``, as its
``main`` calls it, with its CPU-second budget): architectures not in examples/hf.py, built from
their default configs scaled down, plan on 1x8xH100; the bench sorts outcomes as it says
(autopar's own errors are "refused", anything else escaping autopar is "crashed", a plan past
its CPU budget is "over time")."""

import importlib.util
import signal
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


@pytest.mark.parametrize("kind, model_type", [("causal", "gpt_neo"), ("masked", "roberta")])
def test_default_config_architecture_plans(coverage, kind, model_type):
    rows = coverage.architectures([kind], {model_type}, 1)
    (row,) = coverage.plan_all(rows, jobs=1, timeout_s=coverage.TIMEOUT_CPU_S)
    assert row["outcome"] == "planned", row
    assert row["mesh"]["pp"] * row["mesh"]["dp"] * row["mesh"]["tp"] == 8, row
    assert 0 < row["cpu_s"] < coverage.TIMEOUT_CPU_S, row


def test_cpu_budget_stops_planning(coverage):
    """Past its CPU seconds an architecture is "over time", and the timer and handler are put back."""
    before = signal.getsignal(signal.SIGPROF)
    (row,) = coverage.plan_all(coverage.architectures(["causal"], {"gpt_neo"}, 1), jobs=1, timeout_s=0.5)
    assert row["outcome"] == "over time" and "0.5 CPU seconds" in row["error"], row
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGPROF) == before


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


def test_a_swallowed_alarm_still_counts_as_over_time(coverage, monkeypatch):
    """An alarm raised inside a callback whose exceptions Python drops (weakref, gc) must not
    let an architecture past its budget: the alarm repeats, and a plan finished after any
    alarm fired is still over time."""
    def plan(*args, **kwargs):
        end = time.process_time() + 0.5
        while time.process_time() < end:
            try:
                sum(range(1000))
            except BaseException:  # every alarm lands here and is dropped
                pass
        return types.SimpleNamespace(mesh={"dp": 8})

    monkeypatch.setattr(coverage.autopar, "plan", plan)
    (row,) = [coverage.plan_one(k, t, c, timeout_s=0.1) for k, t, c in coverage.architectures(["causal"], {"gpt2"}, 1)]
    assert row["outcome"] == "over time", row
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)


def test_a_late_alarm_neither_kills_the_worker_nor_hangs_the_bench(coverage, monkeypatch):
    """The budget's alarm repeats every 0.1 CPU s until disarmed; once planning has ended it is
    ignored (a run once died with the alarm raised inside the finally that stops the timer, and
    multiprocessing.Pool then waited for ever). If one lands before the disarm all the same, the
    job still returns an "over time" row."""
    coverage._armed[0] = False
    assert coverage._alarm(signal.SIGPROF, None) is None  # disarmed: ignored
    coverage._armed[0] = True
    with pytest.raises(coverage._OverTime):
        coverage._alarm(signal.SIGPROF, None)

    def late(*job):
        raise coverage._OverTime

    monkeypatch.setattr(coverage, "plan_one", late)
    row = coverage._plan_job(("causal", "gpt2", "GPT2LMHeadModel", 60.0))
    assert row["outcome"] == "over time" and row["model_type"] == "gpt2", row
    assert not coverage._armed[0] and signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)

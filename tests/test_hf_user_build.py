"""Issue 15's example: a Hugging Face model built as a user builds it (default config, cache on,
dropout on, training mode) on ``meta``, from a config or with ``from_pretrained``, plans."""

import logging

import pytest
import torch

import autopar

transformers = pytest.importorskip("transformers")


def _config():
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512)


def test_gpt2_from_config_on_meta_plans_and_says_once_that_the_cache_is_off(caplog):
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(_config())
    assert model.config.use_cache and model.config.resid_pdrop > 0 and model.training
    ids = torch.zeros(16, 64, dtype=torch.long, device="meta")
    with caplog.at_level(logging.WARNING, logger="autopar.passes.trace"):
        plan = autopar.plan(model, {"input_ids": ids, "labels": ids}, cluster="1x8xH100")
    assert plan.mesh["pp"] * plan.mesh["dp"] * plan.mesh["tp"] == 8
    notes = [r.getMessage() for r in caplog.records if "use_cache=False" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("GPT2LMHeadModel has use_cache=True"), notes
    assert model.config.use_cache is True  # the user's model is left as it was


@pytest.mark.parametrize("device_map", [None, "meta"])
def test_gpt2_from_pretrained_plans(tmp_path, device_map):
    """On "meta" transformers 5 needs ``device_map`` (it refuses ``with torch.device("meta")``
    around from_pretrained), and ``device_map`` needs the accelerate package."""
    if device_map is not None:
        pytest.importorskip("accelerate")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(_config()).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map)
    model.train()  # from_pretrained returns eval mode; training is what is planned
    assert next(model.parameters()).device.type == (device_map or "cpu")
    ids = torch.zeros(8, 32, dtype=torch.long, device=device_map or "cpu")
    plan = autopar.plan(model, {"input_ids": ids, "labels": ids}, cluster="1x8xH100")
    assert plan.mesh["pp"] * plan.mesh["dp"] * plan.mesh["tp"] == 8
    assert plan.model["n_params"] == sum(p.numel() for p in model.parameters())

"""autopar.modelspec.load_model_spec: `FILE.py:FN` -> (model, example_inputs, loss_fn, example_target)."""
import textwrap
from pathlib import Path

import pytest
import torch

from autopar.errors import UserCodeError
from autopar.modelspec import load_model_spec

ROOT = Path(__file__).resolve().parent.parent

SPEC_FILE = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    def two(width="4"):
        return nn.Linear(int(width), 2), (torch.ones(3, int(width)),)

    def three():
        return nn.Linear(4, 2), (torch.ones(3, 4),), torch.nn.functional.mse_loss

    def four(batch=3):
        return nn.Linear(4, 2), (torch.ones(int(batch), 4),), torch.nn.functional.mse_loss, torch.zeros(int(batch), 2)

    def one():
        return (nn.Linear(4, 2),)

    def five():
        return nn.Linear(4, 2), (), None, None, None

    def not_a_tuple():
        return nn.Linear(4, 2)

    def not_a_model():
        return "model", ()

    def raises():
        raise RuntimeError("boom from the user's function")

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def spec_dir(tmp_path, monkeypatch):
    (tmp_path / "models.py").write_text(SPEC_FILE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_four_tuple_passes_through_and_args_arrive(spec_dir):
    model, inputs, loss_fn, target = load_model_spec("models.py:four", {"batch": "5"})
    assert isinstance(model, torch.nn.Module)
    assert inputs[0].shape == (5, 4) and target.shape == (5, 2)
    assert loss_fn is torch.nn.functional.mse_loss


def test_short_tuples_are_padded_with_none(spec_dir):
    model, inputs, loss_fn, target = load_model_spec("models.py:two", {"width": "6"})
    assert model.in_features == 6 and inputs[0].shape == (3, 6)
    assert loss_fn is None and target is None
    _, _, loss_fn, target = load_model_spec("models.py:three", {})
    assert loss_fn is torch.nn.functional.mse_loss and target is None


def test_args_default_to_none(spec_dir):
    assert len(load_model_spec("models.py:four")) == 4


def test_path_relative_to_cwd_in_a_subdirectory(spec_dir):
    (spec_dir / "sub").mkdir()
    (spec_dir / "sub" / "models.py").write_text(SPEC_FILE.replace("nn.Linear(int(width), 2)", "nn.Linear(int(width), 7)"))
    # two files with the same name load as two modules, never one cached for the other
    assert load_model_spec("sub/models.py:two", {})[0].out_features == 7
    assert load_model_spec("models.py:two", {})[0].out_features == 2


@pytest.mark.parametrize(
    "spec, message",
    [
        ("models.py", "has no ':'"),
        ("models.py:", "missing the file or the function"),
        (":build", "missing the file or the function"),
        ("missing.py:build", "no file 'missing.py'"),
        ("models.py:nope", "no function 'nope'"),
        ("models.py:NOT_CALLABLE", "no function 'NOT_CALLABLE'"),
        ("models.py:one", "returned a 1-tuple"),
        ("models.py:five", "returned a 5-tuple"),
        ("models.py:not_a_tuple", "returned Linear"),
        ("models.py:not_a_model", "expected an nn.Module"),
    ],
)
def test_bad_specs_raise_one_line_value_errors(spec_dir, spec, message):
    with pytest.raises(ValueError) as info:
        load_model_spec(spec, {})
    text = str(info.value)
    assert message in text
    assert repr(spec) in text and "FILE.py:FN" in text
    assert "\n" not in text


def test_errors_from_the_function_are_reported_as_the_users(spec_dir):
    with pytest.raises(UserCodeError) as info:
        load_model_spec("models.py:raises", {})
    line = SPEC_FILE.splitlines().index('    raise RuntimeError("boom from the user\'s function")') + 1
    assert str(info.value) == (f"models.py:{line} in raises: RuntimeError: boom from the user's function "
                               f"(raised by your model spec while calling raises(), not by autopar)")
    assert isinstance(info.value.__cause__, RuntimeError)
    assert isinstance(info.value, RuntimeError)  # callers that caught the builtin still do


def test_missing_function_lists_what_the_file_has(spec_dir):
    with pytest.raises(ValueError, match="four"):
        load_model_spec("models.py:build", {})


def test_bundled_examples_load(monkeypatch):
    monkeypatch.chdir(ROOT)
    model, inputs, loss_fn, target = load_model_spec("examples/gpt.py:build", {"size": "tiny", "batch": "2", "seq": "8"})
    assert inputs[0].shape == (2, 8)
    loss = loss_fn(model(*inputs), target)
    assert torch.isfinite(loss)
    model, inputs, loss_fn, target = load_model_spec("examples/llama.py:build", {"size": "70b", "n_layers": "2"})
    assert inputs[0].device.type == "meta" and len(model.layers) == 2

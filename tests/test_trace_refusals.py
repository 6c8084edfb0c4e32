"""The refusal path (issue 15): when a model cannot be traced, the one-line error names the
user's file and line, the cause in plain words and the fix. One case per cause, each a tiny
model whose forward has exactly that problem; every message must name its cause, point at
this file (the user's code) where a line is to blame, and stay on one line."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.errors import InputError, TraceError, UserCodeError
from autopar.modelspec import load_model_spec
from autopar.passes import trace_errors as te
from autopar.passes.trace import trace_joint

HERE = Path(__file__).name


@torch.library.custom_op("autopar_test::no_fake_impl", mutates_args=())
def _no_fake_impl(x: torch.Tensor) -> torch.Tensor:  # an op with a CPU kernel and no shape function
    return x.clone()


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)


class DataDependentBranch(_Base):
    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # a Python branch on a tensor's value
            h = h * 2
        return h.sum()


class DataDependentShape(_Base):
    def forward(self, x):
        h = self.lin(x)
        k = int((h > 0).sum())  # a shape from a tensor's values
        return h.reshape(-1)[:k].sum()


class LayerDrop(_Base):
    def __init__(self):
        super().__init__()
        self.layerdrop = 0.1

    def forward(self, x):
        h = self.lin(x)
        if self.training and torch.rand([]) < self.layerdrop:  # skip the layer at random
            return h.sum()
        return self.lin(h).sum()


class UnsupportedOp(_Base):
    def forward(self, x):
        return _no_fake_impl(self.lin(x)).sum()


class ImportsMissingPackage(_Base):
    def forward(self, x):
        import autopar_no_such_package  # noqa: F401  (as a model importing flash_attn when it is absent)
        return self.lin(x).sum()


class Raises(_Base):
    def forward(self, x):
        raise ValueError("expects 3-d inputs")


def _refusal(model, inputs):
    with pytest.raises((TraceError, InputError)) as excinfo:
        trace_joint(model, inputs)
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize("model, cause, line", [
    (DataDependentBranch, te.DATA_DEPENDENT, "if h.sum() > 0:"),
    (DataDependentShape, te.DATA_DEPENDENT, "k = int((h > 0).sum())"),
    (UnsupportedOp, te.UNSUPPORTED_OP, "return _no_fake_impl(self.lin(x)).sum()"),
    (ImportsMissingPackage, te.IMPORT_ERROR, "import autopar_no_such_package"),
])
def test_refusal_names_cause_file_and_line(model, cause, line):
    message = _refusal(model(), (torch.randn(4, 8),))
    assert f": {cause}: " in message, message
    assert f"{HERE}:{_line_of(line)}" in message, message
    assert "Try: " + te._FIXES[cause] in message, message


def test_layerdrop_is_named_with_its_config_fix():
    message = _refusal(LayerDrop(), (torch.randn(4, 8),))
    assert f": {te.DATA_DEPENDENT}: " in message and f"{HERE}:{_line_of('< self.layerdrop:')}" in message, message
    assert "Try: this is LayerDrop" in message and "layerdrop=0.0" in message, message


def test_unsupported_op_is_named():
    assert "(op autopar_test::no_fake_impl)" in _refusal(UnsupportedOp(), (torch.randn(4, 8),))


def test_inputs_that_do_not_fit():
    message = _refusal(DataDependentBranch(), (torch.randn(4, 5),))
    assert f": {te.BAD_INPUTS}: RuntimeError: " in message and "[4, 5] X [8, 8]" in message, message


class Float32Buffer(_Base):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.register_buffer("mask", torch.ones(1, 8, 8, dtype=dtype))

    def forward(self, x):
        return torch.bmm(self.lin(x), self.mask.expand(x.shape[0], 8, 8)).sum()  # a bf16 activation against a float32 buffer


def _fake_bmm_refuses(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether torch's shape functions refuse a bmm of these two dtypes, as its kernels do (torch
    2.11's do not: there the clash shows only when the step runs, and no trace can name it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        try:
            torch.bmm(torch.empty(1, 2, 2, dtype=a), torch.empty(1, 2, 2, dtype=b))
        except RuntimeError:
            return True
    return False


def _needs_refusing_bmm(a: torch.dtype, b: torch.dtype):
    return pytest.mark.skipif(not _fake_bmm_refuses(a, b), reason=f"torch {torch.__version__} traces a bmm of "
                              f"{a} and {b} without complaint (its meta kernel takes both): nothing to refuse at trace")


@_needs_refusing_bmm(torch.bfloat16, torch.float32)
def test_mixed_dtypes_name_the_precision_policy():
    """Under bf16-mixed the parameters are cast and buffers are not (as FSDP2 does): a model that
    multiplies the two is told so, with the precision to pick, not to check its inputs."""
    with pytest.raises(TraceError) as excinfo:
        trace_joint(Float32Buffer(), (torch.randn(4, 2, 8),), param_dtype=torch.bfloat16)
    message = str(excinfo.value)
    assert f": {te.MIXED_DTYPES}: " in message and f"{HERE}:{_line_of('against a float32 buffer')}" in message, message
    assert "precision='fp32'" in message and "\n" not in message, message
    trace_joint(Float32Buffer(), (torch.randn(4, 2, 8),))  # in fp32 it traces


@_needs_refusing_bmm(torch.float32, torch.float64)
def test_a_dtype_clash_without_half_precision_is_not_blamed_on_the_policy():
    """A float64 buffer against float32 activations clashes in any precision: the error must not
    send the user to precision='fp32'."""
    message = _refusal(Float32Buffer(torch.float64), (torch.randn(4, 2, 8),))
    assert te.MIXED_DTYPES not in message and "precision=" not in message, message


def test_exception_of_the_users_code_is_theirs():
    message = _refusal(Raises(), (torch.randn(4, 8),))
    assert message.startswith(f"{Path(__file__)}:{_line_of('raise ValueError')}: ValueError: expects 3-d inputs")
    assert "not by autopar" in message


def test_cache_object_in_inputs():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=32, vocab_size=64)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8))
    message = _refusal(model, {"input_ids": ids, "labels": ids,
                               "past_key_values": transformers.DynamicCache(config=config)})
    assert message.startswith(f"{te.CACHE_OBJECT}: input 'past_key_values' is a DynamicCache"), message


def test_import_error_while_loading_a_model_spec(tmp_path, monkeypatch):
    (tmp_path / "spec.py").write_text("import torch\nimport autopar_no_such_package\n\ndef build():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserCodeError) as excinfo:
        load_model_spec("spec.py:build")
    message = str(excinfo.value)
    assert re.match(r"spec\.py:2 in <module>: ModuleNotFoundError: No module named 'autopar_no_such_package'", message)
    assert "this is an import error: install the missing package 'autopar_no_such_package'" in message


def test_every_cause_has_a_fix():
    causes = [v for k, v in vars(te).items() if k.isupper() and isinstance(v, str)]
    assert len(causes) >= 5 and set(causes) == set(te._FIXES)


def test_autograd_in_a_forked_process_is_named():
    """torch's CUDA builds refuse autograd in a child forked after its parent ran it, and a trace runs a
    backward: the error says so (and how to start the process), rather than blaming the inputs or the
    model's Python. The chain is the one Dynamo raises: its runtime error over the engine's."""
    root = RuntimeError("Unable to handle autograd's threading in combination with fork-based multiprocessing. "
                        "See https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork")
    try:
        try:
            raise root
        except RuntimeError as e:
            raise torch._dynamo.exc.TorchRuntimeError("Dynamo failed to run FX node with fake tensors") from e
    except Exception as e:  # noqa: BLE001
        message = str(te.trace_error(e, "Net"))
    assert f"could not trace Net: {te.FORKED}: RuntimeError: Unable to handle autograd's threading" in message, message
    assert "'spawn' or 'forkserver'" in message, message

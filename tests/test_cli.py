"""The ``autopar`` command line: ``analyze`` prints a table and writes JSON; user
mistakes print one line, ``autopar: error: ...``, and exit with status 2."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autopar import progress
from autopar.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    # main() points progress lines at the (captured) stderr of the moment; put it back after
    monkeypatch.setattr(progress, "_stream", progress._stream)


def one_error_line(err: str, *, only: bool = False) -> str:
    """The single ``autopar: error:`` line of ``err``; other lines may only be progress lines."""
    assert "Traceback" not in err
    lines = err.splitlines()
    errors = [line for line in lines if line.startswith("autopar: error: ")]
    assert len(errors) == 1, err
    if only:
        assert lines == errors, err
    else:  # a phase that runs over a second announces itself ("autopar: tracing X ...")
        assert all(line.startswith("autopar: ") for line in lines), err
    return errors[0]


def test_analyze_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["analyze", "examples/gpt.py:build", "--cluster", "1x8xH100", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "Block" in stdout and "parameters" in stdout
    assert "1x8xH100" in stdout
    report = json.loads(out.read_text())
    assert {"n_params", "layers", "model_flops_per_step"} <= set(report)
    assert report["n_params"] == 120576  # gpt tiny, the head tied to the embedding
    # the state of the policy a GPU plan uses (bf16-mixed: 2 + 4 fp32 grads + 12), as the planner counts it
    assert report["precision"] == "bf16-mixed"
    assert report["training_state_bytes"] == 18 * 120576
    assert "18 B/param" in stdout
    assert report["model_flops_per_step"] > 0
    assert any(row["class_name"] == "Block" and row["count"] == 2 for row in report["layers"])


def test_bad_cluster_spec_is_one_line(capsys):
    assert main(["analyze", "examples/gpt.py:build", "--cluster", "2x8xH1000"]) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err, only=True)
    assert "known devices" in line and "H1000" in line
    assert captured.out == ""


def test_missing_model_file(capsys):
    assert main(["analyze", "examples/no_such_model.py:build", "--cluster", "1x8xH100"]) == 2
    assert "no_such_model.py" in one_error_line(capsys.readouterr().err, only=True)


def test_arg_without_equals(capsys):
    assert main(["analyze", "examples/gpt.py:build", "--cluster", "1x8xH100", "--arg", "size"]) == 2
    line = one_error_line(capsys.readouterr().err, only=True)
    assert "--arg" in line and "key=value" in line


def test_model_errors_are_one_line(tmp_path, capsys):
    spec = tmp_path / "bad_models.py"
    spec.write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn

        class Branchy(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                y = self.lin(x)
                if y.sum() > 0:
                    return y.sum()
                return -y.sum()

        def logits():
            return nn.Linear(4, 3), (torch.randn(2, 4),)

        def branchy():
            return Branchy(), (torch.randn(2, 4),)
    """))
    assert main(["analyze", f"{spec}:logits", "--cluster", "1x1xcpu"]) == 2
    assert "loss_fn" in one_error_line(capsys.readouterr().err)
    assert main(["analyze", f"{spec}:branchy", "--cluster", "1x1xcpu"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{spec}:12" in line and "Try" in line


def test_usage_errors_exit_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["analyze", "examples/gpt.py:build"])  # no --cluster
    assert excinfo.value.code == 2
    assert "--cluster" in one_error_line(capsys.readouterr().err, only=True)


def test_console_entry_point_exits_2():
    result = subprocess.run([sys.executable, "-m", "autopar.cli", "analyze", "examples/gpt.py:build",
                             "--cluster", "0x8xH100"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    line = one_error_line(result.stderr, only=True)
    assert "0x8xH100" in line and "known devices" in line

"""bench/gpu_check.py: a clear refusal without CUDA, and its CPU dry run (the same code on a tiny GPT)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_it_says_it_needs_a_gpu(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r
    assert "needs a CUDA GPU" in r.stderr and "--device cpu --tiny" in r.stderr and len(r.stderr.splitlines()) == 1


def test_cpu_dry_run_without_ortools_writes_the_figures(tmp_path):
    """As on the GPU machine: no OR-tools (hidden here), world size 1, bf16 mixed, figures in a JSON file."""
    out = tmp_path / "gpu.json"
    code = ("import sys, runpy; sys.modules['ortools'] = None\n"
            f"sys.argv = ['gpu_check.py', '--device', 'cpu', '--tiny', '--steps', '2', '--out', {str(out)!r}]\n"
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    r = _run(code, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert "without OR-tools" in data["plan_source"]
    m = data["model"]
    assert m["precision"] == "bf16-mixed" and m["plan_mesh"] == {"pp": 1, "dp": 1, "tp": 1}
    assert m["predicted_step_s"] > 0 and m["measured_step_s"] > 0 and m["measured_peak_bytes"] > 0
    assert all(x == x and x > 0 for x in m["losses"])
    kinds = {r["kind"] for r in data["kernels"]["rows"]}
    assert kinds == {"gemm", "attention", "causal attention fwd", "causal attention bwd"}
    roles = {r.get("role") for r in data["kernels"]["rows"] if r.get("model")}
    assert roles == {"forward", "input grad", "weight grad"}
    assert all(r["predicted_s_cpu"] > 0 and r["measured_s"] > 0 for r in data["kernels"]["rows"])
    sustained = data["kernels"]["sustained"]
    assert sustained["first_s"] > 0 and sustained["last_s"] > 0 and sustained["last_over_first"] > 0
    blocks = data["blocks"]["llama-tiny"]
    for depth in ("1", "3"):  # each depth measured and priced, by role and kernel kind
        row = blocks["depths"][depth]
        assert row["measured"]["forward_s"] > 0 and row["measured"]["forward_backward_s"] > 0
        predicted = row["predicted"]["cpu"]
        assert {"forward gemm", "backward gemm", "forward attention", "forward other"} <= set(predicted)
        assert predicted["total"] == pytest.approx(sum(v for k, v in predicted.items() if k != "total"))
    summary = blocks["summary"]
    assert summary["block_predicted_s_cpu"] > 0 and summary["block_flops"] > 0
    assert summary["block_measured_over_predicted_cpu"] == pytest.approx(
        summary["block_forward_backward_s"] / summary["block_predicted_s_cpu"])
    ring = data["ring"]  # torch's ring attention of one cp rank, emulated on one device
    assert all(err < 1e-5 for err in ring["check_cp2"].values()), ring["check_cp2"]
    assert {(row["cp"], row["rank"]) for row in ring["rows"]} == {(2, 0), (2, 1), (4, 0), (4, 3)}
    for row in ring["rows"]:
        assert row["forward_s"] > 0 and row["sdpa_backward_s"] > 0
        assert row["predicted_cpu"]["forward_s"] > row["predicted_cpu"]["sdpa_forward_s"] > 0
    op = data["cp_op"]  # autopar's own cp attention op at cp 1, on the device's fused kernel
    assert op["kernel"] == "cpu_flash" and all(err < 2e-2 for err in op["relative_error"].values()), op
    assert op["autopar_forward_backward_s"] > 0 and op["sdpa_forward_s"] > 0
    assert "llama-tiny block" in r.stdout and "ring cp=4 rank 3" in r.stdout and "cp op (cpu_flash)" in r.stdout
    assert "wrote" in r.stdout


@pytest.mark.parametrize("cp", [1, 3, 4])
def test_ring_emulation_equals_whole_sequence_attention(cp, monkeypatch):
    """bench/gpu_ring.py's rank programs, run for every rank in lockstep, give causal attention over
    the whole sequence (output and the gradients of q, k and v); with the later ranks' half-blocks
    swapped, they do not (so the comparison can fail)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_ring

    errors = gpu_ring.check(cp, shape=(2, 3, 8, 4), seed=cp)
    assert max(errors.values()) < 1e-6, errors
    if cp > 1:
        right = gpu_ring.RankRing._step_inputs

        def swapped(self, i):
            q, k, v, causal, partial = right(self, i)
            if 0 < i <= self.rank:  # the second half of the keys instead of the first
                k, v = (x.chunk(2, dim=2)[1] for x in self.blocks[(self.rank - i) % self.cp])
            return q, k, v, causal, partial

        monkeypatch.setattr(gpu_ring.RankRing, "_step_inputs", swapped)
        assert max(gpu_ring.check(cp, shape=(2, 3, 8, 4), seed=cp).values()) > 1e-2

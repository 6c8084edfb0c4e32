"""`autopar plan --emit DIR` writes each rank's generated program (local ops + functional collectives)."""

import json
from pathlib import Path

from autopar.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_emit_writes_rank_programs_with_collectives(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    cluster = tmp_path / "cluster.json"  # fast links: the tiny model gets tensor-parallel shards
    cluster.write_text(json.dumps({"nodes": 1, "devices_per_node": 2, "device": {
        "base": "cpu", "intra_node_bytes_per_s": 1e11, "inter_node_bytes_per_s": 1e11,
        "intra_node_latency_s": 1e-5, "inter_node_latency_s": 1e-5}}))
    out = tmp_path / "programs"
    rc = main(["plan", "examples/gpt.py:build", "--cluster", str(cluster), "--fix", "tp=2", "--fix", "pp=1",
               "--emit", str(out)])
    assert rc == 0
    files = sorted(out.glob("rank_*.py"))
    assert [f.name for f in files] == ["rank_0.py", "rank_1.py"]  # tp ranks slice different shards
    code = files[0].read_text()
    assert "def forward(" in code
    assert "_c10d_functional.all_reduce" in code or "_c10d_functional.reduce_scatter_tensor" in code
    assert "DTensor" not in code  # plain local ops: nothing of DTensor is left
    compile(code, str(files[0]), "exec")
    assert "wrote 2 rank program(s)" in capsys.readouterr().out


def test_emit_writes_each_pipeline_stage_as_f_b_w_pieces(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "programs"
    rc = main(["plan", "examples/gpt.py:build", "--cluster", "1x2xcpu", "--fix", "pp=2", "--fix", "schedule=zb-h1",
               "--fix", "microbatches=2", "--emit", str(out)])
    assert rc == 0
    files = sorted(out.glob("rank_*.py"))
    assert [f.name for f in files] == ["rank_0.py", "rank_1.py"]
    first, last = (f.read_text() for f in files)
    for stage, code in ((0, first), (1, last)):
        for piece in ("F: forward", "B: gradients w.r.t. the stage's inputs", "W: gradients w.r.t. the stage's weights"):
            assert f"# ---- stage {stage} {piece}" in code
        compile(code, "rank.py", "exec")
    assert "aten.nll_loss_forward" in last and "aten.nll_loss_forward" not in first  # the loss is on the last stage
    assert "aten.embedding.default" in first and "aten.embedding.default" not in last

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

"""Cluster specs, files, overrides and link choice."""

import json
import sys

import pytest

from autopar.cluster import Cluster, parse_cluster
from autopar.cost.compute import MEMORY_EFFICIENCY
from autopar.cost.comm import NETWORK_EFFICIENCY, Link
from autopar.cost.devices import DEVICES
from autopar.errors import AutoparError, ClusterSpecError, InfeasibleError, PlanError, TraceError


@pytest.mark.parametrize(
    ("spec", "nodes", "per_node", "device"),
    [
        ("2x8xH100", 2, 8, "H100"),
        ("64x8xA100-80GB", 64, 8, "A100-80GB"),
        ("1x4xcpu", 1, 4, "cpu"),
        ("16x8xH200", 16, 8, "H200"),
        ("4x8xB200", 4, 8, "B200"),
        ("2x8xh100", 2, 8, "H100"),
        ("1X4XCPU", 1, 4, "cpu"),
        (" 8x8xa100 ", 8, 8, "A100-80GB"),
    ],
)
def test_good_specs(spec, nodes, per_node, device):
    cluster = parse_cluster(spec)
    assert cluster.nodes == nodes
    assert cluster.devices_per_node == per_node
    assert cluster.device is DEVICES[device]
    assert cluster.world_size == nodes * per_node
    assert cluster.spec == f"{nodes}x{per_node}x{DEVICES[device].name}"


@pytest.mark.parametrize(
    ("spec", "bad_value"),
    [
        ("2x8", "'2x8'"),
        ("0x8xH100", "node count '0'"),
        ("2x8xH1000", "unknown device 'H1000'"),
        ("-1x8xH100", "node count '-1'"),
        ("1.5x8xH100", "node count '1.5'"),
        ("2x0xH100", "devices per node '0'"),
        ("", "it is empty"),
    ],
)
def test_bad_specs(spec, bad_value):
    with pytest.raises(ClusterSpecError) as info:
        parse_cluster(spec)
    message = str(info.value)
    assert "\n" not in message
    assert f"invalid cluster spec {spec!r}" in message
    assert bad_value in message
    assert "NODESxDEVICESxDEVICE" in message and "2x8xH100" in message
    for name in DEVICES:
        assert name in message
    assert isinstance(info.value, ValueError)


def test_error_hierarchy():
    assert issubclass(ClusterSpecError, AutoparError) and issubclass(ClusterSpecError, ValueError)
    assert issubclass(TraceError, AutoparError) and issubclass(TraceError, RuntimeError)
    assert issubclass(PlanError, AutoparError) and issubclass(PlanError, ValueError)
    assert issubclass(InfeasibleError, PlanError)


def test_parse_cluster_passes_clusters_through_and_rejects_other_types():
    cluster = parse_cluster("2x8xH100")
    assert parse_cluster(cluster) is cluster
    with pytest.raises(TypeError, match="spec string"):
        parse_cluster(16)


def test_direct_construction_validates():
    with pytest.raises(ClusterSpecError, match="nodes must be a positive integer, got 0"):
        Cluster(nodes=0, devices_per_node=8, device=DEVICES["H100"])
    with pytest.raises(TypeError, match="DeviceSpec"):
        Cluster(nodes=1, devices_per_node=8, device="H100")


def test_link_for_group():
    cluster = parse_cluster("2x8xH100")
    h100 = DEVICES["H100"]
    nvlink = Link(bytes_per_s=h100.intra_node_bytes_per_s, latency_s=h100.intra_node_latency_s, nvswitch=True,
                  copy_bytes_per_s=h100.hbm_bytes_per_s * MEMORY_EFFICIENCY)  # (collectives' local copies)
    assert cluster.link_for_group(8, 1) == nvlink
    assert cluster.link_for_group(2, 4) == nvlink
    # across nodes: one NIC per rank of the group on each node (8 for dp=16, 1 for stride 8)
    eff = 50e9 * NETWORK_EFFICIENCY
    assert not cluster.link_for_group(16, 1).nvswitch
    assert cluster.link_for_group(16, 1).bytes_per_s == pytest.approx(8 * eff)
    assert cluster.link_for_group(2, 8).bytes_per_s == pytest.approx(eff)


def test_pipeline_links_follow_the_runtime_rank_layout():
    """Issue 10: 2x8 H100s, tp=4, dp=1, pp=4: pipeline ranks hold ranks 0-3, 4-7, 8-11, 12-15, so only
    the cut between stages 1 and 2 crosses nodes (link_for_group(2, stride=4) called every cut NVLink)."""
    torch = pytest.importorskip("torch")
    from autopar.cost.comm import stage_ranks

    cluster = parse_cluster("2x8xH100")
    h100 = DEVICES["H100"]
    nvlink = Link(bytes_per_s=h100.intra_node_bytes_per_s, latency_s=h100.intra_node_latency_s)
    network = Link(bytes_per_s=h100.inter_node_bytes_per_s, latency_s=h100.inter_node_latency_s)
    assert cluster.pipeline_links(pp=4, dp=1, tp=4) == (nvlink, network, nvlink)
    # interleaved, 2 stages per rank: stage 3 (ranks 12-15) hands on to stage 4 (ranks 0-3) across nodes
    assert cluster.pipeline_links(pp=4, dp=1, tp=4, n_stages=8) == (nvlink, network, nvlink, network,
                                                                    nvlink, network, nvlink)
    assert cluster.pipeline_links(pp=2, dp=2, tp=4) == (network,)  # ranks 0-7 -> 8-15
    assert cluster.pipeline_links(pp=8, dp=1, tp=2) == (nvlink,) * 3 + (network,) + (nvlink,) * 3
    assert parse_cluster("1x8xH100").pipeline_links(pp=8, dp=1, tp=1) == (nvlink,) * 7
    # the layout is init_device_mesh's for mesh shape (pp, dp, tp): torch.arange(world).view(pp, dp, tp)
    pp, dp, tp = 2, 4, 2
    mesh = torch.arange(pp * dp * tp).view(pp, dp, tp)
    for p in range(pp):
        assert list(stage_ranks(p, dp=dp, tp=tp)) == mesh[p].flatten().tolist()


def test_single_node_never_uses_network():
    cluster = parse_cluster("1x4xcpu")
    cpu = DEVICES["cpu"]
    assert cluster.link_for_group(3, 1) == Link(
        bytes_per_s=cpu.intra_node_bytes_per_s, latency_s=cpu.intra_node_latency_s
    )


def test_overrides():
    base = parse_cluster("2x8xH100")
    small = base.with_overrides(hbm_bytes=40e9)
    assert small.device.hbm_bytes == 40_000_000_000
    assert small.device.hbm_bytes_per_s == base.device.hbm_bytes_per_s
    assert small != base
    assert len({base, small, Cluster.from_spec("2x8xH100")}) == 2
    assert Cluster.from_spec("2x8xH100", hbm_bytes=40e9) == small
    assert Cluster.from_spec("2x8xH100") == base
    with pytest.raises(ClusterSpecError, match="unknown device field.*hbm_gb"):
        base.with_overrides(hbm_gb=40)


def test_dict_round_trip_is_json_able():
    cluster = parse_cluster("4x8xB200").with_overrides(peak_flops_per_s={"bf16": 2e15})
    data = json.loads(json.dumps(cluster.to_dict(), sort_keys=True))
    assert Cluster.from_dict(data) == cluster
    assert parse_cluster(data) == cluster
    assert data["device"]["hbm_bytes_per_s"] == 8e12


def test_json_file_round_trip_with_overrides(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({
        "nodes": 2,
        "devices_per_node": 8,
        "device": {"base": "h100", "hbm_bytes": 40 * 2**30, "peak_flops_per_s": {"bf16": 8e14}},
    }))
    cluster = parse_cluster(path)
    assert parse_cluster(str(path)) == cluster
    assert cluster.spec == "2x8xH100"
    assert cluster.device.hbm_bytes == 40 * 2**30
    assert cluster.device.peak("bf16") == 8e14
    assert cluster.device.peak("fp32") == DEVICES["H100"].peak("fp32")
    # The full figures written by to_dict read back identically.
    written = tmp_path / "written.json"
    written.write_text(json.dumps(cluster.to_dict()))
    assert parse_cluster(written) == cluster


def test_json_file_with_device_name(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"nodes": 1, "devices_per_node": 4, "device": "cpu"}')
    assert parse_cluster(path) == parse_cluster("1x4xcpu")


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        ("{not json", "not valid JSON"),
        ('{"nodes": 2, "devices_per_node": 8}', "missing keys \\['device'\\]"),
        ('{"nodes": 2, "devices_per_node": 8, "device": "H100", "gpus": 1}', "unknown keys \\['gpus'\\]"),
        ('{"nodes": 2.5, "devices_per_node": 8, "device": "H100"}', "nodes must be a positive integer, got 2.5"),
        ('{"nodes": 2, "devices_per_node": 8, "device": "H1000"}', "unknown device 'H1000'"),
        ('{"nodes": 2, "devices_per_node": 8, "device": {"base": "H100", "hbm": 1}}', "unknown device field"),
        ('{"nodes": 2, "devices_per_node": 8, "device": 7}', "device must be a name"),
        ("[1, 2]", "expected a mapping"),
    ],
)
def test_bad_json_files(tmp_path, content, pattern):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ClusterSpecError, match=pattern) as info:
        parse_cluster(path)
    assert "bad.json" in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ClusterSpecError, match="cannot read"):
        parse_cluster(str(tmp_path / "nope.json"))


def test_yaml_file(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "cluster.yaml"
    path.write_text("nodes: 16\ndevices_per_node: 8\ndevice:\n  base: H200\n  inter_node_bytes_per_s: 1.0e+11\n")
    cluster = parse_cluster(path)
    assert cluster.spec == "16x8xH200"
    assert cluster.device.inter_node_bytes_per_s == 1e11


def test_yaml_without_pyyaml_says_use_json(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)
    path = tmp_path / "cluster.yml"
    path.write_text("nodes: 1\n")
    with pytest.raises(ClusterSpecError, match="PyYAML.*JSON"):
        parse_cluster(path)

"""Alpha-beta collective costs and intra/inter-node link choice."""

import pytest

from autopar.cost.comm import (
    Link,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    broadcast_s,
    group_link,
    p2p_s,
    reduce_scatter_s,
)
from autopar.cost.devices import DEVICES

H100 = DEVICES["H100"]
LINK = Link(bytes_per_s=100e9, latency_s=10e-6)


def test_ring_all_reduce_hand_computed():
    # 1 GB over 4 ranks at 100 GB/s, 10 us per step:
    # 2 * 3/4 * 1e9 / 1e11 = 0.015 s; 2 * 3 * 10 us = 60 us.
    assert all_reduce_s(1e9, 4, LINK) == pytest.approx(0.015 + 60e-6)


def test_gather_scatter_all_to_all_hand_computed():
    # 8 ranks, 800 MB: 7/8 * 8e8 / 1e11 = 7e-3 s; 7 steps * 10 us = 70 us.
    expected = 7e-3 + 70e-6
    assert all_gather_s(8e8, 8, LINK) == pytest.approx(expected)
    assert reduce_scatter_s(8e8, 8, LINK) == pytest.approx(expected)
    assert all_to_all_s(8e8, 8, LINK) == pytest.approx(expected)


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    for n in (2, 3, 8, 64):
        assert all_reduce_s(1e8, n, LINK) == pytest.approx(
            reduce_scatter_s(1e8, n, LINK) + all_gather_s(1e8, n, LINK)
        )


def test_broadcast_and_p2p():
    assert broadcast_s(1e9, 4, LINK) == pytest.approx(1e9 / 1e11 + 3 * 10e-6)
    assert p2p_s(1e9, LINK) == pytest.approx(1e9 / 1e11 + 10e-6)
    assert p2p_s(0, LINK) == pytest.approx(10e-6)


def test_group_of_one_is_free():
    for fn in (all_reduce_s, all_gather_s, reduce_scatter_s, all_to_all_s, broadcast_s):
        assert fn(1e9, 1, LINK) == 0.0


def test_invalid_arguments():
    with pytest.raises(ValueError, match="group_size"):
        all_reduce_s(1e9, 0, LINK)
    with pytest.raises(ValueError, match="nbytes"):
        all_gather_s(-1.0, 2, LINK)
    with pytest.raises(ValueError, match="bytes_per_s"):
        Link(bytes_per_s=0.0, latency_s=0.0)
    with pytest.raises(ValueError, match="latency_s"):
        Link(bytes_per_s=1.0, latency_s=-1.0)
    with pytest.raises(ValueError, match="stride"):
        group_link(group_size=2, stride=0, devices_per_node=8, device=H100)


def _is_nvlink(link: Link) -> bool:
    return link == Link(bytes_per_s=H100.intra_node_bytes_per_s, latency_s=H100.intra_node_latency_s)


def _is_network(link: Link) -> bool:
    return link == Link(bytes_per_s=H100.inter_node_bytes_per_s, latency_s=H100.inter_node_latency_s)


def test_tp8_stride1_is_nvlink():
    assert _is_nvlink(group_link(group_size=8, stride=1, devices_per_node=8, device=H100))


def test_group_of_16_is_network():
    assert _is_network(group_link(group_size=16, stride=1, devices_per_node=8, device=H100))


def test_group_of_8_stride_8_is_network():
    assert _is_network(group_link(group_size=8, stride=8, devices_per_node=8, device=H100))


def test_small_strided_group_inside_node_is_nvlink():
    # dp=2 over tp=4 on 8-GPU nodes: groups {0,4}, {1,5}, ... stay in one node.
    assert _is_nvlink(group_link(group_size=2, stride=4, devices_per_node=8, device=H100))


def test_unaligned_group_is_network():
    # tp=4 on 6-GPU nodes: ranks 4..7 straddle nodes 0 and 1.
    assert _is_network(group_link(group_size=4, stride=1, devices_per_node=6, device=H100))


def test_network_all_reduce_is_slower_than_nvlink():
    nvlink = group_link(group_size=8, stride=1, devices_per_node=8, device=H100)
    network = group_link(group_size=8, stride=8, devices_per_node=8, device=H100)
    assert all_reduce_s(1e9, 8, network) > all_reduce_s(1e9, 8, nvlink)

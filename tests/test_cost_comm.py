"""Alpha-beta collective costs, intra/inter-node link choice, and the NCCL calibration points."""

import pytest

from autopar.cost.comm import (
    NCCL_ALL_TO_ALL_MANY_NODES,
    NETWORK_EFFICIENCY,
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
    return link.nvswitch and link.bytes_per_s == H100.intra_node_bytes_per_s


def _is_network(link: Link, nics: int = 1) -> bool:
    """A group spanning nodes with ``nics`` of its ranks (and so NICs) on each node."""
    return not link.nvswitch and link.bytes_per_s == pytest.approx(nics * 50e9 * NETWORK_EFFICIENCY)


def test_tp8_stride1_is_nvlink():
    assert _is_nvlink(group_link(group_size=8, stride=1, devices_per_node=8, device=H100))


def test_group_of_16_is_network():
    assert _is_network(group_link(group_size=16, stride=1, devices_per_node=8, device=H100), nics=8)


def test_group_of_8_stride_8_is_network():
    assert _is_network(group_link(group_size=8, stride=8, devices_per_node=8, device=H100))


def test_small_strided_group_inside_node_is_nvlink():
    # dp=2 over tp=4 on 8-GPU nodes: groups {0,4}, {1,5}, ... stay in one node.
    assert _is_nvlink(group_link(group_size=2, stride=4, devices_per_node=8, device=H100))


def test_unaligned_group_is_network():
    # tp=4 on 6-GPU nodes: ranks 4..7 straddle nodes 0 and 1.
    assert _is_network(group_link(group_size=4, stride=1, devices_per_node=6, device=H100), nics=4)


def test_network_all_reduce_is_slower_than_nvlink():
    nvlink = group_link(group_size=8, stride=1, devices_per_node=8, device=H100)
    network = group_link(group_size=8, stride=8, devices_per_node=8, device=H100)
    assert all_reduce_s(1e9, 8, network) > all_reduce_s(1e9, 8, nvlink)


# --- calibration: nccl-tests on 8x H100 NVSwitch, 1 GB messages (algorithm bandwidth, GB/s,
# and small-message latency, us), meta-pytorch/autoparallel nccl_cost_model.py ---
_AG_ALGBW = {2: 537e9, 4: 434e9, 8: 394e9}
_AR_ALGBW = {2: 324e9, 4: 236e9, 8: 267e9}
_AG_LAT = {2: 8e-6, 4: 17e-6, 8: 30e-6}
_AR_LAT = {2: 10e-6, 4: 15e-6, 8: 31e-6}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_nvswitch_reproduces_measured_bandwidth_and_latency(n):
    link = group_link(group_size=n, stride=1, devices_per_node=8, device=H100)
    gb = 2**30  # 1 GB message; algbw = size / (time - latency)
    assert 2**30 / (all_gather_s(gb, n, link) - _AG_LAT[n]) == pytest.approx(_AG_ALGBW[n], rel=1e-9)
    assert 2**30 / (reduce_scatter_s(gb, n, link) - _AG_LAT[n]) == pytest.approx(_AG_ALGBW[n], rel=1e-9)
    assert 2**30 / (all_reduce_s(gb, n, link) - _AR_LAT[n]) == pytest.approx(_AR_ALGBW[n], rel=1e-9)
    assert all_gather_s(0, n, link) == pytest.approx(_AG_LAT[n])
    assert all_reduce_s(0, n, link) == pytest.approx(_AR_LAT[n])


def test_nvswitch_interpolates_between_group_sizes():
    link = group_link(group_size=8, stride=1, devices_per_node=8, device=H100)
    t = [all_gather_s(1e9, n, link) for n in (2, 3, 4, 6, 8)]
    assert t[0] < t[1] < t[2] < t[3] < t[4]  # more ranks, more steps: slower for the same output


def test_collectives_grow_with_message_size_and_vanish_for_one_rank():
    for link in (group_link(group_size=8, stride=1, devices_per_node=8, device=H100),
                 group_link(group_size=64, stride=1, devices_per_node=8, device=H100)):
        for fn in (all_gather_s, reduce_scatter_s, all_reduce_s):
            sizes = [0, 1e3, 1e6, 1e9, 1e10]
            times = [fn(x, 8, link) for x in sizes]
            assert all(a < b for a, b in zip(times, times[1:])), fn.__name__
            assert fn(1e9, 1, link) == 0.0


def test_network_bandwidth_grows_with_ranks_per_node():
    # dp over 32 nodes: one rank per node (stride 8), 2 (stride 4), 4, 8 (stride 1).
    bw = [group_link(group_size=32 * ppn, stride=8 // ppn, devices_per_node=8, device=H100).bytes_per_s
          for ppn in (1, 2, 4, 8)]
    assert bw == sorted(bw) and bw[0] == pytest.approx(50e9 * NETWORK_EFFICIENCY)
    # 8 NICs: 334 GB/s, under the 345 GB/s that 8 ranks reach inside a node
    assert bw[3] == pytest.approx(8 * 50e9 * 0.96 * 0.87)
    assert bw[3] < 394e9 * 7 / 8


def test_network_latency_reproduces_nccl_ring_model():
    # NCCL 2.27 tuning table for H100 (autoparallel _H100_AGRS_RING, SIMPLE): all-gather
    # latency 1204 us at 32 nodes x 8 ranks, 442.4 us at 32 x 1, 70 us at 2 x 8.
    for nodes, ppn, expected in ((32, 8, 1204e-6), (32, 1, 442.4e-6), (2, 8, 70e-6)):
        n = nodes * ppn
        link = group_link(group_size=n, stride=8 // ppn, devices_per_node=8, device=H100)
        assert all_gather_s(0, n, link) == pytest.approx(expected, rel=0.15)


def test_bucketed_link_has_no_latency():
    from dataclasses import replace
    link = replace(group_link(group_size=8, stride=1, devices_per_node=8, device=H100), latency_s=0.0)
    assert all_reduce_s(0, 8, link) == 0.0


def test_context_attention_ring_hides_hops_behind_block_compute():
    from autopar.cost.comm import context_attention_cost, context_kv_bytes, p2p_s

    link = Link(bytes_per_s=100e9, latency_s=5e-6)
    kv, dkv = context_kv_bytes(batch=1, kv_heads=8, seq_local=8192, head_dim=128, elem_bytes=2)
    assert (kv, dkv) == (2 * 8 * 8192 * 128 * 2, 2 * 8 * 8192 * 128 * 4)
    hop_f, hop_b, last = p2p_s(kv, link), p2p_s(kv + dkv, link), p2p_s(dkv, link)
    cp = 4
    # compute-bound: every hop hidden, only the gradients' last hop home is exposed
    slow = context_attention_cost(variant="ring", cp=cp, kv_bytes=kv, dkv_bytes=dkv, forward_s=1.0,
                                  backward_s=2.0, link=link)
    assert slow.forward_exposed_s == 0 and slow.backward_exposed_s == pytest.approx(last)
    assert slow.forward_comm_s == pytest.approx(3 * hop_f) and slow.backward_comm_s == pytest.approx(3 * hop_b + last)
    # communication-bound: each hop exposed by what it takes beyond one step's compute
    fast = context_attention_cost(variant="ring", cp=cp, kv_bytes=kv, dkv_bytes=dkv, forward_s=4e-5,
                                  backward_s=8e-5, link=link)
    assert fast.forward_exposed_s == pytest.approx(3 * (hop_f - 1e-5))
    assert fast.backward_exposed_s == pytest.approx(3 * (hop_b - 2e-5) + last)
    # compute slowed under overlap: a hidden hop still costs hop x (1 - 1/slowdown)
    shared = context_attention_cost(variant="ring", cp=cp, kv_bytes=kv, dkv_bytes=dkv, forward_s=1.0,
                                    backward_s=2.0, link=link, overlap_slowdown=1.25)
    assert shared.forward_exposed_s == pytest.approx(3 * hop_f * 0.2)


def test_context_attention_allgather_hides_nothing_and_cp1_costs_nothing():
    from autopar.cost.comm import all_gather_s, context_attention_cost, reduce_scatter_s

    link = Link(bytes_per_s=100e9, latency_s=5e-6)
    kv, dkv = 1e6, 2e6
    ag = context_attention_cost(variant="allgather", cp=4, kv_bytes=kv, dkv_bytes=dkv, forward_s=1.0,
                                backward_s=2.0, link=link)
    assert ag.forward_exposed_s == pytest.approx(all_gather_s(4 * kv, 4, link))
    assert ag.backward_exposed_s == pytest.approx(all_gather_s(4 * kv, 4, link) + reduce_scatter_s(4 * dkv, 4, link))
    assert ag.exposed_s == ag.forward_comm_s + ag.backward_comm_s
    none = context_attention_cost(variant="ring", cp=1, kv_bytes=kv, dkv_bytes=dkv, forward_s=1.0, backward_s=2.0,
                                  link=link)
    assert none.exposed_s == 0 and none.forward_comm_s == 0
    with pytest.raises(ValueError, match="variant 'ulysses'"):
        context_attention_cost(variant="ulysses", cp=2, kv_bytes=kv, dkv_bytes=dkv, forward_s=1.0, backward_s=1.0,
                               link=link)


def test_torch_context_attention_prices_its_gathers_last_gradient_hop_and_eager_merges():
    """torch's own context parallelism (pinned ``cp_variant="torch"``): the all-gathers hide behind
    step 0, the fp32 K/V gradient hops behind the next step but the last, and its eager per-step
    kernels are counted op by op (here independently of the function's closed form)."""
    from autopar.cost.comm import all_gather_s, p2p_s, torch_context_attention_cost

    link = Link(bytes_per_s=100e9, latency_s=5e-6)
    cp, n, e, rate = 4, 1_000_000, 2, 1e12  # n elements per K (= V = output) block, bf16
    kv = 2 * n * e

    def merge(x):  # upcast, out - block, sigmoid-weight x diff, out - product (bytes per element)
        return (e + 4) + (4 + 4 + 4) + (4 + 4) + (4 + 4 + 4)

    forward = (cp - 1) * (2 * kv + merge(1) * n) + (e + 4) * n + (4 + e) * n
    additions = 3 * ((4 + e) + 4)  # fp32 += bf16, for q, k and v
    backward = 3 * 4 * n + (cp - 1) * 2 * kv + cp * (additions + 2 * (2 * n * 4) / n) * n + 3 * (4 + e) * n
    # the busiest rank's steps after the first: K and V gradients added into half the accumulators
    # (half of two of the three additions), and both accumulators concatenated whole again (read + write)
    backward += (cp - 1) * (-2 * ((4 + e) + 4) / 2 + 2 * (4 + 4)) * n
    gather, hop = all_gather_s(cp * kv, cp, link), p2p_s(2 * n * 4, link)
    slow = torch_context_attention_cost(cp=cp, kv_bytes=kv, elem_bytes=e, forward_s=1.0, backward_s=2.0, link=link,
                                        memory_bytes_per_s=rate)
    assert slow.variant == "torch"
    assert slow.forward_exposed_s == pytest.approx(forward / rate)
    assert slow.backward_exposed_s == pytest.approx(hop + backward / rate)
    assert slow.forward_comm_s == pytest.approx(gather) and slow.backward_comm_s == pytest.approx(gather + cp * hop)
    fast = torch_context_attention_cost(cp=cp, kv_bytes=kv, elem_bytes=e, forward_s=4e-6, backward_s=8e-6, link=link,
                                        memory_bytes_per_s=rate)
    assert fast.forward_exposed_s == pytest.approx(gather - 1e-6 + forward / rate)
    assert fast.backward_exposed_s == pytest.approx(gather - 2e-6 + (cp - 1) * (hop - 2e-6) + hop + backward / rate)
    assert fast.sent_bytes == 2 * (cp - 1) * kv + cp * 8 * n
    # compute slowed while a transfer overlaps it: a hidden gather or hop still costs 1 - 1/slowdown of itself
    shared = torch_context_attention_cost(cp=cp, kv_bytes=kv, elem_bytes=e, forward_s=1.0, backward_s=2.0,
                                          link=link, memory_bytes_per_s=rate, overlap_slowdown=1.25)
    assert shared.forward_exposed_s == pytest.approx(0.2 * gather + forward / rate)
    assert shared.backward_exposed_s == pytest.approx(0.2 * gather + (cp - 1) * 0.2 * hop + hop + backward / rate)
    one = torch_context_attention_cost(cp=1, kv_bytes=kv, elem_bytes=e, forward_s=1.0, backward_s=1.0, link=link,
                                       memory_bytes_per_s=rate)
    assert one.exposed_s == 0 and one.forward_comm_s == 0


def test_te_context_attention_prices_its_ring_and_fused_merges():
    """Transformer Engine's p2p ring (pinned ``cp_variant="te"``): each forward hop (the grouped K/V)
    hides behind a step, each backward message (K/V with the bf16 gradients, the first and last one
    half of that) too; the merges and gradient additions are bf16 passes counted here pass by pass."""
    from autopar.cost.comm import p2p_s, te_context_attention_cost

    link = Link(bytes_per_s=100e9, latency_s=5e-6)
    cp, n, e, rate = 4, 1_000_000, 2, 1e12  # n query (= output) elements, bf16
    kv = 2 * 250_000 * e  # grouped K and V: a quarter of the query heads each
    forward = 2 * kv + 2 * e * n + (cp - 1) * (e * n + 2 * e * n)  # pack; write the first; read, read-write the rest
    backward = 2 * kv + 2 * e * n + (cp - 1) * 3 * e * n + cp * 3 * kv  # copy in; dq adds; dk and dv adds
    slow = te_context_attention_cost(cp=cp, kv_bytes=kv, query_elems=n, elem_bytes=e, forward_s=1.0, backward_s=2.0,
                                     link=link, memory_bytes_per_s=rate)
    assert slow.variant == "te" and slow.kernel_s == 0
    assert slow.forward_exposed_s == pytest.approx(forward / rate)
    assert slow.backward_exposed_s == pytest.approx(backward / rate)
    hop, both = p2p_s(kv, link), p2p_s(2 * kv, link)
    assert slow.forward_comm_s == pytest.approx((cp - 1) * hop)
    assert slow.backward_comm_s == pytest.approx(2 * hop + (cp - 2) * both)
    assert slow.sent_bytes == 3 * (cp - 1) * kv and slow.messages == 2 * cp - 1
    fast = te_context_attention_cost(cp=cp, kv_bytes=kv, query_elems=n, elem_bytes=e, forward_s=4e-6,
                                     backward_s=8e-6, link=link, memory_bytes_per_s=rate)
    assert fast.forward_exposed_s == pytest.approx((cp - 1) * (hop - 1e-6) + forward / rate)
    assert fast.backward_exposed_s == pytest.approx(2 * (hop - 2e-6) + (cp - 2) * (both - 2e-6) + backward / rate)
    one = te_context_attention_cost(cp=1, kv_bytes=kv, query_elems=n, elem_bytes=e, forward_s=1.0, backward_s=1.0,
                                    link=link, memory_bytes_per_s=rate)
    assert one.exposed_s == 0 and one.forward_comm_s == 0


def test_context_exchange_working_sets_grow_with_what_each_variant_holds():
    """Bytes the K/V exchange keeps live inside the attention op (per rank): the ring holds one
    K/V block arriving and three fp32 gradient blocks (its own, arriving, leaving) at any cp; the
    all-gather holds all cp blocks (and their cp gradient blocks in the backward); torch's program
    gathers the repeated K/V and keeps fp32 accumulators of q, k and v. The fp32 output (and
    query gradient) accumulators: 4 bytes per query element, merged into in place."""
    from autopar.cost.comm import context_attention_cost, torch_context_attention_cost

    link = Link(bytes_per_s=100e9, latency_s=5e-6)
    kv, dkv, q = 1e6, 2e6, 4e5

    def cost(variant, cp):
        return context_attention_cost(variant=variant, cp=cp, kv_bytes=kv, dkv_bytes=dkv, forward_s=1.0,
                                      backward_s=2.0, link=link, query_elems=q)

    for cp in (2, 8):
        ring, ag = cost("ring", cp), cost("allgather", cp)
        pair = q / 2 * 2  # a pair's output from the kernel: half the queries, bf16 (kv / dkv: 2 bytes to 4)
        assert (ring.forward_working_bytes, ring.backward_working_bytes) == (4 * q + pair + kv, 4 * q + kv + 3 * dkv)
        assert (ag.forward_working_bytes, ag.backward_working_bytes) == (4 * q + pair + cp * kv,
                                                                         4 * q + cp * (kv + dkv))
    assert cost("ring", 1).forward_working_bytes == cost("allgather", 1).backward_working_bytes == 0
    n, e = 1_000_000, 2
    torch4, torch8 = (torch_context_attention_cost(cp=cp, kv_bytes=2 * n * e, elem_bytes=e, forward_s=1.0,
                                                   backward_s=2.0, link=link, memory_bytes_per_s=1e12)
                      for cp in (4, 8))
    assert torch8.forward_working_bytes - torch4.forward_working_bytes == 4 * 2 * n * e  # 4 more blocks gathered
    assert torch4.backward_working_bytes == 5 * 2 * n * e + 3 * 4 * n + 3 * e * n + 2 * 8 * n


def test_context_eager_kernels_are_counted_op_by_op_and_added_to_what_is_exposed():
    """autopar's cp op merges its blocks' partial outputs and gradients with eager kernels on the
    compute stream; counted here pass by pass (independently of the function's closed form), Llama
    3 8B's shape: 32 query heads, 8 grouped K/V heads repeated to 32 per pair, bf16."""
    from autopar.cost.comm import context_attention_cost, context_eager_bytes

    cp, n, e = 4, 1_000_000, 2
    kv = 2 * n // 4  # K and V elements of a block: a quarter of the heads each
    rep = 2 * n  # repeated K and V
    merge = (4 + 4) + (4 + e + 4)  # rescale the fp32 output in place, add the weighted block output
    forward = 4 * n + cp * (merge * n + kv * e + rep * e) + (4 + e) * n
    dq = 4 + e + 4  # the kernel's query gradient added into the fp32 one
    dkv = 4 + (rep * e + 4 * kv) / kv + (4 + 4 + 4)  # zeroed; repeated heads summed in fp32, added in
    per_block = dq * n + dkv * kv + (kv + rep) * e
    backward = 4 * n + cp * per_block + (4 + e) * (n + kv)
    ring_add = (cp - 1) * 12 * kv  # each arriving gradient block added
    assert context_eager_bytes(variant="allgather", cp=cp, query_elems=n, kv_bytes=kv * e,
                               dkv_bytes=kv * 4) == pytest.approx((forward, backward))
    assert context_eager_bytes(variant="ring", cp=cp, query_elems=n, kv_bytes=kv * e,
                               dkv_bytes=kv * 4) == pytest.approx((forward, backward + ring_add))
    link, rate = Link(bytes_per_s=100e9, latency_s=5e-6), 1e12
    args = dict(variant="ring", cp=cp, kv_bytes=kv * e, dkv_bytes=kv * 4, forward_s=1.0, backward_s=2.0, link=link,
                query_elems=n)
    plain, eager = context_attention_cost(**args), context_attention_cost(**args, memory_bytes_per_s=rate)
    assert eager.forward_exposed_s - plain.forward_exposed_s == pytest.approx(forward / rate)
    assert eager.backward_exposed_s - plain.backward_exposed_s == pytest.approx((backward + ring_add) / rate)


def test_all_to_all_across_nodes_runs_at_one_nic_per_rank():
    """All-to-all has no ring to spread over a node's NICs: what a rank sends off its node
    leaves through its own NIC. EP 16 over 2 H100 nodes: 1/2 of each buffer crosses the network
    at one 400 Gb/s NIC. EP 32 over 4 nodes: 3/4 of it, at NCCL_ALL_TO_ALL_MANY_NODES of that NIC
    (NCCL's all-to-all over more than two nodes; DeepEP's kernels reach the NIC there), so 1 GB
    takes about 30 ms, not the 2-3 ms of ring collectives on 8 NICs' worth."""
    nic = H100.inter_node_bytes_per_s * NETWORK_EFFICIENCY
    two = group_link(group_size=16, stride=1, devices_per_node=8, device=H100)
    assert two.all_to_all_bytes_per_s == pytest.approx(15 / 8 * nic)
    link = group_link(group_size=32, stride=1, devices_per_node=8, device=H100)
    rate = nic * NCCL_ALL_TO_ALL_MANY_NODES
    assert link.all_to_all_bytes_per_s == pytest.approx(31 / 24 * rate)
    assert all_to_all_s(1e9, 32, link) == pytest.approx(0.75 * 1e9 / rate + 31 * link.latency_s + link.base_latency_s)
    assert all_to_all_s(1e9, 32, link) > 9 * all_gather_s(1e9, 32, link)
    inside = group_link(group_size=8, stride=1, devices_per_node=8, device=H100)
    assert inside.all_to_all_bytes_per_s is None  # (NVSwitch: the measured tables)

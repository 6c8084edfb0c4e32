"""What expert parallelism's token exchanges cost: one MoE layer's dispatch and combine per rank.

Three programs move the token rows to their experts and back (``fixed={"ep_dispatch": ...}``,
:data:`autopar.planner.fixed.EP_DISPATCHES`):

- autopar's own (what ``parallelize`` runs, :mod:`autopar.experts`) and Megatron-LM's all-to-all
  dispatcher, both NCCL all-to-alls of the rows (:func:`expert_all_to_all_bytes`,
  :func:`expert_all_to_all_s`, each message an :func:`autopar.cost.comm.all_to_all_s`), which
  differ in the backward;
- DeepEP's normal kernels, which send a token once per rank (and node) holding one of its
  experts (:func:`deepep_bytes`, :func:`deepep_s`).
"""

from __future__ import annotations

import math

from autopar.cost.comm import Link, all_to_all_s
from autopar.cost.devices import DeviceSpec

__all__ = ["deepep_bytes", "deepep_s", "expert_all_to_all_bytes", "expert_all_to_all_s"]


def expert_all_to_all_bytes(*, rows: float, width: int, elem_bytes: int, n_experts: int, count_bytes: int = 8,
                            program: str = "autopar") -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Send buffers of one expert-parallel MoE layer's all-to-alls on one rank, (forward, backward).

    ``rows`` is the rank's token rows entering the experts (tokens x top-k, one row per
    chosen expert), ``width`` the hidden size. As :mod:`autopar.experts` runs it
    (dropless, no capacity padding): each pass first exchanges the per-expert counts
    (``n_experts`` int64), then forward dispatches the rows and combines the results
    (``rows x width`` each); backward dispatches the input and the output gradient together
    (rows of width 2 x ``width``, the input is not kept from forward) and combines the
    input gradient. Balanced routing is assumed: every rank sends and receives ``rows``.

    ``program="megatron"``: Megatron-LM's all-to-all token dispatcher
    (``MoEAlltoAllTokenDispatcher``), which keeps the dispatched rows for the experts' backward,
    so the backward moves the combine's gradient out and the dispatch's back, one message each,
    and exchanges no counts (autograd of its all-to-alls).
    """
    s = rows * width * elem_bytes
    counts = n_experts * count_bytes
    if program == "megatron":
        return (counts, s, s), (s, s)
    return (counts, s, s), (counts, 2 * s, s)


def expert_all_to_all_s(*, rows: float, width: int, elem_bytes: int, n_experts: int, ep: int,
                        link: Link, program: str = "autopar") -> tuple[float, float]:
    """(forward, backward) seconds of :func:`expert_all_to_all_bytes` over an ep group of
    ``ep`` ranks on ``link`` (each message an :func:`all_to_all_s`)."""
    fwd, bwd = expert_all_to_all_bytes(rows=rows, width=width, elem_bytes=elem_bytes, n_experts=n_experts,
                                       program=program)
    return (sum(all_to_all_s(m, ep, link) for m in fwd), sum(all_to_all_s(m, ep, link) for m in bwd))


def _hit_fraction(n_experts: int, groups: int, top_k: int) -> float:
    """The chance that a token's ``top_k`` experts (distinct, uniform over ``n_experts``) include
    one of a group's ``n_experts / groups`` (hypergeometric: 1 - C(E - E/g, k) / C(E, k))."""
    return 1.0 - math.comb(n_experts - n_experts // groups, top_k) / math.comb(n_experts, top_k)


def deepep_bytes(*, rows: float, top_k: int, width: int, elem_bytes: int, n_experts: int, ep: int,
                 ranks_per_node: int) -> tuple[float, float]:
    """(NVLink, RDMA) bytes one rank sends in one DeepEP dispatch of ``rows`` token rows (tokens x
    ``top_k``); its combine sends as many back. DeepEP's normal kernels (deepseek-ai/DeepEP) send a
    token once to each rank that holds one of its experts, not once per expert, and across
    nodes once to each node that does, over RDMA to the rank of the same local index, which
    forwards it on NVLink. Under uniform routing a token meets ``ep x`` :func:`_hit_fraction`
    ranks and ``nodes x`` :func:`_hit_fraction` nodes; the copies to other nodes cross RDMA, those
    to other ranks of a node NVLink."""
    tokens = rows / top_k
    nodes = max(1, ep // ranks_per_node)
    per_node = ep // nodes
    row = width * elem_bytes
    rdma = tokens * row * nodes * _hit_fraction(n_experts, nodes, top_k) * (nodes - 1) / nodes if nodes > 1 else 0.0
    nvl = tokens * row * ep * _hit_fraction(n_experts, ep, top_k) * (per_node - 1) / per_node
    return nvl, rdma


def deepep_s(*, rows: float, top_k: int, width: int, elem_bytes: int, n_experts: int, ep: int,
             ranks_per_node: int, device: DeviceSpec) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE layer's DeepEP dispatch and combine (forward) and
    their gradients' (backward: a combine and a dispatch, the same bytes) on the busiest rank.

    Each moves :func:`deepep_bytes` at the device's NVLink and NIC rates, the two overlapped (its
    normal kernels forward while they receive). At the links' full rates: DeepEP's own figures for
    these kernels (``docs/legacy.md``, "Normal kernels with NVLink and RDMA forwarding": H800, ~160 GB/s
    NVLink and a ~50 GB/s CX7 NIC per GPU, DeepSeek-V3's training shapes) reach 153-158 GB/s on
    NVLink within a node and 43-58 GB/s over RDMA at 16-64 ranks across nodes."""
    nvl, rdma = deepep_bytes(rows=rows, top_k=top_k, width=width, elem_bytes=elem_bytes, n_experts=n_experts,
                             ep=ep, ranks_per_node=ranks_per_node)
    latency = device.inter_node_latency_s if rdma else device.intra_node_latency_s
    one = max(nvl / device.intra_node_bytes_per_s, rdma / device.inter_node_bytes_per_s) + latency
    return 2 * one, 2 * one

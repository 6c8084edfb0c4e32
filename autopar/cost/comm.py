"""Alpha-beta (latency-bandwidth) cost of collectives on one group of ranks.

A message of ``m`` bytes over a link costs ``alpha + m / beta`` (Hockney 1994).
For the bandwidth-optimal ring algorithms NCCL uses on large messages
(Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 19(1), 2005; Patarasuk and Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009), with ``n`` ranks
and ``S`` the size defined per function below:

    all_reduce      2 (n-1)/n * S / beta + 2 (n-1) * alpha   (reduce-scatter + all-gather)
    all_gather        (n-1)/n * S / beta +   (n-1) * alpha   (S = gathered output)
    reduce_scatter    (n-1)/n * S / beta +   (n-1) * alpha   (S = full input)
    all_to_all        (n-1)/n * S / beta +   (n-1) * alpha   (S = send buffer)
    broadcast                   S / beta +   (n-1) * alpha   (pipelined ring)
    p2p                         S / beta +           alpha

The ``(n-1)/n`` and ``2(n-1)/n`` factors are exactly the "bus bandwidth" factors
of nccl-tests (``doc/PERFORMANCE.md`` in https://github.com/NVIDIA/nccl-tests):
a collective whose measured bus bandwidth equals the link bandwidth takes the
time above. ``beta`` is the per-rank, per-direction bandwidth of the slowest hop
of the ring (:func:`group_link` picks it).

Calibration (:func:`group_link` builds the :class:`Link` of a group from it):

- **Inside an NVSwitch node**, bus bandwidth depends on the group size. nccl-tests on
  8x H100 NVSwitch, 1 GB messages (meta-pytorch/autoparallel,
  ``autoparallel/cost_models/nccl_cost_model.py``, ``_NVSWITCH_BW_POINTS``, which are
  *algorithm* bandwidths; bus bandwidth = algbw x (n-1)/n, x 2(n-1)/n for all-reduce):
  all-gather / reduce-scatter 537, 434, 394 GB/s algbw at n = 2, 4, 8 -> 269, 326,
  345 GB/s busbw = 0.60, 0.72, 0.77 of the 450 GB/s NVLink figure; all-reduce 324,
  236, 267 -> 324, 354, 467 GB/s = 0.72, 0.79, 1.04 (NVLS reduces in the switch).
  Latency at small messages (same file, ``_NVSWITCH_LAT_POINTS``): 8, 17, 30 us
  (all-gather, reduce-scatter) and 10, 15, 31 us (all-reduce) at n = 2, 4, 8.
  Other devices get the same fractions of their own NVLink figure (autoparallel does
  the same for Blackwell); group sizes between the points are interpolated linearly.
- **Across nodes**, NCCL runs one ring per channel and the channels leave the node
  through different NICs, so a group with ``ppn`` ranks on each node gets ``ppn`` NICs:
  bus bandwidth ``min(ppn x NIC x NETWORK_EFFICIENCY, intra-node busbw of ppn ranks)``.
  NCCL 2.27's own tuning tables for H100 (same file, ``_H100_AGRS_RING``, SIMPLE protocol,
  2-32 nodes) give 48 GB/s busbw per NIC for ppn = 1, 2, 4, 8 alike (0.96 of 50 GB/s),
  and the correction autoparallel fitted to nccl-tests all-gather / reduce-scatter at
  ppn = 8 (``_TABLE_RING_FULL_MESH_RAMP``, 0.87 for >= 32 MB per GPU) brings it to
  0.96 x 0.87 = 0.835. Latency: NCCL's ring model, ``8.4 us`` base plus per ring step a
  hop latency of 3.4 us on NVLink and 14 us on the network, averaged over the ring's
  hops (``_BASE_LATENCIES`` / ``_HW_LAT_*`` ported from NCCL ``src/graph/tuning.cc``;
  it reproduces that file's 2-32 node table, e.g. 1204 us at 32x8 ranks).
- Message-size ramps (small messages reach less than the bandwidth above) are not
  modelled: the collectives that matter for a plan (gradient, FSDP and tp
  activations) are megabytes or more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.cost.devices import DeviceSpec
from autopar.cost.compute import MEMORY_EFFICIENCY

__all__ = [
    "Link",
    "NETWORK_EFFICIENCY",
    "nvswitch_busbw",
    "all_gather_s",
    "all_reduce_s",
    "all_to_all_s",
    "NCCL_ALL_TO_ALL_MANY_NODES",
    "broadcast_s",
    "ContextAttentionCost",
    "context_attention_cost",
    "context_kv_bytes",
    "context_eager_bytes",
    "group_link",
    "p2p_s",
    "pipeline_links",
    "reduce_scatter_s",
    "stage_group_link",
    "stage_ranks",
    "torch_context_attention_cost",
]


@dataclass(frozen=True)
class Link:
    """The bottleneck link of a group: per-rank per-direction bandwidth and per-step latency.

    A plain ``Link(bytes_per_s, latency_s)`` is the textbook alpha-beta link. The
    calibrated links of :func:`group_link` also carry a fixed ``base_latency_s`` per
    collective, an all-reduce bus bandwidth of its own, and, for groups inside one
    NVSwitch node, ``nvswitch=True``: bandwidth and latency then come from the measured
    tables by group size (module docstring) and ``bytes_per_s`` is the NVLink figure.
    """

    bytes_per_s: float
    """Bandwidth (beta) per rank per direction (bus bandwidth of all-gather / reduce-scatter)."""
    latency_s: float
    """Latency (alpha) of one step (one message) of a collective."""
    base_latency_s: float = 0.0
    """Fixed latency of one collective call, on top of its steps."""
    all_reduce_bytes_per_s: float | None = None
    """Bus bandwidth of all-reduce when it differs from ``bytes_per_s``."""
    nvswitch: bool = False
    """Inside one NVSwitch node: bandwidth and latency by group size from the measured tables."""
    copy_bytes_per_s: float = 0.0
    """Memory bandwidth of the group's devices for the local copy a collective along a tensor
    dim other than 0 makes (:func:`autopar.planner.ilp.reshard_s`); 0: not priced (the gloo
    CPU figures, and gradient buckets, which are flat)."""
    all_to_all_bytes_per_s: float | None = None
    """Bus bandwidth of all-to-all when it differs from ``bytes_per_s`` (a group across nodes:
    :func:`group_link`)."""

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"Link.bytes_per_s must be > 0, got {self.bytes_per_s!r}")
        if not self.latency_s >= 0:
            raise ValueError(f"Link.latency_s must be >= 0, got {self.latency_s!r}")


def _check(nbytes: float, group_size: int) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")


# nccl-tests, 8x H100 NVSwitch, 1 GB messages (module docstring): bus bandwidth as a fraction
# of the 450 GB/s NVLink figure, and latency in seconds, by group size.
NVSWITCH_BUSBW_FRACTION = {
    "all_gather": ((2, 537 * 1 / 2 / 450), (4, 434 * 3 / 4 / 450), (8, 394 * 7 / 8 / 450)),
    "all_reduce": ((2, 324 * 2 * 1 / 2 / 450), (4, 236 * 2 * 3 / 4 / 450), (8, 267 * 2 * 7 / 8 / 450)),
}
NVSWITCH_LATENCY_S = {
    "all_gather": ((2, 8e-6), (4, 17e-6), (8, 30e-6)),
    "all_reduce": ((2, 10e-6), (4, 15e-6), (8, 31e-6)),
}
NETWORK_EFFICIENCY = 0.96 * 0.87
"""Achieved fraction of the NIC's bandwidth per rank on a node (NCCL tuning x autoparallel's fit)."""
NCCL_ALL_TO_ALL_MANY_NODES = 0.6
"""What NCCL's all-to-all reaches, as a fraction of the NIC figure above, in a group over more
than two nodes (two nodes reach the NIC: 46 GB/s busbw, NCCL alltoall on 2 DGX-H100 with
NVLink off, deepseek-ai/DeepEP#3). Field reports, nccl-tests alltoall, NICs not stated: 24-28
GB/s busbw at 8 MiB on 8 nodes of 8 H800 (NVIDIA/nccl#1531), "20+" GB/s on 16 H20 nodes
(NVIDIA/nccl#1792); 0.57-0.67 of 41.8. And torchtitan's DeepSeek-V3 pair (#2107: 64 H100
nodes, EP32 over 4 of them, plain all_to_all_single 346 tok/s/GPU, DeepEP 579): with its forced
round-robin routing a token's 8 experts sit on one rank, so DeepEP, which sends a token once
per rank, moves 1/8 of NCCL's bytes and the rest of the program is the same. The step time
difference (23.7 - 14.2 s) is then NCCL's all-to-all time on the critical path less DeepEP's
(1/8 of the bytes at 41.8 GB/s, 0.7 s): about 245 GB per rank off-node (6 all-to-alls of
3/4 x 470 MB per MoE layer and micro-batch, 7.25 layers x 16 micro-batches) in 10.2 s,
24-29 GB/s (the upper end if the interleaved pipeline's bubble stretches it by its 1.22),
0.57-0.70 of 41.8. (DeepEP's own kernels, built for this, reach the NIC: 43-58 GB/s at EP
16-64, see :func:`group_link`.)"""
NCCL_BASE_LATENCY_S = 8.4e-6
"""NCCL ``baseLat`` of the ring algorithm, SIMPLE protocol (tuning.cc)."""
NVLINK_HOP_LATENCY_S = 3.4e-6
"""NCCL ``hwLat[NVLINK][RING][SIMPLE]`` (tuning.cc)."""
NETWORK_HOP_LATENCY_S = 14e-6
"""NCCL ``hwLat[NET][RING][SIMPLE]`` (tuning.cc)."""


def _interp(points: tuple[tuple[int, float], ...], n: int) -> float:
    """Linear interpolation in the group size, clamped at the measured ends."""
    if n <= points[0][0]:
        return points[0][1]
    for (n0, v0), (n1, v1) in zip(points, points[1:]):
        if n <= n1:
            return v0 + (v1 - v0) * (n - n0) / (n1 - n0)
    return points[-1][1]


def nvswitch_busbw(kind: str, group_size: int, nvlink_bytes_per_s: float) -> float:
    """Bus bandwidth of ``kind`` ("all_gather" for gathers, scatters and all-to-all, or
    "all_reduce") among ``group_size`` ranks of one NVSwitch node."""
    return nvlink_bytes_per_s * _interp(NVSWITCH_BUSBW_FRACTION[kind], group_size)


def _ring_s(nbytes: float, group_size: int, link: Link, *, passes: int) -> float:
    """``passes`` ring sweeps of (n-1) steps, each moving 1/n of ``nbytes``."""
    _check(nbytes, group_size)
    if group_size == 1:
        return 0.0
    steps = passes * (group_size - 1)
    kind = "all_reduce" if passes == 2 else "all_gather"
    if link.nvswitch:  # latency_s == 0 marks bucketed traffic (no latency of its own), as elsewhere
        busbw = nvswitch_busbw(kind, group_size, link.bytes_per_s)
        latency = _interp(NVSWITCH_LATENCY_S[kind], group_size) if link.latency_s > 0 else 0.0
        return steps / group_size * nbytes / busbw + latency
    busbw = link.all_reduce_bytes_per_s if passes == 2 and link.all_reduce_bytes_per_s else link.bytes_per_s
    return steps / group_size * nbytes / busbw + steps * link.latency_s + link.base_latency_s


def all_reduce_s(nbytes: float, group_size: int, link: Link) -> float:
    """Ring all-reduce of a tensor of ``nbytes`` on every rank (input size == output size)."""
    return _ring_s(nbytes, group_size, link, passes=2)


def all_gather_s(nbytes: float, group_size: int, link: Link) -> float:
    """Ring all-gather; ``nbytes`` is the gathered (full) output, each rank holds ``nbytes / n``."""
    return _ring_s(nbytes, group_size, link, passes=1)


def reduce_scatter_s(nbytes: float, group_size: int, link: Link) -> float:
    """Ring reduce-scatter; ``nbytes`` is the full input on each rank, each keeps ``nbytes / n``."""
    return _ring_s(nbytes, group_size, link, passes=1)


def all_to_all_s(nbytes: float, group_size: int, link: Link) -> float:
    """All-to-all; ``nbytes`` is each rank's send buffer, ``(n-1)/n`` of which leaves the rank.
    Across nodes at the link's ``all_to_all_bytes_per_s`` (:func:`group_link`)."""
    if link.all_to_all_bytes_per_s is not None:
        link = replace(link, bytes_per_s=link.all_to_all_bytes_per_s)
    return _ring_s(nbytes, group_size, link, passes=1)


def context_kv_bytes(*, batch: int, kv_heads: int, seq_local: int, head_dim: int, elem_bytes: int,
                     grad_bytes: int = 4) -> tuple[float, float]:
    """(K/V block, K/V gradient block) bytes one rank holds of one attention layer under cp:
    K and V of its ``seq_local`` tokens, and their gradient accumulators, which
    :mod:`autopar.context` keeps in fp32 (``grad_bytes``) while they travel."""
    elems = 2 * batch * kv_heads * seq_local * head_dim
    return elems * elem_bytes, elems * grad_bytes


@dataclass(frozen=True)
class ContextAttentionCost:
    """What exchanging K/V costs one attention layer on the busiest cp rank (seconds)."""

    variant: str
    """"ring" or "allgather" (:mod:`autopar.context`)."""
    forward_comm_s: float
    backward_comm_s: float
    """Time on the link, whether or not compute hides it."""
    forward_exposed_s: float
    backward_exposed_s: float
    """What cp adds to the layer beyond its priced attention: the exchange compute does not hide
    (the ring hides each hop behind the block computed meanwhile; the all-gather variant hides
    nothing), plus ``eager_s`` and ``kernel_s``."""
    messages: int = 0
    """Transfers one rank starts per layer, forward and backward (ring hops; collective calls)."""
    sent_bytes: float = 0.0
    """Bytes one rank sends per layer, forward and backward."""
    eager_s: float = 0.0
    """Of the exposed time, forward and backward: the op's eager kernels (merges, accumulators)."""
    kernel_s: float = 0.0
    """Of the exposed time, forward and backward: the op's attention kernel beyond the SDPA kernel
    the graph's attention is priced at (:func:`autopar.planner.context.cp_kernel_ratio`)."""
    forward_working_bytes: float = 0.0
    backward_working_bytes: float = 0.0
    """Bytes the exchange keeps live inside the attention op beyond its inputs and outputs
    (blocks in flight or gathered, fp32 accumulators), forward and backward: the op's working
    set grows by this much (:func:`autopar.planner.context.apply_cp`)."""

    @property
    def exposed_s(self) -> float:
        return self.forward_exposed_s + self.backward_exposed_s

    @property
    def exchange_exposed_s(self) -> float:
        """Of the exposed time, the exchange's (communication) part; the rest is compute."""
        return self.exposed_s - self.eager_s - self.kernel_s


def context_attention_cost(*, variant: str, cp: int, kv_bytes: float, dkv_bytes: float, forward_s: float,
                           backward_s: float, link: Link, overlap_slowdown: float = 1.0,
                           query_elems: float = 0.0, memory_bytes_per_s: float | None = None) -> ContextAttentionCost:
    """K/V exchange of one attention layer over a cp group of ``cp`` ranks on ``link``.

    ``kv_bytes``, ``dkv_bytes``: one rank's block (:func:`context_kv_bytes`); ``forward_s``,
    ``backward_s``: the busiest rank's attention compute of the layer (all its blocks), of which
    each ring step computes ``1/cp`` (exact for the balanced causal layout: every step is two
    chunk pairs' work, the own block's two diagonals counting one; the contiguous layout's steps
    differ, and this spreads them evenly).

    Ring (as :mod:`autopar.context` runs it): forward ``cp - 1`` hops of one block, each sent
    while the previous block computes, so a hop is exposed by what it takes beyond one step's
    compute (slowed by ``overlap_slowdown`` while it overlaps); backward ``cp - 1`` hops of a
    K/V block together with a gradient block, then one last hop of the gradient block that
    nothing hides. All-gather: K/V gathered (``cp x kv_bytes``) before the forward and again
    before the backward (it keeps no gathered copy), the gradients reduce-scattered after.

    Working set beyond the op's inputs and outputs (``query_elems``: elements of the rank's query
    block, whose output and gradient accumulate in fp32; the blocks run on fused kernels, which
    hold no score matrix, :mod:`autopar.context_blocks`): forward, the fp32 output (merged into in
    place, 4 bytes per query element), a pair's output from the kernel (half the queries, in the
    K/V dtype) and one K/V block arriving (ring) or all ``cp`` gathered; backward, the fp32 query
    gradient, and one K/V block arriving with the block's gradients, the ones arriving and the
    ones leaving (ring: ``3 dkv_bytes``), or all ``cp`` blocks gathered and their ``cp`` gradient
    blocks until the reduce-scatter.

    With ``memory_bytes_per_s`` (eager PyTorch's rate), the op's eager kernels are added to what is
    exposed (they run on the compute stream): :func:`context_eager_bytes`.
    """
    if variant not in ("ring", "allgather"):
        raise ValueError(f"context attention variant {variant!r} is not 'ring' or 'allgather'")
    if cp == 1:
        return ContextAttentionCost(variant, 0.0, 0.0, 0.0, 0.0)
    acc = 4 * query_elems  # the fp32 output, or query gradient
    pair = query_elems / 2 * 4 * kv_bytes / dkv_bytes if dkv_bytes else 0.0  # a pair's output, K/V dtype
    eager_f, eager_b = (0.0, 0.0) if not memory_bytes_per_s else \
        (b / memory_bytes_per_s for b in context_eager_bytes(variant=variant, cp=cp, query_elems=query_elems,
                                                             kv_bytes=kv_bytes, dkv_bytes=dkv_bytes))
    if variant == "allgather":
        gather = all_gather_s(cp * kv_bytes, cp, link)
        fwd, bwd = gather, gather + reduce_scatter_s(cp * dkv_bytes, cp, link)
        return ContextAttentionCost(variant, fwd, bwd, fwd + eager_f, bwd + eager_b, messages=3,
                                    eager_s=eager_f + eager_b,
                                    sent_bytes=(cp - 1) * (2 * kv_bytes + dkv_bytes),
                                    forward_working_bytes=acc + pair + cp * kv_bytes,
                                    backward_working_bytes=acc + cp * (kv_bytes + dkv_bytes))
    step_f, step_b = forward_s / cp, backward_s / cp
    hop_f, hop_b, last = p2p_s(kv_bytes, link), p2p_s(kv_bytes + dkv_bytes, link), p2p_s(dkv_bytes, link)
    return ContextAttentionCost(variant, (cp - 1) * hop_f, (cp - 1) * hop_b + last,
                                (cp - 1) * _behind(hop_f, step_f, overlap_slowdown) + eager_f,
                                (cp - 1) * _behind(hop_b, step_b, overlap_slowdown) + last + eager_b,
                                eager_s=eager_f + eager_b,
                                messages=3 * (cp - 1) + 1, sent_bytes=2 * (cp - 1) * kv_bytes + cp * dkv_bytes,
                                forward_working_bytes=acc + pair + kv_bytes,
                                backward_working_bytes=acc + kv_bytes + 3 * dkv_bytes)


def context_eager_bytes(*, variant: str, cp: int, query_elems: float, kv_bytes: float,
                        dkv_bytes: float) -> tuple[float, float]:
    """(forward, backward) bytes the eager kernels of :mod:`autopar.context` move for one attention
    layer on one rank at ``cp > 1``, as it runs on CUDA in bf16/fp16 (``n`` query elements, ``kv``
    K and V elements of a block, ``e`` bytes each, ``r = 2n`` when K/V are grouped: the repeat to
    the query heads each pair's kernel gets, :mod:`autopar.context_blocks`):

    - forward: the zeroed fp32 output (4n); per block, the log-sum-exp merge of its pairs into the
      fp32 output in place (rescale 8, then add the weighted block output 8 + e bytes per query
      element; the own block's third, diagonal pair not counted) and the K/V repeat (read kv e,
      write r e); the result's downcast.
    - backward: the zeroed fp32 query gradient; per block, the pairs' query gradients added into it
      (8 + e per query element), the K/V gradient accumulators zeroed and added into (4 + 8 + e per
      K/V element; with grouped K/V the repeated heads' gradients are first summed per group into
      fp32, r e + 4 kv, and added as fp32, 12 per K/V element), the K/V repeat again; the ring
      adds each arriving gradient block (12 per K/V element, all blocks but the first); the three
      downcasts.
    """
    n = query_elems
    e = 4 * kv_bytes / dkv_bytes  # the gradient blocks are fp32
    kv = kv_bytes / e
    r = 2 * n if kv < 2 * n else 0.0
    repeat = (kv + r) * e
    fwd = 4 * n + cp * ((16 + e) * n + repeat) + (4 + e) * n
    dkv = 4 * kv + (r * e + 16 * kv if r else (8 + e) * kv)
    bwd = (4 * n + cp * ((8 + e) * n + dkv + repeat) + (4 + e) * (n + kv)
           + (12 * (cp - 1) * kv if variant == "ring" else 0.0))
    return fwd, bwd


def _behind(comm_s: float, compute_s: float, slowdown: float) -> float:
    """What a transfer of ``comm_s`` started beside ``compute_s`` of compute adds to it: compute runs
    at 1/``slowdown`` while the transfer is on the link, so it ends inside the transfer (exposed:
    the rest of the transfer), or the transfer costs it ``comm_s x (1 - 1/slowdown)`` of progress."""
    if not slowdown >= 1:
        raise ValueError(f"overlap_slowdown must be >= 1, got {slowdown!r}")
    return comm_s - compute_s if compute_s * slowdown <= comm_s else comm_s * (1 - 1 / slowdown)


def torch_context_attention_cost(*, cp: int, kv_bytes: float, elem_bytes: int, forward_s: float,
                                 backward_s: float, link: Link, memory_bytes_per_s: float,
                                 overlap_slowdown: float = 1.0) -> ContextAttentionCost:
    """K/V exchange of one attention layer as torch's own context parallelism runs it
    (``torch.distributed.tensor.experimental.context_parallel`` with its "allgather" rotation,
    torchtitan's default), the program of runs made with it (``bench/fidelity.py``); autopar's
    runtime runs :mod:`autopar.context` instead, priced by :func:`context_attention_cost`.

    ``kv_bytes``: one rank's K and V block as SDPA receives them, i.e. after any grouped-query
    head repeat (torchtitan's Llama repeats K/V to every query head before SDPA, so the exchange
    moves the repeated heads); ``forward_s``, ``backward_s``: the rank's attention compute of the
    layer, ``cp`` equal steps of it. Read from ``_templated_ring_attention`` and its backward
    (torch 2.13's ``_context_parallel/_attention.py``; the runs compared used a December 2024
    build, whose ``experimental/_attention.py`` has the same ring and also copies K and V
    contiguous once per layer, not priced):

    - forward: K/V all-gathered once, issued before step 0 (the own block) and awaited at step 1,
      so step 0's compute hides it; each step then concatenates the K/V block it would send
      (which the all-gather rotation ignores), and merges its output into an fp32 accumulator
      by log-sum-exp (upcast, difference, sigmoid-weighted product, subtraction: eager kernels).
    - backward: K/V gathered again the same way; fp32 gradient accumulators for q, k and v; each
      step adds its gradients in, concatenates the K/V gradients and passes them to the next rank
      (``permute_tensor``: an all-to-all with one peer), which the next step's compute hides; the
      last pass nothing hides.

    The eager traffic is counted per step on the busiest rank (its every step merges the whole
    output; ``tests/test_torch_cp_program.py`` counts torch's own ring's bytes on meta tensors
    against it) at ``memory_bytes_per_s``, and added to what is exposed: it runs on the compute stream.
    A transfer hidden behind compute costs it as :func:`context_attention_cost`'s hops do
    (``overlap_slowdown``).

    Working set beyond the op's inputs and outputs: forward, the gathered K/V (``cp x kv_bytes``),
    one concatenated block and the fp32 output with the merge's two fp32 temporaries; backward,
    the gathered K/V, one concatenated block, the fp32 q, k, v gradient accumulators, a step's
    gradients from the kernel, and the fp32 K/V gradients concatenated to leave and arriving.
    """
    if cp == 1:
        return ContextAttentionCost("torch", 0.0, 0.0, 0.0, 0.0)
    n = kv_bytes / (2 * elem_bytes)  # elements of one K (= V = query = output) block
    e = elem_bytes
    gather = all_gather_s(cp * kv_bytes, cp, link)
    hop = p2p_s(2 * n * 4, link)  # fp32 K and V gradients
    step_f, step_b = forward_s / cp, backward_s / cp
    # forward bytes: per step after the first, the K/V concatenation (read + write) and one merge
    # (upcast e + 4, difference 12, weighted product 8, subtraction 12 bytes per element), plus the
    # first block's upcast and the result's downcast
    forward_bytes = (cp - 1) * (4 * n * e + (e + 36) * n) + 2 * (e + 4) * n
    # backward bytes: zeroed fp32 accumulators (12), per step the K/V concatenation but on the last,
    # the q, k, v gradient additions (3 x (e + 8)) and the fp32 K/V gradient concatenation (16),
    # and the three downcasts at the end; on the busiest rank every step after the first adds its
    # K and V gradients into the first halves of the accumulators and concatenates them whole again
    # (``_partial_update``: half the additions, 2 x (e + 8) / 2, and 16 more)
    backward_bytes = (12 * n + (cp - 1) * 4 * n * e + cp * (3 * (e + 8) + 16) * n + 3 * (4 + e) * n
                      + (cp - 1) * (16 - (e + 8)) * n)
    fwd_exposed = _behind(gather, step_f, overlap_slowdown) + forward_bytes / memory_bytes_per_s
    bwd_exposed = (_behind(gather, step_b, overlap_slowdown) + (cp - 1) * _behind(hop, step_b, overlap_slowdown)
                   + hop + backward_bytes / memory_bytes_per_s)
    return ContextAttentionCost("torch", gather, gather + cp * hop, fwd_exposed, bwd_exposed, messages=2 + cp,
                                eager_s=(forward_bytes + backward_bytes) / memory_bytes_per_s,
                                sent_bytes=2 * (cp - 1) * kv_bytes + cp * 8 * n,
                                forward_working_bytes=(cp + 1) * kv_bytes + 3 * 4 * n,
                                backward_working_bytes=(cp + 1) * kv_bytes + 3 * 4 * n + 3 * e * n + 2 * 8 * n)


def te_context_attention_cost(*, cp: int, kv_bytes: float, query_elems: float, elem_bytes: int, forward_s: float,
                              backward_s: float, link: Link, memory_bytes_per_s: float,
                              overlap_slowdown: float = 1.0) -> ContextAttentionCost:
    """K/V exchange of one attention layer as Transformer Engine's p2p context parallelism runs it
    (``AttnFuncWithCPAndKVP2P``, Megatron-LM's default ``--cp-comm-type p2p``), the program of
    Megatron-LM runs (``bench/fidelity.py``); autopar's runtime runs :mod:`autopar.context`.
    Read at TransformerEngine a75da0c (2025-11-22; v2.5-v2.10 the same for bf16 sbhd/bshd):

    - forward: K and V (grouped heads, not repeated) packed into one buffer (one copy), then ``cp``
      steps of the fused (cuDNN) kernel, each step's block sent on to the next rank while the
      current one computes; the partial outputs merged by log-sum-exp after the loop, one fused
      pass per step (``jit_fuser``: torch.compile) that reads the step's output and reads and writes
      the bf16 accumulator.
    - backward: K/V copied into the ring buffer; each step sends K/V with the K/V gradients gathered
      so far (bf16, one message of ``2 x kv_bytes``; the first step K/V alone, the last the
      gradients alone) while its kernel runs, then adds its query
      gradient into a bf16 buffer and its K and V gradients into the arriving ones (eager ``add_``:
      read, read, write each).

    Busiest rank (its every step full size); the blocks are the SDPA kernel the graph's attention
    is priced at, so nothing is added for them; the eager passes run on the compute stream at
    ``memory_bytes_per_s`` and are exposed, as are the transfers' time beyond each step's compute
    (slowed by ``overlap_slowdown`` while overlapped). Working set beyond the op's inputs and
    outputs: forward, every step's received K/V and partial output (merged after the loop);
    backward, the two ring buffers (K/V and gradients, twice) and the step's query and K/V gradients.
    """
    if cp == 1:
        return ContextAttentionCost("te", 0.0, 0.0, 0.0, 0.0)
    e, n = elem_bytes, query_elems
    step_f, step_b = forward_s / cp, backward_s / cp
    hop, both = p2p_s(kv_bytes, link), p2p_s(2 * kv_bytes, link)
    forward_bytes = 2 * kv_bytes + 2 * e * n + (cp - 1) * 3 * e * n  # pack; the first merge writes, the others add
    backward_bytes = 2 * kv_bytes + 2 * e * n + (cp - 1) * 3 * e * n + cp * 3 * kv_bytes
    eager_f, eager_b = forward_bytes / memory_bytes_per_s, backward_bytes / memory_bytes_per_s
    return ContextAttentionCost(
        "te", (cp - 1) * hop, 2 * hop + (cp - 2) * both,
        (cp - 1) * _behind(hop, step_f, overlap_slowdown) + eager_f,
        2 * _behind(hop, step_b, overlap_slowdown) + (cp - 2) * _behind(both, step_b, overlap_slowdown) + eager_b,
        messages=(cp - 1) + cp, eager_s=eager_f + eager_b, sent_bytes=(cp - 1) * kv_bytes + 2 * (cp - 1) * kv_bytes,
        forward_working_bytes=(cp + 1) * kv_bytes + cp * e * n,
        backward_working_bytes=5 * kv_bytes + 2 * e * n)


def broadcast_s(nbytes: float, group_size: int, link: Link) -> float:
    """Pipelined-ring broadcast of ``nbytes`` from one rank (NCCL's bus factor 1)."""
    _check(nbytes, group_size)
    if group_size == 1:
        return 0.0
    return nbytes / link.bytes_per_s + (group_size - 1) * link.latency_s


def p2p_s(nbytes: float, link: Link) -> float:
    """One send/recv of ``nbytes`` (a pipeline edge)."""
    _check(nbytes, 1)
    return nbytes / link.bytes_per_s + link.latency_s


def group_link(*, group_size: int, stride: int, devices_per_node: int, device: DeviceSpec) -> Link:
    """The calibrated link of the groups of one mesh axis (see the module docstring).

    Ranks are numbered node-major (rank ``r`` lives on node ``r // devices_per_node``)
    and an axis of ``group_size`` ranks ``stride`` apart tiles the ranks in blocks of
    ``group_size * stride`` consecutive ranks. Every group of the axis stays inside
    one node exactly when ``group_size * stride`` divides ``devices_per_node``; then
    the NVSwitch tables apply to the NVLink figure. Otherwise each group has
    ``ppn = min(group_size, devices_per_node // stride)`` ranks on each of its nodes
    (at least 1) and the bus bandwidth is ``ppn`` NICs' worth, capped by what
    ``ppn`` ranks reach inside a node. Examples on 8-GPU H100 nodes: (8, 1) -> NVSwitch;
    (16, 1) -> 8 NICs, 334 GB/s; (32, 8) -> one NIC per node, 42 GB/s; (8, 4) -> 2 NICs.
    A group of one rank never communicates and gets the NVLink link.
    """
    for name, value in (("group_size", group_size), ("stride", stride),
                        ("devices_per_node", devices_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if device.name == "cpu":  # gloo processes on one machine: the plain alpha-beta figures
        if group_size == 1 or devices_per_node % (group_size * stride) == 0:
            return Link(bytes_per_s=device.intra_node_bytes_per_s, latency_s=device.intra_node_latency_s)
        return Link(bytes_per_s=device.inter_node_bytes_per_s, latency_s=device.inter_node_latency_s)
    copy = device.hbm_bytes_per_s * MEMORY_EFFICIENCY
    if group_size == 1 or devices_per_node % (group_size * stride) == 0:
        return Link(bytes_per_s=device.intra_node_bytes_per_s, latency_s=device.intra_node_latency_s,
                    nvswitch=True, copy_bytes_per_s=copy)
    ppn = max(1, min(group_size, devices_per_node // stride))
    nodes = -(-group_size // ppn)
    nic = ppn * device.inter_node_bytes_per_s * NETWORK_EFFICIENCY
    ag = nic if ppn == 1 else min(nic, nvswitch_busbw("all_gather", ppn, device.intra_node_bytes_per_s))
    ar = nic if ppn == 1 else min(nic, nvswitch_busbw("all_reduce", ppn, device.intra_node_bytes_per_s))
    # a ring of ppn * nodes ranks has `nodes` network hops and the rest on NVLink
    hop = ((group_size - nodes) * NVLINK_HOP_LATENCY_S + nodes * NETWORK_HOP_LATENCY_S) / group_size
    # All-to-all has no ring to spread over the node's NICs: what a rank sends to the other
    # nodes, (n - ppn) / n of its buffer, leaves through its own NIC (its node-local part moves
    # on NVLink meanwhile). In nccl-tests' bus bandwidth, (n - 1) / n of the buffer over the
    # time: (n - 1) / (n - ppn) NICs' worth. DeepEP's dispatch and combine, built to saturate
    # exactly this, reach 43-58 GB/s per H800 with a 400 Gb/s (~50 GB/s) CX7 at EP 16-64
    # (deepseek-ai/DeepEP docs/legacy.md at 0297fc8, "Normal kernels"); ring collectives get
    # ppn NICs' worth (above).
    # (A group that straddles two nodes without tiling them, 4 of 6-GPU nodes, is taken as split
    # in halves.)
    # NCCL's all-to-all falls short of that over more than two nodes (NCCL_ALL_TO_ALL_MANY_NODES).
    off_node = group_size - ppn if group_size > ppn else max(1, group_size // 2)
    a2a = (group_size - 1) / off_node * device.inter_node_bytes_per_s * NETWORK_EFFICIENCY
    if nodes > 2:
        a2a *= NCCL_ALL_TO_ALL_MANY_NODES
    return Link(bytes_per_s=ag, latency_s=hop, base_latency_s=NCCL_BASE_LATENCY_S, all_reduce_bytes_per_s=ar,
                copy_bytes_per_s=copy, all_to_all_bytes_per_s=min(a2a, ag))


def stage_ranks(pp_rank: int, *, dp: int, tp: int) -> range:
    """The global ranks of pipeline rank ``pp_rank`` on a ``pp x dp x tp`` mesh, in (dp, tp) order.

    The runtime builds its mesh with ``init_device_mesh(device, (pp, dp, tp))``, which
    numbers ranks row-major (``torch.arange(world).view(pp, dp, tp)``): pp outermost, tp
    innermost, so rank ``(p, d, t)`` is ``(p * dp + d) * tp + t``.
    """
    return range(pp_rank * dp * tp, (pp_rank + 1) * dp * tp)


def pipeline_links(*, pp: int, dp: int, tp: int, n_stages: int, devices_per_node: int,
                   device: DeviceSpec) -> tuple[Link, ...]:
    """The link of each pipeline cut, stage ``c`` -> ``c + 1`` for ``c < n_stages - 1``.

    Stage ``s`` runs on pipeline rank ``s % pp`` (one stage per rank, or several under
    the interleaved schedule); each of its ranks sends to the rank with the same dp
    and tp coordinates on the next stage's pipeline rank (:func:`stage_ranks`). A cut
    gets the NVLink figures when every such pair shares a node (rank ``r`` lives on
    node ``r // devices_per_node``), the per-GPU network figures otherwise: all the
    pairs send at once, each through its own GPU's link. On 2x8 GPUs with tp=4, dp=1,
    pp=4 the pipeline ranks hold ranks 0-3, 4-7, 8-11 and 12-15, so cuts 0 and 2 stay
    on NVLink and cut 1 (ranks 4-7 -> 8-11) crosses the network.
    """
    for name, value in (("pp", pp), ("dp", dp), ("tp", tp), ("n_stages", n_stages),
                        ("devices_per_node", devices_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    intra = Link(bytes_per_s=device.intra_node_bytes_per_s, latency_s=device.intra_node_latency_s)
    inter = Link(bytes_per_s=device.inter_node_bytes_per_s, latency_s=device.inter_node_latency_s)
    links = []
    for cut in range(n_stages - 1):
        src = stage_ranks(cut % pp, dp=dp, tp=tp)
        dst = stage_ranks((cut + 1) % pp, dp=dp, tp=tp)
        same_node = all(a // devices_per_node == b // devices_per_node for a, b in zip(src, dst))
        links.append(intra if same_node else inter)
    return tuple(links)


def stage_group_link(pp_ranks: tuple[int, ...], *, dp: int, tp: int, devices_per_node: int,
                     device: DeviceSpec) -> Link:
    """The link of a group joining the same (dp, tp) coordinate on several pipeline ranks (the
    all-reduce of a parameter two stages share): NVLink when every such group stays in one node
    (rank ``r`` on node ``r // devices_per_node``, ranks from :func:`stage_ranks`), else the network."""
    members = [stage_ranks(p, dp=dp, tp=tp) for p in pp_ranks]
    same_node = all(len({rs[k] // devices_per_node for rs in members}) == 1 for k in range(dp * tp))
    if same_node:
        return Link(bytes_per_s=device.intra_node_bytes_per_s, latency_s=device.intra_node_latency_s)
    return Link(bytes_per_s=device.inter_node_bytes_per_s, latency_s=device.inter_node_latency_s)

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
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.devices import DeviceSpec

__all__ = [
    "Link",
    "all_gather_s",
    "all_reduce_s",
    "all_to_all_s",
    "broadcast_s",
    "group_link",
    "p2p_s",
    "pipeline_links",
    "reduce_scatter_s",
    "stage_group_link",
    "stage_ranks",
]


@dataclass(frozen=True)
class Link:
    """The bottleneck link of a group: per-rank per-direction bandwidth and per-step latency."""

    bytes_per_s: float
    """Bandwidth (beta) per rank per direction."""
    latency_s: float
    """Latency (alpha) of one step (one message) of a collective."""

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


def _ring_s(nbytes: float, group_size: int, link: Link, *, passes: int) -> float:
    """``passes`` ring sweeps of (n-1) steps, each moving 1/n of ``nbytes``."""
    _check(nbytes, group_size)
    if group_size == 1:
        return 0.0
    steps = passes * (group_size - 1)
    return steps / group_size * nbytes / link.bytes_per_s + steps * link.latency_s


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
    """All-to-all; ``nbytes`` is each rank's send buffer, ``(n-1)/n`` of which leaves the rank."""
    return _ring_s(nbytes, group_size, link, passes=1)


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
    """The bottleneck link of the groups of one mesh axis.

    Ranks are numbered node-major (rank ``r`` lives on node ``r // devices_per_node``)
    and an axis of ``group_size`` ranks ``stride`` apart tiles the ranks in blocks of
    ``group_size * stride`` consecutive ranks. Every group of the axis stays inside
    one node exactly when its block fits in a node and blocks do not straddle node
    boundaries, i.e. when ``group_size * stride`` divides ``devices_per_node``; then
    the NVLink figures apply. Otherwise some ring crosses the network and, with
    hierarchical collectives, the per-GPU network bandwidth is the bottleneck.
    Examples on 8-GPU nodes: (8, 1) -> NVLink; (16, 1) -> network; (8, 8) -> network;
    (2, 4) -> NVLink; (4, 1) with 6-GPU nodes -> network (ranks 4..7 span two nodes).
    A group of one rank never communicates and gets the NVLink figures.
    """
    for name, value in (("group_size", group_size), ("stride", stride),
                        ("devices_per_node", devices_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if group_size == 1 or devices_per_node % (group_size * stride) == 0:
        return Link(bytes_per_s=device.intra_node_bytes_per_s, latency_s=device.intra_node_latency_s)
    return Link(bytes_per_s=device.inter_node_bytes_per_s, latency_s=device.inter_node_latency_s)


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

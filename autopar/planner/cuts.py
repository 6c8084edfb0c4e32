"""What a pipeline rank sends across a cut, per micro-batch, as the runtime sends it.

The runtime cuts the per-rank program into stages (:func:`autopar.passes.pipeline.split_program`)
and :class:`autopar.runtime.pipeline.PipelineRunner` sends, for every micro-batch, across the
cut between stage s and s + 1:

- forward (s -> s + 1): every value a stage <= s makes that a stage > s reads: the block
  output, values relayed through the stages between (Llama's rotary tables), a forward value
  that a later stage's backward reads;
- backward (s + 1 -> s): every value a stage > s makes that a stage <= s reads: the
  gradients the earlier stage's backward waits for. Inputs that need no gradient (rotary
  tables, masks) get none, so nothing of them comes back.

Each value travels as this rank's local tensor: its tp shard when the sharding solution
splits it over tp (1/tp of it: the sequence-sharded residual stream under sequence
parallelism, or a hidden-dim shard), the whole value when partial. A value replicated on
tp (tp > 1) travels whole, or, where the plan says so for the message, as one piece of
``ceil(numel / tp)`` elements per tp rank that the receiving stage's tp group all-gathers
(Megatron-LM's scatter/gather of pipeline tensors): :class:`Messages` gives both sizes and
:func:`autopar.planner.timing.message_send` takes the faster on the cut's links, since the
gather's latency outweighs the bytes saved on small messages and NVLink cuts. Values
travel in the dtype the program computes them in (bf16 activations and gradients under a bf16-mixed
policy; the joint graph is traced in the policy's dtypes). The values of one direction are
flattened into one buffer per dtype: one ``isend`` per dtype and direction, every
micro-batch. Two kinds of values never cross: views of a parameter (each piece re-makes
them from its own parameter input) and the addends of a gradient summed over layers of
several stages (a tied embedding's: each stage sums its own addends and the stages
all-reduce them, :func:`autopar.passes.pipeline.split_tied_gradients`).

The planner reads this off the joint graph with layers in place of stages: a value
crosses the cut after layer k when its maker is at or before k and a reader is after k
(forward), or the other way round (backward). A cut inside a run of repeated blocks (the
trace keeps two, the second standing for the rest) is read off the cut after the run's
first traced block: the same values cross it, made with the second block's placements,
as the runtime gives every block after the first the second one's.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import fx

from autopar.passes import meta_keys as mk
from autopar.passes.backward_split import tied_gradient_sums
from autopar.passes.pipeline import PARAM_VIEWS
from autopar.passes.strategies import StrategyGraph

__all__ = ["Crossing", "CutTable", "Messages", "piece_bytes"]


@dataclass(frozen=True)
class Crossing:
    """One value crossing a cut."""

    tensor: str
    """The joint-graph node."""
    node: str
    """The strategy-graph node that makes it (a ``getitem`` folds into its producer)."""
    out: int
    """Which output of ``node``."""
    side: str
    """"forward" or "backward"."""
    dtype: torch.dtype
    source: str
    """Module that makes it (forward) or layer (backward)."""
    reader: str
    """Module of its first reader across the cut."""


@dataclass(frozen=True)
class Messages:
    """The messages of one cut for one micro-batch, per rank, one per dtype, each way:
    (dtype, bytes one rank sends with the values replicated on tp whole, bytes it sends with
    them as tp pieces, bytes the receiving tp group then all-gathers: ``tp`` pieces of
    each; 0 when no value of the message is replicated or tp == 1)."""

    forward: tuple[tuple[str, float, float, float], ...]
    """Sent from the stage before the cut to the one after it."""
    backward: tuple[tuple[str, float, float, float], ...]
    """Sent back."""


class CutTable:
    """Per layer of a joint graph (``gm.meta[LAYERS]`` order), what crosses the cut after it."""

    def __init__(self, gm: fx.GraphModule):
        layers: tuple[mk.LayerInfo, ...] = gm.meta[mk.LAYERS]
        info: mk.GraphTrace = gm.meta[mk.GRAPH]
        self.order = [x.path for x in layers]
        position = {p: i for i, p in enumerate(self.order)}
        self.first_of_run = {r.traced[1]: r.traced[0] for r in info.repeats}
        """The second traced block of a run -> the first (a cut inside the run is read after the first)."""
        self.after: dict[int, list[Crossing]] = defaultdict(list)
        compute = [n for n in gm.graph.nodes if n.op == "call_function" and mk.LAYER in n.meta
                   and n.meta[mk.LAYER] in position]
        at = {n: position[n.meta[mk.LAYER]] for n in compute}
        self.layer_of = {n.name: n.meta[mk.LAYER] for n in compute}
        """Joint-graph node -> its layer."""
        free = _param_views(gm)
        tied = {n for tree, _ in tied_gradient_sums(gm, at).values() for n in tree}
        for u in compute:
            val = u.meta.get("val")
            if u in free or not isinstance(val, torch.Tensor):
                continue
            readers = [v for v in u.users if v in at and v not in tied and v not in free]
            later = [v for v in readers if at[v] > at[u]]
            earlier = [v for v in readers if at[v] < at[u]]
            node, out = (u.args[0].name, int(u.args[1])) if _is_getitem(u) else (u.name, 0)
            path = u.meta[mk.TRACE].module_path or "<model>"
            for k in range(at[u], max((at[v] for v in later), default=at[u])):  # the first reader after k
                reader = min((v for v in later if at[v] > k), key=at.__getitem__)
                self.after[k].append(Crossing(u.name, node, out, "forward", val.dtype, path, _module(reader)))
            for k in range(min((at[v] for v in earlier), default=at[u]), at[u]):  # the last reader up to k
                reader = max((v for v in earlier if at[v] <= k), key=at.__getitem__)
                self.after[k].append(Crossing(u.name, node, out, "backward", val.dtype, u.meta[mk.LAYER],
                                              _module(reader)))
        self.twins: dict[str, dict[str, str]] = {}
        """Per run, its first traced block's ops -> the second's, by position (identical blocks)."""
        for second, first in self.first_of_run.items():
            a = [n.name for n in compute if n.meta[mk.LAYER] == first and not _is_getitem(n)]
            b = [n.name for n in compute if n.meta[mk.LAYER] == second and not _is_getitem(n)]
            self.twins[second] = dict(zip(a, b)) if len(a) == len(b) else {}
        self._sg: StrategyGraph | None = None
        self._sg_index: dict[str, int] = {}

    def crossings(self, left: str, right: str | None = None) -> tuple[list[Crossing], str | None]:
        """What crosses the cut between a layer ``left`` and the next, ``right``, both plan layer
        paths (a run's second traced block names every block after the first: ``left ==
        right`` is a cut inside the run); and, for a cut inside a run, the block whose
        placements the values made before the cut take (else None)."""
        if left == right and left in self.first_of_run:
            return self.after[self.order.index(self.first_of_run[left])], left
        return self.after[self.order.index(left)], None

    def messages(self, crossings: list[Crossing], placed_as: str | None, sg: StrategyGraph, choice: tuple[int, ...],
                 microbatch: int) -> Messages:
        """Per-rank bytes of the cut's messages at ``microbatch`` under the sharding ``choice``."""
        out: dict[str, dict[str, list[float]]] = {"forward": {}, "backward": {}}
        tp = sg.axis_size
        for c, (_, placement, nbytes) in zip(crossings, self.placed(crossings, placed_as, sg, choice, microbatch)):
            totals = out[c.side].setdefault(str(c.dtype).removeprefix("torch."), [0, 0, 0])
            totals[0] += nbytes
            if placement == "R" and tp > 1:
                piece = piece_bytes(nbytes, c.dtype, tp)
                totals[1] += piece
                totals[2] += piece * tp
            else:
                totals[1] += nbytes
        return Messages(**{side: tuple((d, *t) for d, t in by.items()) for side, by in out.items()})

    def forward_share(self, layer: str, sg: StrategyGraph, choice: tuple[int, ...], microbatch: int) -> float:
        """The part of the forward values made in ``layer`` and read after it that one rank holds
        (per-rank bytes over whole bytes; 1.0 when nothing crosses): 1/tp for the residual stream
        split over the sequence (sequence parallelism), 1 for a replicated one. Full recompute
        keeps these values per layer, as each rank holds them."""
        crossings, placed_as = self.crossings(layer)
        made = [(c, p) for c, p in zip(crossings, self.placed(crossings, placed_as, sg, choice, microbatch))
                if c.side == "forward" and self.layer_of.get(c.tensor) == layer]
        whole = sum(p[0] for _, p in made)
        return sum(p[2] for _, p in made) / whole if whole else 1.0

    def placed(self, crossings: list[Crossing], placed_as: str | None, sg: StrategyGraph, choice: tuple[int, ...],
               microbatch: int) -> list[tuple[int, str, int]]:
        """Per crossing: (its bytes at ``microbatch``, its placement on tp under ``choice``, the
        bytes one rank holds: its tp shard, a 1/tp part since only even shards are candidates;
        else all of it)."""
        index = self._index(sg)
        twins = self.twins.get(placed_as, {}) if placed_as else {}
        out = []
        for c in crossings:
            v = index[c.node]
            whole = round(sg.nodes[v].out_bytes[c.out](microbatch))  # exact: affine in the batch
            if c.side == "forward" and c.node in twins:
                v = index[twins[c.node]]
            placement = sg.nodes[v].candidates[choice[v]].outs[c.out] or "R"
            out.append((whole, placement, whole // sg.axis_size if placement.startswith("S") else whole))
        return out

    def _index(self, sg: StrategyGraph) -> dict[str, int]:
        if self._sg is not sg:
            self._sg, self._sg_index = sg, {n.name: v for v, n in enumerate(sg.nodes)}
        return self._sg_index


def piece_bytes(nbytes: int, dtype: torch.dtype, tp: int) -> int:
    """Bytes of one tp piece of a replicated value of ``nbytes``: ``ceil(numel / tp)`` elements
    (the runtime pads the last piece, :mod:`autopar.runtime.pipeline`)."""
    elem = dtype.itemsize
    return -(-(nbytes // elem) // tp) * elem


def _module(n: fx.Node) -> str:
    return n.meta[mk.TRACE].module_path or "<model>"


def _is_getitem(n: fx.Node) -> bool:
    return n.target is operator.getitem


def _param_views(gm: fx.GraphModule) -> set[fx.Node]:
    """Chains of view ops from a trainable parameter: every piece that reads one re-makes it
    (:func:`autopar.passes.pipeline._tags`), so none crosses a cut."""
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    views: set[fx.Node] = {p for p in gm.graph.find_nodes(op="placeholder")
                           if p.meta[mk.TRACE].role is mk.Role.PARAM and p.meta[mk.TRACE].fqn in info.grad_outputs}
    params = set(views)
    for n in gm.graph.nodes:
        ins = n.all_input_nodes
        if n.op == "call_function" and n.target in PARAM_VIEWS and ins and ins[0] in views \
                and all(a.op == "get_attr" for a in ins[1:]):
            views.add(n)
    return views - params

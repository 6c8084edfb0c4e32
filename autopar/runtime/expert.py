"""Expert parallelism in :func:`autopar.parallelize`: each rank keeps only its experts, folded over dp.

The layout (the seeds' EP section; DESIGN's mesh axes, ``ep`` inside ``dp``): the
world's ``dp`` data-parallel ranks are ``dp // ep`` groups of ``ep`` consecutive ranks.
Attention and every other non-expert parameter is data parallel over all ``dp`` ranks;
the experts of a block are cut into ``ep`` parts, rank ``r`` holding part ``r % ep``, so
each ep group holds every expert once and the ``dp // ep`` groups are replicas:

    rank      0   1   2   3          (dp = 4, ep = 2)
    batch     b0  b1  b2  b3         each rank a quarter of the global batch
    experts   A   B   A   B          A = experts [0, E/2), B = [E/2, E)
    ep group  {0, 1}  {2, 3}         all-to-all dispatch and combine (autopar.experts)
    replicas  {0, 2}  {1, 3}         expert gradients summed (ZeRO: their state chunked) here
    dp        {0, 1, 2, 3}           non-expert gradients summed (ZeRO: their state chunked) here

Every gradient is the sum of the ranks' addends of the global mean loss: non-expert ones
over all dp ranks, expert ones over the replica group, whose members' all-to-alls already
brought every token of their ep group to them.

What is recognised: the experts ops of the traced graph (:func:`autopar.experts.moe_experts`,
as ``examples/moe.py``'s ``MoE`` calls it, and as Hugging Face's gated-SiLU experts modules
(Mixtral, Qwen2-MoE, ...) are traced: :func:`autopar.experts.hf_experts_forward`); the plan's
``experts`` record names their stacked parameters (dim 0 = expert: Mixtral's ``gate_up_proj``
and ``down_proj``). Other grouped-matmul experts are planned under ep
(:mod:`autopar.planner.experts`) but not run under it: runnable plans leave them out of ep.

Folded over tp as well (the plan's ``etp=1``, :mod:`autopar.planner.expert_folding`): the ep
group is the tp ranks of ``ep / tp`` consecutive dp ranks (:func:`folded_ep_group`), each tp rank
routes its own tokens (the block's ops run on its shard: :func:`autopar.passes.folded.run_folded`),
the dp part of ep cuts the experts here as above (``ep / tp`` parts, replicas ``ep / tp`` dp ranks
apart in the tp column) and the plan's expert-dim split over tp (S0) cuts them the rest of the
way when the parameters are placed.

In the build (beside tp and pp, at any ZeRO stage, from real weights or ``meta``; beside tp
the experts are replicated over tp and each tp rank exchanges tokens with its ep peers in its
tp column, beside pp within its pipeline rank's slice): :func:`ep_groups` creates the groups,
:func:`cut_experts` keeps each rank's experts before the trace (so the traced program holds
them), :func:`point_experts_at` sends the traced experts ops over the rank's ep group, the
routing runs on each rank's own tokens (:mod:`autopar.passes.token_local`), and
:class:`autopar.runtime.zero.ShardedParams` sums expert gradients over the replica group (and at
ZeRO >= 1 keeps their state in chunks over it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import PlanError

__all__ = ["check_dispatch_runnable", "ep_groups", "folded_ep_group", "expert_param_names", "cut_experts",
           "whole_experts_in", "point_experts_at", "EpLayout"]


def check_dispatch_runnable(dispatch: str | None) -> None:
    """``parallelize`` moves ep's tokens with its own all-to-alls: a plan priced with another
    program's (``ep_dispatch``) is refused before any collective."""
    if dispatch not in (None, "autopar"):
        raise PlanError(f"ep_dispatch={dispatch!r} prices another program's token exchange (for comparing with "
                        f"runs made with it) and autopar does not run it; leave ep_dispatch unpinned or pin 'autopar'")


def ep_groups(mesh_ranks: torch.Tensor, ep: int, rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(ep group, replica group) of ``rank`` for the (dp, tp) mesh of global ranks ``mesh_ranks``
    (or the (pp, dp, tp) mesh: the same in each pipeline rank's slice): along each tp column, ep
    groups of ``ep`` consecutive dp ranks and replica groups of the dp ranks ``ep`` apart (the
    plan's layout, :class:`EpLayout`). Every rank creates every group, in the same order
    (``new_group`` is collective)."""
    slices = mesh_ranks if mesh_ranks.dim() == 3 else mesh_ranks.unsqueeze(0)
    _, dp, tp = slices.shape
    layout = EpLayout(dp=dp, ep=ep)
    mine: dict[str, dist.ProcessGroup] = {}
    for mesh in slices:
        for t in range(tp):
            column = [int(r) for r in mesh[:, t]]
            for kind, groups in (("ep", layout.ep_groups()), ("replicas", layout.replica_groups())):
                for members in groups:
                    ranks = [column[i] for i in members]
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        mine[kind] = group
    return mine["ep"], mine["replicas"]


def folded_ep_group(mesh_ranks: torch.Tensor, k: int, rank: int) -> dist.ProcessGroup:
    """The experts ops' group of ``rank`` when ep is folded over tp as well (the plan's ``etp=1``,
    :mod:`autopar.planner.expert_folding`): the tp ranks of ``k`` consecutive dp ranks, ordered dp
    rank then tp rank, so group rank ``j * tp + t`` holds chunk ``t`` (of tp, its tp shard) of dp
    part ``j``'s experts: the experts' order, as the op's dispatch reads it. Every rank creates
    every group, in the same order."""
    slices = mesh_ranks if mesh_ranks.dim() == 3 else mesh_ranks.unsqueeze(0)
    _, dp, _ = slices.shape
    mine = None
    for mesh in slices:
        for g in range(dp // k):
            ranks = [int(r) for r in mesh[g * k:(g + 1) * k].reshape(-1)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
    return mine


def expert_param_names(plan) -> list[str]:
    """Every stacked expert parameter of the model ``plan`` was made for, in stage order. The plan's
    ``experts`` record names those of the layers its trace kept (a repeated block's second instance
    stands for the third and later ones); each instance's are its stand-in's, renamed."""
    from autopar.planner.record import _stand_in

    by_layer: dict[str, list[str]] = {}
    for site in plan.experts["layers"].values():
        by_layer.setdefault(site["layer"], []).extend(site["params"])
    out = []
    for stage in plan.stages:
        for path in stage["layers"]:
            src = _stand_in(path, plan.layers)
            out += [path + f[len(src):] for f in by_layer.get(src, [])]
    return out


def cut_experts(model: nn.Module, fqns: list[str], *, ep: int, part: int,
                device: torch.device) -> dict[str, nn.Parameter]:
    """Keep part ``part`` of ``ep`` (rows ``[part * E/ep, (part + 1) * E/ep)`` of dim 0) of rank
    0's value of each stacked expert parameter ``fqns``, in place; the rest is freed. (Every
    rank starts from rank 0's weights, as for every other parameter: the whole value is
    broadcast first, over ``device`` as NCCL needs.) A collective: every rank calls it.

    A parameter on ``meta`` is cut to a meta parameter of the part's shape (no collective); the
    whole meta parameters are returned by name, for :func:`whole_experts_in` to put back while
    the model is initialised (:mod:`autopar.runtime.materialize` initialises a module whole, so
    that every part gets the rows of the same whole values)."""
    wholes = {}
    for fqn in fqns:
        path, _, name = fqn.rpartition(".")
        module = model.get_submodule(path)
        full = getattr(module, name)
        if full.shape[0] % ep:
            raise ValueError(f"{fqn} has {full.shape[0]} experts, not divisible by ep={ep}")
        n = full.shape[0] // ep
        if full.device.type == "meta":
            wholes[fqn] = full
            setattr(module, name, nn.Parameter(full[part * n:(part + 1) * n], requires_grad=full.requires_grad))
            continue
        whole = full.detach().to(device, copy=True)
        dist.broadcast(whole, src=0)
        setattr(module, name, nn.Parameter(whole[part * n:(part + 1) * n].to(full.device, copy=True),
                                           requires_grad=full.requires_grad))
    return wholes


@contextlib.contextmanager
def whole_experts_in(model: nn.Module, wholes: dict[str, nn.Parameter]):
    """While the context lasts, the whole meta expert parameters (:func:`cut_experts`) stand in
    the model instead of the parts; the parts are put back after."""
    cut = {}
    for fqn, whole in wholes.items():
        path, _, name = fqn.rpartition(".")
        module = model.get_submodule(path)
        cut[fqn] = (module, name, getattr(module, name))
        setattr(module, name, whole)
    try:
        yield
    finally:
        for module, name, part in cut.values():
            setattr(module, name, part)


def point_experts_at(gm: torch.fx.GraphModule, group_name: str) -> int:
    """Make every experts op of the traced graph (forward and backward) run over the process
    group ``group_name`` (its last argument); the number of nodes changed."""
    from autopar.passes.token_local import op_name

    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node) in ("autopar::moe_experts", "autopar::moe_experts_backward"):
            node.args = (*node.args[:-1], group_name)
            n += 1
    return n


@dataclass(frozen=True, kw_only=True)
class EpLayout:
    """Rank groups of expert parallelism folded over ``dp`` data-parallel ranks."""

    dp: int
    ep: int

    def __post_init__(self):
        if self.ep < 1 or self.dp < 1 or self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}: expert parallelism folds over the "
                             f"data-parallel ranks; pick ep among the divisors of {self.dp}")

    def ep_groups(self) -> list[list[int]]:
        """Consecutive ranks: the ranks that exchange tokens (all-to-all)."""
        return [list(range(g * self.ep, (g + 1) * self.ep)) for g in range(self.dp // self.ep)]

    def replica_groups(self) -> list[list[int]]:
        """Ranks holding the same experts: where expert gradients are summed."""
        return [list(range(i, self.dp, self.ep)) for i in range(self.ep)]

    def expert_part(self, rank: int) -> int:
        return rank % self.ep

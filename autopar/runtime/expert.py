"""Expert parallelism at module level: each rank keeps only its experts, folded over dp.

The layout (the seeds' EP section; DESIGN's mesh axes, ``ep`` inside ``dp``): the
world's ``dp`` data-parallel ranks are ``dp // ep`` groups of ``ep`` consecutive ranks.
Attention and every other non-expert parameter is data parallel over all ``dp`` ranks;
the experts of a block are cut into ``ep`` parts, rank ``r`` holding part ``r % ep``, so
each ep group holds every expert once and the ``dp // ep`` groups are replicas:

    rank      0   1   2   3          (dp = 4, ep = 2)
    batch     b0  b1  b2  b3         each rank a quarter of the global batch
    experts   A   B   A   B          A = experts [0, E/2), B = [E/2, E)
    ep group  {0, 1}  {2, 3}         all-to-all dispatch and combine (autopar.experts)
    replicas  {0, 2}  {1, 3}         expert gradients summed here
    dp        {0, 1, 2, 3}           non-expert gradients summed here

The global loss is the mean over the dp ranks' local mean losses (equal slices), so
every gradient is (sum over the ranks that computed an addend) / dp: non-expert over
all dp ranks, expert over its replica group, whose members' all-to-alls already brought
every token of their ep group to them.

What is recognised: a module with the class attribute ``autopar_experts`` naming its
stacked expert parameters (dim 0 = expert), an ``n_experts`` attribute and an
``ep_group`` attribute that it passes to :func:`autopar.experts.moe_experts`, as
``examples/moe.py``'s ``MoE`` does. Recognising experts from arbitrary traced graphs
(Hugging Face Mixtral's grouped matmul) and running EP inside the compiled per-rank
program of :func:`autopar.parallelize` are not done yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["refuse_ep", "EpLayout", "expert_modules", "expert_parameter_names", "shard_experts", "ExpertParallel"]


def refuse_ep(ep: int | None) -> None:
    """:func:`autopar.parallelize` does not run expert parallelism yet: a clear error for ``ep`` > 1."""
    if ep and ep > 1:
        from autopar.errors import PlanError

        raise PlanError(f"ep={ep}: autopar.parallelize does not run expert parallelism yet (it is planned and "
                        f"priced); train with autopar.runtime.expert.ExpertParallel (experts sharded over ep, "
                        f"everything else data parallel), or drop ep")


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


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every expert module (``autopar_experts`` marker), in model order."""
    return [(path, m) for path, m in model.named_modules() if getattr(type(m), "autopar_experts", None)]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Fully qualified names of the stacked expert parameters."""
    return [f"{path}.{name}" if path else name for path, m in expert_modules(model) for name in type(m).autopar_experts]


def shard_experts(model: nn.Module, *, ep: int, part: int, group_name: str) -> list[str]:
    """Cut every expert module's stacked weights to part ``part`` of ``ep`` (rows
    ``[part * E/ep, (part + 1) * E/ep)`` of dim 0) in place, and point it at the ep group
    ``group_name``. Returns the expert parameter names. The rest is freed: the rank holds
    only its experts."""
    for path, m in expert_modules(model):
        if m.n_experts % ep:
            raise ValueError(f"{path or 'the model'} has {m.n_experts} experts, not divisible by ep={ep}; "
                             f"pick ep among the divisors of {m.n_experts}")
        n = m.n_experts // ep
        for name in type(m).autopar_experts:
            full = getattr(m, name)
            if full.shape[0] != m.n_experts:
                raise ValueError(f"{path}.{name} has {full.shape[0]} rows on dim 0 but {m.n_experts} experts; "
                                 f"was it sharded already?")
            setattr(m, name, nn.Parameter(full.detach()[part * n:(part + 1) * n].clone(),
                                          requires_grad=full.requires_grad))
        m.ep_group = group_name if ep > 1 else ""
    return expert_parameter_names(model)


class ExpertParallel:
    """Train ``model`` under ``layout`` on this process group's ranks (world size = dp):
    experts sharded over ep, everything else replicated and data parallel.

    ``train_step(inputs, target)`` takes the global batch (the same on every rank), keeps
    this rank's slice of dim 0, runs forward, backward, the gradient sums above and one
    optimizer step, and returns the global mean loss."""

    def __init__(self, model: nn.Module, *, layout: EpLayout, loss_fn: Callable,
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != layout.dp:
            raise ValueError(f"expert parallelism with dp={layout.dp} needs {layout.dp} processes, "
                             f"this world has {world}")
        if not expert_modules(model):
            raise ValueError(f"ep={layout.ep}: {type(model).__name__} has no expert module (a module with "
                             f"an 'autopar_experts' attribute, like examples/moe.py's MoE)")
        self.layout, self.rank, self.model, self.loss_fn = layout, rank, model, loss_fn
        # every rank creates every group, in the same order (new_group is collective)
        ep_groups = [dist.new_group(r) for r in layout.ep_groups()]
        replica_groups = [dist.new_group(r) for r in layout.replica_groups()]
        self.ep_group = ep_groups[rank // layout.ep]
        self.replica_group = replica_groups[layout.expert_part(rank)]
        self.expert_names = set(shard_experts(model, ep=layout.ep, part=layout.expert_part(rank),
                                              group_name=self.ep_group.group_name))
        self.optimizer = optimizer([p for p in model.parameters() if p.requires_grad])

    def local_batch(self, value):
        """This rank's slice of dim 0 of a global batch tensor."""
        if not isinstance(value, torch.Tensor):
            return value
        if value.shape[0] % self.layout.dp:
            raise ValueError(f"the global batch of {value.shape[0]} is not divisible by dp={self.layout.dp}")
        n = value.shape[0] // self.layout.dp
        return value[self.rank * n:(self.rank + 1) * n]

    def train_step(self, inputs, target) -> float:
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        out = self.model(*(self.local_batch(x) for x in inputs))
        loss = self.loss_fn(out, self.local_batch(target))
        loss.backward()
        self.reduce_grads()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / self.layout.dp

    def reduce_grads(self) -> None:
        """Non-expert gradients: mean over all dp ranks; expert gradients: summed over their
        replica group, divided by dp (one all-reduce per tensor: a first milestone, not bucketed)."""
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            if name in self.expert_names:
                if self.layout.dp > self.layout.ep:
                    dist.all_reduce(p.grad, group=self.replica_group)
            else:
                dist.all_reduce(p.grad)
            p.grad.div_(self.layout.dp)

"""Context parallelism (cp > 1) and expert parallelism (ep > 1) in :class:`autopar.parallel.ParallelModule`.

Kept apart from :mod:`autopar.parallel` as a mixin, as :mod:`autopar.runtime.pipelined`
keeps pp > 1: the builds (:mod:`autopar.runtime.startup`, :mod:`autopar.runtime.pipelined`)
and the step loop call these, and each is a no-op at cp = 1 (ep = 1). The work itself is
in :mod:`autopar.runtime.context` (cp groups, the attention rewrite, the sequence layout)
and :mod:`autopar.runtime.expert` (ep groups, cutting the experts).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

log = logging.getLogger("autopar.parallel")  # the start-up's phases log as autopar.parallel (README)

__all__ = ["CpEpBuild"]


class CpEpBuild:
    """``ParallelModule``'s methods for cp > 1 and ep > 1."""

    def _context_parallel(self):
        """cp > 1: this rank's cp group (``cp`` consecutive dp ranks in its tp column and stage, the
        layout of :mod:`autopar.runtime.context`)."""
        if self.cp == 1:
            return None
        from autopar.runtime.context import cp_group

        mesh = self.pp_mesh if self.plan.mesh["pp"] > 1 else self.mesh
        return cp_group(mesh.mesh, self.cp, dist.get_rank())

    def _check_cp_graph(self, gm) -> None:
        """cp > 1 under a given plan: refuse, on every rank alike, a traced step (rows of ``S / cp``
        tokens) with an op that works along each sequence apart, which would run on the rank's
        chunks. The planner refuses cp for such a model, so a plan made here has been checked; a
        given one may have been made before the planner did, or edited."""
        if self.cp == 1 or self._given_plan is None:
            return
        from autopar.errors import PlanError
        from autopar.passes.sequence_mixing import described, sequence_mixing

        found = sequence_mixing(gm, self.plan.context["sequence"] // self.cp)
        if found:
            raise PlanError(f"cp={self.cp}: {described(found)}, which would run on this rank's chunks as if they were "
                            f"sequences; the planner refuses cp for this model (a plan made before it did, or edited): "
                            f"plan it again, or compute that op over all tokens")

    def _cp_program(self, program) -> None:
        """cp > 1: this rank's step program (before it is cut into pipeline pieces) rewritten for its cp group."""
        if self.cp == 1:
            return
        from autopar.runtime.context import apply_cp, runtime_variant

        n = apply_cp(program, cp=self.cp, group=self.cp_group.group_name, rank=dist.get_rank(self.cp_group),
                     seq=self.plan.context["sequence"], variant=runtime_variant(self.plan.context))
        log.info("rank %d: %d attention ops over cp group %s", dist.get_rank(), n,
                 dist.get_process_group_ranks(self.cp_group))

    def _cp_micro(self, micro: dict[str, Any]) -> dict[str, Any]:
        """A micro-batch as the program takes it under cp > 1: stacked by (batch group, cp rank),
        a Hugging Face causal LM's labels shifted on the whole sequence first (see
        :mod:`autopar.runtime.context`); unchanged without cp."""
        if self.cp == 1:
            return micro
        from autopar.runtime.context import shift_hf_labels, stack_sequences

        rows = self.plan.model["global_batch"] // self.plan.schedule["microbatches"]
        return stack_sequences(shift_hf_labels(self.model, micro), cp=self.cp, seq=self.plan.context["sequence"],
                               rows=rows, groups=self.plan.mesh["dp"] // self.cp)

    def _expert_parallel(self) -> dict[str, Any]:
        """ep > 1: create the ep and replica groups, keep this rank's experts in the model (before
        the trace, so the traced program holds them); ShardedParams' expert arguments."""
        if self.ep == 1:
            return {}
        from autopar.runtime.expert import cut_experts, ep_groups, expert_param_names, folded_ep_group

        mesh = self.pp_mesh if self.plan.mesh["pp"] > 1 else self.mesh  # (every slice's groups, on every rank)
        # ep folded over tp as well (etp=1): the dp part of ep cuts the experts here, the plan's
        # expert-dim split over tp (S0) cuts them the rest of the way when the parameters are placed
        folded = self.plan.ep_over_tp
        k = self.ep // self.plan.mesh["tp"] if folded else self.ep
        ep_group, replica_group = ep_groups(mesh.mesh, k, dist.get_rank())
        op_group = folded_ep_group(mesh.mesh, k, dist.get_rank()) if folded else ep_group
        names = expert_param_names(self.plan)
        part = self.mesh.get_local_rank(0) % k
        # (started from meta: the whole meta experts, put back while the model is initialised)
        self._whole_experts = cut_experts(self.model, names, ep=k, part=part, device=self.torch_device)
        self._expert_rows = {f: (part * self._whole_experts[f].shape[0] // k,
                                 (part + 1) * self._whole_experts[f].shape[0] // k) for f in self._whole_experts}
        log.info("rank %d: experts cut to part %d of %d (ep group %s)", dist.get_rank(), part, k,
                 dist.get_process_group_ranks(op_group))
        return {"experts": names, "ep_group": ep_group, "replica_group": replica_group, "op_group": op_group}

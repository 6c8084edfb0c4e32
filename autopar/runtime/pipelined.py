"""The pipelined half of :class:`autopar.parallel.ParallelModule` (pp > 1): build, step, schedule.

Kept apart from :mod:`autopar.parallel` (the start-up order, the step loop, state) as a mixin:
it reads the module's plan, mesh and parameters and uses the helpers of the other mixins
(``_trace``, ``_materialize``, ... in :mod:`autopar.runtime.startup`; ``_cp_micro`` in
:mod:`autopar.runtime.cp_ep`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import PlanError
from autopar.passes import meta_keys as mk

__all__ = ["PipelineBuild"]


class PipelineBuild:
    """``ParallelModule``'s methods for pp > 1."""

    def _build_pipeline(self, names, values, has_target) -> None:
        """pp > 1: trace, tag each node with its stage, shard, cut into F/B/W pieces per stage.

        Every rank traces and shards the whole joint graph with its own (dp, tp)
        coordinates, so the tp collectives of a stage are those of the tp group
        that runs it and pp neighbours (same coordinates) agree on every message
        they exchange; then it keeps the pieces of its own stages and the
        parameters they read.
        """
        from autopar.passes.pipeline import (INPUT_PREFIX, PARAM_PREFIX, split_program, split_tied_gradients,
                                             stage_of_layers, tag_stages)
        from autopar.passes.recompute import recompute_in_backward
        from autopar.passes.shard import shard_joint_graph
        from autopar.runtime.executor import placements_for_graph
        from autopar.runtime.pipeline import PipelineRunner, tp_pieces
        from autopar.runtime.startup import _check_scalar_loss, _layer_groups, _split_batch, _trace_params
        from autopar.runtime.zero import ShardedParams

        with torch.no_grad():  # every stage is cut from rank 0's weights, as with pp = 1
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                if t.device.type == "meta":  # (meta ones are initialised per rank from one seed)
                    continue
                on_device = t.data.to(self.torch_device)  # NCCL sends only device tensors
                dist.broadcast(on_device, src=0)
                if on_device is not t.data:
                    t.data.copy_(on_device)
        plan, m = self.plan, self.plan.schedule["microbatches"]
        first = _split_batch(values, m, plan.model["global_batch"])[0]
        self.cp_group = self._context_parallel()
        first = self._cp_micro(first)
        inputs, target = self._as_user_inputs(tuple(first), first, has_target)
        experts = self._expert_parallel()
        self.gm = self._trace(inputs, target)
        self._check_cp_graph(self.gm)
        if experts:
            from autopar.runtime.expert import point_experts_at

            point_experts_at(self.gm, experts.pop("op_group").group_name)
        _check_scalar_loss(self.gm)
        self.ops, tp_params = placements_for_graph(self.gm, plan)
        recompute_in_backward(self.gm, plan.recompute, self.ops)  # (before the tags: copies are backward nodes)
        stages = tag_stages(self.gm, stage_of_layers([st["layers"] for st in plan.stages]))
        tied = split_tied_gradients(self.gm, stages)
        info: mk.GraphTrace = self.gm.meta[mk.GRAPH]
        trainable = [f for f in info.param_fqns if f in info.grad_outputs]
        addends = [(f, info.grad_outputs[f]) for f in trainable]
        addends += [(f, idx) for f, parts in tied.items() for _, idx in parts[1:]]
        self._materialize(trainable, held={})  # buffers and frozen parameters, before the trace bakes them in
        self.frozen = self._frozen_state(set(trainable))
        self.input_names = list(first)
        program = shard_joint_graph(self.gm, mesh=self.mesh, ops=self.ops,
                                    params=_trace_params(self.model, trainable, self.mesh, tp_params,
                                                         param_dtype=self.policy.param_dtype),
                                    frozen=self.frozen, trainable=trainable, tp_placements=tp_params,
                                    inputs=self._place_inputs(first), loss_scale=1.0 / m, addends=addends,
                                    keep_tags=True, tracing_mode="fake")
        self.grad_returns = program.meta[mk.GRAD_RETURNS]
        self._cp_program(program)
        pp, pp_rank = plan.mesh["pp"], self.pp_mesh.get_local_rank("pp")
        n_stages = len(plan.stages)
        self.pipeline = split_program(
            program, n_stages=n_stages, placeholder_keys=[PARAM_PREFIX + f for f in trainable]
            + [INPUT_PREFIX + n for n in self.input_names], loss_output=0,
            grad_outputs={1 + j: f for j, (f, _) in enumerate(addends)})
        mine = [s for s in range(n_stages) if s % pp == pp_rank]
        held = {f for s in mine for f in self.pipeline.stages[s].params}
        self.trainable = [f for f in trainable if f in held]
        self.tp_params = tp_params
        addends: dict[str, int] = {}
        for s in mine:
            for fqn in self.pipeline.stages[s].grads.values():
                addends[fqn] = addends.get(fqn, 0) + 1
        self.params = ShardedParams(self.model, mesh=self.mesh, tp_placements=tp_params, zero=plan.zero,
                                    trainable=self.trainable, groups=_layer_groups(self.gm), addends=addends,
                                    **self._param_policy(),
                                    **{k: ([f for f in v if f in held] if k == "experts" else v)
                                       for k, v in experts.items()})
        self._setup_params()
        self._materialize(trainable, held=self.params.entries)  # this rank's stages' parameters
        self.params.set_tp_returns(self.grad_returns)
        self.pipeline = _with_zero_calls(self.pipeline, mine, self.params)
        coords = self.pp_mesh.mesh  # global rank at (pp, dp, tp)
        dp_rank, tp_rank = self.mesh.get_local_rank(0), self.mesh.get_local_rank(1)
        self.tied_groups = {}
        for fqn in sorted(self.pipeline.tied):  # every rank creates every group, in the same order
            ranks_pp = sorted({s % pp for s in self.pipeline.tied[fqn]})
            if len(ranks_pp) < 2:
                continue  # the addends meet on one rank (interleaved stages): summed locally
            for d in range(coords.shape[1]):
                for t in range(coords.shape[2]):
                    group = dist.new_group([int(coords[r, d, t]) for r in ranks_pp])
                    if (d, t) == (dp_rank, tp_rank) and pp_rank in ranks_pp:
                        self.tied_groups[fqn] = group
        self.runner = PipelineRunner(self.pipeline, pp=pp, pp_rank=pp_rank, schedule=plan.schedule["kind"],
                                     n_micro=m, n_virtual=n_stages // pp,
                                     rank_of_stage=lambda s: int(coords[s % pp, dp_rank, tp_rank]),
                                     guard=self._guard, timeout_s=self.timeout_s, tp_ranks=self._group_ranks("tp"),
                                     begin_microbatch=self.params.begin_microbatch, device=self.torch_device,
                                     tp_group=self.mesh.get_group("tp"),
                                     tp_pieces=tp_pieces(plan.communication.get("p2p", {}).get("pp", {})
                                                         .get("cuts", [])))
        self.last_stage_rank = int(coords[(n_stages - 1) % pp, 0, 0])
        self.step_program = None
        self.optimizer = self.optimizer_factory(self.params.optimizer_params())
        self._compiled = True

    def _pipeline_step(self, values) -> float:
        from autopar.runtime.startup import _split_batch

        m = self.plan.schedule["microbatches"]
        micro = [self._cp_micro(x) for x in _split_batch(values, m, self.plan.model["global_batch"])]
        self.params.begin_step(m)
        held = ({f: None for f in self.trainable} if self.plan.zero == 3  # stage 3: the pieces gather per group
                else self.params.local_params())
        loss, _ = self.runner.run(micro, held)  # the gradients went to their buckets inside the pieces
        self._finish_and_step(self.tied_groups)
        total = torch.zeros((), device=self.torch_device)
        if dist.get_rank() == self.last_stage_rank:
            total += loss
        with self._guard(f"all-reduce of the loss from the last stage's rank {self.last_stage_rank}"):
            dist.all_reduce(total)  # every rank returns the loss the last stage computed
        return float(total) / m

    def set_schedule(self, kind: str) -> None:
        """Run later steps under another pipeline schedule, without recompiling.

        The stages, their F/B/W programs and the parameters stay; only each rank's
        action list changes, so ``kind`` must keep the plan's stages per rank
        (any of gpipe, 1f1b, zb-h1, zb-h2 for one stage per rank; interleaved for
        several). ``plan.schedule["kind"]`` follows; the plan's predictions do not
        (re-plan with ``fixed={"schedule": kind}`` for those).
        """
        from dataclasses import replace

        from autopar.cost.schedule import SCHEDULE_KINDS
        from autopar.runtime.pipeline import PipelineRunner

        self._require_compiled()
        pp, n_stages = self.plan.mesh["pp"], len(self.plan.stages)
        if pp == 1:
            raise PlanError("set_schedule needs a pipeline (pp > 1); this plan has pp=1")
        if kind not in SCHEDULE_KINDS:
            raise PlanError(f"unknown schedule {kind!r}; expected one of {', '.join(SCHEDULE_KINDS)}")
        if (kind == "interleaved") != (n_stages > pp):
            raise PlanError(f"schedule {kind!r} cannot run this plan's {n_stages} stages on {pp} pipeline ranks "
                            f"({'interleaved needs' if kind == 'interleaved' else 'only interleaved runs'} "
                            f"several stages per rank); re-plan with fixed={{'schedule': {kind!r}}}")
        old = self.runner
        self.runner = PipelineRunner(self.pipeline, pp=pp, pp_rank=old.pp_rank, schedule=kind,
                                     n_micro=old.n_micro, n_virtual=n_stages // pp, rank_of_stage=old.rank_of_stage,
                                     guard=old.guard, timeout_s=old.timeout_s, tp_ranks=old.tp_ranks,
                                     begin_microbatch=old.begin_microbatch, device=old.device, tp_group=old.tp_group,
                                     tp_pieces=old.tp_pieces)
        self.plan = replace(self.plan, schedule={**self.plan.schedule, "kind": kind})

    def _across_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """With pp > 1 each stage holds its own parameters: gather every stage's (a collective)."""
        if self.plan.mesh["pp"] == 1:
            return mine
        first = self.mesh.get_local_rank(0) == 0 and self.mesh.get_local_rank(1) == 0
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine if first else {})
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update(part)
        return out


def _with_zero_calls(program, stages: list[int], params):
    """The pipeline program with each of ``stages``' pieces running its ZeRO calls (gathers, buckets)."""
    from dataclasses import replace

    from autopar.passes.pipeline import PARAM_PREFIX, Piece
    from autopar.runtime.zero_program import insert_zero_calls

    out = list(program.stages)
    for s in stages:
        st = program.stages[s]
        pieces = {}
        for field, kind in (("forward", "F"), ("backward_input", "B"), ("backward_weight", "W"), ("backward", "BW")):
            piece: Piece = getattr(st, field)
            gm = insert_zero_calls(
                piece.gm, params=params,
                param_inputs={i: k[len(PARAM_PREFIX):] for i, k in enumerate(piece.inputs) if k.startswith(PARAM_PREFIX)},
                grad_outputs={i: st.grads[n] for i, n in enumerate(piece.outputs) if n in st.grads},
                phase="F" if kind == "F" else "B", gather=params.zero == 3, key=f"{s}{kind}:")
            pieces[field] = replace(piece, gm=gm)
        out[s] = replace(st, **pieces)
    return replace(program, stages=out)

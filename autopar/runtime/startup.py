"""The start-up of :class:`autopar.parallel.ParallelModule` (its first ``train_step``).

Kept apart from :mod:`autopar.parallel` (the order of the start-up, the step loop, state)
as a mixin, as :mod:`autopar.runtime.pipelined` keeps the pp > 1 build: agreeing on the
plan (rank 0 plans or checks it, the others read it from the store), the one-stage build
(pp = 1: trace at the micro-batch, map the plan, shard the parameters, generate the rank's
program), and the helpers both builds share (``_trace``, ``_materialize``,
``_frozen_state``, ``_place_inputs``, ...). ``ParallelModule._compile`` calls them in the
order the :mod:`autopar.parallel` module docstring gives.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.analysis import build_graph
from autopar.errors import PlanError
from autopar.passes import meta_keys as mk
from autopar.passes.layers import graph_hash
from autopar.plan import Plan
from autopar.precision import cast_floating, plan_precision, resolve_precision
from autopar.progress import progress
from autopar.runtime.tp_buckets import contiguous_stride

log = logging.getLogger("autopar.parallel")  # the start-up's phases log as autopar.parallel (README)

__all__ = ["Startup"]


_PLAN_ROUNDS = 0
"""Plans handed out in this process (every rank counts the same calls), naming their store keys."""


def _batch_size(values: dict[str, Any]) -> int | None:
    return next((v.shape[0] for v in values.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)


def _check_scalar_loss(gm) -> None:
    """The loss must be one number before the first step runs (not a float() failure after it)."""
    from autopar.passes.trace import LossError

    out = gm.graph.find_nodes(op="output")[0].args[0][gm.meta[mk.GRAPH].loss_output]
    val = out.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() != 0:
        raise LossError(f"the loss is a tensor of shape {tuple(val.shape)}, not a scalar; make loss_fn reduce it "
                        f"to one number (.mean(), or reduction='mean' instead of reduction='none')")


def _layer_groups(gm) -> list[tuple[str, ...]]:
    """The planner's layer groups (forward order): the parameters of each, ZeRO's buckets."""
    return [layer.param_fqns for layer in sorted(gm.meta[mk.LAYERS], key=lambda layer: layer.index)]


def _trace_params(model: nn.Module, fqns: list[str], mesh, tp_params: dict[str, str], *,
                  param_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Each parameter as a DTensor (replicated on dp, placed on tp) over a FakeTensor shard.

    The per-rank program is traced on FakeTensors (``shard_joint_graph(tracing_mode="fake")``):
    tracing reads only the parameters' placements, shapes, dtypes and strides, so start-up
    runs no forward or backward, allocates no parameter-sized memory (at ZeRO-3 tracing on
    real shards gathered the whole model on every rank), and costs time in the graph's
    size, not its parameter count. The fake mode lets real tensors in: the frozen
    parameters, buffers and graph constants stay real and are baked into the program.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from autopar.passes.shard import placement

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = mesh.device_type
    out = {}
    for fqn in fqns:
        p = model.get_parameter(fqn)
        pls = [Replicate(), placement(tp_params.get(fqn, "R"))]
        local_shape, _ = compute_local_shape_and_global_offset(p.shape, mesh, pls)
        with fake_mode:
            dtype = param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype
            local = torch.empty(local_shape, dtype=dtype, device=device)
            out[fqn] = DTensor.from_local(local, mesh, pls, run_check=False, shape=p.shape,
                                          stride=contiguous_stride(p.shape))
    return out


def _split_batch(values: dict[str, Any], parts: int, batch: int) -> list[dict[str, Any]]:
    out = [dict() for _ in range(parts)]
    for name, v in values.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
            for i, chunk in enumerate(v.chunk(parts)):
                out[i][name] = chunk
        else:
            for i in range(parts):
                out[i][name] = v
    return out


class Startup:
    """``ParallelModule``'s start-up: the plan every rank runs, the one-stage build, shared helpers."""

    # -- the plan -------------------------------------------------------------

    def _make_plan(self, names, values, has_target) -> Plan:
        """On rank 0: plan (or check the given plan); then every rank gets the same answer."""
        payload = [None]
        if dist.get_rank() == 0:
            try:
                inputs, target = self._as_user_inputs(names, values, has_target)
                name = type(self.model).__name__
                if self._given_plan is None:
                    from autopar.planner.make import make_plan

                    log.info("planning %s for %s on rank 0", name, self.cluster.spec)
                    with progress(f"planning {name} for {self.cluster.spec} (rank 0; the others wait)"):
                        plan = make_plan(self.model, inputs, cluster=self.cluster, loss_fn=self.loss_fn,
                                         example_target=target, fixed=self.fixed, precision=self._asked_precision,
                                         runnable=True)
                else:
                    plan = self._given_plan
                    planned, got = plan.model.get("global_batch"), _batch_size(values)
                    if planned is not None and got is not None and planned != got:
                        raise PlanError(f"the plan was made for a global batch of {planned}, but train_step got "
                                        f"a batch of {got}; pass batches of {planned}, or re-plan for {got}")
                    policy = plan_precision(plan.model)
                    asked = self._asked_precision and resolve_precision(
                        self._asked_precision, model=self.model, gpu_cluster=True)[0].name
                    if asked and asked != policy.name:
                        raise PlanError(f"precision={self._asked_precision!r} was asked for, but the given plan was "
                                        f"made for {plan.model.get('precision')!r}; drop precision= to run the "
                                        f"plan's, or re-plan with precision={self._asked_precision!r}")
                    log.info("checking the given plan against %s on rank 0", name)
                    with progress(f"tracing {name} to check the plan (rank 0)"):
                        gm = build_graph(self.model, inputs, cluster=self.cluster, loss_fn=self.loss_fn,
                                         example_target=target, param_dtype=policy.param_dtype)
                    plan.check_model(graph_hash(gm))
                    if plan.cluster.get("spec") != self.cluster.spec:
                        raise PlanError(f"the plan was made for cluster {plan.cluster.get('spec')}, not "
                                        f"{self.cluster.spec}; re-plan for this cluster")
                payload[0] = ("ok", plan.to_json())
            except Exception as e:  # every rank must learn of it, or the others hang
                payload[0] = ("error", f"{type(e).__name__}: {e}")
        # Through the store, not a collective: the others wait as long as rank 0 is alive,
        # however long planning takes (a collective would give up after timeout_s).
        global _PLAN_ROUNDS
        _PLAN_ROUNDS += 1
        key = f"plan/{_PLAN_ROUNDS}"
        if dist.get_rank() == 0:
            self._watch.publish(key, json.dumps(payload[0]))
        else:
            payload[0] = json.loads(self._watch.wait_for(
                key, 0, "receiving the plan from rank 0 (rank 0 plans or checks it while the others wait)"))
        status, text = payload[0]
        if status == "error":
            raise PlanError(f"planning failed on rank 0: {text}")
        plan = Plan.from_json(text)
        plan.validate(world_size=self.world)
        return plan

    def _as_user_inputs(self, names, values, has_target):
        kw = [n for n in names if not n.startswith("arg") and n != "target"]
        target = values["target"] if has_target else None
        if kw:
            return {n: values[n] for n in kw}, target
        return tuple(values[n] for n in names if n != "target"), target

    def _adopt_plan(self, plan: Plan) -> None:
        """Take ``plan`` as this module's plan: its mesh, schedule and precision policy drive the build."""
        self.plan = plan
        self.policy = plan_precision(plan.model)
        self.ep = int(plan.experts.get("ep", 1)) if plan.experts else 1
        self.cp = int(plan.context.get("cp", 1)) if plan.context else 1

    # -- the one-stage build ----------------------------------------------------

    def _build(self, names, values, has_target) -> None:
        """Trace at the micro-batch size, map the plan, shard the parameters, generate the program."""
        from autopar.passes.recompute import recompute_in_backward
        from autopar.runtime.executor import placements_for_graph
        from autopar.runtime.zero import ShardedParams

        micro = self.plan.schedule["microbatch_size"] * self.plan.mesh["dp"]
        first = _split_batch(values, self.plan.schedule["microbatches"], self.plan.model["global_batch"])[0]
        self.cp_group = self._context_parallel()
        first = self._cp_micro(first)
        names = tuple(first)  # (under cp a Hugging Face causal LM also gets shift_labels)
        inputs, target = self._as_user_inputs(names, first, has_target)
        got = next(iter(v.shape[0] for v in first.values() if isinstance(v, torch.Tensor)))
        assert got == micro, (got, micro)
        experts = self._expert_parallel()
        self.gm = self._trace(inputs, target)
        self._check_cp_graph(self.gm)
        if experts:
            from autopar.runtime.expert import point_experts_at

            point_experts_at(self.gm, experts.pop("op_group").group_name)
        _check_scalar_loss(self.gm)
        self.ops, tp_params = placements_for_graph(self.gm, self.plan)
        recompute_in_backward(self.gm, self.plan.recompute, self.ops)  # what the plan does not keep, re-run
        info: mk.GraphTrace = self.gm.meta[mk.GRAPH]
        trainable = [f for f in info.param_fqns if f in info.grad_outputs]
        self.params = ShardedParams(self.model, mesh=self.mesh, tp_placements=tp_params, zero=self.plan.zero,
                                    trainable=trainable, groups=_layer_groups(self.gm), **self._param_policy(),
                                    **experts)
        self._setup_params()
        self._materialize(trainable, held=self.params.entries)
        self.frozen = self._frozen_state(set(trainable))
        self.trainable = trainable
        self.tp_params = tp_params
        self.step_program = None
        if self.compile:
            from autopar.passes.shard import shard_joint_graph
            from autopar.runtime.zero_program import insert_zero_calls

            micro_inputs = self._place_inputs(first)
            self.input_names = list(micro_inputs)
            program = shard_joint_graph(
                self.gm, mesh=self.mesh, ops=self.ops,
                params=_trace_params(self.model, trainable, self.mesh, tp_params, param_dtype=self.policy.param_dtype),
                frozen=self.frozen, trainable=trainable, tp_placements=tp_params, inputs=micro_inputs,
                loss_scale=1.0 / self.plan.schedule["microbatches"], tracing_mode="fake")
            self.grad_returns = program.meta[mk.GRAD_RETURNS]
            self.params.set_tp_returns(self.grad_returns)
            self._cp_program(program)
            # the step's ZeRO collectives go inside the program: gathers before use, buckets when final
            self.step_program = insert_zero_calls(
                program, params=self.params, param_inputs=dict(enumerate(trainable)),
                grad_outputs={1 + j: f for j, f in enumerate(trainable)}, loss_output=0,
                gather=self.plan.zero == 3, key="step")
        self.optimizer = self.optimizer_factory(self.params.optimizer_params())
        self._compiled = True

    # -- helpers both builds use --------------------------------------------------

    def _materialize(self, trainable: list[str], *, held) -> None:
        """Started from meta: initialise this rank's pieces module by module.

        Wanted are the parameters in ``held`` (:attr:`params`' entries: each rank copies its
        piece out of the whole value, :meth:`ShardedParams.load_whole`, which is then dropped)
        and, kept whole in the model, every buffer and frozen parameter (replicated on every
        rank anyway; already-real ones are left alone).
        """
        if not self.from_meta:
            return
        from autopar.runtime.materialize import materialize_pieces

        trainable_set = set(trainable)
        buffers = {n for n, _ in self.model.named_buffers()}

        def want(fqn: str) -> bool:
            return fqn in held or fqn in buffers or fqn not in trainable_set

        rows = getattr(self, "_expert_rows", {})  # expert parallelism: this rank's part of each expert tensor

        def take(fqn: str, value: torch.Tensor) -> bool:
            if fqn in held:
                self.params.load_whole(fqn, value[slice(*rows[fqn])] if fqn in rows else value)
                return False
            return fqn not in trainable_set

        from autopar.runtime.expert import whole_experts_in

        with whole_experts_in(self.model, getattr(self, "_whole_experts", {})):  # initialised whole, then cut
            self.materialized = materialize_pieces(self.model, seed=self.init_seed, want=want, take=take,
                                                   init_fn=self.init_fn)
        log.info("rank %d: materialised %d modules from meta", dist.get_rank(), len(self.materialized))

    def _trace(self, inputs, target):
        """The joint graph of this rank's program: traced at the micro-batch in the policy's compute dtype, on
        fake tensors of this rank's device type so that it calls that device's kernels (SDPA's differ)."""
        return build_graph(self.model, inputs, cluster=self.cluster, loss_fn=self.loss_fn, example_target=target,
                           collapse_repeats=False, param_dtype=self.policy.param_dtype,
                           fake_device=self.torch_device if self.torch_device.type != "cpu" else None)

    def _param_policy(self) -> dict[str, Any]:
        """ShardedParams' dtype and device arguments under the plan's precision."""
        p = self.policy
        return {"param_dtype": p.param_dtype, "reduce_dtype": p.reduce_dtype, "master_dtype": p.master_dtype,
                "device": self.torch_device}

    def _place_inputs(self, values: dict[str, Any]) -> dict[str, Any]:
        """The step's inputs on this rank's device, floating model inputs (not the target) cast to the
        policy's compute dtype, as FSDP2's ``cast_forward_inputs`` does."""
        out = {}
        for name, v in values.items():
            if isinstance(v, torch.Tensor):
                v = v.to(self.torch_device, non_blocking=True)
                if name != "target":
                    v = cast_floating(v, self.policy.param_dtype)
            out[name] = v
        return out

    def _setup_params(self) -> None:
        self.params.guard = self._guard
        self.params.overlap = self.overlap

    def _frozen_state(self, trainable: set[str]) -> dict[str, Any]:
        from torch.distributed.tensor import Replicate, distribute_tensor

        out = {}
        for node in self.gm.graph.find_nodes(op="placeholder"):
            t = node.meta[mk.TRACE]
            if t.role in (mk.Role.PARAM, mk.Role.BUFFER) and t.fqn not in trainable:
                if t.role is mk.Role.PARAM:  # frozen weights are cast too, as FSDP2 casts every parameter
                    value = cast_floating(self.model.get_parameter(t.fqn).detach(), self.policy.param_dtype)
                else:
                    value = self.model.get_buffer(t.fqn).detach()
                out[t.fqn] = distribute_tensor(value.to(self.torch_device), self.mesh, [Replicate(), Replicate()],
                                               src_data_rank=0)
        return out

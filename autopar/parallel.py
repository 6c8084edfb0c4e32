"""``autopar.parallelize``: plan once, then train the model sharded on every rank.

    torchrun --nproc-per-node 4 examples/train.py --cluster 1x4xcpu

    pm = autopar.parallelize(model, cluster="1x4xcpu", loss_fn=..., optimizer=...)
    loss = pm.train_step(inputs, target)     # one global batch, the same on every rank

The steps of the first ``train_step``, in order:

1. Check the world: the process count must equal the cluster's device count; this
   is read from ``WORLD_SIZE`` before any collective, so a mismatch is an error, not
   a hang. Then the process group starts (NCCL with CUDA, gloo otherwise).
2. Plan on rank 0 (or load the given plan) and broadcast it, so all ranks run the
   same plan; a plan for another model or cluster is an error on every rank.
3. Trace the model at the global micro-batch size (micro-batch size x dp) on each
   rank, map the plan's placements onto that graph, and shard the parameters from
   rank 0's copy (:mod:`autopar.runtime.zero`).

``train_step`` takes the global batch (every rank passes the same tensors) and
each data-parallel rank keeps its slice; :meth:`ParallelModule.local_batch` returns
that slice for callers that load data per rank. Pipeline parallelism (pp > 1) is
planned but not executed yet: such a plan is refused with a message.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.analysis import build_graph
from autopar.cluster import Cluster, parse_cluster
from autopar.errors import PlanError
from autopar.passes import meta_keys as mk
from autopar.passes.layers import graph_hash
from autopar.passes.trace import flatten_inputs
from autopar.plan import Plan

log = logging.getLogger(__name__)

__all__ = ["parallelize", "ParallelModule"]


def parallelize(model: nn.Module, *, cluster: str | Cluster, plan: Plan | str | os.PathLike | None = None,
                loss_fn: Callable | None = None,
                optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
                fixed: dict | None = None, compile: bool = True) -> ParallelModule:
    """Wrap ``model`` for sharded training on ``cluster`` (see the module docstring).

    ``compile=True`` runs the per-rank program traced once (:mod:`autopar.passes.shard`);
    ``False`` interprets the joint graph over DTensors every step (slower, same numbers).
    """
    return ParallelModule(model, cluster=cluster, plan=plan, loss_fn=loss_fn, optimizer=optimizer, fixed=fixed,
                          compile=compile)


def _check_world(cluster: Cluster) -> int:
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cluster.world_size:
        raise ValueError(
            f"cluster {cluster.spec} has {cluster.world_size} devices but this job has {world} "
            f"process(es) (WORLD_SIZE={world}); launch with torchrun --nproc-per-node "
            f"{cluster.devices_per_node} --nnodes {cluster.nodes}, or pass the cluster this job runs on")
    return world


def _init_process_group() -> str:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return backend


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


class ParallelModule:
    """A model sharded by a plan: ``train_step``, ``plan``, ``state_dict``, ``named_parameters``."""

    def __init__(self, model: nn.Module, *, cluster: str | Cluster, plan=None, loss_fn=None, optimizer=None,
                 fixed=None, compile: bool = True):
        self.model = model
        self.compile = compile
        self.cluster = parse_cluster(cluster)
        if any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError("parallelize needs the model's weights: it is on 'meta'. Build or load it on 'cpu' "
                             "(rank 0's copy is what every rank's shards are cut from); planning alone works "
                             "on 'meta' with autopar.plan(...)")
        self.loss_fn = loss_fn
        self.optimizer_factory = optimizer or (lambda params: torch.optim.AdamW(params))
        self.fixed = dict(fixed or {})
        if "pp" not in self.fixed:  # said in the plan's "fixed" and in the log, never silently
            log.warning("pipeline execution is not available yet: planning with pp=1")
            self.fixed["pp"] = 1
        self._given_plan = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
        self.world = _check_world(self.cluster)
        self.plan: Plan | None = None
        self._compiled = False

    # -- compile --------------------------------------------------------------

    def _make_plan(self, names, values, has_target) -> Plan:
        """On rank 0: plan (or check the given plan); then every rank gets the same answer."""
        payload = [None]
        if dist.get_rank() == 0:
            try:
                inputs, target = self._as_user_inputs(names, values, has_target)
                if self._given_plan is None:
                    from autopar.planner.make import make_plan

                    plan = make_plan(self.model, inputs, cluster=self.cluster, loss_fn=self.loss_fn,
                                     example_target=target, fixed=self.fixed)
                else:
                    plan = self._given_plan
                    gm = build_graph(self.model, inputs, cluster=self.cluster, loss_fn=self.loss_fn,
                                     example_target=target)
                    plan.check_model(graph_hash(gm))
                    if plan.cluster.get("spec") != self.cluster.spec:
                        raise PlanError(f"the plan was made for cluster {plan.cluster.get('spec')}, not "
                                        f"{self.cluster.spec}; re-plan for this cluster")
                payload[0] = ("ok", plan.to_json())
            except Exception as e:  # every rank must learn of it, or the others hang
                payload[0] = ("error", f"{type(e).__name__}: {e}")
        dist.broadcast_object_list(payload, src=0)
        status, text = payload[0]
        if status == "error":
            raise PlanError(f"planning failed on rank 0: {text}")
        plan = Plan.from_json(text)
        plan.validate(world_size=self.world)
        if plan.mesh["pp"] != 1:
            raise PlanError(f"the plan has pp={plan.mesh['pp']} pipeline stages; pipeline execution is not "
                            f"available yet: pass fixed={{'pp': 1}} to plan without a pipeline")
        return plan

    def _as_user_inputs(self, names, values, has_target):
        kw = [n for n in names if not n.startswith("arg") and n != "target"]
        target = values["target"] if has_target else None
        if kw:
            return {n: values[n] for n in kw}, target
        return tuple(values[n] for n in names if n != "target"), target

    def _compile(self, names, values, has_target) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        backend = _init_process_group()
        self.plan = self._make_plan(names, values, has_target)
        dp, tp = self.plan.mesh["dp"], self.plan.mesh["tp"]
        device = "cuda" if backend == "nccl" else "cpu"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        self.mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
        self._build(names, values, has_target)

    def _build(self, names, values, has_target) -> None:
        """Trace at the micro-batch size, map the plan, shard the parameters, generate the program."""
        from autopar.runtime.executor import placements_for_graph
        from autopar.runtime.zero import ShardedParams

        micro = self.plan.schedule["microbatch_size"] * self.plan.mesh["dp"]
        first = _split_batch(values, self.plan.schedule["microbatches"], self.plan.model["global_batch"])[0]
        inputs, target = self._as_user_inputs(names, first, has_target)
        got = next(iter(v.shape[0] for v in first.values() if isinstance(v, torch.Tensor)))
        assert got == micro, (got, micro)
        self.gm = build_graph(self.model, inputs, cluster=self.cluster, loss_fn=self.loss_fn,
                              example_target=target, collapse_repeats=False)
        self.ops, tp_params = placements_for_graph(self.gm, self.plan)
        info: mk.GraphTrace = self.gm.meta[mk.GRAPH]
        trainable = [f for f in info.param_fqns if f in info.grad_outputs]
        self.params = ShardedParams(self.model, mesh=self.mesh, tp_placements=tp_params, zero=self.plan.zero,
                                    trainable=trainable)
        self.frozen = self._frozen_state(set(trainable))
        self.trainable = trainable
        self.tp_params = tp_params
        self.step_program = None
        if self.compile:
            from autopar.passes.shard import shard_joint_graph

            micro_inputs = dict(first)
            self.input_names = list(micro_inputs)
            self.step_program = shard_joint_graph(
                self.gm, mesh=self.mesh, ops=self.ops, params=self.params.compute_params(), frozen=self.frozen,
                trainable=trainable, tp_placements=tp_params, inputs=micro_inputs,
                loss_scale=1.0 / self.plan.schedule["microbatches"])
        self.optimizer = self.optimizer_factory(self.params.optimizer_params())
        self._compiled = True

    def _frozen_state(self, trainable: set[str]) -> dict[str, Any]:
        from torch.distributed.tensor import Replicate, distribute_tensor

        out = {}
        for node in self.gm.graph.find_nodes(op="placeholder"):
            t = node.meta[mk.TRACE]
            if t.role in (mk.Role.PARAM, mk.Role.BUFFER) and t.fqn not in trainable:
                value = self.model.get_parameter(t.fqn) if t.role is mk.Role.PARAM else self.model.get_buffer(t.fqn)
                out[t.fqn] = distribute_tensor(value.detach(), self.mesh, [Replicate(), Replicate()], src_data_rank=0)
        return out

    # -- training --------------------------------------------------------------

    def train_step(self, inputs: Any, target: Any = None) -> float:
        """Forward, backward and one optimizer step on one global batch; the global mean loss."""
        from autopar.passes.shard import grad_partial, run_joint

        names, flat, _ = flatten_inputs(inputs)
        values = dict(zip(names, flat))
        if target is not None:
            names, values["target"] = names + ("target",), target
        if not self._compiled:
            self._compile(names, values, target is not None)
        batch = self.plan.model["global_batch"]
        got = next((v.shape[0] for v in values.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        if got != batch:
            raise ValueError(f"train_step got a batch of {got} but the plan is for a global batch of {batch}; "
                             f"pass the global batch (every rank the same), or re-plan for this batch size")
        m = self.plan.schedule["microbatches"]
        total_loss = 0.0
        acc: dict[str, torch.Tensor] = {}
        for micro in _split_batch(values, m, batch):
            if self.step_program is not None:
                local = self.params.local_params()
                out = self.step_program(*[local[n] for n in self.trainable], *[micro[n] for n in self.input_names])
                loss, partials = out[0], dict(zip(self.trainable, out[1:]))
            else:
                params = self.params.compute_params()
                dloss, grads = run_joint(self.gm, mesh=self.mesh, ops=self.ops, params={**params, **self.frozen},
                                         inputs=micro, loss_scale=1.0 / m)
                loss = dloss.full_tensor()
                partials = {n: grad_partial(grads[n], mesh=self.mesh, tp_placement=self.tp_params.get(n, "R"))
                            for n in self.trainable}
            total_loss += float(loss) / m
            for fqn, g in partials.items():
                acc[fqn] = g if fqn not in acc else acc[fqn] + g
        self.params.reduce_gradients(acc)
        self.optimizer.step()
        self.params.after_step()
        return total_loss

    def local_batch(self, value: torch.Tensor) -> torch.Tensor:
        """This data-parallel rank's slice of a global batch tensor."""
        if not self._compiled:
            raise RuntimeError("local_batch needs the plan: call train_step once first")
        return value.chunk(self.plan.mesh["dp"])[self.mesh.get_local_rank(0)]

    # -- state -----------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) parameters, keys as ``model.state_dict()``; a collective on every rank."""
        self._require_compiled()
        out = {fqn: self.params.full_tensor(fqn) for fqn in self.params.entries}
        for name, buf in self.model.named_buffers():
            out.setdefault(name, buf.detach().clone())
        return out

    full_state_dict = state_dict

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The last step's reduced gradients, gathered whole (a collective on every rank)."""
        self._require_compiled()
        return {fqn: self.params.full_grad(fqn) for fqn in self.params.entries}

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's shards, the tensors its optimizer updates."""
        self._require_compiled()
        for fqn, e in self.params.entries.items():
            yield fqn, e.opt_param

    def memory_bytes(self):
        """Parameter, gradient and optimizer bytes held on this rank, measured on live tensors."""
        self._require_compiled()
        return self.params.state_bytes(self.optimizer)

    def _require_compiled(self) -> None:
        if not self._compiled:
            raise RuntimeError("the model is not compiled yet: call train_step once first")

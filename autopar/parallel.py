"""``autopar.parallelize``: plan once, then train the model sharded on every rank.

    torchrun --nproc-per-node 4 examples/train.py --cluster 1x4xcpu

    pm = autopar.parallelize(model, cluster="1x4xcpu", loss_fn=..., optimizer=...)
    loss = pm.train_step(inputs, target)     # one global batch, the same on every rank

The steps of the first ``train_step``, in order:

1. Check the world: the process count must equal the cluster's device count; this
   is read from ``WORLD_SIZE`` before any collective, so a mismatch is an error, not
   a hang. Then the process group starts (NCCL on ``device="cuda"``, the default for a
   GPU cluster; gloo on ``"cpu"``, the default for a ``cpu`` cluster) with ``timeout_s``.
2. Plan on rank 0 (or load the given plan) and broadcast it, so all ranks run the
   same plan; a plan for another model or cluster is an error on every rank.
3. Trace the model at the global micro-batch size (micro-batch size x dp) on each
   rank, map the plan's placements onto that graph, and shard the parameters from
   rank 0's copy (:mod:`autopar.runtime.zero`) or, for a model on ``meta``, allocate
   only the rank's pieces and initialise them module by module
   (:mod:`autopar.runtime.materialize`); then trace the rank's program on FakeTensors
   (no real forward or backward at start-up).

Waiting on other ranks is bounded. ``timeout_s`` (default 600 s) is the process
group's timeout, so gloo collectives and pipeline receives give up after it (and at
once when a peer's connection drops). Then :class:`~autopar.errors.PeerError` says
which rank gave up, on what ("gradient reduction over dp group [0, 1, 2]",
"pipeline recv of gradients for micro-batch 3 of stage 1 from rank 2"), and which
peer is dead or silent, read from heartbeats in the c10d store
(:mod:`autopar.runtime.watch`). A process group the caller created keeps its own
timeout.

Mistakes are one error each, before any step runs: a process count that is not
the cluster's device count; a GPU cluster on a machine without CUDA (pass
``device="cpu"`` to run it on CPU processes anyway); a plan file that is not JSON
(plans are read with ``json``, never executed) or was made for another model,
cluster or batch size; pinned ``microbatches`` or ``microbatch_size`` that do not
divide the batch; a loss that is not a scalar. A later ``train_step`` whose batch
size differs from the first's is a ``ValueError`` with both sizes. The first
``train_step`` logs its phases (planning, tracing, sharding) and shows them with
:func:`autopar.progress.enable`.

``train_step`` takes the global batch (every rank passes the same tensors) and
each data-parallel rank keeps its slice; :meth:`ParallelModule.local_batch` returns
that slice for callers that load data per rank.

With pp > 1 the mesh is (pp, dp, tp): every rank traces and shards the whole
joint graph with its own (dp, tp) coordinates, tags each op with its stage
(the plan's cuts), cuts the program into per-stage F, B and W pieces
(:mod:`autopar.passes.pipeline`) and keeps its own stages' pieces and
parameters; each step runs the rank's action list of the plan's schedule
(:mod:`autopar.runtime.pipeline`), then the ZeRO/DP reduction per stage. A
parameter two stages read (a tied embedding) is held by both, and their
gradient addends are summed between them once per step.

The code: this module holds the entry point, the order of the start-up
(``ParallelModule._compile``), the step loop and state; :class:`ParallelModule`'s other
methods come from mixins: the plan and the one-stage build
(:mod:`autopar.runtime.startup`), pp > 1 (:mod:`autopar.runtime.pipelined`), cp > 1 and
ep > 1 (:mod:`autopar.runtime.cp_ep`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.cluster import Cluster, parse_cluster
from autopar.passes.trace import flatten_inputs
from autopar.plan import Plan
from autopar.progress import progress
from autopar.runtime.context import check_cp_runnable
from autopar.runtime.cp_ep import CpEpBuild
from autopar.runtime.expert import check_dispatch_runnable
from autopar.runtime.device import bind_local_device, local_device
from autopar.runtime.pipelined import PipelineBuild
from autopar.runtime.startup import Startup, _batch_size, _split_batch
from autopar.runtime.world import (check_world, init_process_group, peer_watch, resolve_device,
                                  share_rng_state)

log = logging.getLogger(__name__)

__all__ = ["parallelize", "ParallelModule", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 600.0
"""Seconds a rank waits on a peer before :class:`~autopar.errors.PeerError` (also the
process-group timeout). Generous: rank 0 may be planning or tracing a large model
while the others wait for its plan."""


def parallelize(model: nn.Module, *, cluster: str | Cluster, plan: Plan | str | os.PathLike | None = None,
                loss_fn: Callable | None = None,
                optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
                fixed: dict | None = None, compile: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                device: str | None = None, overlap: bool | None = None,
                resume_from: str | os.PathLike | None = None, init_fn: Callable[[nn.Module], None] | None = None,
                init_seed: int | None = None, precision: str | None = None) -> ParallelModule:
    """Wrap ``model`` for sharded training on ``cluster`` (see the module docstring).

    ``resume_from`` is a checkpoint (:meth:`ParallelModule.load_checkpoint`) to continue from:
    a directory of checkpoints that holds no complete one yet starts afresh, so a job that
    restarts itself can always pass its checkpoint directory.

    ``compile=True`` runs the per-rank program traced once (:mod:`autopar.passes.shard`);
    ``False`` interprets the joint graph over DTensors every step (slower, same numbers).
    ``timeout_s`` bounds every wait on another rank (collectives, pipeline receives):
    past it, or as soon as a peer's connection drops, :class:`PeerError` names the dead
    or silent rank. ``device`` is ``"cuda"`` (NCCL) or ``"cpu"`` (gloo); by default
    ``"cuda"`` for a GPU cluster, which is an error on a machine without CUDA, and
    ``"cpu"`` for a ``cpu`` cluster. ``overlap=False`` waits for every ZeRO/dp collective as
    soon as it is issued instead of overlapping it with compute (a debugging and benchmarking
    aid: same numbers; also set by the environment variable ``AUTOPAR_OVERLAP=0``).

    A model built on ``meta`` (``with torch.device("meta"): model = ...``) is never
    materialised whole: each rank allocates only its own pieces (its stages' parameters,
    tp shards, ZeRO slices) and initialises them module by module with the model's own
    initialisation (``reset_parameters``, ``init_weights``, the root's ``_init_weights``) or
    ``init_fn(module)``, from the seed ``init_seed`` (default: rank 0's
    ``torch.initial_seed()``); :func:`autopar.materialize` builds the same weights whole in
    one process. See :mod:`autopar.runtime.materialize` for the rules and the RNG scheme.

    ``precision`` (:mod:`autopar.precision`): "fp32", "bf16-mixed" ("bf16": fp32 masters and
    optimizer state, bf16 compute, gradients reduced in fp32) or "bf16-mixed-bf16-reduce";
    by default "bf16-mixed" on a GPU cluster and the model's dtype on a ``cpu`` cluster. A
    given ``plan`` carries its own precision; asking for another is a ``PlanError``.
    The optimizer steps the fp32 masters: ``named_parameters`` and ``state_dict`` are fp32.
    """
    pm = ParallelModule(model, cluster=cluster, plan=plan, loss_fn=loss_fn, optimizer=optimizer, fixed=fixed,
                        compile=compile, timeout_s=timeout_s, device=device, overlap=overlap, init_fn=init_fn,
                        init_seed=init_seed, precision=precision)
    if resume_from is not None:
        from autopar.runtime.checkpoint_io import latest

        p = Path(resume_from)
        if p.is_dir() and not (p / "autopar.json").exists() and not any(p.glob("*.safetensors")) \
                and latest(p) is None:  # (an interrupted first save leaves only step-N.tmp)
            log.info("resume_from=%s holds no checkpoint yet: starting afresh", p)
        else:
            pm.load_checkpoint(p)
    return pm


class ParallelModule(PipelineBuild, Startup, CpEpBuild):
    """A model sharded by a plan: ``train_step``, ``plan``, ``state_dict``, ``named_parameters``."""

    def __init__(self, model: nn.Module, *, cluster: str | Cluster, plan=None, loss_fn=None, optimizer=None,
                 fixed=None, compile: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S, device: str | None = None,
                 overlap: bool | None = None, init_fn=None, init_seed: int | None = None,
                 precision: str | None = None):
        from autopar.precision import resolve_precision
        from autopar.runtime.materialize import is_meta

        self.model = model
        self.overlap = os.environ.get("AUTOPAR_OVERLAP", "1") != "0" if overlap is None else bool(overlap)
        self.compile = compile
        self.cluster = parse_cluster(cluster)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.device = resolve_device(self.cluster, device)
        self.from_meta = is_meta(model)
        """Started from meta: each rank materialises its own pieces (autopar.runtime.materialize)."""
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn must be a function of one module (called like model.apply's), got "
                            f"{type(init_fn).__name__}")
        if init_seed is not None and (isinstance(init_seed, bool) or not isinstance(init_seed, int)):
            raise TypeError(f"init_seed must be an int, got {init_seed!r}")
        self.init_fn, self.init_seed = init_fn, init_seed
        self.torch_device = local_device(self.device)
        """Where this rank's tensors live (``cuda:LOCAL_RANK`` or ``cpu``): :mod:`autopar.runtime.device`."""
        self._asked_precision = precision
        resolve_precision(precision, model=model, gpu_cluster=self.cluster.device.name.lower() != "cpu")  # checks
        self.policy = None  # the plan's precision policy, once planned
        self.loss_fn = loss_fn
        self.optimizer_factory = optimizer or (lambda params: torch.optim.AdamW(params))
        self.fixed = dict(fixed or {})
        self._given_plan = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
        self.world = check_world(self.cluster)
        self.plan: Plan | None = None
        self._compiled = False
        self._watch = None
        self._first_batch: int | None = None
        self.steps = 0
        """Optimizer steps taken (restored by load_checkpoint)."""
        self._pending_checkpoint = None  # loaded right after compiling (autopar.runtime.checkpoint)
        self._probes = None  # measure_step's LiveBytes, one per micro-batch

    def _guard(self, action: str, peers=None):
        """Turn a backend failure inside the block into a PeerError naming ``action`` and the peers."""
        return self._watch.guard(action, peers) if self._watch is not None else contextlib.nullcontext()

    def _group_ranks(self, axis: str) -> list[int]:
        return dist.get_process_group_ranks(self.mesh.get_group(axis))

    # -- compile --------------------------------------------------------------

    def _compile(self, names, values, has_target) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if self._given_plan is None:
            from autopar.planner.make import check_batch_split
            from autopar.planner.search import Fixed

            fixed = Fixed.from_dict(self.fixed)
            check_cp_runnable(fixed.cp, compile=self.compile, variants=fixed.cp_variant or ())
            check_dispatch_runnable(fixed.ep_dispatch)
            check_batch_split(_batch_size(values), fixed)
        else:
            context = self._given_plan.context or {}
            check_cp_runnable(context.get("cp"), compile=self.compile, variants=context.get("variants", ()))
            check_dispatch_runnable(self._given_plan.experts.get("dispatch"))
        bind_local_device(self.device)  # before the first collective: NCCL binds to the current GPU
        init_process_group(self.device, self.timeout_s)
        self._watch = peer_watch(self.timeout_s)
        if self.from_meta:  # every rank initialises from rank 0's seed (autopar.runtime.materialize)
            seed = [self.init_seed if self.init_seed is not None else torch.initial_seed()]
            with self._guard("receiving the initialisation seed from rank 0"):
                dist.broadcast_object_list(seed, src=0, device=torch.device(
                    "cuda", torch.cuda.current_device()) if self.device == "cuda" else None)
            self.init_seed = int(seed[0])
        self._adopt_plan(self._make_plan(names, values, has_target))
        dp, tp = self.plan.mesh["dp"], self.plan.mesh["tp"]
        # (every rank has the same plan: all raise alike)
        check_cp_runnable(self.cp, compile=self.compile)
        device = self.device
        pp = self.plan.mesh["pp"]
        mesh_text = " x ".join(f"{a}={self.plan.mesh[a]}" for a in ("pp", "dp", "tp"))
        log.info("rank %d: building the %s mesh, tracing and sharding %s", dist.get_rank(), mesh_text,
                 type(self.model).__name__)
        rng_devices = [torch.cuda.current_device()] if device == "cuda" else []
        # building runs the program once on real tensors: it must not draw from the user's random stream
        with progress(f"tracing and sharding {type(self.model).__name__} on a {mesh_text} mesh"), \
                self._guard("building the device mesh and sharding the parameters from rank 0"), \
                torch.random.fork_rng(devices=rng_devices):
            if pp > 1:
                self.pp_mesh = init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
                self.mesh = self.pp_mesh["dp", "tp"]
                self._build_pipeline(names, values, has_target)
            else:
                self.mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
                self._build(names, values, has_target)
        from autopar.passes.shard import random_ops

        if random_ops(self.gm):
            with self._guard("starting every rank's random generator from rank 0's state"):
                share_rng_state(device)

    # -- training --------------------------------------------------------------

    def train_step(self, inputs: Any, target: Any = None) -> float:
        """Forward, backward and one optimizer step on one global batch; the global mean loss."""
        from autopar.passes.shard import grad_addends, run_joint

        names, flat, _ = flatten_inputs(inputs)
        values = dict(zip(names, flat))
        if target is not None:
            names, values["target"] = names + ("target",), target
        got = _batch_size(values)
        if self._first_batch is not None and got != self._first_batch:
            raise ValueError(
                f"train_step got a batch of {got}, but the first call had a batch of {self._first_batch} (the plan, "
                f"the traced program and the micro-batches are built for it); pass batches of {self._first_batch} "
                f"on every step (drop or pad a last partial batch), or parallelize again for a batch of {got}")
        if not self._compiled:
            self._compile(names, values, target is not None)
            self._first_batch = got
            if self._pending_checkpoint is not None:  # load_checkpoint / resume_from before the first step
                from autopar.runtime.checkpoint import load_shards

                load_shards(self)
        batch = self.plan.model["global_batch"]
        if got != batch:
            raise ValueError(f"train_step got a batch of {got} but the plan is for a global batch of {batch}; "
                             f"pass the global batch (every rank the same), or re-plan for this batch size")
        values = self._place_inputs(values)
        self.steps += 1
        if self.plan.mesh["pp"] > 1:
            return self._pipeline_step(values)
        m = self.plan.schedule["microbatches"]
        total_loss = 0.0
        tp_ranks = self._group_ranks("tp")
        self.params.begin_step(m)
        for i, micro in enumerate(_split_batch(values, m, batch)):
            micro = self._cp_micro(micro)
            self.params.begin_microbatch(i)
            if self.step_program is not None:
                # stage 3 passes no parameters: the program gathers each layer group itself
                local = {} if self.plan.zero == 3 else self.params.local_params()
                with self._guard(f"forward and backward of micro-batch {i} (tp collectives over tp group "
                                 f"{tp_ranks})", tp_ranks):
                    program = self.step_program if self._probes is None else self._probed
                    out = program(*[local.get(n) for n in self.trainable], *[micro[n] for n in self.input_names])
                loss = out[0]  # the gradients went to their buckets inside the program
            else:
                params = self.params.compute_params()
                dloss, grads = run_joint(self.gm, mesh=self.mesh, ops=self.ops, params={**params, **self.frozen},
                                         inputs=micro, loss_scale=1.0 / m)
                loss = dloss.full_tensor()
                local, self.grad_returns = grad_addends([(n, grads[n]) for n in self.trainable], mesh=self.mesh,
                                                        tp_placements=self.tp_params)
                self.params.set_tp_returns(self.grad_returns)
                for fqn, g in zip(self.trainable, local):
                    self.params.add_grad(fqn, g, i)
            total_loss += float(loss) / m
        self._finish_and_step()
        return total_loss

    def measure_step(self, inputs: Any, target: Any = None) -> dict[str, float]:
        """:meth:`train_step`, with this rank's step program run op by op to measure the bytes of its
        intermediate tensors (:mod:`autopar.runtime.liveness`; slower, the same result). Returns the
        loss, ``activation_bytes`` (alive when the backward starts: what the forward keeps for it,
        the plan's ``memory_bytes["activations"]`` per stage) and ``peak_bytes`` (the most alive at
        once), each the largest over the step's micro-batches. With pp > 1, ``peak_bytes`` is the
        most this rank's stages held at once over the step (their stores between pieces, every
        micro-batch in flight, plus the running piece's live values) and ``activation_bytes`` the
        most its stores held between pieces."""
        if self._compiled and self.plan.mesh["pp"] > 1:
            self.runner.measure = True
            try:
                loss = self.train_step(inputs, target)
            finally:
                self.runner.measure = False
            return {"loss": loss, "activation_bytes": self.runner.peak_stored_bytes,
                    "peak_bytes": self.runner.peak_bytes}
        self._probes = []
        try:
            loss = self.train_step(inputs, target)
            probes = self._probes
        finally:
            self._probes = None
        if not probes:
            raise ValueError("measure_step measures a built step: call train_step once first (a pipelined plan is "
                             "built then), and with pp = 1 parallelize with compile=True")
        return {"loss": loss, "activation_bytes": max(p.at_backward_bytes or 0 for p in probes),
                "peak_bytes": max(p.peak_bytes for p in probes)}

    def _probed(self, *args):
        from autopar.runtime.liveness import LiveBytes

        probe = LiveBytes(self.step_program)
        self._probes.append(probe)
        return probe.run(*args)

    def _finish_and_step(self, tied: dict | None = None) -> None:
        """Wait for the gradient buckets, sum tied addends across stages, step, gather back (ZeRO 1-2)."""
        with self._guard(f"gradient reduction over dp group {self._group_ranks('dp')}", None):
            self.params.finish_step()
        for fqn, group in (tied or {}).items():  # the stages sharing a parameter add their reduced gradients
            ranks = dist.get_process_group_ranks(group)
            with self._guard(f"all-reduce of tied parameter {fqn}'s gradient over ranks {ranks}", ranks):
                dist.all_reduce(self.params.entries[fqn].grad, group=group)
        self.optimizer.step()
        self.params.after_step()

    def save_checkpoint(self, path: str | os.PathLike, *, state: dict | None = None, async_save: bool = False,
                        keep: int | None = None):
        """Save a sharded checkpoint of this step into ``path/step-NNNNNNNN`` (every rank calls it).

        ``state`` maps names to objects with ``state_dict``/``load_state_dict`` (a sampler's data
        position), saved per rank. ``async_save`` copies the shards and writes them in a thread
        while training goes on; ``keep`` removes all but the newest ``keep`` checkpoints. Returns
        a handle whose ``wait()`` gives the directory once published (see
        :mod:`autopar.runtime.checkpoint`)."""
        from autopar.runtime.checkpoint import save

        self._require_compiled()
        return save(self, path, state=state, async_save=async_save, keep=keep)

    def load_checkpoint(self, path: str | os.PathLike, *, state: dict | None = None) -> None:
        """Continue from checkpoint ``path`` (or the newest complete one in it) under this plan, or
        start from whole weights (a ``torch.save`` state dict, safetensors, a ``save_pretrained``
        directory). The step, RNG and ``state`` objects are restored at once, the shards now or,
        before the first step, right after compiling. Bad checkpoints raise ``CheckpointError``."""
        from autopar.runtime.checkpoint import load

        load(self, path, state=state)

    def local_batch(self, value: torch.Tensor) -> torch.Tensor:
        """This data-parallel rank's slice of a global batch tensor."""
        if not self._compiled:
            raise RuntimeError("local_batch needs the plan: call train_step once first")
        if self.cp > 1:  # its batch group's sequences, its two chunks of each
            from autopar.runtime.context import local_rows

            return local_rows(value, cp=self.cp, dp=self.plan.mesh["dp"], dp_rank=self.mesh.get_local_rank(0))
        return value.chunk(self.plan.mesh["dp"])[self.mesh.get_local_rank(0)]

    # -- state -----------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) parameters, keys as ``model.state_dict()``; a collective on every rank."""
        self._require_compiled()
        with self._guard("gathering the full parameters (state_dict) from every rank"):
            out = self._across_stages({fqn: self.params.full_tensor(fqn) for fqn in self.params.entries})
        canonical = {id(p): fqn for fqn, p in self.model.named_parameters()}
        for name, p in self.model.named_parameters(remove_duplicate=False):  # tied aliases (lm_head.weight)
            if name not in out and canonical.get(id(p)) in out:
                out[name] = out[canonical[id(p)]]
        for name, p in self.model.named_parameters(remove_duplicate=False):  # frozen or unreached: held whole
            if name not in out and not p.is_meta:
                out[name] = p.detach().clone()
        for name, buf in self.model.named_buffers():
            out.setdefault(name, buf.detach().clone())
        return out

    full_state_dict = state_dict

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The last step's reduced gradients, gathered whole (a collective on every rank)."""
        self._require_compiled()
        with self._guard("gathering the full gradients from every rank"):
            return self._across_stages({fqn: self.params.full_grad(fqn) for fqn in self.params.entries})

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's shards, the tensors its optimizer updates."""
        self._require_compiled()
        for fqn, e in self.params.entries.items():
            yield fqn, e.opt_param

    def memory_bytes(self):
        """Parameter, gradient and optimizer bytes held on this rank, measured on live tensors."""
        self._require_compiled()
        return self.params.state_bytes(self.optimizer)

    def peak_memory_bytes(self, reset: bool = False) -> int:
        """This rank's peak bytes since the last reset: on CUDA the caching allocator's
        ``torch.cuda.max_memory_allocated`` (everything: state, activations, buffers); on CPU
        the peak of the buffers the runtime tracks (parameters, gradients, gathered weights and
        collective buffers, :mod:`autopar.runtime.memtrack`; activations are not seen there).
        ``reset`` starts a new window."""
        self._require_compiled()
        if self.torch_device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.torch_device)
            if reset:
                torch.cuda.reset_peak_memory_stats(self.torch_device)
            return int(peak)
        peak = self.params.live.peak
        if reset:
            self.params.live.reset_peak()
        return int(peak)

    def _require_compiled(self) -> None:
        if not self._compiled:
            raise RuntimeError("the model is not compiled yet: call train_step once first")

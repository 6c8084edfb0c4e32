"""``autopar plan ... --emit DIR``: write each rank's generated program as Python.

The programs are generated exactly as ``parallelize`` generates them at run time
(:mod:`autopar.passes.shard`), but in one process: each rank is impersonated
in turn on torch's "fake" process-group backend, whose collectives do nothing
and whose only job here is to let the mesh and the trace exist. That backend
lives in ``torch.testing._internal`` (private, test-only): it is used here and
nowhere on the training path. Ranks whose programs are identical share a file.
The model must live on "cpu" (its values do not matter; a small shape will do).
With pipeline stages, a rank's file holds the F, B and W pieces of each of its
stages, each headed by the values it reads and writes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.cluster import Cluster
from autopar.errors import PlanError
from autopar.plan import Plan

__all__ = ["emit_programs", "program_collectives", "rank_collectives"]


def _on_rank(rank, world, spec, spec_args, plan_json, cluster, then):
    """Build rank ``rank``'s ParallelModule on the fake backend and return ``then(pm, pp_rank)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.modelspec import load_model_spec
    from autopar.parallel import ParallelModule
    from autopar.passes.trace import flatten_inputs

    model, inputs, loss_fn, target = load_model_spec(spec, spec_args)
    names, flat, _ = flatten_inputs(inputs)
    values = dict(zip(names, flat))
    if target is not None:
        names, values["target"] = names + ("target",), target
    has_target = target is not None
    plan = Plan.from_json(plan_json)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        pm = ParallelModule(model, cluster=cluster, plan=plan, loss_fn=loss_fn)
        pm._adopt_plan(plan)
        pp, dp, tp = plan.mesh["pp"], plan.mesh["dp"], plan.mesh["tp"]
        if pp == 1:
            pm.mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            pm._build(names, values, has_target)
            return then(pm, 0)
        pm.pp_mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        pm.mesh = pm.pp_mesh["dp", "tp"]
        pm._build_pipeline(names, values, has_target)
        return then(pm, pm.pp_mesh.get_local_rank("pp"))
    finally:
        dist.destroy_process_group()


_PIECES = (("F: forward", "forward"), ("B: gradients w.r.t. the stage's inputs", "backward_input"),
           ("W: gradients w.r.t. the stage's weights", "backward_weight"))


def _programs(pm, pp_rank) -> list[tuple[str, Any]]:
    """(heading, piece) of every program the rank runs: the step program, or its stages' F, B, W pieces."""
    if pm.plan.mesh["pp"] == 1:
        return [("", pm.step_program)]
    return [(f"stage {st.stage} {what}", getattr(st, attr)) for st in pm.pipeline.stages
            if st.stage % pm.plan.mesh["pp"] == pp_rank for what, attr in _PIECES]


def _code(pm, pp_rank) -> str:
    programs = _programs(pm, pp_rank)
    buckets = "".join(f"# then once per step, in the runtime: one tp {b['kind']} ({b['dtype']}, {b['bytes']} bytes) "
                      f"returning the gradients of {', '.join(b['grads'])}\n" for b in _census(pm, pp_rank)["buckets"])
    if pm.plan.mesh["pp"] == 1:
        return buckets + programs[0][1].code
    return buckets + "\n".join(f"# ---- {heading}\n# reads  {', '.join(piece.inputs) or '-'}\n"
                     f"# writes {', '.join(piece.outputs) or '-'}{piece.gm.code}" for heading, piece in programs)


def _rank_program(rank, world, spec, spec_args, plan_json, cluster) -> str:
    return _on_rank(rank, world, spec, spec_args, plan_json, cluster, _code)


# The plan's names for the functional collectives a program holds. CPU process groups
# (gloo, fake) have no all-to-all: DTensor runs Shard -> Shard there as an all-gather
# of the whole tensor and a local chunk, which shows as all_gather in a program.
_KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}


def program_collectives(gm: torch.fx.GraphModule, *, group_names: dict[str, str]) -> dict[str, dict[str, dict]]:
    """The collectives of a per-rank program: kind -> mesh axis -> {"count", "bytes"}.

    Bytes are the whole tensor's, as the plan counts them: an all-gather's output, the
    input of the others. ``group_names`` maps process-group names to axis names ("tp",
    "dp"); a collective on another group counts under its group name.
    """
    out: dict[str, dict[str, dict]] = {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != "_c10d_functional":
            continue
        name = target._schema.name.split("::")[-1]
        if name not in _KINDS:
            continue
        value = node.meta["val"] if name == "all_gather_into_tensor" else node.args[0].meta["val"]
        axis = group_names.get(str(node.args[-1]), str(node.args[-1]))
        c = out.setdefault(_KINDS[name], {}).setdefault(axis, {"count": 0, "bytes": 0})
        c["count"] += 1
        c["bytes"] += value.numel() * value.element_size()
    return out


def _census(pm, pp_rank) -> dict:
    from autopar.runtime.tp_buckets import tp_buckets

    groups = {pm.mesh.get_group(i).group_name: axis for i, axis in enumerate(("dp", "tp"))}
    program: dict[str, dict[str, dict]] = {}
    for _, piece in _programs(pm, pp_rank):
        for kind, axes in program_collectives(getattr(piece, "gm", piece), group_names=groups).items():
            for axis, c in axes.items():
                mine = program.setdefault(kind, {}).setdefault(axis, {"count": 0, "bytes": 0})
                mine["count"] += c["count"]
                mine["bytes"] += c["bytes"]
    returns = {r.fqn: r for r in pm.grad_returns if r.fqn in pm.params.entries}
    buckets = []
    for g, fqns in enumerate(pm.params.groups):  # the runtime returns them per layer group (runtime/zero.py)
        mine = [returns[f] for f in fqns if f in returns]
        dtypes = {r.fqn: pm.params.entries[r.fqn].dtype for r in mine}
        buckets += [{"kind": b.kind, "axis": "tp", "group": g, "dtype": str(b.dtype),
                     "grads": [r.fqn for r in b.grads], "bytes": b.nbytes} for b in tp_buckets(mine, dtypes)]
    return {"program": program, "buckets": buckets}


def rank_collectives(spec: str, spec_args: dict[str, str], *, plan: Plan, cluster: Cluster, rank: int = 0) -> dict:
    """What rank ``rank`` communicates on the plan's mesh, generated as ``parallelize`` generates it.

    ``{"program": {kind: {axis: {"count", "bytes"}}}, "buckets": [...]}``: "program" are the
    collectives of the rank's per-micro-batch program (all its pipeline pieces), counted
    by :func:`program_collectives`; "buckets" the tp collectives that return gradients to
    replicated parameters, which the runtime issues once per step, one call per bucket
    (kind, axis, dtype, the gradients it carries, their whole bytes). The data-parallel
    reduction and pipeline messages, bucketed in the runtime, are not listed. Runs in a
    fresh process (see :func:`emit_programs`).
    """
    ctx = torch.multiprocessing.get_context("spawn")
    world = plan.mesh["pp"] * plan.mesh["dp"] * plan.mesh["tp"]
    with ctx.Pool(processes=1, maxtasksperchild=1) as pool:
        return pool.apply(_on_rank, (rank, world, spec, dict(spec_args), plan.to_json(), cluster, _census))


MAX_RANKS = 64
"""Beyond this many ranks only the first MAX_RANKS are generated (the rest repeat their pattern)."""


def emit_programs(spec: str, spec_args: dict[str, str], *, plan: Plan, cluster: Cluster,
                  out_dir: str | os.PathLike) -> list[Path]:
    """Write one ``rank_<r>.py`` per distinct rank program into ``out_dir``; return their paths.

    The model comes from the model spec (``FILE.py:FN`` and its arguments): each rank
    is generated in a fresh process, which builds the model itself.
    """
    from autopar.modelspec import load_model_spec

    model = load_model_spec(spec, spec_args)[0]
    if any(p.device.type == "meta" for p in model.parameters()):
        raise PlanError("--emit generates the programs by running them once, so the model must be on 'cpu'; "
                        "build it on cpu (a small size keeps this quick)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    world = plan.mesh["pp"] * plan.mesh["dp"] * plan.mesh["tp"]
    seen: dict[str, list[int]] = {}
    codes: dict[str, str] = {}
    # One fresh process per rank: a process group, once destroyed, leaves state behind
    # (group names cached by DTensor's collectives) that a second one would trip over.
    ctx = torch.multiprocessing.get_context("spawn")
    args = (spec, dict(spec_args), plan.to_json(), cluster)
    with ctx.Pool(processes=min(2, world), maxtasksperchild=1) as pool:
        results = pool.starmap(_rank_program, [(rank, world, *args) for rank in range(min(world, MAX_RANKS))])
    for rank, code in enumerate(results):
        key = hashlib.sha256(code.encode()).hexdigest()
        seen.setdefault(key, []).append(rank)
        codes.setdefault(key, code)
    paths = []
    for key, ranks in seen.items():
        path = out / f"rank_{ranks[0]}.py"
        header = (f"# autopar per-rank program for {plan.model.get('name')} on mesh {plan.mesh}, "
                  f"ZeRO-{plan.zero}\n# ranks: {', '.join(map(str, ranks))}\n")
        if plan.mesh["pp"] == 1:
            header += ("# step(*tp_shards_of_trainable_params, *global_micro_batch_inputs) -> "
                       "(loss, *grad_addends_before_dp_reduction)\n")
        else:
            header += (f"# pipeline stage pieces run by the {plan.schedule['kind']} schedule; 'param:' and "
                       f"'input:' values are the rank's parameter shards and the micro-batch, the others are "
                       f"activations and gradients kept per micro-batch or sent between stages\n")
        header += "import torch\n"
        path.write_text(header + codes[key])
        paths.append(path)
    return paths

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
import torch
import torch.distributed as dist

from autopar.cluster import Cluster
from autopar.errors import PlanError
from autopar.plan import Plan

__all__ = ["emit_programs"]


def _rank_program(rank, world, spec, spec_args, plan_json, cluster) -> str:
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
        pm.plan = plan
        pp, dp, tp = plan.mesh["pp"], plan.mesh["dp"], plan.mesh["tp"]
        if pp == 1:
            pm.mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            pm._build(names, values, has_target)
            return pm.step_program.code
        pm.pp_mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        pm.mesh = pm.pp_mesh["dp", "tp"]
        pm._build_pipeline(names, values, has_target)
        parts = []
        for st in pm.pipeline.stages:
            if st.stage % pp != pm.pp_mesh.get_local_rank("pp"):
                continue
            for what, piece in (("F: forward", st.forward), ("B: gradients w.r.t. the stage's inputs",
                                                              st.backward_input),
                                ("W: gradients w.r.t. the stage's weights", st.backward_weight)):
                parts.append(f"# ---- stage {st.stage} {what}\n# reads  {', '.join(piece.inputs) or '-'}\n"
                             f"# writes {', '.join(piece.outputs) or '-'}{piece.gm.code}")
        return "\n".join(parts)
    finally:
        dist.destroy_process_group()

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

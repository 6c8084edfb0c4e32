"""``autopar plan ... --emit DIR``: write each rank's generated program as Python.

The programs are generated exactly as ``parallelize`` generates them at run time
(:mod:`autopar.passes.shard`), but in one process: each rank is impersonated
in turn on torch's "fake" process-group backend, whose collectives do nothing
and whose only job here is to let the mesh and the trace exist. That backend
lives in ``torch.testing._internal`` (private, test-only): it is used here and
nowhere on the training path. Ranks whose programs are identical share a file.
The model must live on "cpu" (its values do not matter; a small shape will do).
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
        pm = ParallelModule(model, cluster=cluster, plan=plan, loss_fn=loss_fn, fixed={"pp": 1})
        pm.plan = plan
        pm.mesh = init_device_mesh("cpu", (plan.mesh["dp"], plan.mesh["tp"]), mesh_dim_names=("dp", "tp"))
        pm._build(names, values, has_target)
        return pm.step_program.code
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
    if plan.mesh["pp"] != 1:
        raise PlanError(f"--emit covers plans without pipeline stages; this plan has pp={plan.mesh['pp']}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    world = plan.mesh["dp"] * plan.mesh["tp"]
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
                  f"ZeRO-{plan.zero}\n# ranks: {', '.join(map(str, ranks))}\n"
                  f"# step(*tp_shards_of_trainable_params, *global_micro_batch_inputs) -> "
                  f"(loss, *grad_addends_before_dp_reduction)\nimport torch\n")
        path.write_text(header + codes[key])
        paths.append(path)
    return paths

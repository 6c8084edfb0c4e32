"""Codegen: the per-rank program, as a plain fx graph of local ops and functional collectives.

``compile_rank_step`` traces :func:`autopar.runtime.executor.run_joint` (the joint
graph interpreted over DTensors as the plan places it) with ``make_fx``. What
comes out is one rank's program: local-shape ATen ops, with
``_c10d_functional`` collectives (all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all; gloo's missing all-to-all becomes all-gather
+ slice) wherever a tensor changes placement, and nothing of DTensor left. It
runs at the speed of the ops themselves, and ``gm.code`` is the readable
program (``autopar plan ... --emit DIR`` writes it).

Signature of the compiled step, per micro-batch:

    step(*param_shards, *inputs) -> (loss, *grad_partials)

``param_shards``: each trainable parameter's tp shard, whole on dp; ``inputs``:
the global micro-batch, each rank slicing its dp part inside the graph; ``loss``:
the micro-batch's global mean loss, replicated; ``grad_partials``: per
parameter, this rank's addend of the gradient on its tp shard, to be summed over
dp (all-reduce or reduce-scatter, by ZeRO stage) after micro-batch accumulation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.runtime.executor import OpPlacements, placement, run_joint

__all__ = ["compile_rank_step", "grad_partial"]


def grad_partial(g: DTensor, *, mesh: DeviceMesh, tp_placement: str, dp_dim: int = 0, tp_dim: int = 1):
    """A gradient as this rank's local addend: tp placed like its parameter, Partial on dp."""
    want = list(g.placements)
    want[tp_dim] = placement(tp_placement)
    if want[tp_dim].is_partial() and not g.placements[tp_dim].is_partial():
        want[tp_dim] = Replicate()  # a partial parameter placement is not a thing; keep it whole
    if want[dp_dim].is_shard():
        want[dp_dim] = Replicate()
    if tuple(want) != tuple(g.placements):
        g = g.redistribute(mesh, want)
    local = g.to_local()
    if not g.placements[dp_dim].is_partial() and mesh.get_local_rank(dp_dim) != 0:
        local = torch.zeros_like(local)  # replicated on dp: one rank contributes the value
    return local


def compile_rank_step(gm: fx.GraphModule, *, mesh: DeviceMesh, ops: dict[str, OpPlacements],
                      params: dict[str, DTensor], frozen: dict[str, DTensor], trainable: list[str],
                      tp_placements: dict[str, str], inputs: dict[str, Any], loss_scale: float,
                      tracing_mode: str = "real") -> fx.GraphModule:
    """This rank's step program (see the module docstring)."""
    names = list(inputs)

    def step(*flat):
        shards, values = flat[: len(trainable)], flat[len(trainable):]
        ps = {n: DTensor.from_local(local, mesh, params[n].placements, run_check=False,
                                    shape=params[n].shape, stride=params[n].stride())
              for n, local in zip(trainable, shards)}
        loss, grads = run_joint(gm, mesh=mesh, ops=ops, params={**ps, **frozen},
                                inputs=dict(zip(names, values)), loss_scale=loss_scale)
        partials = [grad_partial(grads[n], mesh=mesh, tp_placement=tp_placements.get(n, "R")) for n in trainable]
        return (loss.full_tensor(), *partials)

    example = [params[n].to_local() for n in trainable] + [inputs[n] for n in names]
    program = make_fx(step, tracing_mode=tracing_mode)(*example)
    program.graph.eliminate_dead_code()
    program.recompile()
    return program

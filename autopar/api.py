"""autopar's user-facing functions (re-exported from ``autopar``)."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from autopar.cluster import Cluster
from autopar.plan import Plan

__all__ = ["plan"]


def plan(model: nn.Module, example_inputs: Any, *, cluster: str | Cluster, loss_fn: Callable | None = None,
         example_target: Any = None, fixed: dict | None = None, precision: str | None = None) -> Plan:
    """Choose how to train ``model`` on ``cluster``: mesh, sharding, pipeline cuts, schedule.

    ``example_inputs`` is one global batch (a tuple of positional args, a dict of
    keyword args, or a tensor); the model and inputs may live on "meta". The
    loss is ``loss_fn(output, example_target)``, else the model's scalar output
    or its ``.loss``. ``fixed`` pins decisions: tp, pp, dp, zero (0-3),
    schedule ("gpipe", "1f1b", "zb-h1"), microbatch_size, microbatches,
    recompute ("none", "selective", "sac", "moe", "full"). No devices are touched.

    ``precision`` is the training precision the plan prices and ``parallelize`` runs
    (:mod:`autopar.precision`): "fp32" (no casts), "bf16-mixed" (fp32 masters and
    optimizer state, bf16 compute, gradients reduced in fp32; "bf16" for short) or
    "bf16-mixed-bf16-reduce" (gradients reduced in bf16). Default: "bf16-mixed" on a GPU
    cluster, the model's own dtype on a ``cpu`` cluster. An unknown name, or "fp32" for
    a model whose weights are not fp32, is a ``ValueError``.

    Raises (all :class:`autopar.AutoparError`): ``ClusterSpecError`` for a bad
    cluster; ``PlanError`` for bad ``fixed`` decisions (before tracing);
    ``InputError`` before tracing for a model with nothing to train, an empty
    batch or a target whose batch differs from the inputs'; ``LossError`` when
    the loss is missing or not a floating-point scalar tensor; ``TraceError``
    when the model cannot be traced; ``InfeasibleError`` when nothing fits.
    """
    from autopar.planner.make import make_plan

    return make_plan(model, example_inputs, cluster=cluster, loss_fn=loss_fn, example_target=example_target,
                     fixed=fixed, precision=precision)

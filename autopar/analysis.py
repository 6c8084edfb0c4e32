"""Per-layer costs of a model on a cluster: what ``autopar analyze`` prints.

``build_graph`` is the front half every entry point shares (trace -> annotate ->
group layers); ``analyze`` summarises its result per layer class.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable

from torch import fx, nn

from autopar.cluster import Cluster, parse_cluster
from autopar.cost.memory import training_state_bytes
from autopar.passes import meta_keys as mk
from autopar.passes.annotate import annotate_cost
from autopar.passes.layers import graph_hash, group_layers
from autopar.passes.trace import trace_joint
from autopar.fmt import fmt_bytes as _bytes
from autopar.fmt import fmt_s as _secs
from autopar.fmt import fmt_si as _si
from autopar.progress import progress

log = logging.getLogger(__name__)

__all__ = ["build_graph", "analyze", "Analysis", "LayerClassRow"]


def build_graph(model: nn.Module, example_inputs: Any, *, cluster: Cluster,
                loss_fn: Callable | None = None, example_target: Any = None,
                collapse_repeats: bool = True, param_dtype=None, fake_device=None) -> fx.GraphModule:
    """Trace, annotate and group: the annotated joint graph the planner reads.

    ``param_dtype`` is a mixed-precision policy's compute dtype (:mod:`autopar.precision`):
    the graph is traced, and so priced, as it will run."""
    with progress(f"tracing {type(model).__name__}"):
        gm = trace_joint(model, example_inputs, loss_fn=loss_fn, example_target=example_target,
                         collapse_repeats=collapse_repeats, param_dtype=param_dtype, fake_device=fake_device)
    with progress("annotating costs"):
        annotate_cost(gm, device=cluster.device)
        group_layers(gm)
    return gm


@dataclass(frozen=True, kw_only=True)
class LayerClassRow:
    class_name: str
    """Class of the layer's module."""
    paths: tuple[str, ...]
    """The layers of this class (the first of a collapsed run stands for all)."""
    count: int
    """Instances in the model."""
    params: int
    """Parameters of one instance."""
    flops_fwd: float
    flops_bwd: float
    activation_bytes: float
    """Saved activations of one instance at the traced batch."""
    time_s: float
    """Forward + backward roofline time of one instance on one device."""


@dataclass(frozen=True, kw_only=True)
class Analysis:
    model: str
    cluster: str
    graph_hash: str
    global_batch: int
    n_nodes: int
    layers: tuple[LayerClassRow, ...]
    n_params: int
    model_flops_per_step: float
    training_state_bytes: float
    """AdamW state under ``precision``, unsharded (:data:`autopar.cost.memory.PRECISIONS`: 18 bytes/param
    for "bf16-mixed": bf16 compute copy, fp32 gradients, fp32 master, m and v; 16 for "fp32")."""
    precision: str = "bf16-mixed"
    """The training precision policy the costs are for (:mod:`autopar.precision`), as :func:`autopar.plan`
    resolves it: "bf16-mixed" on a GPU cluster unless asked otherwise."""
    activation_bytes: float
    time_one_device_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        """The per-layer-class table and totals, for a person."""
        head = f"{'layer class':<28} {'count':>5} {'params':>10} {'FLOPs fwd':>10} {'FLOPs bwd':>10} {'activations':>11} {'time/dev':>9}"
        lines = [f"{self.model} on {self.cluster}: global batch {self.global_batch}, "
                 f"{self.n_nodes} graph nodes, graph {self.graph_hash}", head, "-" * len(head)]
        for r in self.layers:
            name = f"{r.class_name} ({r.paths[0]}{'' if len(r.paths) == 1 else '..'})"
            lines.append(f"{name[:28]:<28} {r.count:>5} {_si(r.params):>10} {_si(r.flops_fwd):>10} "
                         f"{_si(r.flops_bwd):>10} {_bytes(r.activation_bytes):>11} {_secs(r.time_s):>9}")
        lines.append("-" * len(head))
        lines.append(f"parameters {_si(self.n_params)}; model FLOPs per step {_si(self.model_flops_per_step)}; "
                     f"training state {_bytes(self.training_state_bytes)} (AdamW, {self.precision}, "
                     f"{self.training_state_bytes / max(self.n_params, 1):.0f} B/param, unsharded); "
                     f"activations {_bytes(self.activation_bytes)}; one device: {_secs(self.time_one_device_s)} per step")
        return "\n".join(lines)


def analyze(model: nn.Module, example_inputs: Any, *, cluster: str | Cluster,
            loss_fn: Callable | None = None, example_target: Any = None, precision: str | None = None) -> Analysis:
    """Trace ``model`` and report its per-layer-class costs on one device of ``cluster``, under the
    precision policy :func:`autopar.plan` would use (``precision``, default as there): traced in
    its compute dtype, training state at its bytes per parameter."""
    from autopar.precision import resolve_precision

    cluster = parse_cluster(cluster)
    policy, _ = resolve_precision(precision, model=model, gpu_cluster=cluster.device.name.lower() != "cpu")
    gm = build_graph(model, example_inputs, cluster=cluster, loss_fn=loss_fn, example_target=example_target,
                     param_dtype=policy.param_dtype)
    return summarize(gm, cluster=cluster, precision=policy.memory_preset)


def summarize(gm: fx.GraphModule, *, cluster: Cluster, precision: str = "bf16-mixed") -> Analysis:
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    layers: tuple[mk.LayerInfo, ...] = gm.meta[mk.LAYERS]
    by_sig: dict[str, list[mk.LayerInfo]] = {}
    for layer in layers:
        by_sig.setdefault(layer.signature, []).append(layer)
    rows = []
    for group in by_sig.values():
        first = group[0]
        rows.append(LayerClassRow(
            class_name=first.class_name, paths=tuple(x.path for x in group),
            count=sum(x.count for x in group), params=first.n_params,
            flops_fwd=first.flops_fwd, flops_bwd=first.flops_bwd,
            activation_bytes=first.saved_bytes, time_s=first.time_fwd_s + first.time_bwd_s))
    flops = sum((x.flops_fwd + x.flops_bwd) * x.count for x in layers)
    return Analysis(
        model=info.model_name, cluster=cluster.spec, graph_hash=graph_hash(gm),
        global_batch=info.global_batch, n_nodes=len(gm.graph.nodes), layers=tuple(rows),
        n_params=info.n_params, model_flops_per_step=flops,
        training_state_bytes=training_state_bytes(n_params=info.n_params, zero_stage=0, dp=1,
                                                  precision=precision).total, precision=precision,
        activation_bytes=sum(x.saved_bytes * x.count for x in layers),
        time_one_device_s=sum((x.time_fwd_s + x.time_bwd_s) * x.count for x in layers))

"""The metadata autopar's passes attach to fx nodes and graph modules.

Every key autopar writes is defined here, once, with the frozen dataclass that
is its value. A pass only adds its own keys, so running it twice is harmless.

Node keys (``node.meta[KEY]``):

- ``TRACE`` (:class:`NodeTrace`, set by ``trace_joint``): the node's role and
  the module path it came from.
- ``COST`` (:class:`NodeCost`, set by ``annotate_cost``): FLOPs, bytes moved,
  saved-activation bytes and a roofline time estimate.
- ``LAYER`` (``str``, set by ``group_layers``): the layer path the node belongs to.
- ``FUSED`` (``True``, set by ``fuse_memory_bound``): a memory-bound op of a compiled layer, run
  inside a TorchInductor kernel (priced as kernel kind "fused", not "other").
- ``FLOAT8`` (``True``, set by ``mark_float8_linears``): a GEMM of an ``nn.Linear`` that a Float8
  training run executes in float8 (priced as kernel kind "fp8_gemm", not "gemm").
- ``TP_PLACEMENT`` (``str``, set by ``shard_joint_graph`` on the per-rank program): the
  tp placement ("R", "P", "S<d>"; "?" when two DTensors of different placements share the
  node) of the DTensor whose local tensor the node makes. The pipeline sends a value
  replicated on tp as 1/tp pieces (:mod:`autopar.runtime.pipeline`).

Graph keys (``gm.meta[KEY]``):

- ``GRAPH`` (:class:`GraphTrace`, set by ``trace_joint``).
- ``LAYERS`` (``tuple[LayerInfo, ...]``, set by ``group_layers``).
- ``GRAD_RETURNS`` (``tuple[GradReturn, ...]``, set by ``shard_joint_graph`` on the
  per-rank program): the tensor-parallel gradient collectives left to the runtime.
- ``RECOMPUTED`` (``dict[str, str]``, set by ``recompute_in_backward``): each copy the backward
  re-runs, by name, and the forward op it copies.

Shapes always come from ``node.meta["val"]`` (a FakeTensor), never from here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

TRACE = "autopar.trace"
COST = "autopar.cost"
LAYER = "autopar.layer"
FUSED = "autopar.fused"
FLOAT8 = "autopar.float8"
GRAPH = "autopar.graph"
LAYERS = "autopar.layers"
GRAD_RETURNS = "autopar.grad_returns"
TP_PLACEMENT = "autopar.tp_placement"
RECOMPUTED = "autopar.recomputed"


class Role(str, enum.Enum):
    """What a node of the joint graph is."""

    PARAM = "param"  # a trainable parameter (placeholder)
    BUFFER = "buffer"  # a non-trainable buffer (placeholder)
    INPUT = "input"  # a user input or the loss target (placeholder)
    TANGENT = "tangent"  # the seed gradient of the loss (placeholder)
    CONSTANT = "constant"  # a tensor constant the graph holds (get_attr), replicated everywhere
    FORWARD = "forward"  # computed in the forward pass
    BACKWARD = "backward"  # computed in the backward pass
    OUTPUT = "output"  # the graph's output node (loss and gradients)


@dataclass(frozen=True, kw_only=True)
class NodeTrace:
    role: Role
    """Role of the node in the joint graph."""
    module_path: str
    """Dotted path of the innermost module that produced the node, relative to
    the user's model ("" for code in the model's own forward or the loss)."""
    module_class: str = ""
    """Class name of that module ("" when unknown)."""
    fqn: str = ""
    """For PARAM/BUFFER placeholders: the state_dict key; for INPUT: the input's name."""
    seq_nr: int = -1
    """Autograd sequence number; a backward node shares it with its forward op."""


@dataclass(frozen=True, kw_only=True)
class NodeCost:
    flops: float
    """Floating-point operations (multiply and add counted separately)."""
    bytes_read: float
    """Bytes of tensor inputs the op reads (0 for views)."""
    bytes_written: float
    """Bytes of tensor outputs the op writes (0 for views)."""
    output_bytes: float
    """Size of the node's outputs, views included."""
    saved_bytes: float
    """Bytes of this forward node's output that backward reads (activation memory)."""
    param_bytes: float
    """For parameter placeholders, the parameter's size; else 0."""
    time_s: float
    """Roofline time of the op on one device of the cluster."""


@dataclass(frozen=True, kw_only=True)
class Repeat:
    container: str
    """Path of the ModuleList/Sequential whose blocks repeat, e.g. "model.layers"."""
    traced: tuple[str, ...]
    """Paths of the two blocks that were traced, e.g. ("model.layers.0", "model.layers.1");
    the first stands for itself, the second for the ``count - 1`` others."""
    count: int
    """How many identical blocks the container holds."""
    n_params_each: int
    """Parameters in one block."""


@dataclass(frozen=True, kw_only=True)
class GraphTrace:
    model_name: str
    input_names: tuple[str, ...]
    """Names of the user inputs (positional "arg0", ... or keyword names), then "target" if any."""
    param_fqns: tuple[str, ...]
    """Parameter names in placeholder order."""
    grad_outputs: dict[str, int] = field(default_factory=dict)
    """Parameter name -> index of its gradient in the output tuple."""
    loss_output: int = 0
    """Index of the loss in the output tuple."""
    n_params: int = 0
    """Parameters of the whole model, counting collapsed repeats."""
    repeats: tuple[Repeat, ...] = ()
    """Repeated blocks traced once and stood for by their first instance."""
    global_batch: int = 1
    """Leading dimension of the inputs: the batch the planner splits."""
    module_classes: dict[str, str] = field(default_factory=dict)
    """Module path -> class name, for every module of the model ("" is the model)."""


@dataclass(frozen=True, kw_only=True)
class LayerInfo:
    """One layer of the model (a repeated block, an embedding, a head) and its costs.

    Costs are for one instance at the traced (global) batch; ``count`` instances
    exist when the layer stands for a run of identical blocks.
    """

    path: str
    """Module path of the layer, e.g. "transformer.h.0"."""
    index: int
    """Position in forward order."""
    class_name: str
    """Class of the layer's module, e.g. "Block"."""
    signature: str
    """Structural hash: layers with the same signature are interchangeable."""
    count: int
    """Instances this layer stands for (> 1 for collapsed repeats)."""
    param_fqns: tuple[str, ...]
    n_params: int
    param_bytes: float
    flops_fwd: float
    flops_bwd: float
    bytes_fwd: float
    bytes_bwd: float
    time_fwd_s: float
    time_bwd_s: float
    saved_bytes: float
    """Activation bytes the backward reads (what a stage holds per micro-batch in flight)."""
    boundary_bytes: float
    """Bytes of forward outputs later layers read (what a pipeline cut after it sends)."""


@dataclass(frozen=True, kw_only=True)
class GradReturn:
    """A parameter gradient the per-rank program returns before its tensor-parallel
    collective: the runtime issues that collective, bucketed with the others of its
    kind and dtype, once per step."""

    fqn: str
    """The parameter."""
    kind: str
    """"all_reduce" (the addend is Partial on tp, the parameter replicated) or
    "all_gather" (the addend is a Shard(dim) piece, the parameter replicated)."""
    dim: int | None
    """The sharded dim for "all_gather"; None for "all_reduce"."""
    shape: tuple[int, ...]
    """The parameter's (and gradient's) global shape."""
    nbytes: int
    """Bytes of the whole gradient: what the plan prices for its collective."""

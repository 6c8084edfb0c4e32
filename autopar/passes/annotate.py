"""Annotate every node of a traced joint graph with its cost on one device.

FLOPs come from ``torch.utils.flop_counter``'s formula registry for the ops it
knows (mm, addmm, bmm, convolution, the SDPA kernels, ...). It does not know
the CPU flash-attention kernel that CPU traces contain
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward), so those get
the registry's own SDPA formulas applied to their shapes. Nor does it know
grouped matmuls (mixture-of-experts layers): ``aten._grouped_mm`` and the
``transformers::grouped_mm_fallback`` custom op (+ backward) that Hugging Face
experts run on CPU or fp32 get 2 x tokens x in x out FLOPs (x2 for backward:
input and weight gradients), each token going through one expert's matrix;
autopar's own experts op registers its formula (:mod:`autopar.experts`) and is timed as
GEMMs of one expert's rows. Every other op is
memory bound (pointwise, reductions, norms, softmax, embedding): it is costed
by the bytes it moves and counts 0 FLOPs, as the flop counter does, so "model
FLOPs" mean the matmul/attention FLOPs that MFU conventionally counts.

Bytes: an op reads its tensor inputs and writes its outputs once; views
(``t``, ``view``, ``expand``, ``getitem`` ...) move nothing. Saved activations
are the forward tensors (and inputs) that a backward node reads, counted once
per storage: a view read by backward charges its base tensor.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.utils import flop_counter

from autopar.cost.compute import kernel_time_s
from autopar.cost.devices import DeviceSpec
from autopar.passes import meta_keys as mk

__all__ = ["GemmShape", "annotate_cost", "kernel_of", "node_flops", "tensor_bytes"]

aten = torch.ops.aten

# Matmul ops and the positions of their two operands among the node's args.
_GEMM_OPERANDS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1)}
# autopar's experts op (autopar.experts.moe_experts) and its backward: positions of the token rows
# and of the first stacked weight. Each expert runs GEMMs over its rows (rows/E of them under
# balanced routing, more per expert under ep, which this does not credit) with the hidden and
# expert widths as the other two dims, in forward and backward alike.
_EXPERTS_OPERANDS = {"autopar::moe_experts": (0, 2), "autopar::moe_experts_backward": (1, 3)}
_ATTENTION_WORDS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


class GemmShape(tuple):
    """``(m, n, k, a_index, b_index, a_rank, b_rank)`` of a matmul node: batch folded into m;
    ``a_index``/``b_index`` are the operands' positions among the node's tensor inputs."""


def kernel_of(node: fx.Node) -> tuple[str, GemmShape | None]:
    """The kind of kernel a ``call_function`` node runs ("gemm", "fp8_gemm" for a GEMM that
    ``mark_float8_linears`` marked, "attention", "causal_attention",
    "fused" for a memory-bound op that ``fuse_memory_bound`` put in a compiled kernel, "other")
    and, for a GEMM, its global shape (for :func:`autopar.cost.compute.kernel_time_s`).
    An SDPA kernel (forward or backward) is causal when its ``is_causal`` argument is true."""
    target = node.target
    if target in _GEMM_OPERANDS:
        ia, ib = _GEMM_OPERANDS[target]
        a, b = node.args[ia].meta.get("val"), node.args[ib].meta.get("val")
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            m = int(a.shape[:-1].numel())  # (B, M, K) or (M, K): batch folded into m
            k, n = int(a.shape[-1]), int(b.shape[-1])
            # tensor inputs in order: addmm's bias comes first
            offset = 1 if target is aten.addmm.default and isinstance(node.args[0], fx.Node) else 0
            return ("fp8_gemm" if node.meta.get(mk.FLOAT8) else "gemm"), \
                GemmShape((m, n, k, offset, offset + 1, a.dim(), b.dim()))
        return "gemm", None
    experts = _EXPERTS_OPERANDS.get(target.name().split(".")[0]) if isinstance(target, torch._ops.OpOverload) \
        else None
    if experts is not None:  # autopar's experts op: one (rows/E, d) x (d, f) GEMM shape per expert
        ix, iw = experts
        x, w = node.args[ix].meta.get("val"), node.args[iw].meta.get("val")  # (rows, d), (E, d, f)
        if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor):
            return "gemm", GemmShape((max(1, int(x.shape[0]) // int(w.shape[0])), int(w.shape[2]),
                                      int(x.shape[1]), ix, iw, 2, 3))
    name = str(getattr(target, "__name__", target))
    if any(word in name for word in _ATTENTION_WORDS):
        return ("causal_attention" if _is_causal(node) else "attention"), None
    return ("fused" if node.meta.get(mk.FUSED) else "other"), None


def _is_causal(node: fx.Node) -> bool:
    """The node's ``is_causal`` argument, found by name in the op's schema (its position differs
    between the flash, efficient, cuDNN and CPU kernels and their backwards)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    for i, arg in enumerate(schema.arguments):
        if arg.name == "is_causal":
            if arg.name in node.kwargs:
                return bool(node.kwargs[arg.name])
            if i < len(node.args):
                return bool(node.args[i])
            return bool(arg.default_value) if arg.has_default_value() else False
    return False


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
"""Cost-model dtype names of the float dtypes it prices (anything else is priced as fp32)."""

# Ops that alias their input without copying although their schema is not a view.
_NO_COPY = {aten._unsafe_view.default, aten.detach.default, aten.alias.default}


def annotate_cost(gm: fx.GraphModule, *, device: DeviceSpec, compute_dtype: str | None = None) -> fx.GraphModule:
    """Add ``meta[COST]`` (:class:`NodeCost`) to every node of ``gm``; return ``gm``.

    Contract:
      needs: ``meta["val"]`` and ``meta[TRACE]`` on every node (``trace_joint``).
      produces: ``meta[COST]`` on every node, and no ``meta[FUSED]`` or ``meta[FLOAT8]`` (an
      earlier ``fuse_memory_bound``'s or ``mark_float8_linears``' marks are dropped with their
      prices); the graph itself is unchanged.
      ``compute_dtype`` picks the device peak ("bf16", "fp32", ...) for all ops;
      by default each op's output dtype picks it.
      raises: nothing for unknown ops (they are costed by bytes alone).
    """
    saved = _saved_storages(gm)
    for node in gm.graph.nodes:
        node.meta.pop(mk.FUSED, None)  # annotated afresh: as eager, until fuse_memory_bound runs again
        node.meta.pop(mk.FLOAT8, None)  # and in the plan's dtype, until mark_float8_linears runs again
        info = node.meta[mk.TRACE]
        out_bytes = tensor_bytes(node.meta.get("val"))
        if node.op != "call_function":
            param = out_bytes if info.role is mk.Role.PARAM else 0.0
            node.meta[mk.COST] = mk.NodeCost(
                flops=0.0, bytes_read=0.0, bytes_written=0.0, output_bytes=out_bytes,
                saved_bytes=out_bytes if node in saved else 0.0, param_bytes=param, time_s=0.0)
            continue
        flops = node_flops(node)
        if _is_view(node):
            read = written = 0.0
        elif node.target is aten.embedding.default:
            read = tensor_bytes(node.args[1].meta["val"]) + out_bytes  # the gathered rows
            written = out_bytes
        else:
            read = sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
            written = out_bytes
        dtype = compute_dtype or _dtype_name(node.meta.get("val"))
        node.meta[mk.COST] = mk.NodeCost(
            flops=flops, bytes_read=read, bytes_written=written, output_bytes=out_bytes,
            saved_bytes=out_bytes if node in saved else 0.0, param_bytes=0.0,
            time_s=_time_s(node, flops, read + written, device, dtype))
    return gm


def _time_s(node: fx.Node, flops: float, nbytes: float, device: DeviceSpec, dtype: str) -> float:
    kind, shape = kernel_of(node)
    return kernel_time_s(kind=kind, flops=flops, bytes_moved=nbytes, device=device, dtype=dtype,
                         gemm=tuple(shape[:3]) if shape else None)


def tensor_bytes(val: Any) -> float:
    """Bytes of a FakeTensor, or of every tensor in a tuple/list of them."""
    if isinstance(val, torch.Tensor):
        return float(val.numel() * val.element_size())
    if isinstance(val, (tuple, list)):
        return sum(tensor_bytes(v) for v in val)
    return 0.0


def _vals(x: Any) -> Any:
    if isinstance(x, fx.Node):
        return x.meta.get("val")
    if isinstance(x, (tuple, list)):
        return type(x)(_vals(v) for v in x)
    return x


def node_flops(node: fx.Node) -> float:
    """FLOPs of one ``call_function`` node, as FlopCounterMode would count them."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is None:
        return 0.0
    args, kwargs = _vals(node.args), _vals(node.kwargs)
    out = node.meta.get("val")
    if any(word in str(packet) for word in _ATTENTION_WORDS):
        args = _kv_heads_as_query(args, backward="backward" in str(packet))
    formula = flop_counter.flop_registry.get(packet)
    if formula is not None:
        return float(formula(*args, **kwargs, out_val=out))
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        q, k, v = args[:3]
        return float(flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape))
    if packet is aten._scaled_dot_product_flash_attention_for_cpu_backward:
        grad_out, q, k, v = args[:4]
        return float(flop_counter.sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape))
    name = getattr(packet, "_qualified_op_name", "")
    if name in ("aten::_grouped_mm", "transformers::grouped_mm_fallback"):
        return _grouped_mm_flops(args[0].shape, args[1].shape)
    if name == "transformers::grouped_mm_fallback_backward":  # (input, weight, offs, grad_output)
        return 2 * _grouped_mm_flops(args[0].shape, args[1].shape)
    return 0.0


def _kv_heads_as_query(args: list, *, backward: bool) -> list:
    """An SDPA op's arguments with key and value given the query's heads where they have fewer
    (grouped-query attention, ``enable_gqa=True``): the kernel does the work of the broadcast heads,
    and torch 2.11's flop formulas assert equal heads (``sdpa_flop_count``: "query/key/value shapes
    are incompatible"; 2.13's broadcast them). Shapes only: the formulas read nothing else."""
    iq = 1 if backward else 0  # the backward ops take the output's gradient first
    if len(args) < iq + 3 or not all(isinstance(a, torch.Tensor) and a.dim() == 4 for a in args[iq:iq + 3]):
        return args
    q = args[iq]
    heads = q.shape[1]
    fixed = list(args)
    for i in (iq + 1, iq + 2):
        t = args[i]
        if t.shape[1] != heads:
            fixed[i] = torch.empty((t.shape[0], heads, *t.shape[2:]), dtype=t.dtype, device="meta")
    return fixed


def _grouped_mm_flops(a_shape, b_shape) -> float:
    """FLOPs of a grouped matmul: each row (or batch) of ``a`` meets one group's matrix.
    (S, K) x (E, K, N) -> 2SKN; (E, M, K) x (E, K, N) -> 2EMKN; (M, K) x (K, N) with K split
    in groups -> 2MKN."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2.0 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2.0 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2.0 * a_shape[0] * a_shape[1] * b_shape[1]
    return 0.0  # a layout not seen in practice here: costed by its bytes, like unknown ops


def _is_view(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target in _NO_COPY)


def _base(node: fx.Node) -> fx.Node:
    """Follow views back to the node that owns the storage."""
    while node.op == "call_function" and _is_view(node) and node.target is not operator.getitem:
        node = node.args[0]
    return node


def _saved_storages(gm: fx.GraphModule) -> set[fx.Node]:
    """Forward nodes and inputs whose storage some backward node reads."""
    saved = set()
    for node in gm.graph.nodes:
        if node.meta[mk.TRACE].role is not mk.Role.BACKWARD:
            continue
        for arg in node.all_input_nodes:
            base = _base(arg)
            if base.meta[mk.TRACE].role in (mk.Role.FORWARD, mk.Role.INPUT):
                saved.add(base)
    return saved


def _dtype_name(val: Any) -> str:
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    if isinstance(val, torch.Tensor):
        return DTYPE_NAMES.get(val.dtype, "fp32")
    return "fp32"

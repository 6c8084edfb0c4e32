"""Trace an unmodified model and its loss into one joint forward+backward ATen graph.

How: TorchDynamo captures the Python-level graph (this is what lets Hugging Face
models through: their mask helpers skip data-dependent checks while dynamo is
tracing), then AOTAutograd's ``aot_export_joint_with_descriptors`` turns it into
a functional ATen graph of forward and backward, with descriptors that say which
placeholder is which parameter and which output is which gradient. Everything
runs on FakeTensors: parameters on the ``meta`` device are swapped for fake CPU
tensors for the duration of the trace, so a 70B-shaped model allocates nothing.

Repeated blocks: a ModuleList/Sequential of three or more structurally identical
blocks (same class, same parameter shapes, same configuration) is traced with
its first two blocks only, and the graph records that the second stands for all
the others (:class:`~autopar.passes.meta_keys.Repeat`). The first block is kept
apart because it often differs (its input may not need a gradient); the second
is a faithful copy of every later one. That keeps a 80-layer model's trace as
cheap as a 2-layer one. Pass ``collapse_repeats=False`` for the full graph
(codegen needs it; planning does not).

References: torch/_functorch/aot_autograd.py (aot_export_joint_with_descriptors),
torch/_dynamo/functional_export.py.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn

from autopar.errors import InputError, LossError
from autopar.passes import meta_keys as mk
from autopar.passes import trace_cache, trace_store
from autopar.passes.hf_paths import hf_training_paths
from autopar.passes.train_checks import check_trainable, checked_loss
from autopar.passes.trace_errors import CACHE_OBJECT, trace_error

log = logging.getLogger(__name__)

__all__ = ["trace_joint", "flatten_inputs", "LossError"]


def trace_joint(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    example_target: Any = None,
    collapse_repeats: bool = True,
    param_dtype: torch.dtype | None = None,
    fake_device: torch.device | None = None,
) -> fx.GraphModule:
    """Trace ``loss_fn(model(*inputs), target)`` forward and backward into an ATen graph.

    Contract:
      needs: a model whose parameters live on one device (``cpu`` or ``meta``);
        ``example_inputs`` a tuple of positional args, a dict of keyword args or
        a single tensor (one global batch).
      produces: a GraphModule whose placeholders are parameters, buffers, inputs
        (then the target) and the loss tangent, and whose output is
        ``(loss, *param_grads)`` in AOTAutograd's order; every node has
        ``meta["val"]`` and ``meta[TRACE]`` (:class:`NodeTrace`); the module has
        ``gm.meta[GRAPH]`` (:class:`GraphTrace`). With ``param_dtype`` (a mixed-precision
        policy, :mod:`autopar.precision`) every floating parameter and floating model input
        (not the target) is traced as that dtype, as the runtime will cast them. With
        ``fake_device`` the fake tensors live there instead of on the CPU, so the graph names
        that device's kernels (a CUDA rank's program must not call the CPU-only
        ``_scaled_dot_product_flash_attention_for_cpu`` that a CPU trace picks for SDPA).
      raises: :class:`InputError` before tracing for an empty batch, a target
        whose batch differs from the inputs' or a model with no trainable
        parameter; :class:`LossError` when no loss can be found or ``loss_fn``
        returns no floating-point scalar tensor; :class:`TraceError` naming the
        op or source line when the model cannot be traced.
    """
    names, flat, kw_names = flatten_inputs(example_inputs)
    _check_no_cache(names, flat)
    check_trainable(model, names, flat, example_target)
    if example_target is not None:
        names, flat = names + ("target",), flat + [example_target]
    key = None
    if trace_cache.enabled():
        key = trace_cache.trace_key(model, names, flat, loss_fn, (
            collapse_repeats, param_dtype, fake_device and torch.device(fake_device), len(kw_names),
            example_target is not None))
        if (gm := trace_cache.lookup(key)) is not None:
            log.info("traced %s: reused the trace of an identical model, inputs and loss (%s)",
                     type(model).__name__, trace_cache.ENV)
            return gm
    with trace_cache.shared(key) as claim:
        if claim.found is not None:
            log.info("traced %s: loaded the trace another process made of an identical model, inputs and loss "
                     "(%s)", type(model).__name__, trace_store.ENV)
            return claim.found
        gm = _trace_new(model, names, flat, kw_names, loss_fn, example_target, collapse_repeats, param_dtype,
                        fake_device)
        claim.keep(gm)
    return gm


def _trace_new(model, names, flat, kw_names, loss_fn, example_target, collapse_repeats, param_dtype,
               fake_device) -> fx.GraphModule:
    repeats = _find_repeats(model) if collapse_repeats else ()
    n_params = sum(p.numel() for p in model.parameters())
    wrapper = _TrainStep(model, loss_fn, n_pos=len(flat) - len(kw_names) - (example_target is not None),
                         kw_names=kw_names, has_target=example_target is not None)
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    n_model_inputs = len(flat) - (example_target is not None)
    with _collapsed(model, repeats), hf_training_paths(model), _attention_fused_for_any_value_width(), \
            _fake_state(model, fake_mode, param_dtype, fake_device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fake_inputs = [_to_fake(x, fake_mode, param_dtype if i < n_model_inputs else None, fake_device)
                       for i, x in enumerate(flat)]
        joint, flat_to_fqn = _export(wrapper, fake_inputs, type(model).__name__)
    gm = joint.graph_module
    _annotate_nodes(gm, flat_to_fqn, names)
    out_node = gm.graph.find_nodes(op="output")[0]
    grad_outputs, loss_output = {}, 0
    outs = out_node.args[0]
    for i, desc in enumerate(out_node.meta.get("desc", ())):
        kind = type(desc).__name__
        if kind == "GradAOTOutput" and type(desc.grad_of).__name__ == "ParamAOTInput":
            if outs[i] is None:  # the loss does not reach it: no gradient, as in eager (.grad stays None,
                continue  # the optimizer skips it); it is held like a frozen parameter
            grad_outputs[_param_name(desc.grad_of.target, flat_to_fqn)] = i
        elif kind == "PlainAOTOutput" and desc.idx == 0:
            loss_output = i
    params = tuple(n.meta[mk.TRACE].fqn for n in gm.graph.find_nodes(op="placeholder")
                   if n.meta[mk.TRACE].role is mk.Role.PARAM)
    batch = next((x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0), 1)
    gm.meta[mk.GRAPH] = mk.GraphTrace(
        model_name=type(model).__name__, input_names=names, param_fqns=params,
        grad_outputs=grad_outputs, loss_output=loss_output, n_params=n_params,
        repeats=repeats, global_batch=int(batch),
        module_classes={name: type(m).__name__ for name, m in model.named_modules()})
    log.info("traced %s: %d nodes, %d params, repeats=%s", type(model).__name__,
             len(gm.graph.nodes), n_params, [(r.container, r.count) for r in repeats])
    return gm


# -- inputs and loss ---------------------------------------------------------


def flatten_inputs(example_inputs: Any) -> tuple[tuple[str, ...], list[Any], tuple[str, ...]]:
    """Return (names, flat values, keyword names) for the accepted input forms."""
    if isinstance(example_inputs, torch.Tensor):
        return ("arg0",), [example_inputs], ()
    if isinstance(example_inputs, dict):
        keys = tuple(k for k, v in example_inputs.items() if v is not None)
        return keys, [example_inputs[k] for k in keys], keys
    if isinstance(example_inputs, (tuple, list)):
        return tuple(f"arg{i}" for i in range(len(example_inputs))), list(example_inputs), ()
    raise TypeError(
        f"example_inputs must be a tuple of positional arguments, a dict of keyword "
        f"arguments or a single tensor; got {type(example_inputs).__name__}")


def _check_no_cache(names: tuple[str, ...], flat: list[Any]) -> None:
    """A key/value cache passed as an input (``past_key_values=DynamicCache()``) is refused by name."""
    for name, value in zip(names, flat):
        if any(c.__name__ == "Cache" for c in type(value).__mro__):
            raise InputError(
                f"{CACHE_OBJECT}: input {name!r} is a {type(value).__name__}, a key/value cache for generation; "
                f"a training step reads none. Try: leave {name!r} out of the inputs (autopar traces Hugging Face "
                f"models with use_cache=False)")


class _TrainStep(nn.Module):
    """``loss = loss_fn(model(*args, **kwargs), target)`` as one module to trace."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, *, n_pos: int,
                 kw_names: tuple[str, ...], has_target: bool) -> None:
        super().__init__()
        self.user = model
        self.loss_fn = loss_fn
        self.n_pos = n_pos
        self.kw_names = kw_names
        self.has_target = has_target

    def forward(self, *flat: Any) -> torch.Tensor:
        args = flat[: self.n_pos]
        kwargs = dict(zip(self.kw_names, flat[self.n_pos: self.n_pos + len(self.kw_names)]))
        out = self.user(*args, **kwargs)
        if self.loss_fn is not None:
            return checked_loss(self.loss_fn(out, flat[-1] if self.has_target else None))
        return _loss_of(out)


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    raise LossError(
        f"the model returned {shape}, which is not a scalar loss and has no .loss; "
        f"pass loss_fn=lambda output, target: ... and example_target (or, for Hugging "
        f"Face models, include labels=... in the inputs)")


# -- repeated blocks ---------------------------------------------------------


def _block_signature(block: nn.Module) -> tuple:
    """What must agree for two blocks to be traced as one: classes, configs, shapes."""
    sig = []
    for name, mod in block.named_modules():
        conf = tuple(sorted((k, v) for k, v in vars(mod).items()
                            if isinstance(v, (int, float, str, bool, type(None)))
                            and not k.startswith("_") and k != "training"
                            and "idx" not in k and "index" not in k))
        sig.append((name, type(mod).__qualname__, mod.extra_repr(), conf))
    for name, t in list(block.named_parameters()) + list(block.named_buffers()):
        sig.append((name, tuple(t.shape), str(t.dtype), t.requires_grad))
    return tuple(sig)


def _find_repeats(model: nn.Module) -> tuple[mk.Repeat, ...]:
    """ModuleLists/Sequentials whose blocks are all alike (and hold parameters)."""
    found = []
    for path, mod in model.named_modules():
        if type(mod) not in (nn.ModuleList, nn.Sequential) or len(mod) < 3:
            continue
        if any(path.startswith(r.container + ".") for r in found):
            continue
        blocks = list(mod)
        first = _block_signature(blocks[0])
        n_each = sum(p.numel() for p in blocks[0].parameters())
        if n_each == 0 or any(_block_signature(b) != first for b in blocks[1:]):
            continue
        keys = list(mod._modules)
        found.append(mk.Repeat(container=path, traced=(f"{path}.{keys[0]}", f"{path}.{keys[1]}"),
                               count=len(blocks), n_params_each=n_each))
    return tuple(found)


@contextlib.contextmanager
def _collapsed(model: nn.Module, repeats: tuple[mk.Repeat, ...]) -> Iterator[None]:
    """Temporarily keep only the first two blocks of each repeated container."""
    saved = []
    try:
        for r in repeats:
            container = model.get_submodule(r.container)
            saved.append((container, dict(container._modules)))
            keys = list(container._modules)[:2]
            container._modules = {k: container._modules[k] for k in keys}
        yield
    finally:
        for container, modules in saved:
            container._modules = modules


# -- fake state --------------------------------------------------------------


def _to_fake(x: Any, fake_mode, float_dtype: torch.dtype | None = None, device: torch.device | None = None) -> Any:
    """Meta tensors become fake CPU tensors (meta has no kernels for autograd's needs);
    floating ones become ``float_dtype`` when given (a mixed-precision cast)."""
    if not isinstance(x, torch.Tensor):
        return x
    dtype = float_dtype if float_dtype is not None and x.is_floating_point() else x.dtype
    with fake_mode:
        device = device if device is not None else "cpu" if x.device.type == "meta" else x.device
        t = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=dtype, device=device)
    return t


@contextlib.contextmanager
def _fake_state(model: nn.Module, fake_mode, param_dtype: torch.dtype | None = None,
                device: torch.device | None = None) -> Iterator[None]:
    """Swap every parameter and buffer for a fake CPU tensor, keeping ties; restore after.
    Floating parameters (not buffers) become ``param_dtype`` when given."""
    swapped: list[tuple[dict, str, Any]] = []
    new: dict[int, Any] = {}
    try:
        for mod in model.modules():
            for store, is_param in ((mod._parameters, True), (mod._buffers, False)):
                for name, t in list(store.items()):
                    if t is None:
                        continue
                    if id(t) not in new:
                        fake = _to_fake(t, fake_mode, param_dtype if is_param else None, device)
                        new[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake
                    swapped.append((store, name, t))
                    store[name] = new[id(t)]
        yield
    finally:
        for store, name, t in reversed(swapped):
            store[name] = t


# -- capture ----------------------------------------------------------------


def _export(wrapper: nn.Module, fake_inputs: list[Any], model_name: str):
    from torch._dynamo.functional_export import _dynamo_graph_capture_for_export
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    # A failing op makes the fake-tensor logger print its traceback to stderr; the exception
    # carries the same story, which trace_error turns into one line (and keeps in .details).
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    if not log.isEnabledFor(logging.INFO):
        fake_log.setLevel(logging.CRITICAL)
    try:
        with _no_constraint_guards(), _dynamo_globals_dropped(_dynamo_graph_capture_for_export):
            captured = _dynamo_graph_capture_for_export(wrapper)(*fake_inputs)
        flat_to_fqn = dict(captured.meta.get("dynamo_flat_name_to_original_fqn", {}))
        flat_to_fqn.update(_canonical_names(captured, wrapper))
        with contextlib.ExitStack() as stack:
            joint = aot_export_joint_with_descriptors(stack, captured, tuple(fake_inputs))
    except Exception as e:  # translate torch's tracing errors into one that says what to do
        raise trace_error(e, model_name) from e
    finally:
        fake_log.setLevel(level)
    return joint, flat_to_fqn


@contextlib.contextmanager
def _dynamo_globals_dropped(capture) -> Iterator[None]:
    """Remove the globals Dynamo installs for one capture when it is done.

    Dynamo puts each traced frame's compiled graph (``__compiled_fn_*``, a GraphModule whose nodes
    hold the capture's FakeTensors), its scopes and its builtins into the traced frame's module
    globals, to be removed by the hooks of a cache entry that export capture never makes: in
    torch 2.11 and 2.13 every trace left one more graph in ``torch._dynamo.functional_export``'s namespace,
    about 2,500 objects for a 2-block GPT and 26,000 for a 16-block Llama with its program, so a
    process that traces again and again (the planner's pair of traces, each start, the tests'
    hundreds) grew without bound and every garbage collection walked the growing heap. The
    graph autopar keeps is the one the capture returns; nothing calls the installed ones."""
    scope = vars(sys.modules[capture.__module__])
    before = set(scope)
    try:
        yield
    finally:
        for name in set(scope) - before:
            if name.startswith("__"):  # (Dynamo's names; the module defines no others at run time)
                del scope[name]


@contextlib.contextmanager
def _attention_fused_for_any_value_width() -> Iterator[None]:
    """Trace SDPA with value heads narrower than query/key heads as the fused kernel, on values
    zero-padded to the query/key width, and the output cut back.

    Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4 MoE lite) has query/key heads of
    192 and value heads of 128. The CPU flash kernel a trace picks takes one head width only, so
    SDPA falls back to its math decomposition: two bmm and a softmax over the whole (T, T) score
    matrix, upcast to fp32 on CPU. Priced as such on an H100 that is fp32 matmuls on non-tensor
    cores and T x T scores through HBM: 64 ms for one of DeepSeek-V3's attention bmm at 2 x 4096
    tokens, where a GPU runs one fused bf16 kernel. Zero value columns add nothing to the
    output's kept columns and get zero gradient, so the padded kernel computes the same values
    and gradients (the scale is the query width's either way); it is what Hugging Face's own
    FlashAttention-2 path does for these models. The price is the padded columns' FLOPs in the
    second matmul of attention (192 where 128 would do)."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    def padded(query, key, value, *args, **kwargs):
        width, value_width = query.shape[-1], value.shape[-1]
        if key.shape[-1] != width or value_width >= width:
            return sdpa(query, key, value, *args, **kwargs)
        out = sdpa(query, key, F.pad(value, (0, width - value_width)), *args, **kwargs)
        return out[..., :value_width]

    F.scaled_dot_product_attention = padded
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


@contextlib.contextmanager
def _no_constraint_guards() -> Iterator[None]:
    """Skip the guard set dynamo's export capture builds after tracing.

    The capture builds every guard of the frame (shape-env guards printed to Python source
    and compiled) only to report violated dynamic-shape constraints; autopar traces with
    static shapes and no constraints, and never runs the guards. Skipping them takes a GPT
    tiny traced pair from 7.2 to 6.5 CPU-s (cProfile puts them at 1.9 s, inflated by its
    per-call overhead), and every plan and every rank's build traces. Where a torch version
    lays the capture out otherwise (no such hook), nothing is skipped."""
    from torch._dynamo import functional_export

    check = getattr(functional_export, "_suggest_or_raise_constraint_violation", None)
    if check is None:
        yield
        return
    functional_export._suggest_or_raise_constraint_violation = lambda *args, **kwargs: None
    try:
        yield
    finally:
        functional_export._suggest_or_raise_constraint_violation = check


def _canonical_names(captured: nn.Module, wrapper: nn.Module) -> dict[str, str]:
    """Dynamo's flat names -> the name ``named_parameters()`` gives the same tensor.

    Dynamo names a tied parameter after the module it was read through (BERT's
    ``cls.predictions.decoder.bias``) and leaves such aliases out of its own
    name map; matching by identity gives every tensor the one name the user sees
    (``cls.predictions.bias``), as for an untied one.
    """
    canonical = {id(t): name for name, t in [*wrapper.named_parameters(), *wrapper.named_buffers()]}
    flat = [*captured.named_parameters(remove_duplicate=False), *captured.named_buffers(remove_duplicate=False)]
    return {name: canonical[id(t)] for name, t in flat if id(t) in canonical}


# -- node annotation ----------------------------------------------------------


_WRAPPER_PREFIX = "user."


def _param_name(flat_name: str, flat_to_fqn: dict[str, str]) -> str:
    fqn = flat_to_fqn.get(flat_name, flat_name)
    return fqn[len(_WRAPPER_PREFIX):] if fqn.startswith(_WRAPPER_PREFIX) else fqn


def _normalize_path(raw: str) -> str:
    """Dynamo's source names ("L['self'].user.h[0]") -> module paths ("h.0")."""
    s = raw.replace("L['self']", "")
    s = re.sub(r"\._modules\['([^']+)'\]", r".\1", s)
    s = re.sub(r"\['([^']+)'\]", r".\1", s)
    s = re.sub(r"\[(\d+)\]", r".\1", s)
    while "getattr(" in s:
        s2 = re.sub(r"getattr\(([^()]*), '([^']+)'\)", r"\1.\2", s)
        if s2 == s:
            break
        s = s2
    s = s.lstrip(".")
    if s == "user":
        return ""
    return s[len(_WRAPPER_PREFIX):] if s.startswith(_WRAPPER_PREFIX) else s


def _innermost(stack: dict | None) -> tuple[str, str]:
    if not stack:
        return "", ""
    raw, cls = list(stack.values())[-1]
    name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return _normalize_path(raw), name.rsplit(".", 1)[-1]


def _annotate_nodes(gm: fx.GraphModule, flat_to_fqn: dict[str, str], input_names: tuple[str, ...]) -> None:
    by_seq: dict[int, tuple[str, str]] = {}
    for node in gm.graph.nodes:
        seq = node.meta.get("seq_nr", -1)
        if node.op == "placeholder":
            desc = node.meta.get("desc")
            kind = type(desc).__name__
            if kind == "ParamAOTInput":
                info = mk.NodeTrace(role=mk.Role.PARAM, module_path="", fqn=_param_name(desc.target, flat_to_fqn))
            elif kind == "BufferAOTInput":
                info = mk.NodeTrace(role=mk.Role.BUFFER, module_path="", fqn=_param_name(desc.target, flat_to_fqn))
            elif kind == "TangentAOTInput":
                info = mk.NodeTrace(role=mk.Role.TANGENT, module_path="")
            else:
                idx = getattr(desc, "idx", 0)
                name = input_names[idx] if idx < len(input_names) else f"arg{idx}"
                info = mk.NodeTrace(role=mk.Role.INPUT, module_path="", fqn=name)
        elif node.op == "output":
            info = mk.NodeTrace(role=mk.Role.OUTPUT, module_path="")
        elif node.op == "get_attr":  # a tensor constant (torch.tensor([...]) in the forward)
            node.meta.setdefault("val", getattr(gm, node.target))
            info = mk.NodeTrace(role=mk.Role.CONSTANT, module_path="", fqn=node.target)
        else:
            backward = node.meta.get("partitioner_tag") == "is_backward" or node.meta.get("autograd_backward", False)
            if not backward:
                path, cls = _innermost(node.meta.get("nn_module_stack"))
                if seq >= 0:
                    by_seq.setdefault(seq, (path, cls))
            else:
                path, cls = _innermost(node.meta.get("fwd_nn_module_stack"))
                if not path and seq in by_seq:
                    path, cls = by_seq[seq]
            info = mk.NodeTrace(role=mk.Role.BACKWARD if backward else mk.Role.FORWARD,
                                module_path=path, module_class=cls, seq_nr=seq)
        node.meta[mk.TRACE] = info
    _place_params(gm)


def _place_params(gm: fx.GraphModule) -> None:
    """A parameter's module path is its name without the last component."""
    for node in gm.graph.find_nodes(op="placeholder"):
        info = node.meta[mk.TRACE]
        if info.role in (mk.Role.PARAM, mk.Role.BUFFER):
            owner = info.fqn.rsplit(".", 1)[0] if "." in info.fqn else ""
            node.meta[mk.TRACE] = mk.NodeTrace(role=info.role, module_path=owner, fqn=info.fqn)

"""Reuse a trace within one process when nothing the trace reads has changed (opt-in).

Tracing (TorchDynamo, then AOTAutograd) costs seconds of CPU even for a tiny model, and a
process that plans or builds the same model many times (the test suite trains one example
under a dozen pinned layouts per world; a sweep over clusters in a notebook) traces the
same graph again and again. With ``AUTOPAR_TRACE_CACHE=1`` in the environment (or
:func:`enabled` set), :func:`autopar.passes.trace.trace_joint` keeps its last results keyed
by a fingerprint of everything the trace reads, and hands out a copy on a hit.

The fingerprint (:func:`trace_key`):

- every module (by path, ties included): its class, ``training``, and every other instance
  attribute that is not a parameter, buffer or submodule (configuration values, recursively:
  a Hugging Face config is read field by field);
- parameters and buffers: names, shapes, dtypes, devices (``meta`` as ``cpu``: both are traced
  as fake CPU tensors), ``requires_grad``, which names are the same tensor; their values do not
  enter the trace (it runs on fake tensors);
- tensors kept as plain attributes: their values too (the trace bakes them in as constants);
- inputs and target: structure, tensor shapes, strides, dtypes, devices; other values;
- the loss function: its code, defaults and closure values, or its object state;
- the trace's options, torch's default dtype and grad mode, whether transformers is loaded.

Not fingerprinted, so not seen: a global that the model's code reads, or a function that it
calls, changed between two traces (monkeypatching). That is why the cache is opt-in: a hit
is exact only while the code a model runs stays put. A model with forward or backward hooks,
or a value the fingerprint cannot read (an object with neither ``__dict__`` nor
``__slots__``, a structure deeper than :data:`_MAX_DEPTH`), is traced every time.

Why written here: torch.compile's guards answer "may I reuse this graph" for one frame of
bytecode, but dynamo's export capture and AOTAutograd's joint export bypass its cache.
Between processes (the ranks of a world, the test suite's workers): :mod:`.trace_store`, with
``AUTOPAR_TRACE_CACHE_DIR``.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import hashlib
import os
import sys
import types
import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn

from autopar.passes import trace_store

__all__ = ["enabled", "set_enabled", "lookup", "store", "shared", "Claim", "trace_key", "clear", "stats"]

ENV = "AUTOPAR_TRACE_CACHE"
_MAX_ENTRIES = 16
_MAX_DEPTH = 12
_ENTRIES: OrderedDict[Any, fx.GraphModule] = OrderedDict()
_STATS = {"hits": 0, "misses": 0, "unkeyable": 0, "loaded": 0}
_forced: bool | None = None


def enabled() -> bool:
    """Whether traces are cached: :func:`set_enabled`'s value, else ``AUTOPAR_TRACE_CACHE``."""
    if _forced is not None:
        return _forced
    return os.environ.get(ENV, "").strip() not in ("", "0")


def set_enabled(value: bool | None) -> None:
    """Cache traces (True) or not (False) whatever the environment says; None: as it says."""
    global _forced
    _forced = value


def clear() -> None:
    _ENTRIES.clear()
    for k in _STATS:
        _STATS[k] = 0


def stats() -> dict[str, int]:
    """Hits, misses and untraceable-key counts since the last :func:`clear`, and misses answered from
    the shared directory (``loaded``, :mod:`.trace_store`)."""
    return dict(_STATS)


def lookup(key: Any) -> fx.GraphModule | None:
    """A copy of the cached graph for ``key``, or None (``key`` None: never cached)."""
    if key is None:
        _STATS["unkeyable"] += 1
        return None
    gm = _ENTRIES.get(key)
    if gm is None:
        _STATS["misses"] += 1
        return None
    _ENTRIES.move_to_end(key)
    _STATS["hits"] += 1
    return _copy(gm)


def store(key: Any, gm: fx.GraphModule) -> None:
    """Keep a copy of ``gm`` (the caller goes on to change its own) under ``key``."""
    if key is None:
        return
    _ENTRIES[key] = _copy(gm)
    while len(_ENTRIES) > _MAX_ENTRIES:
        _ENTRIES.popitem(last=False)


class Claim:
    """A miss's turn at a key across processes (:func:`shared`): ``found`` is the trace another process
    stored, else the caller traces and hands the graph to :meth:`keep`."""

    def __init__(self, key: Any, path, found: fx.GraphModule | None):
        self.key, self.path, self.found = key, path, found

    def keep(self, gm: fx.GraphModule) -> None:
        store(self.key, gm)
        if self.path is not None:
            trace_store.save(self.path, gm)


@contextlib.contextmanager
def shared(key: Any) -> Iterator[Claim]:
    """After a miss: with ``AUTOPAR_TRACE_CACHE_DIR`` set, hold the key's lock across processes for the
    block and offer what another process stored (see :mod:`.trace_store`); else a plain claim."""
    name = trace_store.digest(key) if key is not None and trace_store.directory() is not None else None
    with trace_store.claimed(name) as path:
        found = trace_store.load(path) if path is not None and path.exists() else None
        if found is not None:
            _STATS["loaded"] += 1
            store(key, found)
        yield Claim(key, path if found is None else None, found)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph and module over the same node values (fake tensors and frozen records,
    which no pass changes in place); tens of milliseconds where the trace took seconds."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (pytree's deprecated LeafSpec, deep-copied)
        return copy.deepcopy(gm)


class _Unkeyable(Exception):
    """A value the fingerprint cannot read faithfully: the trace is not cached."""


def trace_key(model: nn.Module, names: tuple[str, ...], flat: list[Any], loss_fn: Callable | None,
              options: tuple) -> Any:
    """The fingerprint described in the module docstring, or None where it cannot be taken."""
    from torch.nn.modules import module as module_mod

    if any(getattr(module_mod, h, None) for h in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                  "_global_backward_hooks", "_global_backward_pre_hooks")):
        return None
    fp = _Fingerprint()
    try:
        inputs = tuple(fp.tensor_meta(x) if isinstance(x, torch.Tensor) else fp.value(x, 0) for x in flat)
        return ("trace", fp.module_tree(model), names, inputs, fp.value(loss_fn, 0), options,
                torch.get_default_dtype(), torch.is_grad_enabled(), "transformers" in sys.modules)
    except (_Unkeyable, RecursionError):
        return None


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_SKIPPED = {"_parameters", "_buffers", "_modules", "training", "_state_dict_hooks", "_state_dict_pre_hooks",
            "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs",
            "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook",
            *_HOOKS}
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
          torch.memory_format, torch.layout, enum.Enum, range, slice, type(Ellipsis))


class _Fingerprint:
    """Builds a hashable structure; objects already seen become back-references by visit
    order, so shared objects (one config read by every layer) and cycles are taken once."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}
        self.keep: list[Any] = []  # (ids stay unique while this fingerprint is built)

    def _ref(self, obj: Any) -> tuple | None:
        i = self.seen.get(id(obj))
        if i is not None:
            return ("ref", i)
        self.seen[id(obj)] = len(self.seen)
        self.keep.append(obj)
        return None

    def module_tree(self, model: nn.Module) -> tuple:
        tensors: dict[int, str] = {}
        out = []
        for path, mod in model.named_modules(remove_duplicate=False):
            if any(getattr(mod, h, None) for h in _HOOKS):
                raise _Unkeyable(f"{path or 'the model'} has hooks")
            own = []
            for kind, store in (("p", mod._parameters), ("b", mod._buffers)):
                for name, t in store.items():
                    if t is None:
                        own.append((kind, name, None))
                        continue
                    tie = tensors.setdefault(id(t), f"{path}.{name}")
                    # (a meta parameter is traced as a fake CPU one, trace._to_fake: the same trace)
                    device = "cpu" if t.device.type == "meta" else t.device.type
                    own.append((kind, name, tuple(t.shape), tuple(t.stride()), t.dtype, device, t.requires_grad, tie))
            attrs = tuple((k, self.value(v, 1)) for k, v in sorted(vars(mod).items())
                          if k not in _SKIPPED and not isinstance(v, nn.Module))
            out.append((path, type(mod), mod.training, tuple(own), tuple(mod._modules), attrs))
        return tuple(out)

    def value(self, v: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise _Unkeyable("too deep")
        if isinstance(v, _ATOMS):
            return (type(v), v)
        if isinstance(v, torch.Tensor):
            return self._tensor(v)
        if isinstance(v, (type, types.ModuleType, types.BuiltinFunctionType, types.CodeType)):
            return v  # hashable, compared by identity (code objects: by content)
        ref = self._ref(v)
        if ref is not None:
            return ref
        d = depth + 1
        if isinstance(v, (tuple, list)):
            return (type(v), tuple(self.value(x, d) for x in v))
        if isinstance(v, (set, frozenset)):
            return (type(v), tuple(sorted((self.value(x, d) for x in v), key=repr)))
        if isinstance(v, dict):
            return (type(v), tuple((self.value(k, d), self.value(x, d)) for k, x in v.items()))
        if isinstance(v, types.FunctionType):
            cells = tuple(self.value(c.cell_contents, d) if _filled(c) else None for c in v.__closure__ or ())
            return ("function", v.__code__, v.__module__, self.value(v.__defaults__, d),
                    self.value(v.__kwdefaults__, d), cells)
        if isinstance(v, types.MethodType):
            return ("method", self.value(v.__func__, d), self.value(v.__self__, d))
        if isinstance(v, nn.Module):
            return ("module", self.module_tree(v))
        if hasattr(v, "__dict__") or hasattr(type(v), "__slots__"):
            state = dict(vars(v)) if hasattr(v, "__dict__") else {}
            for cls in type(v).__mro__:
                for s in getattr(cls, "__slots__", ()):
                    if s not in ("__dict__", "__weakref__") and hasattr(v, s):
                        state[s] = getattr(v, s)
            return (type(v), tuple((k, self.value(x, d)) for k, x in sorted(state.items())))
        raise _Unkeyable(type(v).__name__)

    @staticmethod
    def tensor_meta(t: torch.Tensor) -> tuple:
        """An input's fingerprint: the trace sees a fake tensor like it, not its values."""
        return ("tensor", tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type, t.requires_grad)

    def _tensor(self, t: torch.Tensor) -> tuple:
        """A tensor held by the model or the loss: a constant of the graph, so its values count."""
        meta = self.tensor_meta(t)
        if t.device.type == "meta" or type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
            return meta  # no values (meta), or a subclass whose values are not read here
        data = t.detach().contiguous().reshape(-1)
        raw = data.view(torch.uint8) if data.numel() else data
        return meta + (hashlib.blake2b(raw.cpu().numpy().tobytes(), digest_size=16).digest(),)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True

"""Materialise a model built on ``meta`` one module at a time, keeping only what a rank needs.

A model built under ``torch.device("meta")`` has shapes and no storage.
:class:`~autopar.parallel.ParallelModule` gives each rank only its own pieces (its
pipeline stages' parameters, its tp shards, its ZeRO slices) by walking the modules:

    for each module (``named_modules`` order) that directly owns a meta tensor some rank-local
    consumer wants:
        allocate the module's own meta tensors on CPU, filled with a sentinel (NaN; the
            dtype's minimum for integers)
        seed the default CPU generator with module_seed(seed, module path)
        run the module's own initialisation (below)
        hand each wanted tensor, whole, to ``take`` (which cuts the rank's piece out of it),
            check that no sentinel is left, put the meta tensors back (or keep a tensor
            ``take`` asks to keep: buffers and frozen parameters, replicated anyway)

so at most one module's tensors exist whole at a time: the peak is the largest module
(the embedding, usually), not the model. ``module.to_empty`` would materialise the whole
subtree at once; here each module's direct tensors are swapped in and out of
``_parameters``/``_buffers`` (what ``to_empty(recurse=False)`` does, without keeping them).

The module's own initialisation, in this order (each that exists runs):
    1. ``module.reset_parameters()`` (what torch.nn layers run in their constructors);
    2. ``module.init_weights()`` when it takes no arguments (torchtitan-style per module);
    3. ``init_fn(module)`` when the user passes one, else the root model's
       ``_init_weights(module)`` (Hugging Face ``PreTrainedModel`` and nanoGPT call it on
       every module through ``model.apply``).
A tensor that none of them wrote still holds the sentinel, and that is an error naming it
(the fix is an ``init_fn``); a buffer that was already real (built on CPU) is kept as it
is. An initialisation that reads other modules' tensors sees meta tensors (whose ops do
nothing), so it cannot silently write garbage either: the sentinel check catches what it
was meant to set.

RNG scheme. Each module draws from the default CPU generator seeded with
``module_seed(seed, path)``, a function of the run's seed and the module's path only, so
a module's values do not depend on which other modules a rank materialises (a pipeline
rank walks only its stages), on the plan, or on the world size: every run with the same
seed starts from the same weights, and :func:`materialize` builds exactly those weights
whole in one process (the single-device reference). They are not the values of the same
model built on CPU after ``torch.manual_seed(seed)``: that draws from one stream in
construction order, which a rank that skips other stages' modules cannot reproduce
without drawing every other parameter too.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["InitError", "materialize", "materialize_pieces", "module_seed", "is_meta"]


class InitError(ValueError):
    """A meta tensor that no initialisation wrote."""


def module_seed(seed: int, path: str) -> int:
    """The seed of module ``path``'s draws: a function of the run's seed and the path only."""
    return (int(seed) * 1_000_003 + zlib.crc32(path.encode())) % (2 ** 63)


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on ``meta``."""
    return any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


def _sentinel(t: torch.Tensor) -> torch.Tensor:
    new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    if t.dtype.is_floating_point or t.dtype.is_complex:
        new.fill_(float("nan"))
    elif t.dtype != torch.bool:
        new.fill_(torch.iinfo(t.dtype).min)
    return new


def _unwritten(t: torch.Tensor) -> bool:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False  # no value is left over in a bool: it cannot be checked
    return bool((t == torch.iinfo(t.dtype).min).any())


def _no_arg_method(module: nn.Module, name: str):
    fn = getattr(module, name, None)
    if not callable(fn):
        return None
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
           for p in params):
        return None
    return fn


def _initialise(root: nn.Module, module: nn.Module, init_fn: Callable | None) -> list[str]:
    """Run ``module``'s own initialisation (see the module docstring); the names of what ran."""
    ran = []
    for name in ("reset_parameters", "init_weights"):
        fn = _no_arg_method(module, name)
        if fn is not None:
            fn()
            ran.append(f"{type(module).__name__}.{name}()")
    if init_fn is not None:
        init_fn(module)
        ran.append("init_fn(module)")
    elif callable(getattr(root, "_init_weights", None)):
        root._init_weights(module)
        ran.append(f"{type(root).__name__}._init_weights(module)")
    return ran


def materialize_pieces(model: nn.Module, *, seed: int, want: Callable[[str], bool],
                       take: Callable[[str, torch.Tensor], bool], init_fn: Callable | None = None) -> list[str]:
    """Initialise, one module at a time, every meta tensor of ``model`` that ``want(fqn)`` selects,
    and hand it whole to ``take(fqn, tensor)`` (see the module docstring).

    ``fqn`` is the canonical name (the first of tied aliases, as ``named_parameters`` gives it).
    ``take`` returns True to keep the materialised tensor in the model (it replaces the meta
    one for good), False to drop it after ``take`` returns (the model keeps its meta tensor).
    Returns the paths of the modules materialised, in order. Raises :class:`InitError` for a
    wanted tensor that no initialisation wrote.
    """
    canonical = {id(p): n for n, p in model.named_parameters()}
    canonical.update({id(b): n for n, b in model.named_buffers()})
    done: set[int] = set()
    # id of a meta tensor -> (it, the tensor that replaced it for good); holding the meta tensor
    # keeps its id from being reused once no module refers to it
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    walked = []
    for path, module in model.named_modules():
        direct = [(n, t, True) for n, t in module._parameters.items() if t is not None]
        direct += [(n, t, False) for n, t in module._buffers.items() if t is not None]
        owned = [(n, t) for n, t, _ in direct
                 if t.device.type == "meta" and id(t) not in done and id(t) in canonical and want(canonical[id(t)])]
        if not owned:
            continue
        walked.append(path)
        saved: dict[tuple[str, bool], torch.Tensor] = {}
        for n, t, is_param in direct:
            if t.device.type != "meta":
                continue
            saved[(n, is_param)] = t
            new = _sentinel(t)
            if is_param:
                module._parameters[n] = nn.Parameter(new, requires_grad=t.requires_grad)
            else:
                module._buffers[n] = new
        keep = set()
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(module_seed(seed, path))
                ran = _initialise(model, module, init_fn)
            for n, t in owned:
                is_param = (n, True) in saved and saved[(n, True)] is t
                value = (module._parameters if is_param else module._buffers)[n]
                fqn = canonical[id(t)]
                if _unwritten(value):
                    what = "parameter" if is_param else "buffer"
                    raise InitError(
                        f"{what} {fqn!r} ({tuple(t.shape)}, {t.dtype}) of module {path or '<root>'!r} "
                        f"({type(module).__name__}) is on 'meta' and no initialisation set it "
                        f"(ran: {', '.join(ran) or 'nothing: the module has no reset_parameters, init_weights or '}"
                        f"{'' if ran else 'model._init_weights'}); pass init_fn=lambda module: ... to parallelize "
                        f"to initialise it, give {type(module).__name__} a reset_parameters() that sets it, or "
                        f"build {'the buffer on cpu (it is then kept as it is)' if not is_param else 'the model on cpu'}")
                done.add(id(t))
                if take(fqn, value.detach()):
                    keep.add((n, is_param))
                    kept[id(t)] = (t, value)
        finally:
            for (n, is_param), t in saved.items():
                if (n, is_param) in keep:
                    continue
                (module._parameters if is_param else module._buffers)[n] = t
    if kept:  # a kept tensor's tied aliases in other modules still hold the meta one: point them at it
        for module in model.modules():
            for slots in (module._parameters, module._buffers):
                for n, t in list(slots.items()):
                    if t is not None and id(t) in kept and t is kept[id(t)][0]:
                        slots[n] = kept[id(t)][1]
    return walked


def materialize(model: nn.Module, *, seed: int, init_fn: Callable | None = None) -> nn.Module:
    """Initialise every meta tensor of ``model`` on CPU, in place, with the values a meta-started
    :func:`autopar.parallelize` run of the same ``seed`` starts from (the single-device
    reference); returns ``model``. Tied parameters stay tied."""
    def take(fqn: str, value: torch.Tensor) -> bool:
        return True

    materialize_pieces(model, seed=seed, want=lambda fqn: True, take=take, init_fn=init_fn)
    return model

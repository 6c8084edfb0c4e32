"""What autopar changes about a Hugging Face model while it traces it (and restores after),
so that the graph is the model's training step as users run it:

- the key/value cache off (:func:`caches_off`);
- gated-SiLU experts modules traced through autopar's experts op (:func:`experts_as_autopar`);
- the training kernels where the modeling code keeps a slower loop for export targets
  (:func:`training_kernels`).

Each says once per model class what it did; the user's model is left as it was.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from collections.abc import Iterator

from torch import nn

log = logging.getLogger("autopar.passes.trace")  # (the trace's messages, as before this module split off)

__all__ = ["hf_training_paths", "caches_off", "experts_as_autopar", "training_kernels"]


@contextlib.contextmanager
def hf_training_paths(model: nn.Module) -> Iterator[None]:
    """All of this module's adjustments, for the duration of a trace."""
    with caches_off(model), experts_as_autopar(model), training_kernels(model):
        yield


_CACHE_NOTED: set[str] = set()


@contextlib.contextmanager
def caches_off(model: nn.Module) -> Iterator[None]:
    """Trace with Hugging Face's key/value cache off (``config.use_cache``), then restore it.

    Training never reads the cache, but with it on the model builds a cache object and
    attends over ``cat(empty cache, keys)``: tensor constants and copies that cost time
    and memory in the plan and are no part of the loss. Said once per model class.
    """
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "use_cache", False) is True}
    if configs and type(model).__name__ not in _CACHE_NOTED:
        _CACHE_NOTED.add(type(model).__name__)
        log.warning("%s has use_cache=True; autopar traces it with use_cache=False (a training step "
                    "never reads the key/value cache), your model is left as it was", type(model).__name__)
    try:
        for c in configs.values():
            c.use_cache = False
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


_EXPERTS_NOTED: set[str] = set()


@contextlib.contextmanager
def experts_as_autopar(model: nn.Module) -> Iterator[None]:
    """Trace Hugging Face's gated-SiLU experts modules through autopar's experts op
    (:func:`autopar.experts.hf_experts_forward`), then restore their forward.

    Same function of the same weights, but one op the planner recognises and the runtime runs
    under expert parallelism; whichever ``experts_implementation`` the user picked (the grouped
    matmul, or the "eager" loop over the experts that received tokens, which cannot be traced
    at all) only decides the kernel of their own eager runs. Said once per model class."""
    from autopar.experts import hf_experts_forward, hf_experts_supported

    mods = [m for m in model.modules() if hf_experts_supported(m)]
    if mods and type(model).__name__ not in _EXPERTS_NOTED:
        _EXPERTS_NOTED.add(type(model).__name__)
        log.info("%s: autopar traces the %d experts modules (%s) through autopar.experts.moe_experts "
                 "(the same gated-SiLU experts, runnable under expert parallelism); your model is left as it was",
                 type(model).__name__, len(mods), type(mods[0]).__name__)
    try:
        for m in mods:
            m.forward = types.MethodType(hf_experts_forward, m)
        yield
    finally:
        for m in mods:
            m.__dict__.pop("forward", None)


_KERNELS_NOTED: set[str] = set()


def _export_switched(module: types.ModuleType) -> list[str]:
    """Functions defined in ``module`` that choose ``torch.linalg.solve_triangular`` unless
    ``is_torchdynamo_exporting()`` says an export is running (then a loop instead). (One
    imported from elsewhere reads its own module's flag, which patching this one would not change.)"""
    out = []
    for name, f in vars(module).items():
        f = getattr(f, "__wrapped__", f)
        code = getattr(f, "__code__", None)
        if code is not None and getattr(f, "__module__", None) == module.__name__ \
                and {"is_torchdynamo_exporting", "solve_triangular"} <= set(code.co_names):
            out.append(name)
    return out


@contextlib.contextmanager
def training_kernels(model: nn.Module) -> Iterator[None]:
    """Trace the kernels the model trains with where its modeling code picks a slower form for
    export targets, by making ``is_torchdynamo_exporting()`` false in those modeling modules.

    Transformers' gated delta rule (Qwen3-Next, Qwen3.5, OLMo-Hybrid, ...) solves its
    per-chunk triangular system with ``torch.linalg.solve_triangular`` in training, but under
    ``torch.export`` (which autopar's capture is, to dynamo) with a Python loop of
    ``chunk_size - 1`` = 63 steps, kept for export targets that lack the solver (ONNX).
    autopar is not such a target: the traced graph runs as ATen ops, where the solver exists
    (forward, backward, fake tensors). The loop made each such layer about a thousand graph
    nodes, three times the trace and MIPs of 50-60k variables (Qwen3.5 tiny on 1x8xH100:
    94 CPU-s to plan with the loop, 31 without). Only modules with a function that makes
    exactly this choice are touched (others read the same flag to pick, e.g., Mamba's
    associative scan, which stays as it is)."""
    modules = {type(m).__module__ for m in model.modules()}
    switched = [(mod, names) for name in sorted(modules)
                if (mod := sys.modules.get(name)) is not None and hasattr(mod, "is_torchdynamo_exporting")
                and (names := _export_switched(mod))]
    if switched and type(model).__name__ not in _KERNELS_NOTED:
        _KERNELS_NOTED.add(type(model).__name__)
        log.info("%s: autopar traces %s with torch.linalg.solve_triangular, as it trains, not with the loop "
                 "its code keeps for export targets", type(model).__name__,
                 ", ".join(f"{mod.__name__}.{n}" for mod, names in switched for n in names))
    saved = [(mod, mod.is_torchdynamo_exporting) for mod, _ in switched]
    try:
        for mod, _ in switched:
            mod.is_torchdynamo_exporting = _not_exporting
        yield
    finally:
        for mod, original in saved:
            mod.is_torchdynamo_exporting = original


def _not_exporting() -> bool:
    return False

"""Training precision: which dtype the weights are kept in, computed in, and reduced in.

The policies follow FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``
(``param_dtype``, ``reduce_dtype``, ``cast_forward_inputs=True``):

    name                       master (optimizer)   compute (param_dtype)   gradient reduction (reduce_dtype)
    "fp32"                     the model's fp32     fp32, no casts          fp32
    "bf16-mixed"               fp32                 bf16                    fp32
    "bf16-mixed-bf16-reduce"   fp32                 bf16                    bf16 (half the dp/tp gradient bytes)

"bf16" is accepted for "bf16-mixed". Under a mixed policy every floating parameter (frozen
ones too) is cast to bf16 once per step (ZeRO 0-2) or once per gathered layer group
(ZeRO-3: the fp32 slice is cast, then all-gathered in bf16, as FSDP2 does); floating
inputs are cast to bf16 before the model sees them (the loss target is not: it is not a
model input); buffers keep their dtype. The program therefore runs in bf16 wherever the
model does not promote, its gradients come out in bf16, are summed in ``reduce_dtype``
and land in fp32 buffers, and the optimizer steps the fp32 masters.

Defaults (:func:`resolve_precision`): "bf16-mixed" on GPU clusters, what everyone
training these models uses; on ``cpu`` clusters the model's own dtype ("fp32" for an
fp32 model, "bf16-mixed" for a bf16 one: it gets fp32 masters).

Plan files made before precision policies existed record ``model["precision"]`` as
"mixed" or "fp32" (the model's own dtype, no casts): they load and run as before
(:func:`plan_precision` reads them as "as-is").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PRECISIONS", "Precision", "plan_precision", "resolve_precision"]

PRECISIONS = ("fp32", "bf16-mixed", "bf16-mixed-bf16-reduce")
"""The policies a user may ask for (plus the alias "bf16" for "bf16-mixed")."""

_ALIASES = {"bf16": "bf16-mixed"}

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """A resolved policy. ``param_dtype`` None means no casts (the model's own dtype)."""

    name: str
    """One of :data:`PRECISIONS`, or "as-is" (plan files from before policies: no casts)."""
    param_dtype: torch.dtype | None
    """Compute dtype of floating parameters and inputs; None: leave them as they are."""
    reduce_dtype: torch.dtype | None
    """Dtype of gradient collectives; None: the gradient's own dtype."""
    master_dtype: torch.dtype | None
    """Dtype of the weights the optimizer steps; None: the model's own."""

    @property
    def mixed(self) -> bool:
        return self.param_dtype is not None

    @property
    def memory_preset(self) -> str:
        """The :data:`autopar.cost.memory.PRECISIONS` entry this policy holds."""
        return {"fp32": "fp32", "as-is": "fp32"}.get(self.name, self.name)

    @property
    def compute_dtype_name(self) -> str | None:
        """"bf16" under a mixed policy (the device peak the cost model uses), else None."""
        return "bf16" if self.param_dtype is torch.bfloat16 else None


def _policy(name: str) -> Precision:
    if name == "fp32":
        return Precision(name, None, None, None)
    if name == "as-is":
        return Precision(name, None, None, None)
    reduce = torch.bfloat16 if name == "bf16-mixed-bf16-reduce" else torch.float32
    return Precision(name, torch.bfloat16, reduce, torch.float32)


def _float_param_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters() if p.is_floating_point()}


def resolve_precision(precision: str | None, *, model: torch.nn.Module, gpu_cluster: bool) -> tuple[Precision, str]:
    """The policy to plan and run ``model`` with, and why ("asked", or which default).

    Raises ``ValueError`` for an unknown name, or "fp32" on a model whose weights are not
    fp32 (fp32 means no casts; say "bf16-mixed", or convert the model with ``.float()``).
    """
    dtypes = _float_param_dtypes(model)
    if precision is None:
        if gpu_cluster:
            return _policy("bf16-mixed"), "default on a GPU cluster"
        if dtypes <= {torch.float32}:
            return _policy("fp32"), "default on a cpu cluster: the model's dtype"
        return _policy("bf16-mixed"), "default on a cpu cluster: the model's dtype is not fp32, so fp32 masters"
    if not isinstance(precision, str) or _ALIASES.get(precision, precision) not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)} "
                         f"(or 'bf16' for 'bf16-mixed')")
    name = _ALIASES.get(precision, precision)
    if name == "fp32" and not dtypes <= {torch.float32}:
        got = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise ValueError(f"precision='fp32' trains in the weights' own dtype without casts, but the model's "
                         f"weights are {got}; pass precision='bf16-mixed' (fp32 masters, bf16 compute), or "
                         f"convert the model with model.float()")
    return _policy(name), "asked"


def plan_precision(model_info: dict) -> Precision:
    """The policy a plan file's ``model`` section records; old files ("mixed", "fp32", none) run as-is."""
    name = model_info.get("precision")
    if name in PRECISIONS:
        return _policy(name)
    return _policy("as-is")


def cast_floating(tree, dtype: torch.dtype | None):
    """``tree`` (tensors in tuples, lists, dicts) with floating tensors cast to ``dtype`` (None: as is)."""
    if dtype is None:
        return tree
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() and tree.dtype != dtype else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(cast_floating(x, dtype) for x in tree)
    if isinstance(tree, dict):
        return {k: cast_floating(v, dtype) for k, v in tree.items()}
    return tree

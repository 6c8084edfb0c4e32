"""Checks on what is about to be traced for training: a model with something to train,
a non-empty batch, a target with the inputs' batch, and a loss that backward can start
from. Each mistake is an :class:`~autopar.errors.InputError` (or ``LossError``) that
names the value, raised before tracing where possible, instead of a division by zero,
a misleading trace error or a silently wrong plan later.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autopar.errors import InputError, LossError

__all__ = ["check_trainable", "checked_loss"]


def checked_loss(loss: Any) -> torch.Tensor:
    """``loss_fn``'s result, if it is a loss: backward needs one floating-point scalar."""
    if not isinstance(loss, torch.Tensor):
        raise LossError(
            f"loss_fn returned {type(loss).__name__} {loss!r}, not a tensor; it must return a scalar "
            f"tensor computed from the model's output (e.g. F.cross_entropy(output, target))")
    if loss.dim() != 0:
        raise LossError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not a scalar; reduce it to one "
            f"number (.mean(), or reduction='mean' instead of reduction='none')")
    if not loss.dtype.is_floating_point:
        raise LossError(f"loss_fn returned a {loss.dtype} scalar; a loss must be floating point to "
                        f"have gradients (compute it from the model's output)")
    return loss


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def check_trainable(model: nn.Module, names: tuple[str, ...], flat: list[Any], example_target: Any) -> None:
    """Mistakes that would otherwise surface as a division by zero or a misleading trace error."""
    if not any(p.requires_grad for p in model.parameters()):
        n = sum(p.numel() for p in model.parameters())
        what = f"all {n} of its parameters are frozen (requires_grad=False)" if n else "it has no parameters"
        raise InputError(f"{type(model).__name__} has nothing to train: {what}; autopar plans training, "
                         f"so give it at least one parameter with requires_grad=True")
    batched = [(name, x) for name, x in zip(names, flat) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not batched:
        return
    name, first = batched[0]
    batch = first.shape[0]
    if batch < 1:
        raise InputError(f"the example inputs have batch {batch} ({name} has shape {tuple(first.shape)}); "
                         f"one global batch needs at least one sample (check the batch size you build "
                         f"the inputs with, e.g. --arg batch=8)")
    for t in _tensors(example_target):
        if t.dim() > 0 and t.shape[0] != batch:
            raise InputError(
                f"example_target has shape {tuple(t.shape)}, whose dim 0 ({t.shape[0]}) differs from the "
                f"batch of the inputs ({batch}, {name} of shape {tuple(first.shape)}); autopar splits the "
                f"target with the inputs across data-parallel ranks and micro-batches, so build it with the "
                f"same batch (dim 0)")

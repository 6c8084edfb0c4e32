"""Finding and checking checkpoints on disk, before any collective (:mod:`autopar.runtime.checkpoint`).

Every check here reads files only, so every rank reaches the same verdict on its own
and a bad checkpoint is one :class:`CheckpointError` line everywhere, never a hang.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from autopar.errors import CheckpointError

FORMAT = 1
META = "autopar.json"
"""Written last by a save: a directory without it is not a (complete) checkpoint."""


@dataclass(frozen=True)
class Source:
    kind: str
    """"checkpoint" (a save_checkpoint directory), "torch" (a torch.save state dict file) or
    "safetensors" (a file, or a directory of them as save_pretrained writes)."""
    path: Path


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory in ``root`` (``step-N`` with its autopar.json), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith((".tmp", ".old"))
                  and (p / META).exists())
    return done[-1] if done else None


def resolve(path: str | os.PathLike) -> Source:
    """What ``path`` names: a checkpoint, the newest complete one in a directory of them, or whole weights."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; pass a directory written by save_checkpoint, "
                              f"a torch.save state dict or safetensors weights")
    if path.is_file():
        return Source("safetensors" if path.suffix == ".safetensors" else "torch", path)
    if (path / META).exists():
        return Source("checkpoint", path)
    if any(path.glob("*.safetensors")):
        return Source("safetensors", path)
    newest = latest(path)
    if newest is not None:
        return Source("checkpoint", newest)
    partial = [path.name] if (path / ".metadata").exists() else sorted(p.name for p in path.glob("step-*"))
    if partial:
        raise CheckpointError(f"checkpoint {path} is incomplete: no {META} (written last) in {', '.join(partial)}; "
                              f"the save was interrupted: load an earlier checkpoint")
    raise CheckpointError(f"{path} holds no checkpoint (no {META}, no step-* directory, no .safetensors file); "
                          f"pass the directory given to save_checkpoint")


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {META} cannot be read ({e}); the checkpoint is damaged, "
                              f"load an earlier one") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')!r}, this autopar reads format "
                              f"{FORMAT}")
    return meta


def check_files(path: Path, meta: dict) -> None:
    """Every file the save wrote is there, at the size it was written."""
    missing, short = [], []
    for name, size in sorted(meta["files"].items()):
        f = path / name
        if not f.exists():
            missing.append(name)
        elif f.stat().st_size != size:
            short.append(f"{name} has {f.stat().st_size} bytes, the save wrote {size}")
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing {len(missing)} of its {len(meta['files'])} files "
                              f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); copy them back "
                              f"or load an earlier checkpoint")
    if short:
        raise CheckpointError(f"checkpoint {path} is truncated: {'; '.join(short[:3])}; load an earlier checkpoint")


def _shape(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def check_names_and_shapes(path: Path, saved: dict[str, list[int]], model: torch.nn.Module, what: str,
                           whole: dict[str, list[int]] | None = None) -> None:
    """The saved parameters are this model's, with this model's shapes (``whole``: the whole
    shapes of parameters the model holds a part of, e.g. its experts under expert parallelism)."""
    mine = {f: list(p.shape) for f, p in model.named_parameters()} | (whole or {})
    absent = [f for f in mine if f not in saved]
    if absent:
        extra = [f for f in saved if f not in mine]
        raise CheckpointError(
            f"{what} {path} is of another model: {len(absent)} of this {type(model).__name__}'s {len(mine)} "
            f"parameters are not in it (e.g. {absent[0]!r})"
            + (f" and {len(extra)} of its are not in this model (e.g. {extra[0]!r})" if extra else "")
            + "; load a checkpoint of this model")
    differ = [f for f in mine if list(saved[f]) != mine[f]]
    if differ:
        f = differ[0]
        raise CheckpointError(f"{what} {path} holds {f} with shape {_shape(saved[f])}, this model's is "
                              f"{_shape(mine[f])} ({len(differ)} parameter(s) differ); build the model with the "
                              f"checkpoint's sizes")


def check_model(path: Path, meta: dict, model: torch.nn.Module, *, optimizer: str | None,
                whole: dict[str, list[int]] | None = None) -> None:
    check_names_and_shapes(path, meta["params"], model, "checkpoint", whole)
    if optimizer is not None and meta["optimizer"] != optimizer:
        raise CheckpointError(f"checkpoint {path} holds {meta['optimizer']} state, this run's optimizer is a "
                              f"{optimizer}; use the same optimizer, or export the weights and load them alone")


def full_source(src: Source, model: torch.nn.Module, whole: dict[str, list[int]] | None = None
                ) -> dict[str, Callable[[tuple[slice, ...]], torch.Tensor]]:
    """Per parameter name of ``model``, a function reading a box of the whole tensor from ``src``
    (safetensors and mmap'ed torch.save files read only the bytes asked for); ``whole`` as in
    :func:`check_names_and_shapes`."""
    if src.kind == "torch":
        try:
            sd = torch.load(src.path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as e:
            raise CheckpointError(f"{src.path} is not a torch.save state dict that can be read ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); the file may be truncated") from None
        if not isinstance(sd, dict):
            raise CheckpointError(f"{src.path} holds a {type(sd).__name__}, not a state dict")
        getters = {k: (lambda box, t=t: t[box]) for k, t in sd.items() if isinstance(t, torch.Tensor)}
        shapes = {k: list(t.shape) for k, t in sd.items() if isinstance(t, torch.Tensor)}
    else:
        from safetensors import safe_open

        files = [src.path] if src.path.is_file() else sorted(src.path.glob("*.safetensors"))
        getters, shapes = {}, {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as e:
                raise CheckpointError(f"{f} cannot be read as safetensors ({e}); the file may be truncated") from None
            for k in handle.keys():
                sl = handle.get_slice(k)
                getters[k] = lambda box, sl=sl: sl[box]
                shapes[k] = list(sl.get_shape())
    canonical = {id(p): f for f, p in model.named_parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):  # tied weights saved under another name
        f = canonical[id(p)]
        if f not in shapes and name in shapes:
            shapes[f], getters[f] = shapes[name], getters[name]
    check_names_and_shapes(src.path, shapes, model, "weights", whole)
    return getters

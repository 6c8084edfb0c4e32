"""Sharded checkpoints on torch.distributed.checkpoint (DCP): save under one plan, load under any other.

    pm.save_checkpoint("ckpt", keep=3, state={"data": sampler})    # ckpt/step-00000003, published when complete
    pm.load_checkpoint("ckpt", state={"data": sampler})            # the newest complete one in ckpt/
    pm = autopar.parallelize(model, ..., resume_from="ckpt")        # the same, before the first step
    export_state_dict("ckpt", "model.pt")                           # one plain torch.save state dict
    pm.load_checkpoint("model.pt")   # or a safetensors file, or a save_pretrained directory

On disk (``DIR/step-00000005``)::

    .metadata, __<rank>_0.distcp    DCP: each rank writes the chunks it owns, in parallel
    rank-00000.pt ...               each rank's RNG states and the user's ``state`` objects
    autopar.json                    written last: step, plan, parameter shapes, every file's size

DCP keys are ``model/<fqn>`` (the names of ``model.state_dict()``), ``optim/<fqn>/<name>``
for the optimizer's state of that parameter (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``)
and ``buffer/<name>``. A parameter's shards are DTensors on the (dp, tp) mesh, so DCP's own
planner reshards on load: any plan, any world size.

ZeRO chunks. Under ZeRO-1/2/3 the optimizer (and at ZeRO-3 the parameter) holds one of
``dp`` equal chunks of the *flattened* tp shard. That is not a DTensor placement: a chunk
of a row-major (rows, cols) shard is a partial row, whole rows and a partial row. Rather
than gather the chunks back into tp shards before saving (dp times the memory and a
collective per save) or saving the flat layout (readable only under the same plan),
:class:`FlatShard` describes the chunk to DCP as those rectangular boxes of the whole
tensor, with DCP's own chunk metadata (``ChunkStorageMetadata``). Each box is contiguous
in the chunk, so saving writes views and loading copies into views: no gather, every
rank writes and reads only what it holds, and the files are the same whatever the plan.

Experts under expert parallelism. A rank holds E/ep of a stacked expert parameter's rows
(dim 0; :mod:`autopar.runtime.expert`), the same rows as its replicas: the rank's tp shard
of its part is one box of the whole (E, ...) tensor, described to DCP like a ZeRO chunk
(:class:`FlatShard`), so the files hold the whole experts (replicas write their box once,
DCP dropping the duplicates) and load under any plan, with or without ep.

Nothing lost: a save writes into ``step-N.tmp``; when DCP has finished on every rank
(its ``.metadata`` is written after all data), rank 0 writes ``autopar.json`` with every
file's size, fsyncs and renames the directory to ``step-N``. Loading checks the sizes, the
parameter names and shapes before reading, so a truncated file, a missing file, an
interrupted save, another model or changed shapes is one :class:`CheckpointError` line on
every rank, not a hang or a partial load.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import threading
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate

from autopar.errors import CheckpointError
from autopar.runtime.checkpoint_io import (FORMAT, META, check_files, check_model, full_source, latest,
                                           read_meta, resolve)

log = logging.getLogger(__name__)

__all__ = ["FlatShard", "SaveHandle", "flat_boxes", "save", "load", "export_state_dict", "latest"]


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [start, stop) of a row-major tensor of ``shape`` as rectangular boxes.

    Each box is ``(offsets, sizes, flat_start)``: one index fixed on the leading dims, a
    range on one dim, every trailing dim whole, so each box is contiguous and starts at
    ``flat_start`` in the flattened tensor. At most ``2 * len(shape) - 1`` boxes.
    """
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (stop - start,) * len(shape), start)]
    inner = 1
    for d in shape[1:]:
        inner *= d
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # inside one row: recurse into it
        return [((first, *o), (1, *s), first * inner + f)
                for o, s, f in flat_boxes(shape[1:], start - first * inner, stop - first * inner)]
    out = []
    if start % inner:  # the partial first row
        out += [((first, *o), (1, *s), first * inner + f) for o, s, f in flat_boxes(shape[1:], start % inner, inner)]
        first += 1
    end = stop // inner  # rows [first, end) are whole
    if end > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (end - first, *shape[1:]), first * inner))
    if stop % inner:  # the partial last row
        out += [((end, *o), (1, *s), end * inner + f) for o, s, f in flat_boxes(shape[1:], 0, stop % inner)]
    return out


class FlatShard:
    """A flat ZeRO chunk shown to DCP as boxes of the whole tensor (DCP's ``_Checkpointable``
    protocol: ``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``).

    ``data`` is the chunk (1-D); ``boxes`` are ``(global offsets, sizes, start in data)``.
    """

    def __init__(self, data: torch.Tensor, shape: torch.Size, boxes: list[tuple[tuple, tuple, int]]):
        self.data, self.shape = data, torch.Size(shape)
        self.boxes = [(torch.Size(o), torch.Size(s), start) for o, s, start in boxes]

    def size(self) -> torch.Size:  # DCP's load planner compares this with the saved size
        return self.shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.data)
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=o, sizes=s),
                                                      properties=props, size=self.shape))
                for o, s, _ in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for o, s, start in self.boxes:
            if o == index.offset:
                return self.data[start: start + s.numel()].view(s)
        raise ValueError(f"no chunk of {index.fqn} at offset {tuple(index.offset)} on this rank")


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner; only the look-up of a chunk learns about :class:`FlatShard` (DCP's own
    look-up returns non-Tensor objects whole)."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if isinstance(obj, FlatShard) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's set-up (_init_state_dict) replaces values of types it does not know with None,
        # in place: put the FlatShards back (the dict is flat, so the keys are unchanged).
        flat = {k: v for k, v in state_dict.items() if isinstance(v, FlatShard)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for d in (state_dict, self.state_dict, self.original_state_dict):
            d.update(flat)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if isinstance(obj, FlatShard) else super().lookup_tensor(index)


# -- the state dict of a ParallelModule --------------------------------------------------

def _placements(shard, mesh) -> list:
    """The parameter's (dp, tp) placements. A plan may say "P" for a parameter on a tp axis of
    size 1 (any placement is exact there); DCP refuses Partial, and Replicate is the same thing."""
    from torch.distributed.tensor import Partial

    from autopar.passes.shard import placement

    tp = placement(shard.tp_placement)
    if isinstance(tp, Partial):
        if mesh.size(1) != 1:
            raise CheckpointError(f"a parameter of shape {tuple(shard.shape)} is held Partial on a tp axis of "
                                  f"size {mesh.size(1)}; autopar cannot checkpoint a parameter stored as a sum")
        tp = Replicate()
    return [Replicate(), tp]


def _expert_parts(pm) -> dict[str, tuple[int, torch.Size]]:
    """Per expert parameter this rank holds a part of (expert parallelism, once the model is cut):
    (the dim-0 offset of its rows in the whole parameter, the whole shape)."""
    ep, params = getattr(pm, "ep", 1), getattr(pm, "params", None)
    if ep <= 1 or params is None or not pm._compiled:
        return {}
    if pm.plan.ep_over_tp:  # (etp=1: cut to ep / tp dp parts, the
        ep //= pm.plan.mesh["tp"]                                  # tp split is the parameter's placement)
        if ep == 1:
            return {}
    part = pm.mesh.get_local_rank(0) % ep  # (the part autopar.parallel cut this rank's experts to)
    out = {}
    for fqn in params.experts:
        rows = params.entries[fqn].shape
        out[fqn] = (part * rows[0], torch.Size((rows[0] * ep, *rows[1:])))
    return out


def _whole_shapes(pm) -> dict[str, list[int]]:
    """Whole shapes of the parameters ``pm``'s model holds a part of (its experts under ep)."""
    return {fqn: list(whole) for fqn, (_, whole) in _expert_parts(pm).items()}


def _boxes(shard, mesh, shift: int = 0) -> list[tuple[tuple, tuple, int]]:
    """The boxes of the whole parameter this rank's optimizer tensor holds: (offsets, sizes, start
    in the flattened tensor); ``shift`` moves them along dim 0 (an expert part's rows)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    pls = _placements(shard, mesh)
    _, offset = compute_local_shape_and_global_offset(shard.shape, mesh, pls)  # the tp shard's corner
    offset = (offset[0] + shift, *offset[1:]) if offset else offset
    if shard.flat_range is None:
        return [(tuple(offset), tuple(shard.local_shape), 0)]
    start, stop = shard.flat_range
    return [(tuple(a + b for a, b in zip(o, offset)), s, f - start)
            for o, s, f in flat_boxes(tuple(shard.local_shape), start, stop)]


def _layout(shard, tensor: torch.Tensor, mesh, expert: tuple[int, torch.Size] | None = None) -> DTensor | FlatShard:
    """``tensor`` (the optimizer's parameter or one of its state tensors) as DCP sees it;
    ``expert``: (dim-0 offset, whole shape) of an expert part (:func:`_expert_parts`)."""
    if shard.flat_range is None and expert is None:
        stride = torch.empty(shard.shape, device="meta").stride()
        return DTensor.from_local(tensor, mesh, _placements(shard, mesh), run_check=False, shape=shard.shape,
                                  stride=stride)
    shift, whole = expert or (0, shard.shape)
    if not tensor.is_contiguous():  # (loading writes into views of it)
        raise CheckpointError(f"a parameter part of shape {tuple(tensor.shape)} is not contiguous; autopar "
                              f"cannot describe it to DCP")
    return FlatShard(tensor.reshape(-1), whole, _boxes(shard, mesh, shift))


def _state_dict(pm, *, metadata=None, copy: bool = False) -> tuple[dict[str, Any], dict]:
    """The DCP state dict of ``pm`` (views into its live tensors, or copies with ``copy``) and,
    for loading, the optimizer state tensors to install (``metadata``: the checkpoint's, to
    create the state an optimizer that has not stepped yet lacks)."""
    out: dict[str, Any] = {}
    install: dict = {}
    clone = (lambda t: t.detach().clone()) if copy else (lambda t: t.detach())
    experts = _expert_parts(pm)
    for fqn in pm.params.entries:
        shard = pm.params.optimizer_shard(fqn)
        out[f"model/{fqn}"] = _layout(shard, clone(shard.param), pm.mesh, experts.get(fqn))
        state = dict(pm.optimizer.state.get(shard.param, {}))
        if metadata is not None and not state:  # a fresh optimizer: create the state to load into
            prefix = f"optim/{fqn}/"
            for key, md in metadata.state_dict_metadata.items():
                if not key.startswith(prefix):
                    continue
                if isinstance(md, TensorStorageMetadata) and md.size == shard.shape:
                    state[key[len(prefix):]] = torch.zeros_like(shard.param, dtype=md.properties.dtype)
                elif isinstance(md, TensorStorageMetadata) and fqn in experts and md.size == experts[fqn][1]:
                    state[key[len(prefix):]] = torch.zeros_like(shard.param, dtype=md.properties.dtype)
                elif isinstance(md, TensorStorageMetadata):
                    state[key[len(prefix):]] = torch.zeros(md.size, dtype=md.properties.dtype)
                else:
                    state[key[len(prefix):]] = None  # a Python object: DCP puts it in the dict
            install[shard.param] = state
        for name, value in state.items():
            key = f"optim/{fqn}/{name}"
            if isinstance(value, torch.Tensor) and value.shape == shard.param.shape and value.dim() > 0:
                out[key] = _layout(shard, clone(value), pm.mesh, experts.get(fqn))
            else:
                out[key] = clone(value) if isinstance(value, torch.Tensor) else value
    for name, buf in pm.model.named_buffers():
        out[f"buffer/{name}"] = clone(buf)
    return out, install


def _rng_state() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_GROUPS: dict[int, Any] = {}


def _async_group(timeout_s: float):
    """A gloo group of its own for asynchronous saves, so their collectives (in a thread) never
    interleave with training's on the default group. Synchronous saves and loads use the
    default group: creating a group on every restart of a torchrun job (while its peer may
    still be starting) is one more rendezvous that can fail."""
    key = id(dist.group.WORLD)
    if key not in _GROUPS:
        _GROUPS.clear()
        _GROUPS[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return _GROUPS[key]


# -- save ---------------------------------------------------------------------------------

class SaveHandle:
    """A save in progress (or done): ``wait()`` returns the published directory or raises."""

    def __init__(self, path: Path, future: Future):
        self.path, self._future = path, future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> Path:
        self._future.result()
        return self.path


def save(pm, root: str | os.PathLike, *, state: dict | None = None, async_save: bool = False,
         keep: int | None = None) -> SaveHandle:
    """Write ``pm``'s checkpoint at its current step into ``root/step-NNNNNNNN`` (every rank calls
    this); see the module docstring. With ``async_save`` the tensors are copied first and
    written in a thread while training goes on; otherwise this returns when it is published."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive number of checkpoints to keep, got {keep!r}")
    for name, obj in (state or {}).items():
        if not hasattr(obj, "state_dict") or not hasattr(obj, "load_state_dict"):
            raise TypeError(f"state[{name!r}] is a {type(obj).__name__}, which has no state_dict/load_state_dict; "
                            f"pass objects such as a sampler or data loader that have both")
    _wait_for_saves()  # one save at a time on the checkpoint group
    group = _async_group(pm.timeout_s) if async_save else None
    rank = dist.get_rank()
    root = Path(root)
    final = root / f"step-{pm.steps:08d}"
    tmp = root / f"step-{pm.steps:08d}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir()
    dist.barrier(group=group)
    torch.save({"rng": _rng_state(), "state": {k: v.state_dict() for k, v in (state or {}).items()}},
               tmp / f"rank-{rank:05d}.pt")
    sd, _ = _state_dict(pm, copy=async_save)
    meta = {"format": FORMAT, "step": pm.steps, "world": dist.get_world_size(), "plan": pm.plan.to_json(),
            "model": type(pm.model).__name__, "optimizer": type(pm.optimizer).__name__,
            "params": {f: list(p.shape) for f, p in pm.model.named_parameters()} | _whole_shapes(pm),
            "aliases": _aliases(pm.model)}

    def write() -> None:
        dcp.save(sd, storage_writer=FileSystemWriter(tmp), planner=_SavePlanner(), process_group=group)
        if rank == 0:
            _publish(tmp, final, meta, root, keep)
        dist.barrier(group=group)  # published for everyone when save returns

    future: Future = Future()
    if not async_save:
        with pm._guard(f"saving checkpoint {final} (DCP's plan exchange and barriers)"):
            write()
        future.set_result(final)
        return SaveHandle(final, future)

    def run() -> None:
        try:
            write()
            future.set_result(final)
        except BaseException as e:  # handed to wait()
            future.set_exception(e)

    threading.Thread(target=run, name=f"autopar-save-{pm.steps}", daemon=True).start()
    handle = SaveHandle(final, future)
    _IN_FLIGHT.append(handle)
    return handle


_IN_FLIGHT: list[SaveHandle] = []


def _wait_for_saves() -> None:
    """Finish every asynchronous save still writing (their collectives share the checkpoint group)."""
    while _IN_FLIGHT:
        _IN_FLIGHT.pop(0).wait()


def _aliases(model) -> dict[str, str]:
    """Tied parameters' other names (``lm_head.weight`` -> ``transformer.wte.weight``)."""
    canonical = {id(p): f for f, p in model.named_parameters()}
    return {f: canonical[id(p)] for f, p in model.named_parameters(remove_duplicate=False)
            if canonical[id(p)] != f}


def _publish(tmp: Path, final: Path, meta: dict, root: Path, keep: int | None) -> None:
    """Record every file's size in autopar.json (written last), then rename the directory into view."""
    meta = {**meta, "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}}
    with open(tmp / META, "w") as f:
        json.dump(meta, f, sort_keys=True, indent=1)
        f.flush()
        os.fsync(f.fileno())
    old = final.with_name(final.name + ".old")
    if final.exists():  # the same step saved again: replace it
        final.rename(old)
    tmp.rename(final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power cut
    finally:
        os.close(fd)
    shutil.rmtree(old, ignore_errors=True)
    if keep is not None:
        done = sorted(p for p in root.glob("step-*") if p.is_dir() and (p / META).exists()
                      and not p.name.endswith((".tmp", ".old")))
        for p in done[:-keep]:
            log.info("removing old checkpoint %s (keep=%d)", p, keep)
            shutil.rmtree(p, ignore_errors=True)


# -- load ---------------------------------------------------------------------------------

def load(pm, path: str | os.PathLike, *, state: dict | None = None) -> None:
    """Check ``path`` and restore what needs no plan at once (step, RNG, ``state`` objects);
    the shards load now if ``pm`` is compiled, else before its first step (:func:`load_shards`)."""
    src = resolve(path)
    if src.kind == "checkpoint":
        meta = read_meta(src.path)
        check_files(src.path, meta)
        check_model(src.path, meta, pm.model, optimizer=None, whole=_whole_shapes(pm))
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        own = src.path / f"rank-{rank:05d}.pt"
        extra = torch.load(own if own.exists() else src.path / "rank-00000.pt", weights_only=False)
        _set_rng_state(extra["rng"])
        for name, obj in (state or {}).items():
            if name not in extra["state"]:
                raise CheckpointError(f"checkpoint {src.path} has no state {name!r} (it has "
                                      f"{sorted(extra['state']) or 'none'}); save it with state={{{name!r}: ...}}")
            obj.load_state_dict(extra["state"][name])
        pm.steps = meta["step"]
    else:
        pm.steps = 0
    pm._pending_checkpoint = src
    if pm._compiled:
        load_shards(pm)


def load_shards(pm) -> None:
    """Load the pending checkpoint's shards into the compiled ``pm`` (a collective)."""
    src, pm._pending_checkpoint = pm._pending_checkpoint, None
    if src is None:
        return
    _wait_for_saves()
    with torch.no_grad():
        if src.kind == "checkpoint":
            meta = read_meta(src.path)
            check_model(src.path, meta, pm.model, optimizer=type(pm.optimizer).__name__, whole=_whole_shapes(pm))
            reader = FileSystemReader(src.path)
            sd, install = _state_dict(pm, metadata=reader.read_metadata())
            sd = {k: v for k, v in sd.items() if not k.startswith("buffer/")}
            with pm._guard(f"loading checkpoint {src.path} (DCP's plan exchange)"):
                dcp.load(sd, storage_reader=reader, planner=_LoadPlanner(), process_group=None)
            for param, state in install.items():
                pm.optimizer.state[param] = state
            for key, value in sd.items():  # Python objects and 0-dim tensors come back by key
                if key.startswith("optim/") and not isinstance(value, (DTensor, FlatShard)):
                    fqn, name = key[len("optim/"):].rsplit("/", 1)
                    pm.optimizer.state[pm.params.optimizer_shard(fqn).param][name] = value
            buffers = {name: buf for name, buf in pm.model.named_buffers()}
            buf_sd = {f"buffer/{n}": b for n, b in buffers.items()
                      if f"buffer/{n}" in reader.read_metadata().state_dict_metadata}
            if buf_sd:
                dcp.load(buf_sd, storage_reader=FileSystemReader(src.path), process_group=None)
        else:
            _load_full(pm, src)
        pm.params.after_step()  # ZeRO-1/2: every rank's parameters whole again from the loaded chunks
    log.info("loaded %s into the %s plan (step %d)", src.path, pm.plan.mesh, pm.steps)


def _load_full(pm, src) -> None:
    """Whole tensors (torch.save, safetensors): each rank copies only the boxes it holds."""
    experts = _expert_parts(pm)
    tensors = full_source(src, pm.model, _whole_shapes(pm))
    for fqn in pm.params.entries:
        shard = pm.params.optimizer_shard(fqn)
        get = tensors[fqn]
        boxes = _boxes(shard, pm.mesh, experts.get(fqn, (0, None))[0])
        flat = shard.param.data.reshape(-1)
        for o, s, start in boxes:
            n = 1
            for d in s:
                n *= d
            flat[start: start + n].copy_(get(tuple(slice(a, a + b) for a, b in zip(o, s))).reshape(-1))
        pm.optimizer.state.pop(shard.param, None)  # weights only: the optimizer starts fresh


# -- export -------------------------------------------------------------------------------

def export_state_dict(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write checkpoint ``path`` (or the newest in it) as one ``torch.save`` state dict with
    ``model.state_dict()`` keys, in this process (no process group needed)."""
    src = resolve(path)
    if src.kind != "checkpoint":
        raise CheckpointError(f"{path} is not an autopar checkpoint directory (it is a {src.kind} file); "
                              f"export reads a directory written by save_checkpoint")
    meta = read_meta(src.path)
    check_files(src.path, meta)
    reader = FileSystemReader(src.path)
    sd: dict[str, Any] = {}
    for key, md in reader.read_metadata().state_dict_metadata.items():
        if key.startswith(("model/", "buffer/")) and not isinstance(md, BytesStorageMetadata):
            sd[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(sd, storage_reader=reader, no_dist=True)
    state = {k.split("/", 1)[1]: v for k, v in sd.items()}
    for alias, canonical in meta.get("aliases", {}).items():
        state[alias] = state[canonical]
    out = Path(out)
    torch.save(state, out)
    return out

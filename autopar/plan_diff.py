"""What changed between two plans: ``autopar diff`` and golden-plan tests.

``diff_plans(old, new, rtol=...)`` compares two :class:`~autopar.plan.Plan` s
field by field and returns a :class:`PlanDiff`, a tuple of :class:`Change` s in
groups; ``PlanDiff.render()`` prints one line per change, ``old -> new``.

What is compared, by group:

- ``model and cluster``: model name, graph hash, parameters, global batch,
  precision; the cluster spec and device figures.
- ``configuration``: mesh axes, schedule (kind, micro-batches, micro-batch
  size), ZeRO stage, recompute, the pinned decisions.
- ``stages``: how many, the layers each holds, their devices and predicted
  time and memory.
- ``layers``: each layer's class, count and signature; each parameter's
  placement on the tp axis and its shape.
- ``ops``: each op node's layer, phase and output/input placements on tp.
- ``predicted``: step time, bubble, FLOPs, MFU, peak memory, tokens/s.
- ``communication``: count, bytes and time of each collective on each axis.
- ``solver``: the sharding MIP's status and objective.

Not compared: the runners-up and search statistics (how the search went, not
what it chose), ``autopar_version`` and the planner's wall times.

Predicted quantities are floats that move in their last digits between torch
versions, so two floats are equal when ``|a - b| <= rtol * max(|a|, |b|)``;
everything else (integers, strings, placements, layer lists) must match
exactly, and any such change is a difference whatever the tolerance.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from autopar.errors import PlanError
from autopar.fmt import fmt_bytes, fmt_s
from autopar.plan import Plan

__all__ = ["ABSENT", "Change", "PlanDiff", "diff_plans", "load_plan_file", "DEFAULT_RTOL"]

DEFAULT_RTOL = 0.01

GROUPS = ("model and cluster", "configuration", "stages", "layers", "ops", "predicted", "communication", "solver")


class _Absent:
    """The value on the side of a change where the entry does not exist."""

    def __repr__(self) -> str:
        return "absent"


ABSENT = _Absent()


@dataclass(frozen=True, kw_only=True)
class Change:
    group: str
    """One of ``GROUPS``."""
    item: str
    """What changed: ``mesh.tp``, ``stage 1 layers``, a parameter's name, ``addmm_3 out``."""
    old: Any
    new: Any
    """The values on each side (``ABSENT`` where the entry does not exist)."""

    @property
    def relative(self) -> float | None:
        """(new - old) / |old| for two numbers, else None."""
        if _is_number(self.old) and _is_number(self.new) and self.old != 0:
            return (self.new - self.old) / abs(self.old)
        return None


@dataclass(frozen=True, kw_only=True)
class PlanDiff:
    changes: tuple[Change, ...]
    rtol: float
    """Relative tolerance the floats were compared with."""

    @property
    def equal(self) -> bool:
        return not self.changes

    def by_group(self) -> dict[str, list[Change]]:
        out: dict[str, list[Change]] = {}
        for c in self.changes:
            out.setdefault(c.group, []).append(c)
        return out

    def render(self, *, old_label: str = "old", new_label: str = "new", limit: int = 20) -> str:
        """One line per change, grouped; at most ``limit`` lines per group (0: all)."""
        tol = f"relative tolerance {self.rtol:g}"
        if self.equal:
            return f"plans match ({old_label} -> {new_label}, {tol})"
        groups = self.by_group()
        counts = ", ".join(f"{g} {len(cs)}" for g, cs in groups.items())
        lines = [f"plans differ ({old_label} -> {new_label}, {tol}): {len(self.changes)} changes ({counts})"]
        for group, changes in groups.items():
            lines.append(f"{group}:")
            shown = changes if limit <= 0 else changes[:limit]
            lines += [f"  {_render_change(c)}" for c in shown]
            if len(shown) < len(changes):
                lines.append(f"  ... and {len(changes) - len(shown)} more {group} changes")
        return "\n".join(lines)


def load_plan_file(path: str | os.PathLike) -> Plan:
    """``Plan.load`` whose errors name the file (one line, a PlanError)."""
    try:
        return Plan.load(path)
    except OSError as e:
        raise PlanError(f"cannot read plan file {str(path)!r}: {e.strerror or e}") from None
    except PlanError as e:
        message = str(e)
        if message.startswith(repr(str(path))):  # Plan.load named the file already
            raise
        raise PlanError(f"{str(path)!r} is not an autopar plan file: {message}") from None
    except (ValueError, TypeError, AttributeError, KeyError) as e:  # a shape the structural check missed
        raise PlanError(f"{str(path)!r} is not an autopar plan file: {e}") from None


def diff_plans(old: Plan, new: Plan, *, rtol: float = DEFAULT_RTOL) -> PlanDiff:
    """Every difference between ``old`` and ``new`` beyond ``rtol`` (see the module docstring)."""
    if not (isinstance(rtol, (int, float)) and rtol >= 0 and math.isfinite(rtol)):
        raise ValueError(f"tolerance must be a finite number >= 0, got {rtol!r}")
    a, b = old.to_dict(), new.to_dict()  # rounded the way plan files are, so fresh plans compare like saved ones
    changes = []
    changes += _group("model and cluster", _leaves({"model": a["model"], "cluster": a["cluster"]},
                                                   {"model": b["model"], "cluster": b["cluster"]}, "", rtol))
    config = ("mesh", "schedule", "zero", "recompute", "fixed")
    changes += _group("configuration", _leaves({k: a[k] for k in config}, {k: b[k] for k in config}, "", rtol))
    changes += _group("stages", _stage_changes(a["stages"], b["stages"], rtol))
    changes += _group("layers", _layer_changes(a["layers"], b["layers"], rtol))
    changes += _group("ops", _op_changes(a["ops"], b["ops"], _layer_order(a, b), rtol))
    # predicted.step holds the step program's inputs (per-layer-group times and bytes): what
    # they change shows in the step time, the stage times and predicted.overlap
    changes += _group("predicted", _leaves({k: v for k, v in a["predicted"].items() if k != "step"},
                                           {k: v for k, v in b["predicted"].items() if k != "step"}, "", rtol))
    changes += _group("communication", _comm_changes(a["communication"], b["communication"], rtol))
    solver = ("status", "objective")
    changes += _group("solver", _leaves({k: a["solver"].get(k, ABSENT) for k in solver},
                                        {k: b["solver"].get(k, ABSENT) for k in solver}, "", rtol))
    return PlanDiff(changes=tuple(changes), rtol=float(rtol))


# -- comparing ----------------------------------------------------------------


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _same(x: Any, y: Any, rtol: float) -> bool:
    if _is_number(x) and _is_number(y) and (isinstance(x, float) or isinstance(y, float)):
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) and math.isnan(y)
        return x == y or math.isclose(x, y, rel_tol=rtol, abs_tol=0.0)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(u, v, rtol) for u, v in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k], rtol) for k in x)
    if _is_number(x) and _is_number(y):
        return x == y
    return type(x) is type(y) and x == y


def _leaves(old: Any, new: Any, path: str, rtol: float) -> Iterator[tuple[str, Any, Any]]:
    """(dotted path, old, new) for each leaf that differs; dicts are walked, lists compared whole."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=str):
            yield from _leaves(old.get(k, ABSENT), new.get(k, ABSENT), f"{path}.{k}" if path else str(k), rtol)
    elif not _same(old, new, rtol):
        yield path, old, new


def _group(group: str, rows) -> list[Change]:
    return [Change(group=group, item=item, old=o, new=n) for item, o, n in rows]


def _stage_changes(old: list, new: list, rtol: float) -> Iterator[tuple[str, Any, Any]]:
    if len(old) != len(new):
        yield "count", len(old), len(new)
    for i in range(max(len(old), len(new))):
        s = old[i] if i < len(old) else ABSENT
        t = new[i] if i < len(new) else ABSENT
        if s is ABSENT or t is ABSENT:
            yield f"stage {i} layers", s if s is ABSENT else s["layers"], t if t is ABSENT else t["layers"]
            continue
        for key in ("layers", "devices"):
            if s.get(key) != t.get(key):
                yield f"stage {i} {key}", s.get(key, ABSENT), t.get(key, ABSENT)
        yield from _leaves(s.get("predicted", {}), t.get("predicted", {}), f"stage {i} predicted", rtol)


def _layer_changes(old: dict, new: dict, rtol: float) -> Iterator[tuple[str, Any, Any]]:
    for path in sorted(set(old) | set(new)):
        x, y = old.get(path, ABSENT), new.get(path, ABSENT)
        if x is ABSENT or y is ABSENT:
            yield f"layer {path}", _layer_word(x), _layer_word(y)
            continue
        for key in ("class", "count", "signature", "n_params"):
            if not _same(x.get(key), y.get(key), rtol):
                yield f"layer {path} {key}", x.get(key, ABSENT), y.get(key, ABSENT)
        px, py = x.get("params", {}), y.get("params", {})
        sx, sy = x.get("param_shapes", {}), y.get("param_shapes", {})
        for fqn in sorted(set(px) | set(py)):
            if px.get(fqn, ABSENT) != py.get(fqn, ABSENT):
                yield fqn, px.get(fqn, ABSENT), py.get(fqn, ABSENT)
            if fqn in px and fqn in py and sx.get(fqn) != sy.get(fqn):
                yield f"{fqn} shape", sx.get(fqn, ABSENT), sy.get(fqn, ABSENT)


def _layer_word(layer: Any) -> Any:
    return layer if layer is ABSENT else f"{layer.get('class')} x{layer.get('count')}"


def _layer_order(a: dict, b: dict) -> dict[str, int]:
    """Layer path -> its position in the model (the stages list layers in order)."""
    order: dict[str, int] = {}
    for plan in (a, b):
        for stage in plan["stages"]:
            for path in stage.get("layers", []):
                order.setdefault(path, len(order))
    return order


def _op_changes(old: dict, new: dict, order: dict[str, int], rtol: float) -> Iterator[tuple[str, Any, Any]]:
    def position(name: str) -> tuple:
        op = old.get(name) or new.get(name)
        return order.get(op.get("layer"), len(order)), op.get("index", 0), name

    for name in sorted(set(old) | set(new), key=position):
        x, y = old.get(name, ABSENT), new.get(name, ABSENT)
        if x is ABSENT or y is ABSENT:
            yield f"{name}", _op_word(x), _op_word(y)
            continue
        where = f"{name} ({x.get('layer')}, {x.get('phase')})"
        for key in ("out", "in", "layer", "phase"):
            if not _same(x.get(key), y.get(key), rtol):
                yield f"{where} {key}", x.get(key, ABSENT), y.get(key, ABSENT)


def _op_word(op: Any) -> Any:
    return op if op is ABSENT else f"op in {op.get('layer')} ({op.get('phase')})"


def _comm_changes(old: dict, new: dict, rtol: float) -> Iterator[tuple[str, Any, Any]]:
    for kind in sorted(set(old) | set(new)):
        axes_old, axes_new = old.get(kind, {}), new.get(kind, {})
        for axis in sorted(set(axes_old) | set(axes_new)):
            x, y = axes_old.get(axis, ABSENT), axes_new.get(axis, ABSENT)
            if x is ABSENT or y is ABSENT:
                yield f"{kind} on {axis}", _comm_word(x), _comm_word(y)
            else:
                yield from _leaves(x, y, f"{kind} on {axis}", rtol)


def _comm_word(c: Any) -> Any:
    return c if c is ABSENT else f"{c.get('count', 0):.4g} x, {fmt_bytes(c.get('bytes', 0))}"


# -- printing -----------------------------------------------------------------


def _render_change(c: Change) -> str:
    line = f"{c.item}: {_fmt(c.item, c.old)} -> {_fmt(c.item, c.new)}"
    rel = c.relative
    if rel is not None and (isinstance(c.old, float) or isinstance(c.new, float)):  # predictions, not settings
        line += f" ({rel:+.1%})"
    return line


def _fmt(item: str, v: Any) -> str:
    if v is ABSENT:
        return "absent"
    if v is None:
        return "none"
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            if item.endswith("layers") and len(v) > 3:
                return f"{v[0]} .. {v[-1]} ({len(v)} layers)"
            return "[" + ", ".join(v) + "]"
        if item.endswith("devices") and v and all(isinstance(x, int) for x in v) and v == list(range(v[0], v[-1] + 1)):
            return f"{v[0]}-{v[-1]}" if len(v) > 1 else str(v[0])
        return str(v)
    if _is_number(v) and not isinstance(v, bool):
        leaf = item.rsplit(".", 1)[-1]
        if "bytes" in leaf or "memory_bytes" in item:
            return fmt_bytes(v)
        if (leaf.endswith("_s") and not leaf.endswith("_per_s")) or leaf == "objective":
            return fmt_s(v)
        if leaf in ("mfu", "bubble_fraction"):
            return f"{v:.2%}"
        return f"{v:.6g}" if isinstance(v, float) else str(v)
    return str(v)

"""The Plan: the single contract between planning and execution.

A plan records the mesh, the schedule, the pipeline stages with their predicted
time and memory, the placement of every parameter and op, the predicted step
time and MFU, how the solver did, and the cluster and model it was made for.
It is a frozen dataclass that round-trips through versioned JSON with sorted
keys, so the same model, inputs and cluster give a byte-identical file.
Wall-clock timings of the planner itself (trace, solve) vary from run to run;
they live in ``plan.timings`` and in the summary, never in the file.

Plan file keys (``"schema": 1``): ``mesh``, ``schedule``, ``zero``,
``recompute``, ``stages``, ``layers``, ``ops``, ``predicted``, ``solver``,
``communication``, ``cluster``, ``model``, ``fixed``, ``autopar_version``; ``experts``
only under expert parallelism (``ep``, where the experts live, the all-to-all bytes:
``autopar.planner.experts.experts_record``); ``context`` only under context parallelism
(``cp``, the sequence layout and the key/value exchange: ``autopar.planner.context``). Neither
``ep`` nor ``cp`` is a ``mesh`` key: each folds over ``dp`` and does not multiply the world size
(under cp the batch is split over ``dp / cp`` groups).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from autopar.cost.schedule import SCHEDULE_KINDS
from autopar.errors import PlanError
from autopar.planner.fixed import RECOMPUTE_POLICIES

__all__ = ["Plan", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1


_DICT_KEYS = ("mesh", "schedule", "layers", "ops", "predicted", "solver", "communication", "cluster", "model", "fixed",
              "experts", "context")
"""Top-level keys whose value is a JSON object."""


def _kind(x: Any) -> str:
    """How a JSON value reads in a message: "a string", "null", "a list"."""
    if x is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(x), type(x).__name__)


def _structure_problems(data: dict[str, Any]) -> list[str]:
    """Every value of the wrong JSON type, so that a hand-edited or truncated file is
    rejected on load with what is wrong, not later with an AttributeError."""
    problems = [f"{k!r} must be an object, got {_kind(data[k])}"
                for k in _DICT_KEYS if k in data and not isinstance(data[k], dict)]
    for k in ("layers", "ops"):
        if isinstance(data.get(k), dict):
            bad = sorted(name for name, v in data[k].items() if not isinstance(v, dict))
            if bad:
                problems.append(f"{k!r} entries must be objects, not {_kind(data[k][bad[0]])} ({bad[0]!r}"
                                f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''})")
    stages = data.get("stages")
    if not isinstance(stages, list):
        problems.append(f"'stages' must be a list, got {_kind(stages)}")
    else:
        for i, st in enumerate(stages):
            if not isinstance(st, dict):
                problems.append(f"stage {i} must be an object, got {_kind(st)}")
                continue
            for key, item, item_kind in (("layers", str, "strings"), ("devices", int, "integers")):
                v = st.get(key)
                if not isinstance(v, list) or not all(isinstance(x, item) and not isinstance(x, bool) for x in v):
                    problems.append(f"stage {i} {key!r} must be a list of {item_kind}, got {_kind(v)}")
            if "predicted" in st and not isinstance(st["predicted"], dict):
                problems.append(f"stage {i} 'predicted' must be an object, got {_kind(st['predicted'])}")
    if "sequence_parallel" in data and not isinstance(data["sequence_parallel"], bool):
        problems.append(f"'sequence_parallel' must be true or false, got {_kind(data['sequence_parallel'])}")
    if "zero" in data and (not isinstance(data["zero"], int) or isinstance(data["zero"], bool)):
        problems.append(f"'zero' must be an integer 0-3, got {_kind(data['zero'])}")
    return problems


def _round(x: Any) -> Any:
    """Floats to 6 significant digits so files are stable and readable."""
    if isinstance(x, float):
        if not math.isfinite(x) or x == 0:
            return x
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {str(k): _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


@dataclass(frozen=True, kw_only=True)
class Plan:
    mesh: dict[str, int]
    """Axis name -> size, outermost first: {"pp": .., "dp": .., "tp": ..}."""
    schedule: dict[str, Any]
    """{"kind": "1f1b", "microbatches": m, "microbatch_size": b}."""
    zero: int
    """ZeRO stage on the dp axis (0-3)."""
    recompute: str
    """Activation recompute: "none", "selective" (FLOP-free ops), "sac" ("selective" plus every second
    matmul of a layer, torchtitan's op-level SAC), "moe" ("selective" plus each MoE layer's forward,
    Megatron-LM's ``--recompute-modules layernorm moe``) or "full"."""
    sequence_parallel: bool = False
    """Sequence parallelism on the tp axis (which norms run on token shards: ``layers[...]["sequence_parallel"]``)."""
    stages: tuple[dict[str, Any], ...]
    """Per pipeline stage: layers, devices (ranks), predicted compute/comm/memory."""
    layers: dict[str, dict[str, Any]]
    """Layer path -> class, count, signature, parameter placements on tp."""
    ops: dict[str, dict[str, Any]]
    """Op node name -> layer, target, phase, output/input placements on tp."""
    predicted: dict[str, Any]
    """step_time_s (the simulated step program), bubble_fraction, p2p_s (the slowest cut's transfer),
    model/hardware FLOPs per step, mfu, peak_memory_bytes, tokens_per_s; overlap (per pipeline rank:
    collectives in flight, hidden, exposed, tp) and step (the step program's inputs, ``cost.step.StepSpec``)."""
    solver: dict[str, Any]
    """Sharding MIP status, objective, gap; search statistics; runners-up."""
    communication: dict[str, Any]
    """Collective kind -> per-step count, bytes and time, by mesh axis; ``["p2p"]["pp"]["cuts"]``: per
    pipeline cut, the messages one rank sends each way per micro-batch (``autopar.planner.cuts``)."""
    cluster: dict[str, Any]
    model: dict[str, Any]
    """name, n_params, graph_hash, global_batch."""
    fixed: dict[str, Any] = field(default_factory=dict)
    experts: dict[str, Any] = field(default_factory=dict)
    """Expert parallelism (empty without): ep, replicas, per-layer expert placement, all-to-all cost."""
    context: dict[str, Any] = field(default_factory=dict)
    """Context parallelism (empty without): cp, layout, sequence, tokens per rank, K/V exchange."""
    autopar_version: str = ""
    schema: int = SCHEMA_VERSION
    timings: dict[str, float] = field(default_factory=dict, compare=False)
    """Planner wall times (not saved: they differ between runs)."""

    # -- files -------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _round(getattr(self, f.name)) for f in fields(self) if f.name != "timings"}
        if not self.sequence_parallel:  # absent means off: plan files from before the key stay byte-identical
            del out["sequence_parallel"]
        if not self.experts:  # absent means no expert parallelism, as above
            del out["experts"]
        if not self.context:  # absent means no context parallelism
            del out["context"]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict):
            raise PlanError(f"a plan is a JSON object, got {type(data).__name__}")
        schema = data.get("schema")
        if schema != SCHEMA_VERSION:
            raise PlanError(f"plan schema {schema!r} is not supported (this autopar reads schema {SCHEMA_VERSION})")
        names = {f.name for f in fields(cls)} - {"timings"}
        optional = ("fixed", "autopar_version", "sequence_parallel", "experts", "context")
        missing = sorted(n for n in names if n not in data and n not in optional)
        if missing:
            raise PlanError(f"plan is missing keys: {', '.join(missing)}")
        problems = _structure_problems(data)
        if problems:
            raise PlanError("invalid plan: " + "; ".join(problems))
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["stages"] = tuple(kwargs["stages"])
        plan = cls(**kwargs)
        plan.validate()
        return plan

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e}") from e
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read a plan file: JSON only, so loading a plan never runs code (unlike a pickle).
        Raises OSError when the file cannot be read, PlanError when it is not a plan."""
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise PlanError(f"{str(path)!r} is not a plan file: it is binary, not UTF-8 JSON text (a pickle or "
                            f"checkpoint?); plan files are the JSON that `autopar plan --out` and Plan.save "
                            f"write") from None
        return cls.from_json(text)

    # -- checks ------------------------------------------------------------

    def validate(self, *, world_size: int | None = None) -> None:
        """Raise one PlanError listing every inconsistency found."""
        problems = []
        sizes = [self.mesh.get(a) for a in ("pp", "dp", "tp")]
        if any(not isinstance(s, int) or s < 1 for s in sizes):
            problems.append(f"mesh {self.mesh} needs positive integer pp, dp and tp")
        else:
            world = math.prod(self.mesh.values())
            if world_size is not None and world != world_size:
                problems.append(f"mesh {self.mesh} has {world} devices but the world size is {world_size}")
            v, extra = divmod(len(self.stages), self.mesh["pp"])
            interleaved = self.schedule.get("kind") == "interleaved"
            if extra or v < 1 or (v > 1 and not interleaved):
                problems.append(f"{len(self.stages)} stages for pp={self.mesh['pp']} (one stage per pipeline rank, "
                                f"or a multiple of pp under the interleaved schedule)")
            ranks = sorted(r for s in self.stages for r in s.get("devices", []))
            if ranks != sorted(list(range(world)) * max(v, 1)):
                problems.append(f"stage devices do not cover ranks 0..{world - 1} "
                                f"{'exactly once' if v <= 1 else f'{v} times each'}")
        m, b = self.schedule.get("microbatches"), self.schedule.get("microbatch_size")
        batch = self.model.get("global_batch")
        cp = self.context.get("cp", 1) if self.context else 1
        if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
            problems.append(f"context cp={cp!r} must be an integer >= 1")
            cp = 1
        elif isinstance(self.mesh.get("dp"), int) and self.mesh["dp"] % cp:
            problems.append(f"context cp={cp} does not divide dp={self.mesh['dp']} (cp folds over the dp ranks)")
            cp = 1
        if isinstance(m, int) and isinstance(b, int) and isinstance(batch, int) and isinstance(self.mesh.get("dp"), int):
            if m * b * (self.mesh["dp"] // cp) != batch:
                groups = f"dp {self.mesh['dp']}" if cp == 1 else f"(dp {self.mesh['dp']} / cp {cp})"
                problems.append(f"microbatches {m} x microbatch_size {b} x {groups} != global batch {batch}")
        if self.zero not in (0, 1, 2, 3):
            problems.append(f"zero={self.zero!r} is not 0-3")
        if self.schedule.get("kind") not in SCHEDULE_KINDS:
            problems.append(f"schedule kind {self.schedule.get('kind')!r} is not one of {', '.join(SCHEDULE_KINDS)}")
        for key in ("microbatches", "microbatch_size"):
            v = self.schedule.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"schedule {key}={v!r} must be an integer >= 1")
        if self.recompute not in RECOMPUTE_POLICIES:
            problems.append(f"recompute={self.recompute!r} is not one of {', '.join(RECOMPUTE_POLICIES)}")
        ep = self.experts.get("ep") if self.experts else None
        if ep is not None:
            if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
                problems.append(f"experts ep={ep!r} must be an integer >= 1")
            elif self.ep_over_tp and isinstance(self.mesh.get("dp"), int) and isinstance(self.mesh.get("tp"), int) \
                    and (ep % self.mesh["tp"] or self.mesh["dp"] % (ep // self.mesh["tp"])):
                problems.append(f"experts ep={ep} folded over tp and dp must be tp={self.mesh['tp']} x k with k "
                                f"dividing dp={self.mesh['dp']}")
            elif not self.ep_over_tp and isinstance(self.mesh.get("dp"), int) and self.mesh["dp"] % ep:
                problems.append(f"experts ep={ep} does not divide dp={self.mesh['dp']} (ep folds over the dp ranks)")
            else:
                for name, layer in self.experts.get("layers", {}).items():
                    if isinstance(layer, dict) and isinstance(layer.get("n_experts"), int) and layer["n_experts"] % ep:
                        problems.append(f"experts ep={ep} does not divide the {layer['n_experts']} experts of {name}")
        layer_paths = [p for s in self.stages for p in s.get("layers", [])]
        if len(layer_paths) != len(set(layer_paths)):
            problems.append("a layer appears in more than one stage")
        if problems:
            raise PlanError("invalid plan: " + "; ".join(problems))

    @property
    def ep_over_tp(self) -> bool:
        """Whether the plan's expert parallelism is folded over tp as well as dp (``etp=1``: each tp
        rank routes its own tokens to experts kept whole; :mod:`autopar.planner.expert_folding`)."""
        return (self.experts or {}).get("folded_over") == "tp x dp"

    def check_model(self, graph_hash: str) -> None:
        """A plan drives only the model it was made for."""
        if self.model.get("graph_hash") != graph_hash:
            raise PlanError(
                f"this plan was made for {self.model.get('name')} (graph {self.model.get('graph_hash')}), "
                f"but the model traces to graph {graph_hash}; re-plan with autopar.plan(...) or "
                f"`autopar plan` for this model")

    def summary(self) -> str:
        from autopar.plan_summary import render_summary

        return render_summary(self)

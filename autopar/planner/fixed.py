"""The decisions a user may pin (``fixed={"tp": 8, ...}``, ``--fix tp=8``), parsed and checked.

:class:`Fixed` is what the planner (``autopar.planner.search``, ``autopar.planner.make``)
reads; anything not pinned is the search's to choose. Parsing refuses unknown keys and bad
values in one message that lists them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.errors import PlanError

__all__ = ["Fixed", "FIXED_KEYS", "EP_DISPATCHES", "check_cuts", "SCHEDULES", "RECOMPUTE", "RECOMPUTE_POLICIES"]

CP_VARIANTS = ("ring", "allgather")  # (autopar.context.VARIANTS, without importing the runtime op)
PINNED_CP_VARIANTS = (*CP_VARIANTS, "torch", "te")
"""cp variants a plan may pin: autopar's two, and "torch" (torch's own ``context_parallel`` with its
all-gather rotation, as torchtitan runs it: :func:`autopar.cost.comm.torch_context_attention_cost`)
and "te" (Transformer Engine's p2p ring, as Megatron-LM runs it:
:func:`autopar.cost.comm.te_context_attention_cost`), priced for runs made that way
(``bench/fidelity.py``); autopar's runtime does not run them."""
EP_DISPATCHES = ("autopar", "megatron", "deepep")
"""Programs that carry ep's tokens to their experts and back, as :mod:`autopar.cost.expert_comm`
prices them: autopar's (what ``parallelize`` runs), and, pinned only for
comparison with runs made with them, Megatron-LM's all-to-all dispatcher (torchtitan's all-to-all
runs the same exchanges) and DeepEP's normal kernels (under uniform routing)."""
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
RECOMPUTE_POLICIES = ("none", "selective", "sac", "moe", "full")
"""Recompute policies, from the one that recomputes least (and keeps most) to the one that recomputes
most (:func:`autopar.passes.recompute.dropped_ops`): "sac" is torchtitan's op-level selective
checkpointing, "selective" plus every second matmul of a layer; "moe" is Megatron-LM's
``--recompute-modules layernorm moe``, "selective" plus each MoE layer's whole forward. A plan may pin
any."""
RECOMPUTE = tuple(p for p in RECOMPUTE_POLICIES if p != "moe")
"""The policies the search weighs (sac without a pipeline only: :func:`autopar.planner.search.search`'s
``policies``), and "moe" too on a model with MoE layers (elsewhere it equals selective)."""
FIXED_KEYS = ("tp", "pp", "dp", "zero", "schedule", "microbatch_size", "microbatches", "recompute", "sp",
              "virtual_stages", "ep", "etp", "moe_imbalance", "cp", "cp_variant", "cuts", "ep_dispatch")
_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


@dataclass(frozen=True, kw_only=True)
class Fixed:
    """Decisions the user pins (``fixed={"tp": 8, "pp": 2, ...}``); None = free."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    zero: int | None = None
    schedule: str | None = None
    microbatch_size: int | None = None
    microbatches: int | None = None
    recompute: str | None = None
    sp: bool | None = None
    """Sequence parallelism (norms and pointwise ops of a block on token shards over tp)."""
    virtual_stages: int | None = None
    """Model chunks per rank under the interleaved schedule."""
    ep: int | None = None
    """Expert parallelism: experts cut in ep parts over groups of ep data-parallel ranks
    (``autopar.planner.experts``); None: the search chooses it for a model with experts."""
    etp: int | None = None
    """Expert tensor parallelism, Megatron-LM's ``--expert-tensor-parallel-size``: tp (or None,
    the default) splits each expert's hidden width over the tp ranks and folds ep over dp alone;
    1 keeps the experts whole and folds ep over tp as well (``ep = tp x k``, the ep group the tp
    ranks and k data-parallel ranks: :mod:`autopar.planner.expert_folding`); None: the search
    weighs both."""
    moe_imbalance: float | None = None
    """An assumption, not a decision: under ep, the busiest rank of an ep group receives this
    many times its balanced share of token rows (>= 1; None or 1: balanced routing). It prices
    that rank's expert GEMMs and received all-to-all rows, which set the group's pace."""
    cp: int | None = None
    """Context parallelism: each sequence split over groups of cp data-parallel ranks
    (consecutive, like ep), attention exchanging keys and values around the group
    (:mod:`autopar.context`); None: the search chooses it for long sequences, 1: none."""
    cp_variant: str | None = None
    """How cp attention meets the other ranks' keys: "ring" (K/V blocks passed around, hidden
    behind the block computation) or "allgather" (all K/V gathered first); None: per attention
    op, whichever the cost model says leaves less exposed. "torch" and "te" (:data:`PINNED_CP_VARIANTS`)
    price torch's own program and Transformer Engine's, for runs made with them; autopar's runtime
    refuses such a plan."""
    ep_dispatch: str | None = None
    """How ep's token rows travel to their experts and back (:data:`EP_DISPATCHES`; None: "autopar",
    what ``parallelize`` runs). "megatron" and "deepep" price other programs, for runs made with them
    (``bench/fidelity.py``); autopar's runtime refuses such a plan."""
    cuts: tuple[str, ...] | None = None
    """The pipeline layout: the layer each stage after the first begins with, in order (the
    names the plan's stages list: module paths such as ``"model.layers.8"``, or ``"<loss>"``),
    so ``len(cuts) + 1`` stages, pp x virtual_stages of them (Megatron-LM's
    ``--pipeline-model-parallel-layout``, torchtitan's ``module_fqns_per_model_part``); None: the
    partitioner balances the stages. On the command line, comma-separated."""

    @classmethod
    def from_dict(cls, fixed: dict | None) -> Fixed:
        fixed = dict(fixed or {})
        problems = []
        for key in sorted(set(fixed) - set(FIXED_KEYS)):
            problems.append(f"unknown key {key!r}")
        values = {}
        for key in FIXED_KEYS:
            if key not in fixed or fixed[key] is None:
                continue
            value = fixed[key]
            if key == "sp":
                flag = value if isinstance(value, bool) else _BOOLS.get(str(value).strip().lower())
                if flag is None:
                    problems.append(f"sp={value!r} is not a boolean (use True/False, or 1/0 on the command line)")
                values[key] = flag
                continue
            if key == "moe_imbalance":
                try:
                    factor = float(value)
                except (TypeError, ValueError):
                    factor = math.nan
                if not 1.0 <= factor <= 1024.0:  # (nan fails too)
                    problems.append(f"moe_imbalance={value!r} must be a number >= 1: the busiest ep rank's token "
                                    f"rows over its balanced share (1 = balanced routing, 1.2 = 20% more)")
                values[key] = factor
                continue
            if key == "cuts":
                names = [n.strip() for n in value.split(",")] if isinstance(value, str) else value
                if not isinstance(names, (list, tuple)) or not names or \
                        not all(isinstance(n, str) and n.strip() for n in names):
                    problems.append(f"cuts={value!r} must name the first layer of each stage after the first "
                                    f"(a non-empty list of layer names, comma-separated on the command line)")
                    continue
                names = tuple(n.strip() for n in names)
                twice = sorted({n for n in names if names.count(n) > 1})
                if twice:
                    problems.append(f"cuts name {', '.join(twice)} more than once: each stage begins at a different "
                                    f"layer")
                values[key] = names
                continue
            if key in ("schedule", "recompute", "cp_variant", "ep_dispatch"):
                allowed = {"schedule": SCHEDULES, "recompute": RECOMPUTE_POLICIES, "cp_variant": PINNED_CP_VARIANTS,
                           "ep_dispatch": EP_DISPATCHES}[key]
                if value not in allowed:
                    problems.append(f"{key}={value!r} is not one of {', '.join(allowed)}")
                values[key] = value
                continue
            try:
                number = int(value)
            except (TypeError, ValueError):
                problems.append(f"{key}={value!r} is not an integer")
                continue
            low = 0 if key == "zero" else 1
            if number < low or (key == "zero" and number > 3) or str(number) != str(value).strip():
                problems.append(f"{key}={value!r} must be an integer {'in 0..3' if key == 'zero' else '>= 1'}")
            values[key] = number
        if problems:
            raise PlanError(f"bad fixed decisions: {'; '.join(problems)}; accepted keys: {', '.join(FIXED_KEYS)}")
        return cls(**values)

    def to_dict(self) -> dict:
        return {k: list(v) if k == "cuts" else v for k in FIXED_KEYS if (v := getattr(self, k)) is not None}

    @property
    def n_stages(self) -> int | None:
        """The stage count pinned cuts give (None: cuts not pinned)."""
        return None if self.cuts is None else len(self.cuts) + 1


def check_cuts(fixed: Fixed, layers: list[str]) -> tuple[int, ...] | None:
    """Pinned cuts as indices into ``layers`` (every layer instance, in program order), where
    each stage after the first begins; None if not pinned. Raises :class:`PlanError` for a
    name that is no layer, cuts out of order, or a stage count no pinned pp and
    virtual_stages give."""
    if fixed.cuts is None:
        return None
    index = {name: i for i, name in enumerate(layers)}
    unknown = [n for n in fixed.cuts if n not in index]
    if unknown:
        shown = ", ".join(layers[:4]) + (f", ..., {', '.join(layers[-3:])}" if len(layers) > 7 else
                                         ", ".join([""] + layers[4:]))
        raise PlanError(f"fixed cuts name {', '.join(map(repr, unknown[:5]))}{' ...' if len(unknown) > 5 else ''}, "
                        f"not a layer of the model; its {len(layers)} layers in order: {shown}")
    starts = tuple(index[n] for n in fixed.cuts)
    bad = [(a, b) for a, b in zip(fixed.cuts, fixed.cuts[1:]) if index[a] >= index[b]]
    if starts[0] == 0 or bad:
        what = (f"{fixed.cuts[0]!r} is the first layer (stage 0 begins there; name where stages 1, 2, ... begin)"
                if starts[0] == 0 else f"{bad[0][1]!r} comes before {bad[0][0]!r} in the model")
        raise PlanError(f"fixed cuts are not in the model's layer order: {what}")
    n = len(starts) + 1
    v = fixed.virtual_stages or (1 if fixed.schedule not in (None, "interleaved") else None)
    if fixed.pp is not None and (n % fixed.pp or (v is not None and fixed.pp * v != n)):
        per = f"pp={fixed.pp} x virtual_stages={v}" if v is not None else f"pp={fixed.pp}"
        k = fixed.pp * (v or 1) - 1
        raise PlanError(f"fixed cuts give {n} stages ({len(starts)} cuts), which {per} "
                        f"{'does not divide' if v is None else f'= {fixed.pp * v} does not match'}; "
                        f"name {k} cut{'s' if k != 1 else ''}, or pin pp and virtual_stages to match")
    return starts


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shapes(world: int, tp: int, *, global_batch: int, fixed: Fixed, n_units: int, cps):
    """The (pp, dp, cp, micro-batch size, micro-batches) the search visits at ``tp`` on ``world``
    ranks, under what ``fixed`` pins: pp no deeper than the ``n_units`` layers, each cp of
    ``cps(dp)`` folded over the dp ranks (dp / cp groups split the global batch), every
    micro-batch size that divides a group's sequences. A (pp, dp, cp) whose groups cannot split
    the batch evenly yields micro-batch size None (the search counts them for its error).
    One enumeration for the search and for what the planner prepares for it
    (:func:`autopar.planner.make.plan_graphs`)."""
    for pp in _divisors(world // tp):
        dp = world // (tp * pp)
        if (fixed.pp and pp != fixed.pp) or (fixed.dp and dp != fixed.dp) or pp > n_units \
                or (fixed.cuts and fixed.n_stages % pp):
            continue
        for cp in cps(dp):
            groups = dp // cp
            if global_batch % groups:
                yield pp, dp, cp, None, 0
                continue
            local = global_batch // groups
            for mbs in _divisors(local):
                m = local // mbs
                if (fixed.microbatch_size and mbs != fixed.microbatch_size) or \
                        (fixed.microbatches and m != fixed.microbatches):
                    continue
                yield pp, dp, cp, mbs, m

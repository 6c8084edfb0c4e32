"""One training step as per-rank action lists: compute, p2p and collectives (the step program).

A plan is lowered into one list of :class:`Op` per pipeline rank, the order in which
that rank issues its work, in the spirit of ``torch.distributed.pipelining``'s action
lists (``0F3``, ``0B3``, ``0W3``, and its ``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD``
actions for FSDP under a pipeline). Ranks that differ only in their dp or tp
coordinate run the same list, so one list per pipeline rank stands for them all.

What the lists hold, per ZeRO stage (the one definition is :mod:`autopar.zero_def`;
``dp == 1`` issues no dp collective):

- compute: ``F``, ``B``, ``W`` or fused ``BW`` per stage and micro-batch, split into one
  piece per layer group where a collective hangs off a group (ZeRO-3 gathers before a
  group's forward and backward; a gradient bucket after the group's gradients are final);
  the backward runs the groups last to first. ``OPT`` steps a stage's optimizer.
- p2p: ``SEND_F`` carries the cut's activation messages of one micro-batch over the cut's
  link, ``SEND_B`` its gradient messages back (each priced at its own bytes, as the plan
  records them: :mod:`autopar.planner.cuts`); the peer's ``RECV_*`` completes with it and
  the peer's compute waits for the RECV.
- ``UNSHARD`` (stage 3): the all-gather of one layer group, placed so that it is issued
  when the previous group's piece starts (prefetch depth ``zero_def.PREFETCH_GROUPS`` = 1),
  before the forward and again before the backward (B or BW; a W reads no weights).
- ``REDUCE_GRAD``: a bucket's all-reduce (stage 0) or reduce-scatter, issued with the
  piece that makes the gradients final; stages 0/1 only on the stage's last backward of
  the step, stages 2/3 on every micro-batch.
- ``TIED_REDUCE``: the all-reduce of a parameter two pipeline ranks both hold (a tied
  embedding), after both ranks' last backward and dp reductions (the runtime sums them
  after waiting for its buckets), in the order of the parameters' names.
- ``PARAM_GATHER`` (stages 1, 2): each bucket's all-gather after the optimizer step.

Streams. All compute runs on one stream per rank, in list order. Collectives run on
per-rank streams named by the op: dp all-gathers (``dp.gather``) and dp reductions
(``dp.reduce``) on two streams, as FSDP2's separate all-gather and reduce-scatter streams
(``torch.distributed.fsdp``'s ``FSDPCommContext``), tied all-reduces on their own; each
stream runs its collectives in issue order. tp collectives inside a layer are part of
the compute pieces (the next op reads their result at once): they stay exposed.
:func:`autopar.cost.simulate.simulate_program` times the lists.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import lru_cache

from autopar.cost import comm
from autopar.cost.schedule import Action, timing_order
from autopar.zero_def import stage as zero_stage
from autopar.zero_def import step_collective_counts

__all__ = ["OVERLAP_SLOWDOWN", "GroupCost", "StageCost", "TiedCost", "StepSpec", "Op", "COMPUTE_KINDS",
           "COLLECTIVE_KINDS", "FUSED_BACKWARD", "Prefix", "lower_step", "time_prefix", "dp_collective_s", "group_dp_s",
           "estimate_exposed_s"]

OVERLAP_SLOWDOWN = 1.3
"""Compute runs this many times slower while a collective overlaps it on the same GPU
(the collective's kernels take SMs and memory bandwidth). Hetu-Galvatron's search-engine
docs give 1.1-1.3 as the usual range of this coefficient; its profiler
(``galvatron/profile_hardware/profile_overlap.py``: a 1024 x 4096 x 4096 fp32 matmul against a
64 MB all-reduce, the larger of the two slowdowns) measured 1.126 in the configuration it
ships (``hardware_configs/overlap_coefficient.json``, GPUs not stated; 1.146 in one revision),
all read at cea12ff. We take the top of the range: on an H100 a GEMM sized to one wave of 132
SMs loses a whole second wave to an NCCL kernel's 24 blocks (a report on NVIDIA's forum
measured it near 2x), so the measured 1.13 is not a bound. Not calibrated on a GPU here
(bench/calibration.yaml, ``overlap``)."""

COMPUTE_KINDS = ("F", "B", "W", "BW", "OPT")
COLLECTIVE_KINDS = ("UNSHARD", "REDUCE_GRAD", "TIED_REDUCE", "PARAM_GATHER")
FUSED_BACKWARD = ("gpipe", "1f1b", "interleaved")
"""Schedules that run B and W as one fused backward (BW) action."""

_COLLECTIVE_S = {"all_reduce": comm.all_reduce_s, "reduce_scatter": comm.reduce_scatter_s,
                 "all_gather": comm.all_gather_s}


@dataclass(frozen=True, kw_only=True)
class GroupCost:
    """One layer group of a stage (a gradient bucket), per micro-batch on each of its ranks."""

    name: str
    f_s: float
    b_s: float
    """Input-gradient backward (with any recomputed forward)."""
    w_s: float
    tp_comm_s: float = 0.0
    """The part of ``f_s + b_s + w_s`` spent in tp collectives (on the compute stream)."""
    bucket_bytes: float = 0.0
    """The group's parameters per rank (tp-sharded, before ZeRO) in the gradient dtype:
    the full bytes each dp collective of this bucket moves through its ring."""
    expert_bytes: float = 0.0
    """Of ``bucket_bytes``, the expert parameters' under expert parallelism: the runtime reduces
    (and gathers) them in a bucket of their own over their replica group
    (``StepSpec.replicas``), not over dp."""


@dataclass(frozen=True, kw_only=True)
class StageCost:
    groups: tuple[GroupCost, ...]
    optimizer_s: float = 0.0
    send_s: float = 0.0
    """The activation messages of one micro-batch to the next stage, over the cut's link."""
    send_back_s: float | None = None
    """The gradient messages of one micro-batch back across the same cut (None: ``send_s``,
    as plans written before the two were priced apart)."""

    @property
    def back_s(self) -> float:
        return self.send_s if self.send_back_s is None else self.send_back_s


@dataclass(frozen=True, kw_only=True)
class TiedCost:
    """A parameter held by several stages (each stage's copy lives in ``groups[i]`` of ``stages[i]``)."""

    name: str
    stages: tuple[int, ...]
    groups: tuple[int, ...]
    nbytes: float
    link: comm.Link


@dataclass(frozen=True, kw_only=True)
class StepSpec:
    """Everything the step program of a plan depends on: plain numbers, JSON-able."""

    schedule: str
    pp: int
    microbatches: int
    zero: int
    dp: int
    stages: tuple[StageCost, ...]
    dp_link: comm.Link
    tied: tuple[TiedCost, ...] = ()
    overlap_slowdown: float = OVERLAP_SLOWDOWN
    replicas: int = 0
    """Under expert parallelism, the ranks of an expert part's replica group (dp / ep), which
    its buckets' collectives run over on ``replica_link``; 0 without ep."""
    replica_link: comm.Link | None = None

    @property
    def virtual_stages(self) -> int:
        return len(self.stages) // self.pp

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepSpec:
        stages = tuple(StageCost(groups=tuple(GroupCost(**g) for g in s["groups"]),
                                 optimizer_s=s["optimizer_s"], send_s=s["send_s"],
                                 send_back_s=s.get("send_back_s")) for s in d["stages"])
        tied = tuple(TiedCost(name=t["name"], stages=tuple(t["stages"]), groups=tuple(t["groups"]),
                              nbytes=t["nbytes"], link=comm.Link(**t["link"])) for t in d.get("tied", ()))
        return cls(schedule=d["schedule"], pp=d["pp"], microbatches=d["microbatches"], zero=d["zero"], dp=d["dp"],
                   stages=stages, dp_link=comm.Link(**d["dp_link"]), tied=tied,
                   overlap_slowdown=d.get("overlap_slowdown", OVERLAP_SLOWDOWN), replicas=d.get("replicas", 0),
                   replica_link=comm.Link(**d["replica_link"]) if d.get("replica_link") else None)


@dataclass(frozen=True)
class Op:
    """One entry of a rank's step program. Names are unique in a program; a collective
    that spans pipeline ranks (``TIED_REDUCE``) sits in each participant's list under one name."""

    name: str
    kind: str
    """A compute kind (``COMPUTE_KINDS``), ``SEND``, ``RECV`` or a collective (``COLLECTIVE_KINDS``)."""
    seconds: float
    """Compute time at full speed, transfer time, or the collective's time alone on its link."""
    waits: tuple[tuple[str, float], ...] = ()
    """(op name, delay_s): this op starts no earlier than that op's end plus the delay."""
    stage: int = -1
    microbatch: int = -1
    group: int = -1
    """Layer-group index in the stage; -1 for a whole action or a whole stage."""
    action: Action | None = field(default=None, compare=False)
    """The pipeline action a compute piece belongs to."""
    stream: str = ""
    """The collective's stream on each participant (``dp.gather``, ``dp.reduce``, ``tied``)."""
    collective: str = ""
    """``all_gather``, ``reduce_scatter`` or ``all_reduce``."""
    group_size: int = 1
    nbytes: float = 0.0
    link: comm.Link | None = None
    ranks: tuple[int, ...] = ()
    """Pipeline ranks taking part in a collective that spans them; () for dp collectives."""

    def __str__(self) -> str:
        return self.name


def _check_spec(spec: StepSpec) -> None:
    problems = []
    for name in ("pp", "microbatches", "dp"):
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            problems.append(f"{name} must be an integer >= 1, got {v!r}")
    if spec.pp >= 1 and (not spec.stages or len(spec.stages) % spec.pp):
        problems.append(f"{len(spec.stages)} stages are not a positive multiple of pp={spec.pp}")
    for s, st in enumerate(spec.stages):
        if not st.groups:
            problems.append(f"stage {s} has no layer groups")
        bad = [g.name for g in st.groups if min(g.f_s, g.b_s, g.w_s, g.tp_comm_s, g.bucket_bytes) < 0]
        if bad or st.optimizer_s < 0 or st.send_s < 0 or st.back_s < 0:
            problems.append(f"stage {s} has negative times or bytes ({bad or 'optimizer_s/send_s/send_back_s'})")
    if not spec.overlap_slowdown >= 1:
        problems.append(f"overlap_slowdown must be >= 1, got {spec.overlap_slowdown!r}")
    if problems:
        raise ValueError("bad step spec: " + "; ".join(problems))


def _times(g: GroupCost, kind: str) -> float:
    return {"F": g.f_s, "B": g.b_s, "W": g.w_s, "BW": g.b_s + g.w_s}[kind]


@dataclass(frozen=True)
class Prefix:
    """The actions each rank runs before its first collective can be in flight, timed in one pass
    (:func:`time_prefix`); indices are into :func:`autopar.cost.schedule.timing_order`."""

    done: bytearray
    """1 for an action timed here."""
    tail: tuple[int, ...]
    """The other actions, in the order: :func:`lower_step` lowers these."""
    ends: dict[str, float]
    """End of each timed action an op of the rest waits for, by its op name."""
    free: tuple[float, ...]
    """Per rank, when its compute stream finishes the timed actions (0.0: none)."""
    busy: tuple[float, ...]
    """Per rank, the compute time of its timed actions."""


def time_prefix(spec: StepSpec) -> Prefix | None:
    """Time the start of the step program without lowering it, where that gives the event
    engine's answer: on each rank, the actions before the first one that issues a collective.

    Until a rank issues a collective its compute runs at full speed, so an action starts when
    its rank is free and each input has arrived (the producer's end, plus the cut's transfer
    across ranks: the SEND starts at the producer's end and the RECV ends with it) and lasts
    its stage's time, as :func:`autopar.cost.simulate.simulate_program` would time it. The
    timed set is closed under inputs (an action whose input is not timed is not either), so
    nothing outside it can move it. At ZeRO 0 and 1 the first collective comes with a stage's
    last weight gradient, so nearly the whole pipeline is timed here and only each rank's end
    goes through the event engine; at ZeRO 2 and 3 collectives start with the first backward
    or forward, and this returns None (nothing to gain)."""
    _check_spec(spec)
    z = zero_stage(spec.zero) if spec.dp > 1 else None
    if z is not None and (z.param_gather == "per_use" or z.grad_reduce_every_microbatch):
        return None
    pp, m, v = spec.pp, spec.microbatches, spec.virtual_stages
    order = timing_order(spec.schedule, pp, m, v)
    stop = set(_last_grads(order, len(spec.stages)).values())
    dur = {kind: [sum(_times(g, kind) for g in st.groups) for st in spec.stages] for kind in ("F", "B", "W", "BW")}
    cut_s = ([st.send_s for st in spec.stages], [st.back_s for st in spec.stages])
    done = bytearray(len(order))
    end = [0.0] * len(order)
    free, busy = [0.0] * pp, [0.0] * pp
    open_ = [True] * pp
    tail = []
    for i, (r, a, waits) in enumerate(order):
        if open_[r]:
            t = free[r]
            for j, cut, back in waits:
                if not done[j]:
                    break
                e = end[j] if cut < 0 else end[j] + cut_s[back][cut]
                if e > t:
                    t = e
            else:
                if i not in stop:
                    d = dur[a.kind][a.stage]
                    end[i] = free[r] = t + d
                    busy[r] += d
                    done[i] = 1
                    continue
            open_[r] = False
        tail.append(i)
    ends = {str(order[j][1]): end[j] for i in tail for j, _, _ in order[i][2] if done[j]}
    return Prefix(done=done, tail=tuple(tail), ends=ends, free=tuple(free), busy=tuple(busy))


def lower_step(spec: StepSpec, *, prefix: Prefix | None = None) -> dict[int, list[Op]]:
    """The step program of ``spec``: one list of :class:`Op` per pipeline rank (see the module doc).

    With ``prefix`` (:func:`time_prefix`), the actions it timed are left out: an op that waits
    for one of them waits for its name (which ``prefix.ends`` times) plus the cut's transfer
    where the input crosses ranks, in place of the SEND/RECV pair."""
    _check_spec(spec)
    zero_stage(spec.zero)  # a bad stage fails here with zero_def's message
    pp, m, n_stages = spec.pp, spec.microbatches, len(spec.stages)
    v = spec.virtual_stages
    order = timing_order(spec.schedule, pp, m, v)
    z = zero_stage(spec.zero) if spec.dp > 1 else None
    gather = z is not None and z.param_gather == "per_use"
    last_grad = _last_grads(order, n_stages)  # stage -> index of the last action that makes its weight gradients

    def is_last(a: Action) -> bool:
        return order[last_grad[a.stage]][1] == a

    def reduces(a: Action) -> bool:
        return a.kind in ("W", "BW") and z is not None and (z.grad_reduce_every_microbatch or is_last(a))

    tied_at: dict[tuple[int, int], TiedCost] = {}  # (stage, group) -> the tied parameter it holds a copy of
    for t in spec.tied:
        if len({s % pp for s in t.stages}) > 1:  # copies on one rank add up locally
            for s, g in zip(t.stages, t.groups):
                if not any(x % pp == s % pp and t is u for (x, _), u in tied_at.items()):
                    tied_at[s, g] = t

    def split(a: Action) -> bool:
        if a.kind in ("F", "B"):
            return gather
        return gather or reduces(a)

    memo: dict[tuple[int, str, int], list[tuple[str, int, float]]] = {}

    def pieces(a: Action) -> list[tuple[str, int, float]]:
        key = (a.stage, a.kind, a.microbatch)
        if key not in memo:
            groups = spec.stages[a.stage].groups
            if not split(a):
                memo[key] = [(str(a), -1, sum(_times(g, a.kind) for g in groups))]
            else:
                group_order = range(len(groups)) if a.kind == "F" else reversed(range(len(groups)))
                memo[key] = [(f"{a}.g{g}", g, _times(groups[g], a.kind)) for g in group_order]
        return memo[key]

    priced: dict[tuple[str, float], float] = {}  # repeated layers: one pricing per collective and size

    def dp_op(kind: str, name: str, collective: str, grp: GroupCost, stream: str, waits, a: Action, g: int) -> Op:
        nbytes = grp.bucket_bytes
        seconds = priced.get((collective, nbytes, grp.expert_bytes))
        if seconds is None:
            seconds = priced[collective, nbytes, grp.expert_bytes] = dp_collective_s(
                collective, nbytes, spec.dp, spec.dp_link, grp.expert_bytes, spec.replicas, spec.replica_link)
        return Op(name, kind, seconds, tuple(waits), stage=a.stage, microbatch=a.microbatch, group=g, action=a,
                  stream=stream, collective=collective, group_size=spec.dp, nbytes=nbytes, link=spec.dp_link)

    program: dict[int, list[Op]] = {r: [] for r in range(pp)}
    done = prefix.done if prefix is not None else None
    # walk an order in which every action comes after its inputs, so each RECV is placed before the op that reads it
    for i in (prefix.tail if prefix is not None else range(len(order))):
        rank, a, needs = order[i]
        ops, groups = program[rank], spec.stages[a.stage].groups
        waits = []
        for j, cut, back in needs:
            p = order[j][1]
            if done is not None and done[j]:
                delay = 0.0 if cut < 0 else spec.stages[cut].back_s if back else spec.stages[cut].send_s
                waits.append((str(p), delay))
            elif cut < 0:
                waits.append((pieces(p)[-1][0], 0.0))
            else:
                waits.append((f"{p.stage}RECV_{'B' if back else 'F'}{p.microbatch}", 0.0))
        parts = pieces(a)
        unshard = gather and a.kind != "W"
        phase = "F" if a.kind == "F" else "B"

        def unshard_op(g: int) -> Op:
            return dp_op("UNSHARD", f"{a.stage}UNSHARD_{phase}{a.microbatch}.g{g}", "all_gather",
                         groups[g], "dp.gather", (), a, g)

        reduce_here = reduces(a)
        for n, (name, g, seconds) in enumerate(parts):
            piece_waits = list(waits) if n == 0 else []
            if unshard and groups[g].bucket_bytes > 0:
                if n == 0:  # the first group's gather; each later one is issued as the piece before starts
                    ops.append(unshard_op(g))
                piece_waits.append((f"{a.stage}UNSHARD_{phase}{a.microbatch}.g{g}", 0.0))
            ops.append(Op(name, a.kind, seconds, tuple(piece_waits), stage=a.stage, microbatch=a.microbatch,
                          group=g, action=a))
            if n + 1 == len(parts):  # the output goes to the next rank before any collective
                _add_p2p(ops, program, a, name, spec, n_stages)
            if unshard and n + 1 < len(parts) and groups[parts[n + 1][1]].bucket_bytes > 0:
                ops.append(unshard_op(parts[n + 1][1]))
            if reduce_here and g >= 0 and groups[g].bucket_bytes > 0:
                ops.append(dp_op("REDUCE_GRAD", f"{a.stage}REDUCE_GRAD{a.microbatch}.g{g}", z.grad_collective,
                                 groups[g], "dp.reduce", [(name, 0.0)], a, g))
    last = [order[last_grad[s]][1] for s in range(n_stages)]
    _add_tied(program, spec, last, tied_at, pieces, reduces)
    _add_optimizer(program, spec, z, last, last_grad, reduces, tied_at)
    return program


def _add_tied(program, spec: StepSpec, last, tied_at, pieces, reduces) -> None:
    """Each rank's tied-parameter all-reduces as the runtime runs them
    (``parallel._finish_and_step``): after the rank's last gradient reductions, one after the
    other in the order of the parameters' names. Every rank must issue a shared stream's
    collectives in one order: in backward order, two tied parameters in different groups would
    meet the first and last stage in opposite orders and wait for each other forever."""
    for rank in program:
        finished = [(f"{s}REDUCE_GRAD{last[s].microbatch}.g{g}", 0.0)
                    for s in range(rank, len(spec.stages), spec.pp) if reduces(last[s])
                    for g, grp in enumerate(spec.stages[s].groups) if grp.bucket_bytes > 0]
        for (s, g), t in sorted(tied_at.items(), key=lambda kv: kv[1].name):
            if s % spec.pp != rank:
                continue
            piece = next(name for name, g_, _ in pieces(last[s]) if g_ in (g, -1))
            ranks = tuple(sorted({x % spec.pp for x in t.stages}))
            program[rank].append(Op(f"TIED_REDUCE {t.name}", "TIED_REDUCE",
                                    comm.all_reduce_s(t.nbytes, len(ranks), t.link), ((piece, 0.0), *finished),
                                    stage=s, group=g, stream="tied", collective="all_reduce",
                                    group_size=len(ranks), nbytes=t.nbytes, link=t.link, ranks=ranks))


def _last_grads(order, n_stages: int) -> dict[int, int]:
    """Per stage, the index in ``order`` (:func:`autopar.cost.schedule.timing_order`) of the last
    action that makes its weight gradients (W or BW): each rank's list keeps its order there."""
    last: dict[int, int] = {}
    for i in range(len(order) - 1, -1, -1):
        a = order[i][1]
        if a.kind in ("W", "BW") and a.stage not in last:
            last[a.stage] = i
            if len(last) == n_stages:
                break
    return last


def _add_p2p(ops: list[Op], program: dict[int, list[Op]], a: Action, done: str, spec: StepSpec,
             n_stages: int) -> None:
    """After an action whose output another rank reads: its SEND here, the peer's RECV there
    (appended now, so each rank posts its RECVs in the order the peer sends)."""
    pp = spec.pp
    if a.kind == "F" and a.stage + 1 < n_stages:
        peer_stage, tag, cut = a.stage + 1, "F", a.stage
    elif a.kind in ("B", "BW") and a.stage > 0:
        peer_stage, tag, cut = a.stage - 1, "B", a.stage - 1
    else:
        return
    if peer_stage % pp == a.stage % pp:
        return
    send = f"{a.stage}SEND_{tag}{a.microbatch}"
    seconds = spec.stages[cut].send_s if tag == "F" else spec.stages[cut].back_s
    ops.append(Op(send, "SEND", seconds, ((done, 0.0),), stage=a.stage, microbatch=a.microbatch,
                  action=a))
    program[peer_stage % pp].append(Op(f"{a.stage}RECV_{tag}{a.microbatch}", "RECV", 0.0, ((send, 0.0),),
                                       stage=peer_stage, microbatch=a.microbatch))


def _add_optimizer(program, spec: StepSpec, z, last, last_index, reduces, tied_at) -> None:
    """Each rank steps its stages after its last compute, in the order their backward ended;
    a stage's step waits for its last gradient reductions (a stream runs them in issue order,
    so the earlier ones are done too) and its tied all-reduces; stages 1/2 then gather each
    bucket back."""
    for rank in program:
        ops = program[rank]
        for s in sorted(range(rank, len(spec.stages), spec.pp), key=lambda s: last_index[s]):
            a, groups = last[s], spec.stages[s].groups
            waits = [(f"{s}REDUCE_GRAD{a.microbatch}.g{g}", 0.0) for g, grp in enumerate(groups)
                     if reduces(a) and grp.bucket_bytes > 0]
            waits += [(f"TIED_REDUCE {tied_at[s, g].name}", 0.0) for g in range(len(groups)) if (s, g) in tied_at]
            ops.append(Op(f"{s}OPT", "OPT", spec.stages[s].optimizer_s, tuple(waits), stage=s))
            if z is not None and z.param_gather == "after_step":
                for g, grp in enumerate(groups):
                    if grp.bucket_bytes > 0:
                        seconds = dp_collective_s("all_gather", grp.bucket_bytes, spec.dp, spec.dp_link,
                                                  grp.expert_bytes, spec.replicas, spec.replica_link)
                        ops.append(Op(f"{s}PARAM_GATHER.g{g}", "PARAM_GATHER", seconds, ((f"{s}OPT", 0.0),),
                                      stage=s, group=g, stream="dp.gather", collective="all_gather",
                                      group_size=spec.dp, nbytes=grp.bucket_bytes, link=spec.dp_link))


def dp_collective_s(collective: str, nbytes: float, dp: int, link: comm.Link, expert_bytes: float = 0.0,
                    replicas: int = 0, replica_link: comm.Link | None = None) -> float:
    """One dp collective of a layer group's bucket of ``nbytes``, alone on its links: under expert
    parallelism (``replica_link`` given) ``expert_bytes`` of them run over the experts' replica
    group of ``replicas`` ranks (nothing to do for one), the rest over dp, one after the other,
    as the runtime issues its two buckets (:mod:`autopar.runtime.zero`)."""
    if not expert_bytes or replica_link is None:
        return _COLLECTIVE_S[collective](nbytes, dp, link)
    rest = nbytes - expert_bytes
    seconds = _COLLECTIVE_S[collective](rest, dp, link) if rest > 0 else 0.0
    return seconds + (_COLLECTIVE_S[collective](expert_bytes, replicas, replica_link) if replicas > 1 else 0.0)


def group_dp_s(bucket_bytes: float, *, zero: int, dp: int, link: comm.Link, microbatches: int,
               expert_bytes: float = 0.0, replicas: int = 0, replica_link: comm.Link | None = None) -> float:
    """Seconds of dp collectives one bucket issues in a step (each alone on its link; ``expert_bytes``,
    ``replicas`` and ``replica_link`` as :func:`dp_collective_s`)."""
    if dp == 1 or bucket_bytes == 0:
        return 0.0
    return _group_dp_s(bucket_bytes, zero, dp, link, microbatches, expert_bytes, replicas, replica_link)


@lru_cache(maxsize=65536)
def _group_dp_s(nbytes: float, zero: int, dp: int, link: comm.Link, microbatches: int, expert_bytes: float = 0.0,
                replicas: int = 0, replica_link: comm.Link | None = None) -> float:
    """Cached: the search prices the same buckets (repeated layers) for thousands of candidates.
    The whole :class:`comm.Link` (frozen, so hashable) is the key: its NVSwitch tables, base
    latency and all-reduce bandwidth price each collective exactly as the simulated step
    program does (a bare ``Link(bytes_per_s, latency_s)`` rebuilt here dropped them)."""
    counts = step_collective_counts(zero, n_micro=microbatches)
    return sum(k * dp_collective_s(kind, nbytes, dp, link, expert_bytes, replicas, replica_link)
               for kind, k in counts.items())


def estimate_exposed_s(stage: StageCost, *, zero: int, dp: int, link: comm.Link, microbatches: int,
                       replicas: int = 0, replica_link: comm.Link | None = None) -> float:
    """A cheap estimate of a stage's exposed dp time, for ranking before simulation.

    What cannot hide: the last bucket's reduction (group 0 finishes the backward), the first
    group's ZeRO-3 gather, and the gathers after the optimizer step (stages 1, 2); the rest
    hides while the compute it may overlap (the backward, every micro-batch's for stages 2
    and 3, and the forward too for stage 3's gathers) lasts long enough.
    """
    if dp == 1:
        return 0.0
    z = zero_stage(zero)
    groups = [g for g in stage.groups if g.bucket_bytes > 0]
    if not groups:
        return 0.0
    experts = dict(replicas=replicas, replica_link=replica_link)
    total = sum(group_dp_s(g.bucket_bytes, zero=zero, dp=dp, link=link, microbatches=microbatches,
                           expert_bytes=g.expert_bytes, **experts) for g in groups)

    def once(kind: str, g: GroupCost) -> float:
        return dp_collective_s(kind, g.bucket_bytes, dp, link, g.expert_bytes, replicas, replica_link)

    floor = once(z.grad_collective, groups[0])
    if z.param_gather == "after_step":
        floor += sum(once("all_gather", g) for g in groups)
    if z.param_gather == "per_use":
        floor += once("all_gather", groups[0])
    per_use = z.param_gather == "per_use"
    compute = sum(g.b_s + g.w_s + (g.f_s if per_use else 0.0) for g in stage.groups)
    overlap = compute * (microbatches if z.grad_reduce_every_microbatch else 1)
    return max(floor, total - overlap)

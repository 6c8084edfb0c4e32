"""Helpers for testing with autopar: golden plans, and runs in several processes (gloo on CPU).

``assert_plan_matches(plan, "golden/NAME.json")`` compares a plan with a golden
plan file next to the calling test (see :mod:`autopar.plan_diff` for what counts
as a change) and fails with the readable diff. Run pytest with
``--autopar-update-golden`` (the :mod:`autopar.pytest_plugin` option) or with
``AUTOPAR_UPDATE_GOLDEN=1`` to write golden files that are missing or differ.

``spawn_world(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` fresh
processes with a gloo process group over loopback and returns what each rank's
``fn`` returned, in rank order; an exception on any rank, or a rank's process dying,
is re-raised here with that rank's traceback or exit code. Every rank has a timeout,
so a hang fails the test instead of stalling it. With ``allow_failures=True`` it
returns a :class:`RankOutcome` per rank instead (value, or error and exit code), for
tests in which ranks are meant to fail; the launcher hosts the c10d store, as
torchrun's agent does, so a rank's death (rank 0's included) does not take it along.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from autopar.plan import Plan

__all__ = ["assert_plan_matches", "update_golden_requested", "spawn_world", "RankOutcome", "free_port", "fast_cluster",
           "tp_friendly_cluster", "slow_network_cluster", "tp_only_cluster", "forget_planner_memos", "torch_version",
           "GOLDEN_TORCH", "DROPOUT_P0_TRACED"]

UPDATE_ENV = "AUTOPAR_UPDATE_GOLDEN"


def torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor), read from its package metadata (no torch import)."""
    from importlib.metadata import version

    major, minor = version("torch").split("+")[0].split(".")[:2]
    return int(major), int(minor)


GOLDEN_TORCH = (2, 13)
"""The torch release tests/golden/*.json were planned with (the one CI installs). Another release
traces and shards differently (DTensor's rules, what export keeps), and a plan may move with it:
there the golden tests check each plan's validity, not its equality to the file."""

DROPOUT_P0_TRACED = torch_version() < (2, 14)
"""Whether torch's trace keeps a dropout of p=0 (torch 2.13: a clone; 2.14 leaves no op), and so
whether a model's p=0 ``nn.Dropout`` module is a layer of its plan (the GPT example's
``transformer.drop``)."""


def update_golden_requested() -> bool:
    """True under ``pytest --autopar-update-golden`` or with ``AUTOPAR_UPDATE_GOLDEN`` set (not to "" or "0")."""
    if os.environ.get(UPDATE_ENV, "").strip() not in ("", "0"):
        return True
    plugin = sys.modules.get("autopar.pytest_plugin")
    return bool(plugin and plugin.update_golden)


def assert_plan_matches(plan: Plan, golden: str | os.PathLike, *, rtol: float = 0.01, update: bool | None = None,
                        limit: int = 20) -> None:
    """Fail with the readable diff when ``plan`` differs from the golden plan file.

    ``golden`` is absolute or relative to the directory of the calling file.
    Floats (predictions) compare with relative tolerance ``rtol``; everything
    else exactly. With ``update`` (default: :func:`update_golden_requested`) a
    missing or differing golden file is (re)written, with a warning saying so;
    one that matches within ``rtol`` is left as it is, so files do not churn
    in their last digits. ``limit`` caps the printed changes per group.
    """
    from autopar.plan_diff import diff_plans, load_plan_file

    path = Path(golden)
    if not path.is_absolute():
        path = Path(sys._getframe(1).f_code.co_filename).resolve().parent / path
    if update is None:
        update = update_golden_requested()
    if not path.exists():
        if not update:
            raise AssertionError(
                f"golden plan {path} does not exist; run pytest with --autopar-update-golden "
                f"(or {UPDATE_ENV}=1) to write it from this plan, then review and commit it")
        path.parent.mkdir(parents=True, exist_ok=True)
        plan.save(path)
        warnings.warn(f"wrote new golden plan {path}", stacklevel=2)
        return
    diff = diff_plans(load_plan_file(path), plan, rtol=rtol)
    if diff.equal:
        return
    if update:
        plan.save(path)
        warnings.warn(f"updated golden plan {path}: {len(diff.changes)} changes", stacklevel=2)
        return
    raise AssertionError(
        f"plan differs from golden plan {path}\n{diff.render(old_label='golden', new_label='plan', limit=limit)}\n"
        f"(if the change is intended, rerun with --autopar-update-golden or {UPDATE_ENV}=1 and commit the file)")


def forget_planner_memos() -> None:
    """Empty the planner's in-process memos (solved MIPs, schedules, timing orders: what a second
    plan in this process would reuse), so a benchmark's next plan costs what a first one does."""
    import functools

    from autopar.planner import ilp

    ilp._SOLVED.clear()
    for name, module in list(sys.modules.items()):
        if name.startswith("autopar"):
            for obj in list(vars(module).values()):
                if isinstance(obj, functools._lru_cache_wrapper):
                    obj.cache_clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a rank imports anyway (torch, the distributed runtime, the planner, dynamo and AOTAutograd
# for the trace): about 5 CPU-seconds a process. spawn_world's ranks are forked from a server
# process that imported them once (multiprocessing's forkserver), instead of each importing them
# again in a fresh interpreter: the multi-process tests start a few hundred ranks.
# The server also traces one small model (autopar._warm_ranks), so that each rank's first trace
# costs what a second one does.
_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
            "torch._functorch.aot_autograd", "autopar.parallel", "autopar.planner.make", "autopar._warm_ranks")


def _context(start_method: str):
    import torch.multiprocessing as mp  # here, not at the top: golden-plan tests need no torch import

    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(_PRELOAD))  # (takes effect when the server starts: first call)
    return ctx


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue, environ: dict,
           forked: bool) -> None:
    # A forked rank inherits the server's environment of when it started; give it the caller's,
    # as a spawned one would have.
    os.environ.clear()
    os.environ.update(environ)
    # TORCHELASTIC_USE_AGENT_STORE: every rank is a client of the store the parent hosts, as under
    # torchrun, so the store outlives any rank (a killed rank 0 included).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True")
    import torch
    import torch.distributed as dist

    if world > 1 and "OMP_NUM_THREADS" not in environ:
        # One intra-op thread per rank, as torchrun sets for more than one process per node. With
        # torch's default (a thread per core) every rank's OpenMP pool spins on the same cores:
        # a 4-rank gloo step of the GPT test model took 1.4 s of wall clock and 2.8 CPU-s on 2
        # cores, 0.21 s and 0.34 CPU-s with one thread each. (The forked rank has torch imported
        # already, so the environment variable alone would come too late.)
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)

    try:
        result = fn(rank, world, *args)
        queue.put((rank, "ok", (result, _own_cpu_s() if forked else 0.0)))
    except BaseException as e:  # report every failure to the parent
        queue.put((rank, "error", (f"{type(e).__name__}: {e}", traceback.format_exc(), _own_cpu_s() if forked else 0.0)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class RankOutcome:
    """How one rank of :func:`spawn_world` ended (with ``allow_failures=True``)."""

    rank: int
    ok: bool
    value: Any = None
    """What ``fn`` returned (when ``ok``)."""
    error: str = ""
    """``"TypeName: message"`` of the exception ``fn`` raised, or how the process died."""
    traceback: str = ""
    exitcode: int | None = None
    """The process exit code; negative for a signal (``-9``: SIGKILL), None if it was still running."""


def spawn_world(fn: Callable, world: int, *args: Any, timeout_s: float = 900.0,
                allow_failures: bool = False, start_method: str = "forkserver") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; their results in rank order.

    The parent hosts the c10d store (as torchrun's agent does), so it outlives every rank.
    A world is hung when for ``timeout_s`` no rank finished and the ranks together used
    less than a CPU-second (a hundredth of ``timeout_s`` when that is shorter; read from ``/proc``; where that is missing, the wall clock
    alone decides): a rank blocked in a collective or a receive uses no CPU, a slow one
    does. So a loaded machine only slows a world down, it never fails it (a 2-rank world
    of six Hugging Face models ran past 900 s of wall clock beside another copy of the
    suite), while a real hang fails the run within ``timeout_s``. A rank that raises, or whose
    process dies without reporting (``os._exit``, a signal), fails the call at once with
    its traceback or exit code; with ``allow_failures=True`` every rank runs to its end and
    the call returns one :class:`RankOutcome` per rank instead (a rank still running after
    ``timeout_s`` without progress is killed and reported as hung).

    Ranks start as multiprocessing's ``start_method`` says: by default forked from a server
    that has torch and autopar imported (each rank then skips seconds of imports; the server's
    imports happen once per calling process), with the caller's environment variables; pass
    ``"spawn"`` for fresh interpreters (what a start-up benchmark should time). Each rank of a
    world of more than one runs one intra-op thread unless the caller's environment sets
    ``OMP_NUM_THREADS``, as torchrun does.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = _context(start_method)
    queue = ctx.Queue()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world, store.port, fn, args, queue, environ,
                                                   start_method == "forkserver"))
             for r in range(world)]
    for p in procs:
        p.start()
    outcomes: dict[int, RankOutcome] = {}
    failed = False
    try:
        deadline = time.monotonic() + timeout_s
        cpu_mark = _cpu_seconds(procs)
        while len(outcomes) < world and not (failed and not allow_failures):
            try:
                rank, status, value = queue.get(timeout=0.5)
            except queue_module.Empty:
                for r, p in enumerate(procs):
                    if r not in outcomes and p.exitcode is not None and not _drain(queue, outcomes, procs):
                        outcomes[r] = RankOutcome(r, ok=False, exitcode=p.exitcode,
                                                  error=f"the process died with exit code {p.exitcode} "
                                                        f"without reporting (killed, or os._exit)")
                        failed = True
                if time.monotonic() > deadline:
                    cpu = _cpu_seconds(procs)
                    if cpu is None or cpu_mark is None or cpu - cpu_mark < min(1.0, timeout_s / 100):
                        break
                    cpu_mark, deadline = cpu, time.monotonic() + timeout_s  # slow, not stuck
                continue
            outcomes[rank] = _outcome(rank, status, value, procs)
            failed = failed or status != "ok"
            deadline = time.monotonic() + timeout_s
    finally:
        for p in procs:
            p.join(timeout=5 if failed or len(outcomes) < world else timeout_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del store
    for r, p in enumerate(procs):
        if r not in outcomes:
            outcomes[r] = RankOutcome(r, ok=False, exitcode=p.exitcode,
                                      error=f"did not finish: no rank finished and the ranks used almost no CPU "
                                            f"for {timeout_s:g} s (hung; killed)")
    if allow_failures:
        return [outcomes[r] for r in range(world)]
    bad = [o for o in outcomes.values() if not o.ok]
    if bad:
        first = min(bad, key=lambda o: (o.error.startswith("did not finish"), o.rank))
        raise RuntimeError(f"a rank failed:\nrank {first.rank}: {first.error}\n{first.traceback}")
    return [outcomes[r].value for r in range(world)]


_RANKS_CPU_S = 0.0


def ranks_cpu_seconds() -> float:
    """CPU seconds used so far by the ranks of this process's :func:`spawn_world` calls (as each
    rank reported when its ``fn`` ended) under the forkserver start method: such a rank is not
    this process's child, so ``RUSAGE_CHILDREN`` misses it; the suite's CPU log
    (tests/conftest.py) adds this. (Spawned ranks are children, reaped and counted there.)"""
    return _RANKS_CPU_S


def _own_cpu_s() -> float:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def _cpu_seconds(procs) -> float | None:
    """User + system CPU seconds the live rank processes have used so far; None without /proc."""
    total = 0.0
    for p in procs:
        if p.exitcode is not None or p.pid is None:
            continue
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


def _outcome(rank: int, status: str, value: Any, procs) -> RankOutcome:
    global _RANKS_CPU_S
    *value, cpu = value
    _RANKS_CPU_S += cpu
    if status == "ok":
        return RankOutcome(rank, ok=True, value=value[0])
    error, tb = value
    return RankOutcome(rank, ok=False, error=error, traceback=tb, exitcode=procs[rank].exitcode)


def _drain(queue, outcomes: dict, procs) -> bool:
    """Read any result already in the pipe (a rank that reported, then exited); True if one came."""
    got = False
    while True:
        try:
            rank, status, value = queue.get(timeout=0.5)
        except queue_module.Empty:
            return got
        outcomes[rank] = _outcome(rank, status, value, procs)
        got = True


def fast_cluster(spec: str):
    """A cluster whose links cost nothing, so the planner shards whatever it can
    (the numerics of every placement get exercised on tiny test models)."""
    from autopar.cluster import parse_cluster

    return parse_cluster(spec).with_overrides(intra_node_bytes_per_s=1e18, inter_node_bytes_per_s=1e18,
                                              intra_node_latency_s=0.0, inter_node_latency_s=0.0)


def tp_friendly_cluster(spec: str):
    """CPU-class compute with fast links (100 GB/s, 3 us): on tiny test models the cheapest
    plan on a tp axis is then Megatron's (weights sharded, one all-reduce per block half)."""
    from autopar.cluster import parse_cluster

    return parse_cluster(spec).with_overrides(intra_node_bytes_per_s=1e11, inter_node_bytes_per_s=1e11,
                                              intra_node_latency_s=3e-6, inter_node_latency_s=3e-6)


def slow_network_cluster(spec: str):
    """:func:`tp_friendly_cluster` inside a node and a slow network between nodes (1 MB/s):
    on tiny test models a pipeline cut across nodes then sends the values replicated on tp
    as tp pieces that the receiving tp group all-gathers
    (:func:`autopar.planner.timing.message_send`)."""
    return tp_friendly_cluster(spec).with_overrides(inter_node_bytes_per_s=1e6)


def tp_only_cluster(spec: str):
    """As :func:`tp_friendly_cluster`, with memory-bound ops almost free (HBM at 100 TB/s):
    sharding norms over the sequence then saves nothing and costs an extra collective
    call, so the tp axis runs plain Megatron tensor parallelism without sequence parallelism."""
    return tp_friendly_cluster(spec).with_overrides(hbm_bytes_per_s=1e14)

"""Run one rank's share of a pipeline schedule: F, B and W pieces and the p2p between them.

A rank holds the stages ``s`` with ``s % pp == pp_rank`` (one stage, or several
under the interleaved schedule) and runs its action list from
:func:`autopar.cost.schedule.with_comm` in order: ``1F3`` runs stage 1's forward
piece on micro-batch 3, ``1SEND_F3`` sends what stage 2 reads of it, ``2RECV_B3``
receives the gradients stage 3 computed for stage 2, ``0BW1`` runs
B and W as one piece, in the program's order (:attr:`StageProgram.backward`). The
lists come from one global order in which every receive sits at its send, so a
rank waiting on a receive never waits on a peer that waits on it: no deadlock,
with stages sending to each other in both directions.

Each message is one buffer per dtype (the named tensors flattened and
concatenated) sent with ``isend`` and received with ``irecv`` into a buffer sized
from the program's shapes; the peer is the rank with the same dp and tp
coordinates on the neighbouring stage. A receive is posted where the list has it
and waited for only when the piece that reads it starts (as torch's pipeline
runtime does): the lists put a receive at its peer's send, often before this
rank's own action of the same moment (``1RECV_F1 1F0``: stage 1 would wait for
stage 0's second forward before running its first), and waiting there made the
two ranks take turns instead of overlapping. Posted in the lists' order and
waited for later, the receives still match the sends in order, and no rank waits
on a send that its peer has not already posted or will post before waiting
itself (each wait is for a send earlier in the one global order). Where the plan says so for a message (its
``tp_gather_bytes`` in ``communication["p2p"]["pp"]["cuts"]``), the values every
tp rank holds whole (replicated on tp: rotary tables, a block output when the
residual stream is not split) are not sent tp times over: tp rank ``t`` sends
only piece ``t`` of each (its flattened elements cut in tp pieces of
``ceil(numel / tp)``, the last one padded), at the end of the buffer, and the
receiving stage's tp group all-gathers the pieces into the whole values. This is
Megatron-LM's scatter/gather of pipeline tensors (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", sec. 4.1): 1/tp of the bytes on the pipeline link, which may cross
nodes, for an all-gather on the tp link, which stays inside one. The planner
chooses it per message where it is faster
(:func:`autopar.planner.timing.message_send`). Sends are waited for at the end
of the step (the buffers stay referenced until then). A receive waits at most
``timeout_s``; every send, receive and compute piece (whose tp collectives wait on
the tp group) runs under ``guard``, which turns a backend failure into an error
naming the action and the peer (:mod:`autopar.runtime.watch`).

Per stage and micro-batch a store maps value names to tensors; after F (and its
send) it keeps only what B, W or a later send reads, after B only what W reads,
and W empties it, so a stage holds a micro-batch's activations from its F to
its B, and only W's inputs from its B to its W.
"""

from __future__ import annotations

import re
import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import ContextManager

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from autopar.cost.schedule import make_schedule, parse_action, with_comm
from autopar.passes.pipeline import INPUT_PREFIX, PARAM_PREFIX, Message, Piece, PipelineProgram
from autopar.runtime.liveness import LiveBytes, storage_key

__all__ = ["PipelineRunner", "tp_pieces"]

_COMM = re.compile(r"(\d+)(SEND|RECV)_([FB])(\d+)")


def _no_guard(action: str, peers: list[int] | None = None) -> ContextManager:
    return contextlib.nullcontext()


class PipelineRunner:
    """Execute ``schedule`` for the stages of one pipeline rank (see the module docstring).

    ``rank_of_stage(stage)`` is the global rank that runs ``stage`` with this rank's
    dp and tp coordinates. ``run`` returns (sum over micro-batches of the loss on
    this rank's last stage or None, gradient addends by parameter).
    """

    def __init__(self, program: PipelineProgram, *, pp: int, pp_rank: int, schedule: str, n_micro: int,
                 rank_of_stage: Callable[[int], int], n_virtual: int = 1,
                 guard: Callable[[str, list[int] | None], ContextManager] = _no_guard, timeout_s: float | None = None,
                 tp_ranks: list[int] | None = None, begin_microbatch: Callable[[int], None] | None = None,
                 device: torch.device | str = "cpu", tp_group: dist.ProcessGroup | None = None,
                 tp_pieces: dict[tuple[int, str], frozenset[str]] | None = None):
        self.program = program
        self.device = torch.device(device)
        """Where receive buffers are created (this rank's device: NCCL receives only into device tensors)."""
        self.begin_microbatch = begin_microbatch
        """Called with the micro-batch before each compute piece (the ZeRO calls inside read it)."""
        self.guard = guard
        """``guard(action, peers)``: a context that turns a failed wait on ``peers`` into an error naming them."""
        self.timeout_s = timeout_s
        """Seconds a receive waits for its message (None: the process group's timeout)."""
        self.tp_ranks = tp_ranks or []
        """The ranks of this rank's tp group (their collectives run inside F, B and W)."""
        self.tp_group = tp_group
        """This rank's tp group: it all-gathers the pieces of replicated values a message brings."""
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.tp_pieces = tp_pieces or {}
        """(cut, "F" or "B") -> the dtypes ("bfloat16") whose message sends its values replicated
        on tp as tp pieces, gathered on arrival (the plan's choice, :func:`tp_pieces`)."""
        self.n_stages = len(program.stages)
        self.pp_rank = pp_rank
        self.n_micro = n_micro
        self.rank_of_stage = rank_of_stage
        sched = make_schedule(schedule, n_stages=pp, n_micro=n_micro, n_virtual=n_virtual)
        self.actions: list[str] = with_comm(sched, self.n_stages)[pp_rank]
        self.log: list[str] = []
        """The actions of the last ``run``, in the order they ran (tests compare it with ``actions``)."""
        self.peak_stored_bytes = 0
        """Most bytes the rank's stores held at once during the last ``run`` (activations kept for
        B and W, and received values): measured on the live tensors, each storage counted once."""
        self.measure = False
        """Run each piece op by op (:class:`autopar.runtime.liveness.LiveBytes`, slower, the same
        result) and set :attr:`peak_bytes`."""
        self.peak_bytes = 0
        """With :attr:`measure`: the most intermediate bytes the rank held at once during the last
        ``run``: what its stores held when a piece started plus the piece's own peak of live values."""

    def run(self, micro_inputs: list[dict[str, torch.Tensor]], params: dict[str, torch.Tensor]):
        self._inputs, self._params = micro_inputs, params
        self._store: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._grads: dict[str, torch.Tensor] = {}
        self._pending: list[tuple[dist.Work, torch.Tensor, int]] = []
        self._arriving: dict[tuple[int, int, str], list[tuple[torch.Tensor, Callable[[], None]]]] = {}
        """(stage, micro-batch, channel) -> the posted receives of its message, each as (its
        buffer, what waits for it and puts the values in the store), until the piece that reads them."""
        self._loss: torch.Tensor | None = None
        self._sent_b: set[tuple[int, int]] = set()
        self._done_w: set[tuple[int, int]] = set()
        self.log = []
        self.peak_stored_bytes = self.peak_bytes = 0
        try:
            for text in self.actions:
                comm = _COMM.fullmatch(text)
                if comm:
                    stage, op, channel, mb = int(comm[1]), comm[2], comm[3], int(comm[4])
                    (self._send if op == "SEND" else self._recv)(stage, channel, mb)
                else:
                    a = parse_action(text)
                    self._compute(a.stage, a.kind, a.microbatch)  # (BW: the fused backward piece)
                    self.peak_stored_bytes = max(self.peak_stored_bytes, self._stored_bytes())
                self.log.append(text)
            peers = sorted({peer for _, _, peer in self._pending})
            with self.guard(f"completion of this step's pipeline sends to {_ranks(peers)}", peers):
                for work, _, _ in self._pending:
                    work.wait()
        finally:
            leftover = {k: sorted(v) for k, v in self._store.items() if v}
            unread = sorted(self._arriving)
            self._store, self._pending, self._arriving = {}, [], {}
        if unread:
            raise AssertionError(f"pipeline receives posted and never read this step (stage, micro-batch, "
                                 f"channel): {unread}")
        if leftover:
            raise AssertionError(f"values left in the pipeline store after the step: {leftover}")
        return self._loss, self._grads

    # -- compute ---------------------------------------------------------------

    def _values(self, piece: Piece, stage: int, mb: int, kind: str) -> list[torch.Tensor]:
        """The piece's inputs; a stored value nothing reads after the piece leaves the store, so it
        dies at its last use inside the piece (:class:`Piece`)."""
        store = self._store.setdefault((stage, mb), {})
        later = self._read_after(stage, kind, mb)
        out = []
        for key in piece.inputs:
            if key.startswith(PARAM_PREFIX):
                out.append(self._params[key[len(PARAM_PREFIX):]])
            elif key.startswith(INPUT_PREFIX):
                out.append(self._inputs[mb][key[len(INPUT_PREFIX):]])
            else:
                out.append(store[key] if key in later else store.pop(key))
        return out

    def _read_after(self, stage: int, kind: str, mb: int) -> frozenset[str]:
        """What the store must still hold for (stage, mb) once piece ``kind`` ran: what later pieces
        read and what is still to be sent (the prunes after each piece and send keep the same)."""
        st = self.program.stages[stage]
        if kind == "F":
            return st.keep_after_forward | (frozenset(st.send_forward.names) if st.send_forward else frozenset())
        unsent = st.send_backward is not None and (stage, mb) not in self._sent_b
        sends = frozenset(st.send_backward.names) if unsent else frozenset()
        return st.keep_after_backward | sends if kind == "B" else sends

    def _compute(self, stage: int, kind: str, mb: int) -> None:
        st = self.program.stages[stage]
        piece = {"F": st.forward, "B": st.backward_input, "W": st.backward_weight, "BW": st.backward}[kind]
        for _, finish in self._arriving.pop((stage, mb, "F" if kind == "F" else "B"), ()):
            finish()
        store = self._store.setdefault((stage, mb), {})
        what = f"stage {stage} {kind} of micro-batch {mb} (tp collectives over ranks {self.tp_ranks})"
        if self.begin_microbatch is not None:
            self.begin_microbatch(mb)
        with self.guard(what, self.tp_ranks):
            if self.measure:
                values = self._probed(piece, stage, mb, kind)
            else:
                values = piece(self._values(piece, stage, mb, kind))
        for name, value in zip(piece.outputs, values):
            fqn = st.grads.get(name)
            if fqn is not None and value is None:
                continue  # handed to its gradient bucket inside the piece
            if fqn is not None:
                self._grads[fqn] = value if fqn not in self._grads else self._grads[fqn] + value
            elif name == st.loss:
                loss = value.detach()
                self._loss = loss if self._loss is None else self._loss + loss
            else:
                store[name] = value
        if kind == "F" and st.send_forward is None:
            self._prune(stage, mb, st.keep_after_forward)
        elif kind == "B" and st.send_backward is None:
            self._prune(stage, mb, st.keep_after_backward)
        elif kind in ("W", "BW"):
            self._done_w.add((stage, mb))
            unsent = st.send_backward is not None and (stage, mb) not in self._sent_b
            self._prune(stage, mb, frozenset(st.send_backward.names) if unsent else frozenset())

    def _probed(self, piece: Piece, stage: int, mb: int, kind: str) -> tuple:
        """Run ``piece`` op by op and take the rank's peak: what the stores hold beside it plus the
        piece's live values (the inputs it took out of the store among them, until their last use)."""
        values = self._values(piece, stage, mb, kind)
        stored = self._stored()
        probe = LiveBytes(piece.gm)
        out = probe.run(*values, counted_elsewhere=set(stored) | {storage_key(v) for v in self._params.values()
                                                                  if isinstance(v, torch.Tensor)})
        del values
        self.peak_bytes = max(self.peak_bytes, sum(stored.values()) + probe.peak_bytes)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def _stored(self) -> dict[int, int]:
        """The storages the rank's stores hold, each once: data pointer -> bytes."""
        seen: dict[int, int] = {}
        for posted in self._arriving.values():  # (posted receives hold their buffers)
            for buf, _ in posted:
                seen[storage_key(buf)] = buf.untyped_storage().nbytes()
        for store in self._store.values():
            for t in tree_leaves(list(store.values())):  # (an op with several outputs stores a tuple)
                if isinstance(t, torch.Tensor):
                    seen[storage_key(t)] = t.untyped_storage().nbytes()
        return seen

    def _stored_bytes(self) -> int:
        return sum(self._stored().values())

    def _prune(self, stage: int, mb: int, keep: frozenset[str]) -> None:
        store = self._store.get((stage, mb), {})
        for name in [n for n in store if n not in keep]:
            del store[name]

    # -- p2p ---------------------------------------------------------------------

    def _tag(self, channel: str, cut: int, mb: int, part: int) -> int:
        return ((mb * 2 + (channel == "B")) * self.n_stages + cut) * 16 + part

    def _send(self, stage: int, channel: str, mb: int) -> None:
        st = self.program.stages[stage]
        msg = st.send_forward if channel == "F" else st.send_backward
        peer_stage, cut = (stage + 1, stage) if channel == "F" else (stage - 1, stage - 1)
        store = self._store[(stage, mb)]
        peer = self.rank_of_stage(peer_stage)
        for part, (dtype, whole, split) in enumerate(_by_dtype(msg, self._pieces(cut, channel))):
            flat = [store[n].reshape(-1) for n in whole] + [_piece(store[n], self.tp, self.tp_rank) for n in split]
            buf = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=self.device)
            what = f"pipeline send of {_WHAT[channel]} for micro-batch {mb} from stage {stage} to rank {peer}"
            with self.guard(what, [peer]):
                self._pending.append((dist.isend(buf, peer, tag=self._tag(channel, cut, mb, part)), buf, peer))
        if channel == "F":
            self._prune(stage, mb, st.keep_after_forward)
        else:  # after a fused BW, W already ran: nothing is left to keep
            self._sent_b.add((stage, mb))
            self._prune(stage, mb, frozenset() if (stage, mb) in self._done_w else st.keep_after_backward)

    def _recv(self, stage: int, channel: str, mb: int) -> None:
        st = self.program.stages[stage]
        msg = st.recv_forward if channel == "F" else st.recv_backward
        peer_stage, cut = (stage - 1, stage - 1) if channel == "F" else (stage + 1, stage)
        peer = self.rank_of_stage(peer_stage)
        store = self._store.setdefault((stage, mb), {})
        shapes = dict(zip(msg.names, msg.shapes))
        for part, (dtype, whole, split) in enumerate(_by_dtype(msg, self._pieces(cut, channel))):
            sizes = [_numel(shapes[n]) for n in whole]
            pieces = [_piece_numel(_numel(shapes[n]), self.tp) for n in split]
            buf = torch.empty(sum(sizes) + sum(pieces), dtype=dtype, device=self.device)
            what = (f"pipeline recv of {_WHAT[channel]} for micro-batch {mb} of stage {stage} from rank {peer} "
                    f"(stage {peer_stage})")
            with self.guard(what, [peer]):
                work = dist.irecv(buf, peer, tag=self._tag(channel, cut, mb, part))

            def finish(work=work, buf=buf, what=what, whole=whole, sizes=sizes, split=split, pieces=pieces):
                with self.guard(what, [peer]):
                    if self.timeout_s is None:
                        work.wait()
                    else:
                        work.wait(timedelta(seconds=self.timeout_s))
                chunks = buf.split(sizes + [sum(pieces)])
                for name, chunk in zip(whole, chunks):
                    store[name] = chunk.view(shapes[name])
                if split:
                    self._gather(chunks[-1], split, pieces, shapes, store,
                                 f"{_WHAT[channel]} for micro-batch {mb} of stage {stage}")
            self._arriving.setdefault((stage, mb, channel), []).append((buf, finish))

    def _pieces(self, cut: int, channel: str) -> frozenset[str]:
        return self.tp_pieces.get((cut, channel), frozenset()) if self.tp > 1 else frozenset()

    def _gather(self, mine: torch.Tensor, names: list[str], pieces: list[int], shapes: dict, store: dict,
                what: str) -> None:
        """All-gather over tp the pieces of replicated values one rank received (``mine``)
        and put each whole value in ``store``."""
        rows = torch.empty(self.tp * mine.numel(), dtype=mine.dtype, device=mine.device)
        with self.guard(f"tp all-gather (ranks {self.tp_ranks}) of the replicated {what}", self.tp_ranks):
            dist.all_gather_into_tensor(rows, mine.contiguous(), group=self.tp_group)
        rows = rows.view(self.tp, mine.numel())
        start = 0
        for name, n in zip(names, pieces):
            store[name] = rows[:, start:start + n].reshape(-1)[:_numel(shapes[name])].view(shapes[name])
            start += n


_WHAT = {"F": "activations", "B": "gradients"}


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tp_pieces(plan_cuts: list[dict]) -> dict[tuple[int, str], frozenset[str]]:
    """The plan's choice of messages that send replicated values as tp pieces, from
    ``plan.communication["p2p"]["pp"]["cuts"]``: (cut, "F" or "B") -> dtypes."""
    out = {}
    for cut in plan_cuts:
        for side, channel in (("forward", "F"), ("backward", "B")):
            out[(cut["stages"][0], channel)] = frozenset(m["dtype"] for m in cut[side] if m.get("tp_gather_bytes"))
    return out


def _by_dtype(msg: Message, pieces: frozenset[str]) -> list[tuple[torch.dtype, list[str], list[str]]]:
    """Per dtype of ``msg`` (one buffer each): the values sent whole, then those sent as tp
    pieces (replicated on tp, in a dtype of ``pieces``)."""
    groups: dict[torch.dtype, tuple[list[str], list[str]]] = {}
    replicated = msg.replicated or (False,) * len(msg.names)
    for name, dtype, rep in zip(msg.names, msg.dtypes, replicated):
        split = rep and str(dtype).removeprefix("torch.") in pieces
        groups.setdefault(dtype, ([], []))[1 if split else 0].append(name)
    return [(dtype, whole, split) for dtype, (whole, split) in groups.items()]


def _piece_numel(numel: int, tp: int) -> int:
    return -(-numel // tp)


def _piece(value: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Piece ``rank`` of ``value``'s flattened elements cut in ``tp`` pieces (the last padded)."""
    flat = value.reshape(-1)
    n = _piece_numel(flat.numel(), tp)
    if n * tp != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, n * tp - flat.numel()))
    return flat[rank * n:(rank + 1) * n]

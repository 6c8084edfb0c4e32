"""What a layer keeps for its backward under each recompute policy, and what the copies its
backward makes again hold at their peak.

A recomputed op needs its inputs again in the backward, so a policy that drops an op's
saved output keeps whatever that op is recomputed from. Counting only the saved outputs a
policy does not drop (what the planner did before 2026-12-04) leaves those sources out.
For a Llama 8B block at 2 x 8192 tokens that undercounted torchtitan's op-level SAC by 0.44
GB of its 1.04 GB (the outputs of wq, wv and w2, and the block's input), and selective
recompute by 0.47 GB (the block input and the wq, wk, wv, wo outputs the norms and rotary
embeddings are recomputed from).

- **selective** drops the saved outputs of FLOP-free ops (norms, activations, rotary
  embeddings, casts) and keeps the saved outputs of the rest, plus the sources the dropped
  ones its own backward reads are recomputed from: walking back from each such op through
  FLOP-free ops of the layer to the first output that is not recomputed: an output of a GEMM
  or attention op of the layer, or a value made outside the layer (the block's input).
- **sac** as autopar's runtime runs it keeps as selective does, every second forward GEMM of the
  layer (:func:`sac_recomputed_matmuls`) dropped with the FLOP-free ops: what the backward reads
  of the rest, and what the dropped ops are made again from.
- **torch_sac** keeps what torchtitan's op-level SAC stores (``torchtitan/models/llama/
  parallelize_llama.py`` at 0596be3, ``_save_list`` and the policy in
  ``_apply_ac_to_transformer_block``: it saves the outputs of ``mm``, the SDPA kernels and
  ``reduce_scatter_tensor`` "except every second mm"; ``bench/calibration.yaml``); PyTorch's
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` stores the outputs of ops
  the policy marks MUST_SAVE whether or not the backward reads them), plus what
  ``torch.utils.checkpoint`` keeps of every checkpointed region: its inputs. So: every
  output of the layer's forward GEMMs except every second one, every output of its
  attention ops, and the block's input (w2's output too, which nothing reads). For pricing runs
  of that program (``make_plan(whole_layer_recompute=True)``); until the thirtieth session it was
  the plan's count for autopar's runtime as well, 8% over Llama small's measured peak.
- **moe** (Megatron-LM's ``--recompute-modules layernorm moe``) keeps as selective does, every
  forward op of each MoE layer (:func:`moe_recomputed_ops`) dropped with the FLOP-free ones: the
  layer keeps what its MoE layer reads from outside it (its input), not what is made inside.
- **full** keeps, as :mod:`autopar.passes.recompute` runs it, what the layer's forward reads from
  outside it (its input) and what another layer's backward reads of it; every forward op of the
  layer is made again. (Until the thirtieth session full kept each unit's output, what it sends
  across a cut, as a program that checkpoints each layer's input does: with the copies counted as
  :func:`remade_extra_bytes` does, GPT tiny's first stage of two under 1F1B measured 22.4% under
  that count, its head's logits counted where nothing keeps them; 3.4% under this one.)

A value made outside the layer counts as the layer's input only when no other layer's
forward reads it: a residual stream is the next block's input, whereas rotary tables and
attention masks made once and read by every block stay alive whatever the blocks keep
(they are counted where they are made).

Under every policy a layer also keeps the values made by another layer that its backward reads
(where several layers read one, the layer that makes it keeps it), and a layer's input is
counted where it is made only when that layer keeps it (or a view of it): as
:mod:`autopar.passes.recompute` runs them, copies are made for the backward of the layer that
dropped the op only, so another layer reads the original (the final norm's output, which the
head's weight gradient reads; a block's output, which the next block's norm is recomputed from).
Until the twenty-third session (2026-12-06) neither was counted (a value remade by FLOP-free
ops from what its layer kept was taken as free): Llama tiny's step under selective held 7.4 MB
when its backward began where the plan counted 6.9 (``tests/dist/test_recompute.py``'s model,
one process); it counts 7.4 now.

Recompute applies to every layer alike (as ``full`` recompute's kept block input does): the
planner does not tell a transformer block from the embedding or the loss.
"""

from __future__ import annotations

from collections import defaultdict

from autopar.cost.compute import GEMM_KINDS
from autopar.passes.recompute import FORWARD_EXPERT_OPS, in_modules, moe_modules
from autopar.planner.ilp import Problem, Solution

__all__ = ["kept_bytes", "remade_extra_bytes", "sac_recomputed_matmuls", "moe_recomputed_ops"]

_EXPERTS_NODE_NAMES = tuple(op.split("::")[1] for op in FORWARD_EXPERT_OPS)
"""fx names (so strategy-graph names) of the forward experts ops: fx names a node after its op."""


def sac_recomputed_matmuls(g) -> frozenset[int]:
    """The forward matmuls op-level SAC recomputes: every second one of each layer, in forward
    (graph) order (the 2nd, 4th, ...: Llama's wk, wo and w3), as torchtitan's policy counts them."""
    count: dict[str, int] = defaultdict(int)
    out = set()
    for v, node in enumerate(g.nodes):
        if node.kind == "op" and node.phase == "F" and node.kernel in GEMM_KINDS:
            count[node.layer] += 1
            if count[node.layer] % 2 == 0:
                out.add(v)
    return frozenset(out)


def moe_recomputed_ops(g) -> frozenset[int]:
    """The forward ops of each MoE layer (router, token exchange, experts, combine), which the
    "moe" policy recomputes besides selective's FLOP-free ops: as :func:`autopar.passes.recompute.dropped_ops`
    finds them, by module (:func:`autopar.passes.recompute.moe_modules`)."""
    forward = [(v, node) for v, node in enumerate(g.nodes) if node.kind == "op" and node.phase == "F"]
    if not any(node.name.startswith(_EXPERTS_NODE_NAMES) for _, node in forward):
        return frozenset()
    modules = moe_modules((node.module, node.name.startswith(_EXPERTS_NODE_NAMES), node.kernel in GEMM_KINDS)
                          for _, node in forward)
    return frozenset(v for v, node in forward if modules and in_modules(node.module, modules))


def kept_bytes(problem: Problem, solution: Solution, local, source, moe: frozenset[int] | None = None
               ) -> dict[str, dict[str, float]]:
    """Per layer, per policy ("selective", "sac", "torch_sac", "moe", "full": the module docstring's),
    the bytes kept per device for one micro-batch, one instance of the layer ("sac", "moe" and
    "full" keep as selective does, their dropped ops with the FLOP-free ones; under full every
    forward op is dropped, and the layer keeps what its forward reads from outside it).
    ``local(v, o)``: the bytes of output ``o`` of node ``v`` one device holds under ``solution``;
    ``source(v, o)``: the value an output really is, through views
    (:func:`autopar.planner.evaluation._aliases`); ``moe``: the graph's
    :func:`moe_recomputed_ops`, where the caller has them."""
    g = problem.graph
    cheap_ops = frozenset(v for v, node in enumerate(g.nodes) if node.kind == "op" and node.flops(problem.batch) == 0)
    cheap = cheap_ops.__contains__
    inputs: dict[int, list[tuple[int, int]]] = defaultdict(list)  # op -> its (producer, output) inputs
    readers: dict[tuple[int, int], set[str]] = defaultdict(set)  # value -> layers whose forward reads it
    backward_readers: dict[tuple[int, int], set[str]] = defaultdict(set)  # value -> layers whose backward reads it
    for e in g.edges:
        if e.virtual:
            continue
        inputs[e.dst].append((e.src, e.src_out))
        dst = g.nodes[e.dst]
        if dst.kind == "op" and dst.phase == "F":
            readers[e.src, e.src_out].add(dst.layer)
        elif dst.kind == "op" and dst.phase in ("B", "W"):
            backward_readers[source(e.src, e.src_out)].add(dst.layer)

    def layer_input(value: tuple[int, int], layer: str) -> bool:
        src = g.nodes[value[0]]
        return src.layer != layer and src.kind in ("op", "input") and readers[value] == {layer}

    moe = moe_recomputed_ops(g) if moe is None else moe
    read_back: dict[int, set[str]] = {}  # a forward op -> layers whose backward reads its outputs
    forward = frozenset(v for v, node in enumerate(g.nodes) if node.kind == "op" and node.phase == "F")
    for v in forward:
        read_back[v] = set().union(*(backward_readers.get(source(v, o), ())
                                     for o in range(len(g.nodes[v].out_bytes))))

    by_layer: dict[str, list[int]] = defaultdict(list)
    for v, node in enumerate(g.nodes):
        by_layer[node.layer].append(v)
    recomputed = sac_recomputed_matmuls(g)
    dropped = {"selective": cheap, "sac": lambda v: cheap(v) or v in recomputed,
               "moe": lambda v: cheap(v) or v in moe, "full": forward.__contains__}
    kept: dict[str, dict[str, set]] = {policy: {} for policy in (*dropped, "torch_sac")}
    for layer, members in by_layer.items():
        remade = lambda v, layer=layer: layer in read_back[v]  # noqa: E731
        for policy, drops in dropped.items():
            if policy != "moe" or moe:  # (no MoE layer: "moe" is selective)
                kept[policy][layer] = _selective(g, layer, members, inputs, drops, layer_input, remade)
        kept["moe"].setdefault(layer, kept["selective"][layer])
        kept["torch_sac"][layer] = _sac(g, layer, members, inputs, layer_input, recomputed)
    # what another layer's backward reads is kept: autopar.passes.recompute makes copies for the backward
    # of the dropping layer only (the final norm's output, read by the head's weight gradient). By the
    # reading layer, as its input is (a pipeline stage holds what its own layers read), or where it is
    # made when several other layers read it
    for value, layers in backward_readers.items():
        made = g.nodes[value[0]]
        others = layers - {made.layer}
        if made.kind == "op" and made.phase == "F" and others:
            owner = next(iter(others)) if len(others) == 1 else made.layer
            for sets in kept.values():
                sets[owner].add(value)

    def total(kept: dict[str, set], layer: str) -> float:
        memo: dict[tuple[int, int], bool] = {}

        def derivable(value: tuple[int, int]) -> bool:
            """Kept by the layer that makes it, or a view of such a value (a view of the logits the
            head keeps). Not a value other FLOP-free ops make from kept values (a cast, a residual
            add): the recompute pass remakes values for their own layer's backward only, so another
            layer's copies read the original, which stays alive."""
            if value not in memo:
                memo[value] = False  # (a cycle: not derivable)
                v = value[0]
                memo[value] = value in kept[g.nodes[v].layer] or (
                    g.nodes[v].phase == "F" and source(*value) != value and derivable(source(*value)))
            return memo[value]

        # a layer's input that another layer keeps (or a view of it) is counted there
        return sum(local(*value) for value in kept[layer] if g.nodes[value[0]].layer == layer or not derivable(value))

    return {layer: {policy: total(sets, layer) for policy, sets in kept.items()} for layer in by_layer}


def _selective(g, layer: str, members: list[int], inputs, cheap, layer_input, remade) -> set[tuple[int, int]]:
    """The values ``layer`` keeps under selective recompute: the saved outputs of its ops with
    FLOPs, and what its dropped FLOP-free ops are recomputed from (those whose outputs its own
    backward reads: ``remade(v)``). Under "sac", "moe" and "full", ``cheap`` also holds the other ops
    the policy drops."""
    kept = {(v, o) for v in members if not cheap(v) for o, saved in enumerate(g.nodes[v].saved) if saved}
    todo = [v for v in members if cheap(v) and g.nodes[v].phase == "F" and remade(v)]
    seen = set(todo)
    while todo:
        for value in inputs[todo.pop()]:
            src = g.nodes[value[0]]
            if src.kind == "param":
                continue
            if src.layer != layer:
                if layer_input(value, layer):
                    kept.add(value)
            elif cheap(value[0]) and src.phase == "F":
                if value[0] not in seen:
                    seen.add(value[0])
                    todo.append(value[0])
            else:
                kept.add(value)
    return kept


def _sac(g, layer: str, members: list[int], inputs, layer_input, recomputed) -> set[tuple[int, int]]:
    """The values ``layer`` keeps under op-level SAC: the outputs of the matmuls it saves and of
    attention, and the layer's inputs."""
    kept = set()
    for v in members:
        node = g.nodes[v]
        if node.kind != "op" or node.phase != "F":
            continue
        if node.kernel in (*GEMM_KINDS, "attention", "causal_attention") and v not in recomputed:
            kept.update((v, o) for o in range(len(node.out_bytes)))
        kept.update(value for value in inputs[v] if layer_input(value, layer))
    return kept


def remade_extra_bytes(problem: Problem, local, working: dict[int, float], source,
                       moe: frozenset[int] | None = None) -> dict[str, tuple[float, float, float, float]]:
    """Per layer: (under selective recompute, under op-level SAC, under "moe", under full) what the copies
    the backward makes again add to the layer's largest working set, per device for one micro-batch: the
    peak over the layer's backward ops of the copies alive while each runs plus its own working
    set, less the forward values its backward (or a copy) has read for the last time (they die
    then, as the runtime frees a value after its last reader), less the layer's largest working
    set (never below 0).

    :mod:`autopar.passes.recompute` makes a copy of a dropped forward op right before the first
    backward op of its layer that reads it (the copies it is made from at the same moment), and
    the copy dies after its last reader; so the copies are alive a stretch of the backward each,
    not all at once. (Counting the running layer's dropped bytes whole, tried on 2026-12-06,
    put sac's plan 17% over its measured peak for Llama tiny at pp = 1; counting none of them,
    as before this count, 19% under on pp = 2 1F1B's first stage.) Besides them, the gradients
    the backward made earlier and reads later (:func:`_held_gradients`: the layer output's, which
    its residual branch adds at the end) are alive too. Under full recompute every
    forward op of the layer is a copy, made the same way (until the thirtieth session full was
    counted as torch checkpoint runs it, the whole layer made again at once: ZB-H1's first stage
    of Llama tiny measured 12.7% under that count, GPT tiny's 25-28%); a program that re-runs a
    layer whole is :attr:`autopar.planner.search.Unit.whole_layer_remade`'s.

    ``local(v, o)``: the bytes of output ``o`` of node ``v`` one device holds; ``working``: each
    op's working set (:func:`autopar.planner.evaluation._working_sets`); ``source(v, o)``: the
    value an output really is, through views (they hold nothing of their own, and a copy's view
    keeps the copy alive); ``moe``: as :func:`kept_bytes`'s."""
    g = problem.graph
    inputs: dict[int, list[tuple[int, int]]] = defaultdict(list)  # in argument order, as the graph's edges are
    for e in g.edges:
        if not e.virtual:
            inputs[e.dst].append(source(e.src, e.src_out))
    largest: dict[str, float] = defaultdict(float)
    for v, ws in working.items():
        largest[g.nodes[v].layer] = max(largest[g.nodes[v].layer], ws)
    forward = {v for v, node in enumerate(g.nodes) if node.kind == "op" and node.phase == "F"}
    flop_free = {v for v in forward if g.nodes[v].flops(problem.batch) == 0}
    backward = [v for v, node in enumerate(g.nodes) if node.kind == "op" and node.phase in ("B", "W")]
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    moe = moe_recomputed_ops(g) if moe is None else moe
    policies = {0: flop_free, 1: flop_free | sac_recomputed_matmuls(g), 3: forward}
    if moe:  # (no MoE layer: "moe" is selective)
        policies[2] = flop_free | moe
    held = _held_gradients(g, backward, inputs, local)
    for i, dropped in policies.items():
        bursts, last, read = _copies(g, backward, inputs, dropped)
        freed_copies: dict[int, float] = defaultdict(float)  # position -> copies whose last reader ran just before
        for value, t in last.items():
            freed_copies[t + 1] += local(*value)
        freed: dict[int, float] = defaultdict(float)  # position -> kept bytes whose last reader ran just before
        for value, t in read.items():
            freed[t + 1] += local(*value)
        live = gone = 0.0
        running = None
        for t, r in enumerate(backward):
            layer = g.nodes[r].layer
            if layer != running:  # (what the units' kept bytes lose counts within the running unit only)
                running, gone = layer, 0.0
            live -= freed_copies.get(t, 0.0)
            gone += freed.get(t, 0.0)
            burst = bursts[t]
            peak = 0.0
            if burst:  # the copies made right before r
                peak, early = _burst_peak(g, r, burst, last, t, inputs, local, live)
                live += sum(local(*value) for value in burst) - early
                freed_copies[t + 1] -= early  # (dead already)
            peak = max(peak, live + working.get(r, 0.0))  # (r's working set holds its input gradients)
            if burst or live > 0:
                out[layer][i] = max(out[layer][i], peak + held[t] - gone - largest[layer])
    return {layer: (a, b, c if moe else a, d) for layer, (a, b, c, d) in out.items()}


def _burst_peak(g, r: int, burst, last, t: int, inputs, local, live: float) -> tuple[float, float]:
    """(the most alive while the copies ``burst`` are made right before backward op ``r`` at position
    ``t``, the bytes of those that die as it is made), ``live`` alive before them: they are made in
    the pass's order, beside ``r``'s input gradients (alive already), and a copy that only copies
    of this moment read (last read at ``t``, not by ``r``) dies once the last of them is made."""
    reads = set(inputs.get(r, ()))
    inner = {value for value in burst if last[value] == t and value not in reads}
    pending: dict[tuple[int, int], int] = defaultdict(int)
    for value in burst:
        for x in inputs.get(value[0], ()):
            if x in inner:
                pending[x] += 1
    grads = sum(local(*x) for x in reads if g.nodes[x[0]].phase in ("B", "W"))
    peak = running = live + grads
    early = 0.0
    for value in burst:
        running += local(*value)
        peak = max(peak, running)
        for x in inputs.get(value[0], ()):
            if x in inner:
                pending[x] -= 1
                if pending[x] == 0:
                    running -= local(*x)
                    early += local(*x)
    return peak, early


def _copies(g, backward: list[int], inputs, dropped) -> tuple[list[list[tuple[int, int]]], dict, dict]:
    """The copies :mod:`autopar.passes.recompute` makes for backward ops ``backward`` when it drops
    the forward ops ``dropped``: per backward position, the values copied right before that op, in
    the order the pass makes them (depth first over each reader's inputs, a copy after the copies it
    is made from); each copy's last reading position (its reader's, or that of a copy made later
    from it); and the forward values not dropped the backward reads, with their last position."""
    bursts: list[list[tuple[int, int]]] = []
    last: dict[tuple[int, int], int] = {}
    read: dict[tuple[int, int], int] = {}
    for t, r in enumerate(backward):
        layer = g.nodes[r].layer
        burst: list[tuple[int, int]] = []
        stack = [(value, False) for value in reversed(inputs.get(r, ()))]
        while stack:  # (an iterative depth-first walk: a layer's chain of copies may be long)
            value, made = stack.pop()
            if made:
                burst.append(value)
                continue
            v = value[0]
            if v not in dropped or g.nodes[v].layer != layer:
                if g.nodes[v].kind == "op" and g.nodes[v].phase == "F":
                    read[value] = t
                continue
            first = value not in last
            last[value] = t
            if first:  # made now, after the copies it is made from
                stack.append((value, True))
                stack.extend((x, False) for x in reversed(inputs.get(v, ())))
        bursts.append(burst)
    return bursts, last, read


def _held_gradients(g, backward: list[int], inputs, local) -> list[float]:
    """Per backward position, the bytes of the values backward ops made before it and read after
    it, other than its own inputs (those are its working set): a block's output gradient is read
    by the first ops of its backward and again by the last, where the residual branch adds it to
    the input's gradient, so it is alive through the whole block's backward. (Not counted until
    the thirtieth session: Llama tiny's two 1F1B stages under full recompute measured 5.2% and
    6.2% over the plan without it, 1.7% and 2.4% with it.)"""
    made: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    for t, r in enumerate(backward):
        for value in inputs.get(r, ()):
            if value in made:
                last[value] = t
        for o in range(len(g.nodes[r].out_bytes)):
            made.setdefault((r, o), t)
    diff = [0.0] * (len(backward) + 1)
    for value, t1 in last.items():
        t0 = made[value]
        if t1 > t0 + 1:  # alive at t0 + 1 .. t1 - 1 beside the running op
            diff[t0 + 1] += local(*value)
            diff[t1] -= local(*value)
    held, running = [], 0.0
    for t, r in enumerate(backward):
        running += diff[t]
        mine = sum(local(*value) for value in set(inputs.get(r, ())) if value in last and made[value] < t < last[value])
        held.append(running - mine)
    return held

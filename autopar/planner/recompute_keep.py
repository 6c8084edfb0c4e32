"""What a layer keeps for its backward under selective recompute and op-level SAC.

A recomputed op needs its inputs again in the backward, so a policy that drops an op's
saved output keeps whatever that op is recomputed from. Counting only the saved outputs a
policy does not drop (what the planner did before 2026-12-04) leaves those sources out.
For a Llama 8B block at 2 x 8192 tokens that undercounted torchtitan's op-level SAC by 0.44
GB of its 1.04 GB (the outputs of wq, wv and w2, and the block's input), and selective
recompute by 0.47 GB (the block input and the wq, wk, wv, wo outputs the norms and rotary
embeddings are recomputed from).

- **selective** drops the saved outputs of FLOP-free ops (norms, activations, rotary
  embeddings, casts) and keeps the saved outputs of the rest, plus the sources the dropped
  ones are recomputed from: walking back from each dropped op through FLOP-free ops of the
  layer to the first output that is not recomputed: an output of a GEMM or attention op of
  the layer, or a value made outside the layer (the block's input).
- **sac** keeps what torchtitan's op-level SAC stores (``torchtitan/models/llama/
  parallelize_llama.py`` at 0596be3, ``_save_list`` and the policy in
  ``_apply_ac_to_transformer_block``: it saves the outputs of ``mm``, the SDPA kernels and
  ``reduce_scatter_tensor`` "except every second mm"; ``bench/calibration.yaml``); PyTorch's
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` stores the outputs of ops
  the policy marks MUST_SAVE whether or not the backward reads them), plus what
  ``torch.utils.checkpoint`` keeps of every checkpointed region: its inputs. So: every
  output of the layer's forward GEMMs except every second one, every output of its
  attention ops, and the block's input.

A value made outside the layer counts as the layer's input only when no other layer's
forward reads it: a residual stream is the next block's input, whereas rotary tables and
attention masks made once and read by every block stay alive whatever the blocks keep
(they are counted where they are made).

Recompute applies to every layer alike (as ``full`` recompute's kept block input does): the
planner does not tell a transformer block from the embedding or the loss.
"""

from __future__ import annotations

from collections import defaultdict

from autopar.cost.compute import GEMM_KINDS
from autopar.planner.ilp import Problem, Solution

__all__ = ["kept_bytes", "sac_recomputed_matmuls"]


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


def kept_bytes(problem: Problem, solution: Solution, local) -> dict[str, tuple[float, float]]:
    """Per layer: (bytes kept under selective recompute, bytes kept under op-level SAC), per
    device for one micro-batch, one instance of the layer. ``local(v, o)``: the bytes of output
    ``o`` of node ``v`` one device holds under ``solution``."""
    g = problem.graph
    inputs: dict[int, list[tuple[int, int]]] = defaultdict(list)  # op -> its (producer, output) inputs
    readers: dict[tuple[int, int], set[str]] = defaultdict(set)  # value -> layers whose forward reads it
    for e in g.edges:
        if e.virtual:
            continue
        inputs[e.dst].append((e.src, e.src_out))
        dst = g.nodes[e.dst]
        if dst.kind == "op" and dst.phase == "F":
            readers[e.src, e.src_out].add(dst.layer)

    def cheap(v: int) -> bool:
        node = g.nodes[v]
        return node.kind == "op" and node.flops(problem.batch) == 0

    def layer_input(value: tuple[int, int], layer: str) -> bool:
        src = g.nodes[value[0]]
        return src.layer != layer and src.kind in ("op", "input") and readers[value] == {layer}

    by_layer: dict[str, list[int]] = defaultdict(list)
    for v, node in enumerate(g.nodes):
        by_layer[node.layer].append(v)
    selective, sac = {}, {}
    recomputed = sac_recomputed_matmuls(g)
    for layer, members in by_layer.items():
        selective[layer] = _selective(g, layer, members, inputs, cheap, layer_input)
        sac[layer] = _sac(g, layer, members, inputs, layer_input, recomputed)

    def total(kept: dict[str, set], layer: str) -> float:
        memo: dict[tuple[int, int], bool] = {}

        def derivable(value: tuple[int, int]) -> bool:
            """Kept by the layer that makes it, or remade by FLOP-free forward ops from such values
            (a view or cast of the logits the head keeps)."""
            if value not in memo:
                memo[value] = False  # (a cycle: not derivable)
                v = value[0]
                memo[value] = value in kept[g.nodes[v].layer] or (
                    cheap(v) and g.nodes[v].phase == "F" and bool(inputs[v])
                    and all(g.nodes[p].kind == "param" or derivable((p, o)) for p, o in inputs[v]))
            return memo[value]

        # a layer's input that another layer keeps (or remakes cheaply from what it keeps) is counted there
        return sum(local(*value) for value in kept[layer] if g.nodes[value[0]].layer == layer or not derivable(value))

    return {layer: (total(selective, layer), total(sac, layer)) for layer in by_layer}


def _selective(g, layer: str, members: list[int], inputs, cheap, layer_input) -> set[tuple[int, int]]:
    """The values ``layer`` keeps under selective recompute: the saved outputs of its ops with
    FLOPs, and what its dropped FLOP-free ops are recomputed from."""
    kept = {(v, o) for v in members if not cheap(v) for o, saved in enumerate(g.nodes[v].saved) if saved}
    todo = [v for v in members if cheap(v) and any(g.nodes[v].saved)]
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

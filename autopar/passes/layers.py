"""Group the nodes of an annotated joint graph into layers and hash their structure.

A layer is the unit the pipeline cuts between and the unit repeated-layer
detection ties together. Its path is the node's module path up to the first
numeric component ("model.layers.7.mlp.up_proj" -> "model.layers.7"), or the
whole module path when there is none ("lm_head", "transformer.wte"). Code
written in a container's own forward (the model's, or "model" in a Hugging Face
``...ForCausalLM``) joins the layer before it in forward order, or the first
layer if it comes before all of them. Backward nodes join the layer of the
forward op they differentiate (same autograd ``seq_nr``), or, matching no forward
op of the graph, the latest layer whose backward reads them; the adds that
accumulate a tensor's gradients join the layer of the last gradient they sum.

The structural signature hashes each node's op, its output shapes and dtypes and
how it connects inside the layer; two layers with the same signature are the
same "layer class" and share one sharding decision in the planner.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import torch
from torch import fx

from autopar.passes import meta_keys as mk

__all__ = ["group_layers", "graph_hash", "layer_of_path", "LOSS_LAYER"]

LOSS_LAYER = "<loss>"
"""The layer of the ops after the model's last module: the loss (runs on the last stage)."""


def layer_of_path(path: str) -> str:
    """"model.layers.7.mlp" -> "model.layers.7"; "lm_head" -> "lm_head"."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return path


def group_layers(gm: fx.GraphModule) -> fx.GraphModule:
    """Set ``meta[LAYER]`` on every node and ``gm.meta[LAYERS]``; return ``gm``.

    Contract:
      needs: ``meta[TRACE]`` and ``meta[COST]`` on every node, ``gm.meta[GRAPH]``.
      produces: ``meta[LAYER]`` (layer path, "" for the output node) and
      ``gm.meta[LAYERS]``, a tuple of :class:`LayerInfo` in forward order.
      raises: nothing.
    """
    graph_info: mk.GraphTrace = gm.meta[mk.GRAPH]
    nodes = list(gm.graph.nodes)
    order_of = {n: i for i, n in enumerate(nodes)}
    compute = [n for n in nodes if n.op == "call_function"]
    fwd = [n for n in compute if n.meta[mk.TRACE].role is mk.Role.FORWARD]
    raw = {n: layer_of_path(n.meta[mk.TRACE].module_path) for n in fwd}
    containers = {p for p in set(raw.values()) if p and any(q.startswith(p + ".") for q in raw.values())}
    layer: dict[fx.Node, str] = {}
    prev = ""
    pending = []
    real = [i for i, n in enumerate(fwd) if raw[n] and raw[n] not in containers]
    for n in fwd[real[-1] + 1:] if real else ():  # the loss, computed after the last layer
        layer[n] = LOSS_LAYER
    for n in fwd:
        if n in layer:
            continue  # ops with no layer of their own join the previous layer (or the next)
        lp = raw[n]
        if not lp or lp in containers:
            if prev:
                layer[n] = prev
            else:
                pending.append(n)
            continue
        prev = layer[n] = lp
        for p in pending:
            layer[p] = lp
        pending = []
    for p in pending:
        layer[p] = LOSS_LAYER
    order = list(dict.fromkeys(layer[n] for n in fwd))
    first, last = (order[0], order[-1]) if order else (LOSS_LAYER, LOSS_LAYER)
    by_seq = {}
    for n in fwd:
        by_seq.setdefault(n.meta[mk.TRACE].seq_nr, layer[n])
    unmatched = []  # backward ops differentiating no forward op of the graph
    for n in nodes:
        info = n.meta[mk.TRACE]
        if n in layer:
            continue
        if info.role is mk.Role.BACKWARD and n.meta.get("is_gradient_acc"):
            layer[n] = _layer_from_inputs(n, layer, order_of) or by_seq.get(info.seq_nr) or last
        elif info.role is mk.Role.BACKWARD:
            if info.seq_nr in by_seq:
                layer[n] = by_seq[info.seq_nr]
            else:
                unmatched.append(n)
        elif info.role in (mk.Role.PARAM, mk.Role.BUFFER):
            layer[n] = _layer_from_users(n, layer, forward_only=True) or first
        elif info.role in (mk.Role.INPUT, mk.Role.CONSTANT):
            layer[n] = _layer_from_users(n, layer, forward_only=True) or first
        elif info.role is mk.Role.TANGENT:
            layer[n] = last
        else:
            layer[n] = ""
    position = {p: i for i, p in enumerate(order)}
    for n in reversed(unmatched):  # (readers first)
        layer[n] = _layer_from_backward_users(n, layer, position) or last
    for n in nodes:
        n.meta[mk.LAYER] = layer[n]
    gm.meta[mk.LAYERS] = tuple(_layer_infos(gm, order, layer, graph_info))
    return gm


def _layer_from_inputs(n: fx.Node, layer: dict[fx.Node, str], order_of: dict[fx.Node, int]) -> str:
    """A gradient accumulation joins the layer of its last-computed input.

    AOTAutograd tags the adds that sum a tensor's gradients (a residual stream
    read twice, a tied weight) with ``is_gradient_acc`` and the loss's seq_nr,
    which would put every one of them in the last layer; the add belongs where
    the last of the gradients it sums is computed (the block that read the tensor).
    """
    placed = [arg for arg in n.all_input_nodes if layer.get(arg)]
    return layer[max(placed, key=order_of.__getitem__)] if placed else ""


def _layer_from_backward_users(n: fx.Node, layer: dict[fx.Node, str], position: dict[str, int]) -> str:
    """A backward op whose autograd ``seq_nr`` matches no forward op joins the latest layer (in
    forward order) whose backward reads it: the first of its readers to run, so a pipeline sends
    it back, never forward.

    Before, such ops joined the last layer, the loss's, wherever they were read. Hugging Face's
    DeepSeek-V3 has them in every block (copies of attention-gradient slices, parts of a norm's
    backward), and each block's then crossed every pipeline cut back from the last stage: at
    4096 tokens a (1, 128, 4096, 128) bf16 copy per block, 134 MB, per micro-batch."""
    found = [layer[u] for u in n.users if layer.get(u) in position]
    return max(found, key=position.__getitem__) if found else ""


def _layer_from_users(n: fx.Node, layer: dict[fx.Node, str], *, forward_only: bool = False) -> str:
    """A parameter belongs to the first layer that reads it in forward order."""
    for user in n.users:
        if user in layer and layer[user] and (not forward_only or user.meta[mk.TRACE].role is mk.Role.FORWARD):
            return layer[user]
    return ""


def _layer_infos(gm: fx.GraphModule, order: list[str], layer: dict[fx.Node, str],
                 graph_info: mk.GraphTrace) -> list[mk.LayerInfo]:
    members: dict[str, list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if layer[n]:
            members[layer[n]].append(n)
    counts = {r.traced[1]: r.count - 1 for r in graph_info.repeats}
    position = {name: i for i, name in enumerate(order)}
    infos = []
    for i, path in enumerate(order):
        ns = members[path]
        fwd = [n for n in ns if n.meta[mk.TRACE].role is mk.Role.FORWARD]
        bwd = [n for n in ns if n.meta[mk.TRACE].role is mk.Role.BACKWARD]
        params = [n for n in ns if n.meta[mk.TRACE].role is mk.Role.PARAM]
        boundary = 0.0
        for n in fwd:
            if any(layer.get(u) and position.get(layer[u], -1) > i and u.meta[mk.TRACE].role is mk.Role.FORWARD
                   for u in n.users):
                boundary += n.meta[mk.COST].output_bytes
        cost = [n.meta[mk.COST] for n in ns]
        infos.append(mk.LayerInfo(
            path=path, index=i,
            class_name="loss" if path == LOSS_LAYER else graph_info.module_classes.get(path, path.rsplit(".", 1)[-1]),
            signature=_signature(ns, path),
            count=counts.get(path, 1),
            param_fqns=tuple(n.meta[mk.TRACE].fqn for n in params),
            n_params=sum(n.meta["val"].numel() for n in params),
            param_bytes=sum(c.param_bytes for c in cost),
            flops_fwd=sum(n.meta[mk.COST].flops for n in fwd),
            flops_bwd=sum(n.meta[mk.COST].flops for n in bwd),
            bytes_fwd=sum(n.meta[mk.COST].bytes_read + n.meta[mk.COST].bytes_written for n in fwd),
            bytes_bwd=sum(n.meta[mk.COST].bytes_read + n.meta[mk.COST].bytes_written for n in bwd),
            time_fwd_s=sum(n.meta[mk.COST].time_s for n in fwd),
            time_bwd_s=sum(n.meta[mk.COST].time_s for n in bwd),
            saved_bytes=sum(c.saved_bytes for c in cost),
            boundary_bytes=boundary))
    return infos


def _val_sig(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{tuple(val.shape)}:{val.dtype}"
    if isinstance(val, (tuple, list)):
        return "(" + ",".join(_val_sig(v) for v in val) + ")"
    return type(val).__name__


def _signature(ns: list[fx.Node], path: str) -> str:
    """Hash of the layer's nodes; placeholders by their name relative to the layer
    ("attn.c_attn.weight"), not by their graph name, which differs from block to block."""
    local = {n: i for i, n in enumerate(ns)}

    def arg_sig(a):
        if isinstance(a, fx.Node):
            return f"%{local[a]}" if a in local else f"ext{_val_sig(a.meta.get('val'))}"
        if isinstance(a, (tuple, list)):
            return "[" + ",".join(arg_sig(x) for x in a) + "]"
        return repr(a)

    h = hashlib.sha256()
    for n in ns:
        info = n.meta[mk.TRACE]
        target = n.target
        if n.op == "placeholder":
            target = info.fqn[len(path) + 1:] if info.fqn.startswith(path + ".") else info.fqn
        h.update(f"{n.op}|{target}|{info.role.value}|{arg_sig(n.args)}|{arg_sig(tuple(n.kwargs.items()))}"
                 f"|{_val_sig(n.meta.get('val'))}\n".encode())
    return h.hexdigest()[:16]


def graph_hash(gm: fx.GraphModule) -> str:
    """Hash of the model: its layer signatures in order (runs of equal layers merged, so a
    trace with repeats collapsed and a full trace agree) and its input shapes."""
    h = hashlib.sha256()
    runs: list[list] = []
    for info in gm.meta[mk.LAYERS]:
        if runs and runs[-1][0] == info.signature:
            runs[-1][1] += info.count
        else:
            runs.append([info.signature, info.count])
    for signature, count in runs:
        h.update(f"{signature}|{count}\n".encode())
    for n in gm.graph.find_nodes(op="placeholder"):
        if n.meta[mk.TRACE].role is mk.Role.INPUT:
            h.update(f"{n.meta[mk.TRACE].fqn}|{_val_sig(n.meta.get('val'))}\n".encode())
    return h.hexdigest()[:16]

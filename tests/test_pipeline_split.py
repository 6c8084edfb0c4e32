"""The pipeline pass on one process: stage cuts, B/W split, messages, lifetimes, tied weights.

The joint graph of an example is cut into stages by hand, split into F, B and W
pieces, and the pieces are run stage by stage in one process, moving exactly the
values each ``Message`` names and dropping what the lifetimes say a stage may drop
(after F and its send, after B and its send, after W); the loss and every
gradient must equal the unsplit joint graph's. Multi-process runs of the same
pieces under every schedule are in tests/dist/test_pipeline.py.
"""

import sys
from pathlib import Path

import pytest
import torch

from autopar.analysis import build_graph
from autopar.cluster import parse_cluster
from autopar.errors import PlanError
from autopar.passes import meta_keys as mk
from autopar.passes.pipeline import (INPUT_PREFIX, PARAM_PREFIX, split_program, split_tied_gradients,
                                     stage_of_layers, tag_stages)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

CLUSTER = parse_cluster("1x1xcpu")


def _graph(example: str, **kwargs):
    module = __import__(example)
    torch.manual_seed(0)
    model, inputs, loss_fn, target = module.build(size="tiny", batch=4, **kwargs)
    gm = build_graph(model, inputs, cluster=CLUSTER, loss_fn=loss_fn, example_target=target, collapse_repeats=False)
    values = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        t = node.meta[mk.TRACE]
        if t.role is mk.Role.PARAM:
            values[node] = model.get_parameter(t.fqn).detach()
        elif t.role is mk.Role.BUFFER:
            values[node] = model.get_buffer(t.fqn)
        elif t.role is mk.Role.INPUT:
            values[node] = inputs[0] if t.fqn == "arg0" else target
        else:
            values[node] = torch.ones(node.meta["val"].shape, dtype=node.meta["val"].dtype)
    return gm, values


def _cut(gm, n_stages: int) -> list[list[str]]:
    paths = [x.path for x in gm.meta[mk.LAYERS]]
    size = -(-len(paths) // n_stages)
    return [paths[i:i + size] for i in range(0, len(paths), size)]


def _split(gm, stage_layers):
    stages = tag_stages(gm, stage_of_layers(stage_layers))
    tied = split_tied_gradients(gm, stages)
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    keys = []
    for node in gm.graph.find_nodes(op="placeholder"):
        t = node.meta[mk.TRACE]
        keys.append(PARAM_PREFIX + t.fqn if t.role in (mk.Role.PARAM, mk.Role.BUFFER)
                    else INPUT_PREFIX + (t.fqn or node.name))
    grads = {idx: fqn for fqn, idx in info.grad_outputs.items()}
    grads.update({idx: fqn for fqn, parts in tied.items() for _, idx in parts[1:]})
    program = split_program(gm, n_stages=len(stage_layers), placeholder_keys=keys, loss_output=info.loss_output,
                            grad_outputs=grads)
    return program, keys, tied


def _run_local(program, keys, values_by_node):
    """One micro-batch through every stage in one process, pruning as the runtime does."""
    provided = dict(zip(keys, values_by_node.values()))
    n = len(program.stages)
    stores = [dict() for _ in range(n)]
    grads, loss = {}, None

    def run(s, piece):
        nonlocal loss
        st = program.stages[s]
        args = [provided[k] if k.startswith((PARAM_PREFIX, INPUT_PREFIX)) else stores[s][k] for k in piece.inputs]
        for name, value in zip(piece.outputs, piece(args)):
            if name in st.grads:
                grads[st.grads[name]] = grads.get(st.grads[name], 0) + value
            elif name == st.loss:
                loss = value
            else:
                stores[s][name] = value

    def keep(s, names):
        stores[s] = {k: v for k, v in stores[s].items() if k in names}

    sent = {}
    for s, st in enumerate(program.stages):
        if st.recv_forward is not None:
            stores[s].update({k: sent[k] for k in st.recv_forward.names})
        run(s, st.forward)
        sent = {k: stores[s][k] for k in (st.send_forward.names if st.send_forward else ())}
        keep(s, st.keep_after_forward)
    sent = {}
    for s in reversed(range(n)):
        st = program.stages[s]
        if st.recv_backward is not None:
            stores[s].update({k: sent[k] for k in st.recv_backward.names})
        run(s, st.backward_input)
        sent = {k: stores[s][k] for k in (st.send_backward.names if st.send_backward else ())}
        keep(s, st.keep_after_backward)
        run(s, st.backward_weight)
        keep(s, frozenset())
        assert not stores[s]
    return loss, grads


@pytest.mark.parametrize("example,kwargs,n_stages", [
    ("gpt", {"n_layer": 4}, 2), ("gpt", {"n_layer": 4}, 4), ("llama", {}, 3), ("llama", {}, 5)])
def test_pieces_reproduce_the_joint_graph(example, kwargs, n_stages):
    gm, values = _graph(example, **kwargs)
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    want = torch.fx.Interpreter(gm).run(*values.values(), enable_io_processing=False)
    stage_layers = _cut(gm, n_stages)
    program, keys, tied = _split(gm, stage_layers)
    loss, grads = _run_local(program, keys, values)
    assert torch.equal(loss, want[info.loss_output])
    assert set(grads) == set(info.grad_outputs)
    for fqn, idx in info.grad_outputs.items():
        # Bit-identical: each piece runs the joint graph's own nodes on the same values in the
        # same order; the one sum split across stages, a tied parameter's two contributions,
        # has two operands, and fp addition is commutative (only associativity fails).
        torch.testing.assert_close(grads[fqn], want[idx], rtol=0, atol=0, msg=fqn)
    if example == "gpt":  # the embedding is tied to the output head: both end stages add to its gradient
        assert list(program.tied) == ["transformer.wte.weight"]
        head = next(s for s, layers in enumerate(stage_layers) if "lm_head" in layers)
        assert program.tied["transformer.wte.weight"] == (0, head) and head > 0
    else:  # the rotary tables are computed once and relayed to every stage that has a block
        sends = [set(st.send_forward.names) for st in program.stages[:-1]]
        assert all(any("cos" in n for n in s) for s in sends[:-1]), sends


def test_b_holds_input_gradients_and_w_weight_gradients():
    gm, values = _graph("llama")
    program, keys, _ = _split(gm, _cut(gm, 3))
    middle = program.stages[1]
    mm = torch.ops.aten.mm.default
    n_b = sum(1 for n in middle.backward_input.gm.graph.nodes if n.target == mm)
    n_w = sum(1 for n in middle.backward_weight.gm.graph.nodes if n.target == mm)
    n_f = sum(1 for n in middle.forward.gm.graph.nodes if n.target == mm)
    # every linear layer of the stage: one mm forward, dX = dY W in B, dW = dY^T X in W
    assert n_f > 0 and n_b == n_f and n_w == n_f, (n_f, n_b, n_w)
    assert not any(name in middle.grads for name in middle.backward_input.outputs)
    assert set(middle.grads.values()) == set(middle.params)
    # what W reads after B is a subset of what F saved plus B's outputs: activations used only
    # by B are gone once B ran
    assert middle.keep_after_backward < middle.keep_after_forward | set(middle.backward_input.outputs)


def test_a_layer_outside_every_stage_is_an_error():
    gm, _ = _graph("gpt")
    stage_layers = _cut(gm, 2)
    stage_layers[1] = stage_layers[1][:-1]
    with pytest.raises(PlanError, match="do not place layer"):
        tag_stages(gm, stage_of_layers(stage_layers))


# ---------------------------------------------------------------- one B/W rule for planner and runtime


def _planner_phases(gm) -> dict[str, str]:
    """The phase the planner prices each op in (F, B or W), by node name."""
    from autopar.passes.strategies import build_strategy_graph

    return {n.name: n.phase for n in build_strategy_graph(gm, axis_size=1).nodes if n.kind == "op"}


def _runtime_phases(program) -> dict[str, str]:
    """The piece (F, B or W) each op of the split program runs in, by node name."""
    out = {}
    for st in program.stages:
        for kind, piece in (("F", st.forward), ("B", st.backward_input), ("W", st.backward_weight)):
            for n in piece.gm.graph.nodes:
                if n.op == "call_function" and "getitem" not in n.name:
                    out.setdefault(n.name, set()).add(kind)
    return {name: kinds.pop() for name, kinds in out.items() if len(kinds) == 1}  # free nodes are copied


def _head_weight_gradient(gm):
    """GPT's dW = dY^T X of the output head: the backward mm of lm_head that feeds the tied gradient."""
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    out = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    todo, seen = [out[info.grad_outputs["transformer.wte.weight"]]], set()
    while todo:  # up from the gradient (the tied sum) through lm_head's backward only
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n.target == torch.ops.aten.mm.default:
            return n
        todo.extend(a for a in n.all_input_nodes if a.meta.get(mk.LAYER) == "lm_head")
    raise AssertionError("no weight-gradient matmul of lm_head feeds transformer.wte.weight's gradient")


def test_tied_head_weight_gradient_is_w_for_the_planner_and_the_runtime():
    """Issue 10: the planner priced the tied head's dW as B (it feeds the embedding's gradient, another
    layer), the runtime runs it in W (the tied sum is split per stage); one rule now says W for both."""
    gm, _ = _graph("gpt")
    head_dw = _head_weight_gradient(gm)
    assert _planner_phases(gm)[head_dw.name] == "W"
    stage_layers = _cut(gm, 2)
    program, _, tied = _split(gm, stage_layers)
    assert "transformer.wte.weight" in tied
    head = next(s for s, layers in enumerate(stage_layers) if "lm_head" in layers)
    st = program.stages[head]
    assert head_dw.name in {n.name for n in st.backward_weight.gm.graph.nodes}
    assert head_dw.name not in {n.name for n in st.backward_input.gm.graph.nodes}


@pytest.mark.parametrize("example", ["gpt", "llama"])
def test_planner_and_runtime_split_every_backward_op_alike(example):
    """With one stage per layer the runtime's per-stage B/W split is the planner's per-layer one."""
    gm, _ = _graph(example)
    planned = _planner_phases(gm)
    program, _, _ = _split(gm, [[x.path] for x in gm.meta[mk.LAYERS]])
    ran = _runtime_phases(program)
    common = sorted(set(planned) & set(ran))
    assert len(common) > 0.9 * len(planned)
    assert sum(planned[n] == "B" for n in common) > 0 and sum(planned[n] == "W" for n in common) > 0
    differ = [(n, planned[n], ran[n]) for n in common if planned[n] != ran[n]]
    assert not differ, differ[:10]


def test_split_backward_by_dataflow_on_a_hand_built_graph():
    """B: what an earlier group depends on, through any group's backward; a tied sum is no reader."""
    from autopar.passes.backward_split import split_backward

    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.neg, (x,))  # group 2; flows to group 3 and back into group 2's input gradient
    b = g.call_function(torch.neg, (a,))  # group 3
    c = g.call_function(torch.add, (b, x))  # group 2; its input gradient, read by group 1
    d = g.call_function(torch.neg, (c,))  # group 1; nothing earlier reads it
    w = g.call_function(torch.neg, (x,))  # group 2; a weight gradient, summed with group 1's addend
    tied = g.call_function(torch.add, (w, d))  # group 1: the tied sum
    g.output((tied,))
    backward = {a: 2, b: 3, c: 2, d: 1, w: 2, tied: 1}
    assert split_backward(backward, backward, ignore_readers={tied}) == {a, b, c}
    assert split_backward(backward, backward) == {a, b, c, w}  # the sum read as an ordinary reader


def test_split_backward_runs_a_copy_made_from_b_in_b():
    """A forward op the backward makes again (recompute's copy) goes to B where B makes all it reads,
    even if only W reads it; a copy made from forward values only stays in W."""
    from autopar.passes.backward_split import split_backward

    g = torch.fx.Graph()
    x = g.placeholder("x")
    silu = g.call_function(torch.sigmoid, (x,))  # group 2, a copy B reads (the input gradient needs it)
    grad_in = g.call_function(torch.mul, (silu, x))  # group 2: read by group 1 (B)
    up = g.call_function(torch.neg, (grad_in,))  # group 1
    product = g.call_function(torch.mul, (silu, silu))  # group 2, a copy made from B's: only W reads it
    plain = g.call_function(torch.neg, (x,))  # group 2, a copy made from a forward value: only W reads it
    dw = g.call_function(torch.add, (product, plain))  # group 2: a weight gradient
    g.output((up, dw))
    backward = {silu: 2, grad_in: 2, up: 1, product: 2, plain: 2, dw: 2}
    copies = {silu, product, plain}
    assert split_backward(backward, backward) == {silu, grad_in}
    assert split_backward(backward, backward, remade=copies) == {silu, grad_in, product}


@pytest.mark.parametrize("example", ["gpt", "llama"])
def test_planner_cut_table_names_what_the_runtime_sends(example):
    """The planner prices a cut's messages from the values :class:`CutTable` says cross it; with one
    stage per layer, every cut's forward and backward values are the runtime's message names
    (GPT: the tied embedding's gradient addend crosses no cut; Llama: the rotary tables relay)."""
    from autopar.planner.cuts import CutTable

    gm, _ = _graph(example)
    table = CutTable(gm)  # before the split rewrites the tied gradient sum
    paths = [x.path for x in gm.meta[mk.LAYERS]]
    program, _, _ = _split(gm, [[p] for p in paths])
    for s, st in enumerate(program.stages[:-1]):
        crossings, placed_as = table.crossings(paths[s], paths[s + 1])
        assert placed_as is None
        planned = {side: {c.tensor for c in crossings if c.side == side} for side in ("forward", "backward")}
        ran = {"forward": set(st.send_forward.names), "backward": set(st.recv_backward.names)}
        assert planned == ran, (paths[s], planned, ran)
        dtypes = dict(zip(st.send_forward.names + st.recv_backward.names, st.send_forward.dtypes
                          + st.recv_backward.dtypes))
        assert all(dtypes[c.tensor] == c.dtype for c in crossings)

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

"""Where insert_zero_calls puts REDUCE_GRAD in a step program (single process, a stub ShardedParams).

A traced step takes each gradient's local tensor after the whole joint graph ran
(``DTensor.to_local``: one ``aten.view`` per gradient at the program's end; the per-rank
program makes each a ``reshape``, ``autopar.passes.shard._reshape_computed_views``).
REDUCE_GRAD must follow the gradient's real producer, not that trailing view: else every
layer group's reduction waits for the whole backward and every layer's gradient is alive at
once (a full gradient copy at ZeRO-3; measured 0.6 GB per rank on a 12-block GPT 350m,
bench/startup_memory.py). From 2026-12-03 to 2026-12-07 the reshapes kept every REDUCE_GRAD at
the program's end, which these tests, run on ``view`` only, did not see: they run on both now,
and ``tests/dist/test_zero_memory.py::test_gradients_are_reduced_while_the_backward_runs``
checks a real step program.
"""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.passes.shard import _reshape_computed_views
from autopar.runtime.zero_program import insert_zero_calls

_TRAILING = (torch.ops.aten.view.default, torch.ops.aten.reshape.default)


class _Params:
    """What insert_zero_calls reads of ShardedParams; records the gradients handed over."""

    def __init__(self, groups):
        self.groups = groups
        self.group_of = {f: g for g, fqns in enumerate(groups) for f in fqns}
        self.calls = []

    def grads_ready(self, group, fqns, *grads):
        self.calls.append((group, fqns, [g.clone() for g in grads]))


def _step(w0, w1, x):
    """Two linear layers and their backward by hand; gradients returned through trailing views,
    the first layer's weight gradient a sum of two addends (as a tied embedding's is)."""
    h = x @ w0  # (B, H)
    y = h @ w1  # (B, O)
    loss = y.sum()
    gy = torch.ones_like(y)
    g1 = h.t() @ gy  # (H, O)
    gh = gy @ w1.t()  # (B, H)
    g0 = (x.t() @ gh) + (x.t() * 2.0) @ gh  # two addends, summed last
    return loss, g0.view(g0.shape), g1.view(g1.shape)


def _program(reshape: bool):
    w0, w1, x = torch.randn(4, 3), torch.randn(3, 2), torch.randn(5, 4)
    gm = make_fx(_step)(w0, w1, x)
    if reshape:  # as the per-rank program has them
        _reshape_computed_views(gm.graph)
        assert torch.ops.aten.reshape.default in {n.target for n in gm.graph.nodes}
    params = _Params([("w0",), ("w1",)])
    program = insert_zero_calls(gm, params=params, param_inputs={0: "w0", 1: "w1"}, grad_outputs={1: "w0", 2: "w1"},
                                loss_output=0)
    return program, params, (w0, w1, x)


@pytest.mark.parametrize("reshape", [False, True], ids=["view", "reshape"])
def test_reduce_follows_each_gradients_producer(reshape):
    program, params, args = _program(reshape)
    nodes = list(program.graph.nodes)
    calls = [n for n in nodes if n.op == "call_function" and getattr(n.target, "__name__", "") == "grads_ready"]
    assert [c.args[0] for c in calls] == [1, 0]
    later_group, first_group = calls
    # the second layer's gradients go before the first layer's weight-gradient matmuls run
    total = first_group.args[2]
    while total.target in _TRAILING:
        total = total.args[0]
    addends = [a for a in total.all_input_nodes if a.target is torch.ops.aten.mm.default]
    assert len(addends) == 2, program.code
    assert all(nodes.index(later_group) < nodes.index(a) for a in addends), program.code
    # between a gradient's producer and its REDUCE_GRAD there are only its views
    for call in calls:
        for g in call.args[2:]:
            between = nodes[nodes.index(g) + 1: nodes.index(call)]
            assert all(n.target in _TRAILING for n in between), (call.name, [n.name for n in between])


@pytest.mark.parametrize("reshape", [False, True], ids=["view", "reshape"])
def test_values_are_unchanged_and_the_sum_of_addends_is_in_place(reshape):
    program, params, (w0, w1, x) = _program(reshape)
    loss, *grads = program(w0, w1, x)
    assert grads == [None, None]
    _, g0, g1 = _step(w0, w1, x)
    got = {fqns[0]: gs[0] for _, fqns, gs in params.calls}
    torch.testing.assert_close(got["w0"], g0, rtol=0, atol=0)
    torch.testing.assert_close(got["w1"], g1, rtol=0, atol=0)
    adding = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)
    adds = [n.target for n in program.graph.nodes if n.target in adding]
    assert adds == [torch.ops.aten.add_.Tensor], program.code

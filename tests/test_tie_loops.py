"""The iterations of an unrolled Python loop share one strategy in the sharding MIP
(``autopar.planner.ties.tie_loops``): a restriction of the problem, so its answer can cost
more than the optimum but never less, and the merged problem must price the answer it gives
exactly (checked against ``evaluation.evaluate`` on the whole problem, which knows nothing of ties)."""

import pytest
import torch
from torch import nn

from autopar.cluster import parse_cluster
from autopar.passes.strategies import build_strategy_graph
from autopar.planner import evaluation, ilp, ties
from autopar.planner.frontend import trace_pair

STEPS = 8


class Scan(nn.Module):
    """A gated linear recurrence written as a Python loop over time steps (as Hugging Face's
    RWKV, Mamba and xLSTM do without their CUDA kernels)."""

    def __init__(self, d: int):
        super().__init__()
        self.inp = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        u, gate = self.inp(x).chunk(2, dim=-1)
        h = torch.zeros_like(u[:, 0])
        states = []
        for t in range(x.shape[1]):
            h = torch.sigmoid(gate[:, t]) * h + u[:, t] + u[:, : t + 1].mean(dim=1)  # (a slice that grows)
            states.append(h)
        return x + self.out(torch.stack(states, dim=1))


class Model(nn.Module):
    def __init__(self, d: int = 64, vocab: int = 128):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Scan(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


pytestmark = pytest.mark.usefixtures("solved_afresh")  # (tests/conftest.py)


@pytest.fixture(scope="module")
def graphs():
    torch.manual_seed(0)
    cluster = parse_cluster("1x4xH100")
    ids = torch.randint(0, 128, (8, STEPS))
    gm, gm2 = trace_pair(Model(), ids, cluster=cluster, example_target=ids,
                         loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
    return cluster, gm, gm2


@pytest.mark.parametrize("tp", [2, 4])
def test_loop_iterations_share_a_strategy_and_are_priced_exactly(graphs, tp):
    cluster, gm, gm2 = graphs
    sg = build_strategy_graph(gm, axis_size=tp, gm_double=gm2, shard_batch=False)
    problem = ilp.build_problem(sg, batch=4, device=cluster.device, link=cluster.link_for_group(tp, stride=1))
    small, rep, _, _ = ties.tie_loops(problem)
    # the ops the loop body makes, forward and backward: one per step in each of the two alike
    # blocks, which tie together (a few lines make fewer: the first step adds to a zero state;
    # two like ops of a line tie together)
    merged = [v for v in range(len(sg.nodes)) if rep.count(rep[v]) > 1]
    assert len(small.graph.nodes) < len(sg.nodes) - 0.8 * len(merged) and merged
    sizes = {rep.count(rep[v]) for v in merged}
    # (a slice of odd length cannot shard evenly where an even one can: its candidates differ)
    assert 2 * STEPS in sizes and all(ties.TIE_MIN <= n <= 4 * STEPS for n in sizes), sizes
    assert any({sg.nodes[u].layer for u in merged if rep[u] == rep[v]} == {"blocks.0", "blocks.1"} for v in merged)
    assert all(sg.nodes[v].tie and sg.nodes[v].layer.startswith("blocks.") for v in merged)
    growing = [v for v in merged if sg.nodes[v].shape != sg.nodes[rep.index(rep[v])].shape]
    assert growing  # the slices of u: iterations of different sizes tie too
    # the per-step slices one call makes (the backward of torch.stack over the states) sit at
    # different places in that call, so only their line ties them: one class of STEPS places
    places = {r: {sg.nodes[u].tie for u in merged if rep[u] == r} for r in set(rep[v] for v in merged)}
    assert any(len(p) >= STEPS and len({sg.nodes[u].tie_line for u in merged if rep[u] == r}) <= 2
               for r, p in places.items()), places

    tied = ilp.solve(problem, gap=0)
    free = ilp.solve(problem, gap=0, tie=False)
    assert tied.tied == len(sg.nodes) - len(small.graph.nodes) and free.tied == 0
    assert tied.status == free.status == "OPTIMAL"
    for v in merged:  # one strategy per class
        assert tied.choice[v] == tied.choice[next(u for u in merged if rep[u] == rep[v])]
    # the merged MIP prices its answer as the whole problem does (no tensor counted twice or missed)
    assert evaluation.evaluate(problem, tied).total_s == pytest.approx(tied.objective_s, rel=1e-9)
    # a restriction: never cheaper than the optimum, and here (a symmetric scan) as cheap
    assert tied.objective_s >= free.objective_s * (1 - 1e-9)
    assert tied.objective_s == pytest.approx(free.objective_s, rel=0.01)


def test_forbidden_candidates_follow_their_class(graphs):
    """A pinned decision (the planner forbids candidates to pin sequence parallelism) is kept:
    ops tie only with ops whose forbidden candidates are the same, and the answer avoids them."""
    cluster, gm, gm2 = graphs
    sg = build_strategy_graph(gm, axis_size=2, gm_double=gm2, shard_batch=False)
    loop_ops = [v for v, n in enumerate(sg.nodes) if n.tie and len(n.candidates) > 1 and n.layer == "blocks.0"]
    banned = frozenset((v, 0) for v in loop_ops[::2])  # every other op of the block: splits classes
    problem = ilp.build_problem(sg, batch=4, device=cluster.device, link=cluster.link_for_group(2, stride=1),
                                forbidden=banned)
    sol = ilp.solve(problem, gap=0)
    assert sol.tied > 0 and not any((v, i) in banned for v, i in enumerate(sol.choice))
    assert evaluation.evaluate(problem, sol).total_s == pytest.approx(sol.objective_s, rel=1e-9)


def test_the_plan_says_how_many_ops_were_tied():
    import autopar
    from autopar.plan_summary import render_summary

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (8, STEPS))
    plan = autopar.plan(Model(), ids, cluster="1x4xH100", example_target=ids, fixed={"tp": 4},
                        loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
    assert plan.solver["tied"] > 10 * STEPS
    assert f"; {plan.solver['tied']} ops of unrolled loops took their iteration's strategy)" in render_summary(plan)


class GatedMLP(nn.Module):
    """Three linear layers called on one source line (Llama's MLP), in a loop over two alike blocks."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


@pytest.mark.parametrize("carets", [True, False])
def test_calls_on_one_line_are_not_a_loop(carets, monkeypatch):
    """w1, w2 and w3 make alike matmuls (d x d) on one line: three calls, which must not tie (tied,
    the MLP cannot split w1/w3 by column and w2 by row). Their stacks tell them apart by the
    column markers torch 2.13 adds (``^^^``); torch 2.11's have none (``carets=False`` strips them),
    and there the calls' modules do. The two blocks' like matmuls still tie: a loop over a list."""
    from autopar.passes import meta_keys as mk

    model = nn.Sequential(nn.Embedding(128, 64), GatedMLP(), GatedMLP(), nn.Linear(64, 128))
    ids = torch.randint(0, 128, (8, STEPS))
    cluster = parse_cluster("1x4xH100")
    gm, gm2 = trace_pair(model, ids, cluster=cluster, example_target=ids,
                         loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
    if not carets:
        for node in gm.graph.nodes:
            if node.meta.get("stack_trace"):
                node.meta["stack_trace"] = "\n".join(line for line in node.meta["stack_trace"].splitlines()
                                                     if line.strip(" ^~"))
    sg = build_strategy_graph(gm, axis_size=4, gm_double=gm2, shard_batch=False)
    module = {n.name: n.meta[mk.TRACE].module_path for n in gm.graph.nodes}
    forward_mms = [n for n in sg.nodes if n.kind == "op" and n.phase == "F" and n.name.startswith(("mm", "addmm"))
                   and module[n.name].split(".")[-1] in ("w1", "w2", "w3")]
    assert len(forward_mms) == 6, [n.name for n in forward_mms]
    ties_by_module = {}
    for n in forward_mms:
        ties_by_module.setdefault(module[n.name].split(".", 1)[1], set()).add(n.tie)
    assert sorted(ties_by_module) == ["w1", "w2", "w3"]
    assert all(len(t) == 1 for t in ties_by_module.values()), ties_by_module  # block 1's and block 2's tie
    assert len(set().union(*ties_by_module.values())) == 3, ties_by_module  # w1, w2, w3 apart

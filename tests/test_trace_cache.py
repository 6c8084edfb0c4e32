"""The opt-in trace cache (autopar.passes.trace_cache): a hit only where nothing the trace
reads differs, and a hit hands out a graph equal to a fresh trace that the caller owns."""

import pytest
import torch
from torch import nn

from autopar.passes import meta_keys as mk
from autopar.passes import trace_cache, trace_store
from autopar.passes.trace import trace_joint


class Block(nn.Module):
    def __init__(self, width, eps=1e-5, scale=None):
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=eps)
        self.fc = nn.Linear(width, width)
        self.gelu_approx = "none"
        self.scale = scale  # a plain tensor attribute: a constant of the graph

    def forward(self, x):
        y = nn.functional.gelu(self.fc(self.norm(x)), approximate=self.gelu_approx)
        return x + (y * self.scale if self.scale is not None else y)


class Net(nn.Module):
    def __init__(self, width=8, depth=2, **kw):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width, **kw) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _loss(weight):
    return lambda out, target: ((out - target) ** 2).mean() * weight


def _trace(model, batch=4, loss=None, **kw):
    torch.manual_seed(0)
    x, t = torch.randn(batch, 4), torch.randn(batch, 4)
    return trace_joint(model, (x,), loss_fn=loss or _loss(1.0), example_target=t, **kw)


def _signature(gm):
    return [(n.op, str(n.target), n.name, str(n.meta[mk.TRACE].fqn if mk.TRACE in n.meta else None),
             tuple(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else None)
            for n in gm.graph.nodes]


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.delenv(trace_store.ENV, raising=False)  # (this process's cache alone: tests/test_trace_store.py)
    trace_cache.set_enabled(True)
    trace_cache.clear()
    yield trace_cache
    trace_cache.set_enabled(None)
    trace_cache.clear()


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv(trace_cache.ENV, raising=False)
    trace_cache.set_enabled(None)
    assert not trace_cache.enabled()
    monkeypatch.setenv(trace_cache.ENV, "1")
    assert trace_cache.enabled()
    monkeypatch.setenv(trace_cache.ENV, "0")
    assert not trace_cache.enabled()


def test_an_equal_model_built_again_hits_and_gets_the_same_graph(cache):
    fresh = _trace(Net())
    torch.manual_seed(123)  # other weights: values never enter the trace
    hit = _trace(Net())
    assert cache.stats() == {"hits": 1, "misses": 1, "unkeyable": 0, "loaded": 0}
    assert _signature(hit) == _signature(fresh)
    assert hit.meta[mk.GRAPH] == fresh.meta[mk.GRAPH]
    assert hit is not fresh and hit.graph is not fresh.graph


def test_the_caller_owns_the_graph_it_gets(cache):
    first = _trace(Net())
    before = _signature(first)
    out = first.graph.find_nodes(op="output")[0]
    with first.graph.inserting_before(out):
        first.graph.call_function(torch.ops.aten.relu.default, (out.args[0][0],))
    assert _signature(first) != before
    for n in first.graph.nodes:
        n.meta["scribble"] = 1
    first.meta["scribble"] = 1
    second = _trace(Net())
    assert _signature(second) == before
    assert all("scribble" not in n.meta for n in second.graph.nodes) and "scribble" not in second.meta
    third = _trace(Net())
    assert _signature(third) == before and cache.stats()["hits"] == 2


def test_a_model_on_meta_hits_the_trace_of_the_same_model_on_cpu(cache):
    """Both are traced on fake CPU tensors (a meta-started run and its CPU-started twin, one process)."""
    on_cpu = _trace(Net(depth=3))
    with torch.device("meta"):
        on_meta = Net(depth=3)
    hit = _trace(on_meta)
    assert cache.stats()["hits"] == 1
    trace_cache.set_enabled(False)
    fresh = _trace(on_meta)
    assert _signature(hit) == _signature(fresh) == _signature(on_cpu) and hit.code == fresh.code


@pytest.mark.parametrize("change", [
    "width", "eps", "attribute", "constant", "tie", "frozen", "eval", "batch", "loss_closure", "dtype",
    "uncollapsed", "depth",
])
def test_whatever_the_trace_reads_changes_the_key(cache, change):
    _trace(Net(depth=3))
    model, kw, loss = Net(depth=3), {}, None
    if change == "width":
        model = Net(width=16, depth=3)
    elif change == "eps":
        model = Net(depth=3, eps=1e-3)
    elif change == "attribute":
        model.blocks[1].gelu_approx = "tanh"
    elif change == "constant":
        model = Net(depth=3, scale=torch.tensor(2.0))
        _trace(model)
        model = Net(depth=3, scale=torch.tensor(3.0))
    elif change == "tie":
        model.blocks[1].fc.weight = model.blocks[0].fc.weight
    elif change == "frozen":
        model.embed.weight.requires_grad_(False)
    elif change == "eval":
        model.eval()
    elif change == "batch":
        kw["batch"] = 6
    elif change == "loss_closure":
        loss = _loss(2.0)
    elif change == "dtype":
        kw["param_dtype"] = torch.bfloat16
    elif change == "uncollapsed":
        kw["collapse_repeats"] = False
    elif change == "depth":
        model = Net(depth=4)
    before = cache.stats()
    _trace(model, loss=loss, **kw)
    assert cache.stats()["hits"] == before["hits"], change
    assert cache.stats()["misses"] == before["misses"] + 1, change


def test_hooks_and_unreadable_values_are_never_cached(cache):
    model = Net()
    model.blocks[0].register_forward_hook(lambda mod, args, out: out)
    _trace(model)
    _trace(model)

    class Opaque:
        __slots__ = ()

    odd = Net()
    odd.blocks[0].thing = iter([1])  # an iterator: neither __dict__ nor __slots__ to read
    _trace(odd)
    assert cache.stats() == {"hits": 0, "misses": 0, "unkeyable": 3, "loaded": 0}
    slotted = Net()
    slotted.blocks[0].thing = Opaque()  # empty __slots__: readable, and equal to any other Opaque
    _trace(slotted)
    _trace(slotted)
    assert cache.stats()["hits"] == 1


def test_a_failed_trace_is_not_cached(cache):
    class Bad(Net):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent: cannot be traced
                return super().forward(x)
            return super().forward(-x)

    for _ in range(2):
        with pytest.raises(Exception):
            _trace(Bad())
    assert cache.stats()["hits"] == 0

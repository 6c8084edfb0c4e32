"""Traces shared between processes through a directory (autopar.passes.trace_store): what one
process traced, another loads equal to its own trace, plans the same from, and finds under the
same name; across processes a key is traced once; what is not the same is not shared."""

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar.passes import meta_keys as mk
from autopar.passes import trace_cache, trace_store
from autopar.passes.trace import trace_joint
from autopar.testing import spawn_world

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402

# The GPT example's key as a process computes it (run here and in a fresh interpreter).
KEY_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {examples!r})
    import gpt
    from autopar.passes import trace_cache, trace_store
    from autopar.passes.trace import flatten_inputs

    model, inputs, loss_fn, target = gpt.build(size="tiny", batch=4, n_layer=2)
    names, flat, kw = flatten_inputs(inputs)
    key = trace_cache.trace_key(model, names + ("target",), flat + [target], loss_fn, (False, None, None, 0, True))
    print(trace_store.digest(key))
""").format(examples=str(ROOT / "examples"))


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """Traces cached in this process and shared through a directory of this test's own."""
    monkeypatch.setenv(trace_store.ENV, str(tmp_path / "traces"))
    trace_cache.set_enabled(True)
    trace_cache.clear()
    yield tmp_path / "traces"
    trace_cache.set_enabled(None)
    trace_cache.clear()


def _trace_gpt(**kw):
    model, inputs, loss_fn, target = gpt.build(size="tiny", batch=4, n_layer=2, **kw)
    return trace_joint(model, inputs, loss_fn=loss_fn, example_target=target, collapse_repeats=False)


def _nodes(gm):
    """Everything a pass reads of a node: op, target, name, arguments, autopar's records, the
    values' shapes, strides and dtypes, the module and source stacks."""
    out = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        out.append((n.op, str(n.target), n.name, str(n.args), str(n.kwargs), n.meta.get(mk.TRACE),
                    tuple((tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v for v in vals),
                    str(n.meta.get("nn_module_stack")), str(n.meta.get("source_fn_stack")), n.meta.get("seq_nr"),
                    n.meta.get("stack_trace")))
    return out


def test_a_stored_trace_loads_equal_to_a_fresh_one(shared):
    fresh = _trace_gpt()
    assert trace_cache.stats()["loaded"] == 0 and len(list(shared.glob("*.fx"))) == 1
    trace_cache.clear()  # (this process forgets it, as another process never knew it)
    loaded = _trace_gpt()
    assert trace_cache.stats() == {"hits": 0, "misses": 1, "unkeyable": 0, "loaded": 1}
    assert loaded.code == fresh.code
    assert _nodes(loaded) == _nodes(fresh)
    assert loaded.meta[mk.GRAPH] == fresh.meta[mk.GRAPH]
    hit = _trace_gpt()  # now from this process's memory
    assert trace_cache.stats()["hits"] == 1 and _nodes(hit) == _nodes(fresh)


def test_a_plan_from_a_loaded_trace_is_byte_identical(shared):
    def plan():
        model, inputs, loss_fn, target = gpt.build(size="tiny", batch=8)
        return autopar.plan(model, inputs, cluster="1x8xH100", loss_fn=loss_fn, example_target=target).to_json()

    made = plan()
    trace_cache.clear()
    loaded = plan()
    assert trace_cache.stats()["loaded"] == 2  # (the planner's two traces, batch 8 and 16)
    assert loaded == made


def _trace_in_rank(rank, world, directory):
    os.environ[trace_store.ENV] = directory
    trace_cache.set_enabled(True)
    gm = _trace_gpt()
    return trace_cache.stats(), _nodes(gm)


def test_the_ranks_of_a_world_trace_once(tmp_path):
    """Both ranks ask at once; one traces while the other waits on the key's lock, then loads."""
    one, two = spawn_world(_trace_in_rank, 2, str(tmp_path / "traces"))
    assert sorted((one[0]["loaded"], two[0]["loaded"])) == [0, 1], (one[0], two[0])
    assert one[1] == two[1]
    assert len(list((tmp_path / "traces").glob("*.fx"))) == 1


def test_a_fresh_interpreter_names_a_key_alike():
    """The digest describes types and functions by name and code, not by identity (or hash seed)."""
    mine = subprocess.run([sys.executable, "-c", KEY_SCRIPT], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONHASHSEED": "1"})
    theirs = subprocess.run([sys.executable, "-c", KEY_SCRIPT], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONHASHSEED": "2"})
    assert mine.returncode == 0 and theirs.returncode == 0, mine.stderr[-2000:] + theirs.stderr[-2000:]
    digest = mine.stdout.strip()
    assert len(digest) == 64 and digest == theirs.stdout.strip()


def test_what_differs_is_named_apart(tmp_path, monkeypatch):
    def key(model):
        x, t = torch.randn(2, 4), torch.randn(2, 4)
        return trace_store.digest(trace_cache.trace_key(model, ("x", "target"), [x, t], None, ()))

    module = tmp_path / "store_case.py"
    source = textwrap.dedent("""
        from torch import nn

        class Net(nn.Module):
            def __init__(self, eps=1e-5):
                super().__init__()
                self.norm = nn.LayerNorm(4, eps=eps)

            def forward(self, x):
                return self.norm(x)
    """)
    module.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    case = importlib.import_module("store_case")
    base = key(case.Net())
    assert base is not None and key(case.Net()) == base
    assert key(case.Net(eps=1e-6)) != base  # a configuration value
    module.write_text(source.replace("return self.norm(x)", "return self.norm(x) * 2"))  # the file edited
    assert key(case.Net()) != base

    class Local(nn.Module):  # made by a function: what it closes over is not in the key
        def forward(self, x):
            return x

    assert trace_store.digest(trace_cache.trace_key(Local(), ("x",), [torch.randn(2)], None, ())) is None


def test_a_damaged_entry_is_traced_again_and_replaced(shared, caplog):
    fresh = _trace_gpt()
    (entry,) = shared.glob("*.fx")
    entry.write_bytes(b"not a pickle")
    trace_cache.clear()
    again = _trace_gpt()
    assert trace_cache.stats()["loaded"] == 0 and "could not be loaded" in caplog.text
    assert again.code == fresh.code
    trace_cache.clear()
    _trace_gpt()
    assert trace_cache.stats()["loaded"] == 1  # (the entry was written anew)


def test_nothing_is_shared_without_a_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(trace_store.ENV, "")
    trace_cache.set_enabled(True)
    trace_cache.clear()
    try:
        _trace_gpt()
        trace_cache.clear()
        _trace_gpt()
        assert trace_cache.stats()["loaded"] == 0
    finally:
        trace_cache.set_enabled(None)
        trace_cache.clear()

"""passes/trace.py: joint forward+backward graphs of the examples and of Hugging Face models.

Every test traces on FakeTensors (nothing is computed); the 70B model is built on
"meta" and traced with its 80 identical layers collapsed into two (the first
block, and the second standing for the 79 others).
"""
import functools
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch import fx

from autopar.errors import TraceError
from autopar.modelspec import load_model_spec
from autopar.passes import meta_keys as mk
from autopar.passes.trace import LossError, trace_joint

ROOT = Path(__file__).resolve().parents[1]


def build(example, **args):
    """(model, example_inputs, loss_fn, example_target) of examples/EXAMPLE.py:build."""
    return load_model_spec(str(ROOT / "examples" / f"{example}.py") + ":build", args)


def trace(built, **kw):
    model, inputs, loss_fn, target = built
    return trace_joint(model, inputs, loss_fn=loss_fn, example_target=target, **kw)


@functools.cache
def traced(example, *, collapse_repeats=True, **args):
    """(built, gm) of a tiny example, traced once per test session (no test mutates either)."""
    built = build(example, size="tiny", **args)
    return built, trace(built, collapse_repeats=collapse_repeats)


def placeholders(gm, role):
    return [n for n in gm.graph.find_nodes(op="placeholder") if n.meta[mk.TRACE].role is role]


def input_names(inputs, target):
    if isinstance(inputs, dict):
        names = tuple(k for k, v in inputs.items() if v is not None)
    else:
        names = tuple(f"arg{i}" for i in range(len(inputs)))
    return names + (("target",) if target is not None else ())


CASES = {
    "mlp": ("mlp", {}),
    "gpt-tied": ("gpt", {}),
    "gpt-untied": ("gpt", {"tie_weights": "false"}),
    "llama": ("llama", {}),
    **{f"hf-{m}": ("hf", {"model": m, "batch": "2", "seq": "16"})
       for m in ("gpt2", "llama", "mistral", "qwen2", "mixtral", "bert", "t5", "vit")},
}


@pytest.mark.parametrize("case", list(CASES))
def test_roles_params_grads_and_inputs(case):
    example, args = CASES[case]
    if example == "hf":
        pytest.importorskip("transformers")
    (model, inputs, loss_fn, target), gm = traced(example, collapse_repeats=False, **args)
    info: mk.GraphTrace = gm.meta[mk.GRAPH]

    # every parameter once (named_parameters() drops the second name of a tied weight)
    params = dict(model.named_parameters())
    got = [n.meta[mk.TRACE].fqn for n in placeholders(gm, mk.Role.PARAM)]
    assert len(got) == len(set(got)), got
    assert set(got) == set(params)
    assert info.param_fqns == tuple(got)
    assert info.n_params == sum(p.numel() for p in params.values())
    for n in placeholders(gm, mk.Role.PARAM):
        assert tuple(n.meta["val"].shape) == tuple(params[n.meta[mk.TRACE].fqn].shape), n.format_node()
        assert n.meta[mk.TRACE].module_path == n.meta[mk.TRACE].fqn.rpartition(".")[0]

    # a gradient output for every trainable parameter, shaped like it; the loss is a scalar
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    trainable = {name for name, p in params.items() if p.requires_grad}
    assert set(info.grad_outputs) == trainable
    for name, index in info.grad_outputs.items():
        grad = outputs[index]
        assert isinstance(grad, fx.Node), f"no gradient node for {name}"
        assert tuple(grad.meta["val"].shape) == tuple(params[name].shape), name
    assert outputs[info.loss_output].meta["val"].dim() == 0

    # forward and backward ops, one tangent (the loss seed), one output node
    roles = [n.meta[mk.TRACE].role for n in gm.graph.nodes]
    assert mk.Role.FORWARD in roles and mk.Role.BACKWARD in roles
    assert roles.count(mk.Role.TANGENT) == 1 and roles.count(mk.Role.OUTPUT) == 1
    assert all(n.meta[mk.TRACE].role in (mk.Role.FORWARD, mk.Role.BACKWARD)
               for n in gm.graph.nodes if n.op == "call_function")
    assert all("val" in n.meta for n in gm.graph.nodes if n.op != "output")

    # user inputs (then the target) as placeholders named as the user named them
    names = input_names(inputs, target)
    assert info.input_names == names
    assert tuple(n.meta[mk.TRACE].fqn for n in placeholders(gm, mk.Role.INPUT)) == names
    first = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs[0]
    assert info.global_batch == first.shape[0]
    assert info.model_name == type(model).__name__
    assert info.module_classes[""] == type(model).__name__


def test_tied_head_is_one_parameter():
    _, tied = traced("gpt", collapse_repeats=False)
    _, untied = traced("gpt", collapse_repeats=False, tie_weights="false")
    tied_params = tied.meta[mk.GRAPH].param_fqns
    assert "lm_head.weight" not in tied_params and "transformer.wte.weight" in tied_params
    assert "lm_head.weight" in untied.meta[mk.GRAPH].param_fqns
    assert len(untied.meta[mk.GRAPH].param_fqns) == len(tied_params) + 1


def test_collapsed_repeats_trace_the_first_two_blocks():
    (model, *_), collapsed = traced("gpt", n_layer="4")
    assert len(model.transformer.h) == 4
    _, full = traced("gpt", collapse_repeats=False, n_layer="4")

    info = collapsed.meta[mk.GRAPH]
    n_each = sum(p.numel() for p in model.transformer.h[0].parameters())
    assert info.repeats == (mk.Repeat(container="transformer.h", traced=("transformer.h.0", "transformer.h.1"),
                                      count=4, n_params_each=n_each),)
    blocks = {p.split(".")[2] for p in info.param_fqns if p.startswith("transformer.h.")}
    assert blocks == {"0", "1"}
    assert info.n_params == sum(p.numel() for p in model.parameters())  # counts the collapsed blocks
    paths = {n.meta[mk.TRACE].module_path for n in collapsed.graph.nodes}
    assert not any(p.startswith(("transformer.h.2", "transformer.h.3")) for p in paths)

    full_info = full.meta[mk.GRAPH]
    assert full_info.repeats == ()
    assert set(full_info.param_fqns) == set(dict(model.named_parameters()))
    assert any(n.meta[mk.TRACE].module_path.startswith("transformer.h.3.") for n in full.graph.nodes)
    assert len(full.graph.nodes) > len(collapsed.graph.nodes)
    assert len(model.transformer.h) == 4  # the collapse is undone


def test_two_blocks_are_traced_whole():
    (model, *_), gm = traced("gpt")  # tiny: 2 blocks, nothing to gain from collapsing
    assert gm.meta[mk.GRAPH].repeats == ()
    assert set(gm.meta[mk.GRAPH].param_fqns) == set(dict(model.named_parameters()))


def test_llama_70b_on_meta_traces_two_blocks_and_leaves_the_model_alone():
    # Tracing is fast because only two of the 80 blocks are traced (the repeats check below);
    # no wall-clock bound here: a test's verdict must not depend on machine load.
    model, *_ = built = build("llama", size="70b")
    params = [(name, p) for name, p in model.named_parameters()]
    buffers = [(name, b) for name, b in model.named_buffers()]
    gm = trace(built)

    info = gm.meta[mk.GRAPH]
    assert info.n_params == pytest.approx(70.55e9, rel=1e-3)
    assert [(r.container, r.traced, r.count) for r in info.repeats] == [("layers", ("layers.0", "layers.1"), 80)]
    assert len(model.layers) == 80
    assert [(name, p) for name, p in model.named_parameters()] == params  # the very same objects
    assert all(a is b for (_, a), (_, b) in zip(model.named_parameters(), params))
    assert all(p.device.type == "meta" and p.dtype is torch.bfloat16 for _, p in params)
    assert all(a is b for (_, a), (_, b) in zip(model.named_buffers(), buffers))


class _Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x)  # (B, 3): not a loss


def test_output_that_is_not_a_loss_needs_loss_fn():
    with pytest.raises(LossError, match="loss_fn") as excinfo:
        trace_joint(_Logits(), (torch.randn(2, 4),))
    assert isinstance(excinfo.value, ValueError)
    assert "(2, 3)" in str(excinfo.value)  # says what the model returned


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            return y.sum()
        return -y.sum()


def test_data_dependent_control_flow_is_a_trace_error_naming_the_line():
    lines, first = inspect.getsourcelines(_DataDependent.forward)
    branch = first + next(i for i, line in enumerate(lines) if "if y.sum()" in line)
    with pytest.raises(TraceError) as excinfo:
        trace_joint(_DataDependent(), (torch.randn(2, 4),))
    message = str(excinfo.value)
    assert f"{__file__}:{branch}" in message
    assert "Try" in message and "_DataDependent" in message
    assert "\n" not in message  # one line, as the CLI prints it


def test_error_raised_by_the_model_keeps_its_message():
    model, _, loss_fn, _ = build("gpt", size="tiny")
    too_long = torch.zeros(2, 100, dtype=torch.long)  # block_size is 64
    with pytest.raises(TraceError, match="longer than block_size 64") as excinfo:
        trace_joint(model, (too_long,), loss_fn=loss_fn, example_target=too_long)
    assert "examples/gpt.py" in str(excinfo.value)



def test_hf_eager_experts_are_a_trace_error_that_names_grouped_mm():
    """Hugging Face's "eager" experts loop over the experts that got tokens (data-dependent).
    autopar traces gated-SiLU experts through its own op whatever the implementation (Mixtral's
    default traces), so the error is met by experts it does not run: here with GELU."""
    pytest.importorskip("transformers")
    import transformers

    config = transformers.MixtralConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=32, vocab_size=64,
                                        num_local_experts=2, num_experts_per_tok=1, use_cache=False)
    model = transformers.MixtralForCausalLM._from_config(config, experts_implementation="eager")
    ids = torch.randint(0, 64, (2, 8))
    gm = trace_joint(model, {"input_ids": ids, "labels": ids})
    assert any("moe_experts" in str(n.target) for n in gm.graph.nodes)
    assert model.model.layers[0].mlp.experts.forward.__func__ is type(model.model.layers[0].mlp.experts).forward
    model.model.layers[0].mlp.experts.act_fn = torch.nn.GELU()
    with pytest.raises(TraceError) as excinfo:
        trace_joint(model, {"input_ids": ids, "labels": ids})
    message = str(excinfo.value)
    assert "modeling_mixtral.py" in message and "experts_implementation='grouped_mm'" in message
    assert "\n" not in message


def test_moe_without_other_implementations_is_not_told_to_pick_one():
    """JetMoE routes tokens with ``.tolist()`` in its own code, which has no experts_implementation
    to switch: the error names the data-dependent line and the generic fix, not grouped_mm."""
    pytest.importorskip("transformers")
    import transformers

    config = transformers.JetMoeConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                       num_key_value_heads=1, kv_channels=16, intermediate_size=32,
                                       vocab_size=64, num_local_experts=2, num_experts_per_tok=1, use_cache=False)
    model = transformers.JetMoeForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(TraceError) as excinfo:
        trace_joint(model, {"input_ids": ids, "labels": ids})
    message = str(excinfo.value)
    assert "modeling_jetmoe.py" in message and "data-dependent control flow" in message, message
    assert "grouped_mm" not in message and "\n" not in message, message


def test_forward_module_paths_are_real_submodules():
    (model, *_), gm = traced("gpt", collapse_repeats=False)
    modules = dict(model.named_modules())
    info = gm.meta[mk.GRAPH]
    forward = [n for n in gm.graph.nodes
               if n.op == "call_function" and n.meta[mk.TRACE].role is mk.Role.FORWARD]
    for n in forward:
        path = n.meta[mk.TRACE].module_path
        assert path in modules, f"{n.format_node()}: {path!r} is not a submodule"
        if path:
            assert n.meta[mk.TRACE].module_class == type(modules[path]).__name__
    seen = {n.meta[mk.TRACE].module_path for n in forward}
    assert {"transformer.h.1.mlp.c_fc", "transformer.h.0.attn", "lm_head", ""} <= seen
    assert info.module_classes == {name: type(m).__name__ for name, m in modules.items()}


def _producer(node):
    """Follow views and getitems back to the op that computed ``node``."""
    while node.op == "call_function" and (node.target.__name__ == "getitem" or
                                           getattr(node.target, "is_view", False)):
        node = node.args[0]
    return node


@pytest.mark.parametrize("example", ["gpt", "mlp"])
def test_gradient_of_a_parameter_comes_from_its_module(example):
    args = {"tie_weights": "false"} if example == "gpt" else {}
    _, gm = traced(example, collapse_repeats=False, **args)
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    for name, index in gm.meta[mk.GRAPH].grad_outputs.items():
        op = _producer(outputs[index])
        owner = name.rpartition(".")[0]
        assert op.meta[mk.TRACE].role is mk.Role.BACKWARD, op.format_node()
        assert op.meta[mk.TRACE].module_path == owner, f"{name}: {op.format_node()} at {op.meta[mk.TRACE].module_path!r}"


def test_backward_of_a_linear_carries_its_path():
    _, gm = traced("gpt", collapse_repeats=False)
    path = "transformer.h.0.mlp.c_fc"
    fwd = [n for n in gm.graph.nodes if n.meta[mk.TRACE].role is mk.Role.FORWARD
           and n.target is torch.ops.aten.addmm.default and n.meta[mk.TRACE].module_path == path]
    assert len(fwd) == 1
    bwd = [n for n in gm.graph.nodes if n.meta[mk.TRACE].role is mk.Role.BACKWARD
           and n.meta[mk.TRACE].seq_nr == fwd[0].meta[mk.TRACE].seq_nr]
    # input gradient and weight gradient matmuls, and the bias gradient's sum
    assert sorted(str(n.target) for n in bwd if n.target in (torch.ops.aten.mm.default, torch.ops.aten.sum.dim_IntList)) == [
        "aten.mm.default", "aten.mm.default", "aten.sum.dim_IntList"]
    assert all(n.meta[mk.TRACE].module_path == path and n.meta[mk.TRACE].module_class == "Linear" for n in bwd)
    weight_grad = [n for n in bwd if n.target is torch.ops.aten.mm.default and tuple(n.meta["val"].shape) == (256, 64)]
    assert weight_grad, "the c_fc weight gradient (4C, C) is missing"


def test_latent_attention_traces_the_fused_kernel_and_computes_the_same():
    """Multi-head latent attention (DeepSeek-V3: value heads narrower than query/key heads)
    traces as the fused SDPA kernel on zero-padded values, not as SDPA's math decomposition
    (bmm, a softmax over the whole score matrix, bmm: priced as unfused fp32 matmuls on a GPU);
    the joint graph's loss and gradients equal the eager model's."""
    import sys

    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "examples"))
    import hf

    torch.manual_seed(0)
    config = hf.tiny_config(transformers.DeepseekV3Config, num_hidden_layers=2, first_k_dense_replace=1,
                            use_cache=False)
    assert config.v_head_dim < config.qk_nope_head_dim + config.qk_rope_head_dim
    model = transformers.DeepseekV3ForCausalLM._from_config(config, attn_implementation="sdpa")
    ids = torch.randint(0, config.vocab_size, (2, 16))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    gm = trace_joint(model, inputs, loss_fn=None, example_target=None, collapse_repeats=False)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert targets.count(flash) == 2 and torch.ops.aten.bmm.default not in targets
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):
        t = node.meta[mk.TRACE]
        values.append(model.get_parameter(t.fqn).detach() if t.role is mk.Role.PARAM else
                      model.get_buffer(t.fqn) if t.role is mk.Role.BUFFER else
                      inputs[t.fqn] if t.role is mk.Role.INPUT else
                      torch.ones(node.meta["val"].shape, dtype=node.meta["val"].dtype))
    run = fx.Interpreter(gm, garbage_collect_values=False)
    run.run(*values)
    outputs = [run.env.get(a) for a in gm.graph.find_nodes(op="output")[0].args[0]]  # (flat, as the graph lists them)
    eager = model(**inputs).loss
    eager.backward()
    info: mk.GraphTrace = gm.meta[mk.GRAPH]
    torch.testing.assert_close(outputs[info.loss_output], eager.detach())
    for fqn, i in info.grad_outputs.items():
        torch.testing.assert_close(outputs[i], model.get_parameter(fqn).grad, msg=fqn)


def test_a_trace_leaves_no_graph_behind():
    """Dynamo installs each capture's compiled graph (its nodes holding FakeTensors) in the traced
    frame's module globals, removed only by a cache entry that export capture never makes: until
    autopar dropped them, every trace left one more GraphModule alive (torch 2.11, 2.13), and a process
    that traces often grew without bound."""
    import gc

    from autopar.passes import trace_cache

    built = build("gpt", size="tiny", n_layer=2)

    def graphs_alive():
        gc.collect()
        return sum(isinstance(o, fx.GraphModule) for o in gc.get_objects())

    trace_cache.set_enabled(False)  # (a cached trace would trace nothing)
    try:
        warm = trace(built)  # first-call caches, then the count
        del warm
        alive = graphs_alive()
        for _ in range(3):
            gm = trace(built)
            assert len(gm.graph.nodes) > 100  # (a real trace)
            del gm
            assert graphs_alive() == alive
    finally:
        trace_cache.set_enabled(None)

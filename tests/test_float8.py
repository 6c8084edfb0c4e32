"""Float8 linears priced as torchao's tensorwise Float8 training runs them (autopar.passes.float8)."""

import pytest
import torch
from torch import nn

from autopar.cost.compute import (
    FLOAT8_CAST_BYTES_PER_ELEMENT,
    GEMM_LAUNCH_S,
    MEMORY_EFFICIENCY,
    gemm_efficiency,
    kernel_time_s,
)
from autopar.cost.devices import DEVICES, DeviceSpec
from autopar.passes import meta_keys as mk
from autopar.passes.annotate import annotate_cost, kernel_of
from autopar.passes.float8 import mark_float8_linears
from autopar.passes.trace import trace_joint
from autopar.planner.make import make_plan

H100 = DEVICES["H100"]


def test_a_large_fp8_gemm_runs_at_the_fp8_peak_and_pays_its_operand_casts():
    m = n = k = 8192
    flops = 2.0 * m * n * k
    fp8 = kernel_time_s(kind="fp8_gemm", flops=flops, bytes_moved=0.0, device=H100, gemm=(m, n, k))
    rate = H100.hbm_bytes_per_s * MEMORY_EFFICIENCY
    expected = (flops / (1979e12 * gemm_efficiency(m, n, k)) + FLOAT8_CAST_BYTES_PER_ELEMENT * 2 * m * k / rate
                + GEMM_LAUNCH_S)
    assert fp8 == pytest.approx(expected)
    bf16 = kernel_time_s(kind="gemm", flops=flops, bytes_moved=0.0, device=H100, gemm=(m, n, k))
    assert 0.5 * bf16 < fp8 < 0.7 * bf16  # twice the peak, less the casts


def test_a_skinny_fp8_gemm_is_slower_than_in_bf16():
    """16 tokens through a 4096 x 4096 weight: memory bound either way, and the weight's cast comes
    on top; why Float8 pays only for large GEMMs."""
    m, n, k = 16, 4096, 4096
    flops, nbytes = 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n)
    fp8 = kernel_time_s(kind="fp8_gemm", flops=flops, bytes_moved=nbytes, device=H100, gemm=(m, n, k))
    bf16 = kernel_time_s(kind="gemm", flops=flops, bytes_moved=nbytes, device=H100, gemm=(m, n, k))
    assert fp8 > bf16


def test_a_device_without_fp8_tensor_cores_is_refused():
    with pytest.raises(ValueError, match="A100-80GB.*no FP8 tensor cores"):
        kernel_time_s(kind="fp8_gemm", flops=1e9, bytes_moved=0.0, device=DEVICES["A100"], gemm=(64, 64, 64))


def test_fp8_peaks_of_the_catalog_and_plan_files_written_before_them():
    assert H100.fp8_flops_per_s == 2 * H100.peak("bf16")  # [H100] 3,958 sparse -> 1,979 dense
    assert DEVICES["H200"].fp8_flops_per_s == H100.fp8_flops_per_s
    gt = DEVICES["H100-96GB"]  # the 500 W parts: the same fraction of SXM as bf16
    assert gt.fp8_flops_per_s / H100.fp8_flops_per_s == pytest.approx(gt.peak("bf16") / H100.peak("bf16"))
    assert DEVICES["A100"].fp8_flops_per_s is None
    data = H100.to_dict()
    del data["fp8_flops_per_s"]
    assert DeviceSpec.from_dict(data).fp8_flops_per_s is None
    assert DeviceSpec.from_dict(H100.to_dict()) == H100


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(64, 10, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).float().pow(2).mean()


def _graph():
    gm = trace_joint(Net(), (torch.randn(8, 64),), collapse_repeats=False)
    return annotate_cost(gm, device=H100)


def test_every_gemm_of_the_selected_linears_is_marked_forward_and_backward():
    gm = _graph()
    before = {n.name: n.meta[mk.COST].time_s for n in gm.graph.nodes if n.op == "call_function"}
    marked = mark_float8_linears(gm, device=H100, linears=lambda path: path != "head")
    kinds = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and kernel_of(node)[0] in ("gemm", "fp8_gemm"):
            trace = node.meta[mk.TRACE]
            kinds.setdefault((trace.module_path, kernel_of(node)[0]), []).append(trace.role)
            if kernel_of(node)[0] == "fp8_gemm":
                cost, shape = node.meta[mk.COST], kernel_of(node)[1]
                assert cost.time_s == kernel_time_s(kind="fp8_gemm", flops=cost.flops, device=H100,
                                                    bytes_moved=cost.bytes_read + cost.bytes_written,
                                                    gemm=tuple(shape[:3]))
                assert cost.time_s != before[node.name]
    f, b = mk.Role.FORWARD, mk.Role.BACKWARD
    # the first linear computes no input gradient (the input needs none): forward + weight gradient
    assert sorted(kinds[("layers.0.lin", "fp8_gemm")]) == sorted([f, b])
    assert sorted(kinds[("layers.1.lin", "fp8_gemm")]) == sorted([f, b, b])
    assert sorted(kinds[("head", "gemm")]) == sorted([f, b, b])  # left out, as torchtitan leaves its head
    assert marked == 5
    again = {n.name: n.meta[mk.COST].time_s for n in gm.graph.nodes if n.op == "call_function"}
    assert mark_float8_linears(gm, device=H100, linears=lambda path: path != "head") == 5  # idempotent
    assert {n.name: n.meta[mk.COST].time_s for n in gm.graph.nodes if n.op == "call_function"} == again
    # annotated afresh, the graph is the bf16 program again: marks dropped with the prices they went with
    annotate_cost(gm, device=H100)
    assert not any(kernel_of(n)[0] == "fp8_gemm" for n in gm.graph.nodes if n.op == "call_function")
    assert {n.name: n.meta[mk.COST].time_s for n in gm.graph.nodes if n.op == "call_function"} == before


def test_a_predicate_that_selects_nothing_and_a_device_without_fp8_are_refused():
    with pytest.raises(ValueError, match="accepted no nn.Linear GEMM"):
        mark_float8_linears(_graph(), device=H100, linears=lambda path: False)
    with pytest.raises(ValueError, match="has no FP8 tensor cores"):
        mark_float8_linears(_graph(), device=DEVICES["A100"], linears=lambda path: True)


class Wide(nn.Module):
    def __init__(self, d=2048, layers=2):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(),
                                                   nn.Linear(4 * d, d, bias=False)) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.float().pow(2).mean()


def test_a_plan_with_float8_linears_is_faster_and_keeps_its_sac_recompute():
    """The same pinned configuration, priced in bf16 and with Float8 linears: GEMM-bound blocks get
    faster; op-level SAC still recomputes every second forward GEMM (now Float8 ones)."""
    with torch.device("meta"):
        model = Wide().to(torch.bfloat16)
    inputs = (torch.empty(64, 512, 2048, dtype=torch.bfloat16, device="meta"),)
    fixed = {"dp": 8, "tp": 1, "pp": 1, "zero": 3, "recompute": "sac", "microbatch_size": 8, "microbatches": 1}
    bf16 = make_plan(model, inputs, cluster="1x8xH100", fixed=fixed)
    fp8 = make_plan(model, inputs, cluster="1x8xH100", fixed=fixed, float8_linears=lambda path: True)
    assert fp8.predicted["step_time_s"] < 0.9 * bf16.predicted["step_time_s"]
    # the same work counted, the recomputed (every second) forward GEMMs included
    hardware = fp8.predicted["hardware_flops_per_step"]
    assert hardware == bf16.predicted["hardware_flops_per_step"] > fp8.predicted["model_flops_per_step"]


def test_tensor_parallel_all_gathers_into_float8_linears_move_float8():
    """torchao's float8 tensor-parallel styles cast a linear's input to float8 before its tp
    all-gather, and its output's gradient before the backward all-gather: half the bytes of bf16.
    Reduce-scatters (partial sums) stay in bf16. Same layout, only the all-gathers change; the head
    left in bf16 keeps its all-gather at full width."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import llama

    model, inputs, loss_fn, target = llama.build(size="8b", n_layers=2, batch=8, seq=2048, device="meta")
    fixed = {"tp": 8, "sp": True, "dp": 1, "pp": 1, "zero": 0, "recompute": "none", "microbatch_size": 8,
             "microbatches": 1}
    kw = dict(cluster="1x8xH100", loss_fn=loss_fn, example_target=target, fixed=fixed)
    bf16 = make_plan(model, inputs, **kw)
    every = make_plan(model, inputs, float8_linears=lambda path: True, **kw)
    blocks = make_plan(model, inputs, float8_linears=lambda path: path != "output", **kw)
    assert bf16.ops == every.ops == blocks.ops

    def tp(plan, kind):
        return plan.communication[kind]["tp"]

    assert tp(every, "all_gather")["bytes"] == tp(bf16, "all_gather")["bytes"] / 2
    assert tp(every, "all_gather")["time_s"] < tp(bf16, "all_gather")["time_s"]
    head = 8 * 2048 * model.output.weight.shape[1] * 2  # the head's input gathered whole in bf16 (B x T x dim)
    assert tp(blocks, "all_gather")["bytes"] == tp(every, "all_gather")["bytes"] + head / 2
    assert tp(every, "reduce_scatter") == tp(bf16, "reduce_scatter")

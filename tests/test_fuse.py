"""Fused pricing of compiled layers' memory-bound ops (autopar.passes.fuse)."""

import torch
import torch.nn as nn

from autopar.cost.compute import kernel_time_s
from autopar.cost.devices import DEVICES
from autopar.passes import meta_keys as mk
from autopar.passes.annotate import annotate_cost, kernel_of, tensor_bytes
from autopar.passes.fuse import fuse_memory_bound
from autopar.passes.layers import group_layers
from autopar.passes.trace import trace_joint

H100 = DEVICES["H100"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):  # (B, T, 64)
        y = self.lin(x)
        return (torch.sin(y * 2.0) + 1.0) * 3.0  # a pointwise chain after the GEMM


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def graph():
    gm = trace_joint(Net(), (torch.randn(4, 16, 64),), collapse_repeats=False)
    annotate_cost(gm, device=H100)
    group_layers(gm)
    return gm


def costs(gm):
    return {n.name: n.meta[mk.COST] for n in gm.graph.nodes}


def test_nothing_compiled_changes_nothing():
    gm = graph()
    before = costs(gm)
    assert fuse_memory_bound(gm, device=H100, compiled=lambda layer: False) == 0
    assert costs(gm) == before


def test_fusing_again_after_annotating_again_prices_the_same():
    """Annotating a fused graph again (for another device, or a graph reused across plans) prices it
    eager again, so fusing then gives what the first fusion gave, not eager prices marked fused."""
    compiled = lambda layer: layer == "layers.1"  # noqa: E731
    gm = graph()
    fuse_memory_bound(gm, device=H100, compiled=compiled)
    first = costs(gm)
    annotate_cost(gm, device=DEVICES["H200"])
    annotate_cost(gm, device=H100)
    assert not any(mk.FUSED in n.meta for n in gm.graph.nodes)
    fuse_memory_bound(gm, device=H100, compiled=compiled)
    assert costs(gm) == first


def test_intermediates_of_a_compiled_block_leave_hbm():
    gm = graph()
    before = costs(gm)
    n = fuse_memory_bound(gm, device=H100, compiled=lambda layer: layer == "layers.1")
    after = costs(gm)
    assert n > 0
    moved = {}
    for node in gm.graph.nodes:
        b, a = before[node.name], after[node.name]
        layer = node.meta.get(mk.LAYER) or ""
        if layer != "layers.1" or node.op != "call_function" or kernel_of(node)[0] != "fused":
            assert a == b, node.name  # GEMMs, views, other layers, the loss: as eager
            assert layer != "layers.1" or kernel_of(node)[0] != "other" or node.op != "call_function" \
                or not a.bytes_read + a.bytes_written, node.name  # every memory-bound op of the block is fused
            continue
        assert a.bytes_read <= b.bytes_read and a.bytes_written <= b.bytes_written
        assert a.time_s == kernel_time_s(kind="fused", flops=0.0, bytes_moved=a.bytes_read + a.bytes_written,
                                         device=H100, dtype="fp32")
        # what the backward reads is still written in the forward
        if b.saved_bytes > 0:
            assert a.bytes_written == b.bytes_written
        moved[node.name] = (b.bytes_read + b.bytes_written) - (a.bytes_read + a.bytes_written)
    # some forward intermediate of the chain: its producer no longer writes it, its reader no longer reads it
    fwd = [nd for nd in gm.graph.nodes if nd.op == "call_function" and nd.meta.get(mk.LAYER) == "layers.1"
           and nd.meta[mk.TRACE].role is mk.Role.FORWARD and kernel_of(nd)[0] == "fused"]
    gone = [nd for nd in fwd if after[nd.name].bytes_written == 0 and before[nd.name].bytes_written > 0]
    assert gone
    for nd in gone:
        size = tensor_bytes(nd.meta["val"])
        assert before[nd.name].bytes_written - after[nd.name].bytes_written == size
    assert sum(moved.values()) > 0

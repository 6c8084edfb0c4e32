"""The runtime's tensors are created on its device, and the device is bound before NCCL starts.

Without a GPU a stray CPU tensor cannot be seen by where it lands: on a CPU run every
tensor is on the CPU, the right ones and the stray ones. What makes a tensor stray on a
GPU is that the code creating it did not say where: ``torch.empty(n)`` (torch's
default device, the CPU) instead of ``torch.empty(n, device=...)``, where ``device``
comes from :mod:`autopar.runtime.device`. ``StrayAllocations`` (a ``TorchFunctionMode``,
which sees the Python-level call with the arguments as written, unlike a dispatch mode,
which sees the device already filled in) records every call of a torch factory function
(``torch.utils._device._device_constructors()``: empty, zeros, ones, full, arange,
tensor, ...) without ``device=`` made from autopar's code, and the test runs DP, ZeRO-3,
TP+SP and pp=2 worlds under it, from ``parallelize`` through two steps, in fp32 and bf16
mixed. ``*_like`` and ``new_*`` calls, and ops on existing tensors, inherit their
input's device, so they need no check. The factory ops inside the traced graph carry
``device=cpu`` from the fake-CPU trace; :func:`autopar.passes.shard.interpret` replaces
it with the mesh's device (``test_graph_factories_follow_the_mesh_device``).
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import autopar
from autopar.testing import spawn_world, tp_friendly_cluster

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
AUTOPAR_DIR = str(Path(autopar.__file__).resolve().parent)
TORCH_DIR = str(Path(torch.__file__).resolve().parent)
DTENSOR_DIR = os.path.join(TORCH_DIR, "distributed", "tensor")
OPTIM_DIR = os.path.join(TORCH_DIR, "optim")
RUNTIME_FILES = ("parallel.py", "runtime", os.path.join("passes", "shard.py"), os.path.join("passes", "pipeline.py"))
"""The code that runs on a rank's device (planning and tracing work on fake CPU tensors by design)."""


class StrayAllocations(TorchFunctionMode):
    """Record autopar runtime code that calls a torch factory without ``device=``."""

    def __init__(self):
        super().__init__()
        from torch.utils._device import _device_constructors

        self.factories = _device_constructors()
        self.found: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.factories and kwargs.get("device") is None:
            where = self._caller()
            if where:
                self.found.add(f"{where}: torch.{getattr(func, '__name__', func)} without device=")
        return func(*args, **kwargs)

    @staticmethod
    def _caller() -> str | None:
        frame = sys._getframe(2)
        if frame.f_code.co_filename.startswith(DTENSOR_DIR):
            return None  # DTensor's own index math (compute_local_shape_and_global_offset's aranges)
        if frame.f_code.co_filename.startswith(OPTIM_DIR):
            return None  # the optimizer's own state (torch 2.11's AdamW: its step count, a CPU scalar by design)
        while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
            frame = frame.f_back  # through torch's own Python wrappers to the code that asked
        if frame is None or not frame.f_code.co_filename.startswith(AUTOPAR_DIR):
            return None
        rel = os.path.relpath(frame.f_code.co_filename, AUTOPAR_DIR)
        if not rel.startswith(RUNTIME_FILES):
            return None
        return f"autopar/{rel}:{frame.f_lineno}"


def test_the_check_sees_a_stray_allocation():
    mode = StrayAllocations()
    with mode:
        from autopar.runtime import device as device_module

        exec(compile("import torch\nx = torch.zeros(3)\ny = torch.zeros(3, device='cpu')\n",
                     device_module.__file__, "exec"), {})
    assert len(mode.found) == 1 and "torch.zeros without device=" in next(iter(mode.found)), mode.found


def _run(rank, world, configs):
    sys.path.insert(0, EXAMPLES)
    import gpt

    found = {}
    for name, cluster, fixed, precision in configs:
        torch.manual_seed(0)
        model, inputs, loss_fn, target = gpt.build(size="tiny", batch=8, n_layer=4, dropout=0.1)
        mode = StrayAllocations()
        with mode:
            pm = autopar.parallelize(model, cluster=cluster, loss_fn=loss_fn, fixed=fixed, precision=precision)
            for _ in range(2):
                pm.train_step(inputs, target)
            pm.state_dict()
            pm.full_gradients()
        found[name] = sorted(mode.found)
    return found


CONFIGS = [
    ("dp_zero1", "1x2xcpu", {"dp": 2, "zero": 1, "microbatches": 2}, "bf16-mixed"),
    ("zero3", "1x2xcpu", {"dp": 2, "zero": 3}, "fp32"),
    ("tp_sp", tp_friendly_cluster("1x2xcpu"), {"tp": 2, "sp": True}, "bf16-mixed-bf16-reduce"),
    ("pp2", "1x2xcpu", {"pp": 2, "dp": 1, "tp": 1, "microbatches": 2}, "bf16-mixed"),
]


def test_runtime_creates_every_tensor_on_its_device():
    results = spawn_world(_run, 2, CONFIGS)
    for rank, found in enumerate(results):
        for name, stray in found.items():
            assert not stray, f"rank {rank}, {name}: " + "; ".join(stray)


def test_graph_factories_follow_the_mesh_device():
    """A factory op traced with device=cpu is created on the mesh's device (a meta mesh stands for cuda)."""
    from autopar.passes.shard import on_mesh_device

    class MetaMesh:
        device_type = "meta"

    kwargs = {"device": torch.device("cpu"), "dtype": torch.float32}
    t = torch.ops.aten.full.default([2, 3], 1.0, **on_mesh_device(kwargs, MetaMesh()))
    assert t.device.type == "meta"
    assert on_mesh_device({"dtype": torch.float32}, MetaMesh()) == {"dtype": torch.float32}


def test_an_unused_attention_without_dropout_is_dead_code():
    """The program's dead-code pass drops an unused SDPA call with dropout 0 (on an H200, DTensor's
    sharding propagation of cuDNN attention left one on empty CPU tensors, which the CUDA step then
    ran and failed on), with the empty tensors it read; one with dropout, which draws random
    numbers, stays, as does a used one."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.passes.shard import _impure

    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

    def step(q):
        stray = torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device)
        sdpa(stray, stray, stray, 0.0, True)  # unused, no dropout: dead
        sdpa(q, q, q, 0.1, True)  # unused, but it draws random numbers
        return sdpa(q, q, q, 0.0, True)[0]

    graph = make_fx(step)(torch.randn(1, 2, 8, 4, device="meta")).graph  # meta: CPU kernels refuse dropout
    attention = lambda: [n.args[3] for n in graph.nodes if n.target is sdpa]  # noqa: E731
    assert attention() == [0.0, 0.1, 0.0]
    graph.eliminate_dead_code(is_impure_node=_impure)
    assert attention() == [0.1, 0.0]
    assert not [n for n in graph.nodes if n.target is torch.ops.aten.empty_strided.default]


def test_the_local_gpu_is_bound_before_the_first_collective(monkeypatch):
    """torch.cuda.set_device(LOCAL_RANK) must precede init_process_group (NCCL binds the current GPU)."""
    import autopar.parallel as parallel

    sys.path.insert(0, EXAMPLES)
    import gpt

    calls = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", str(d))))

    def init(device, timeout_s):
        calls.append(("init_process_group", device))
        raise RuntimeError("stop here")

    monkeypatch.setattr(parallel, "init_process_group", init)
    model, inputs, loss_fn, target = gpt.build(size="tiny", batch=8)
    pm = autopar.parallelize(model, cluster="1x8xH100", loss_fn=loss_fn)
    assert pm.torch_device == torch.device("cuda", 3)
    with pytest.raises(RuntimeError, match="stop here"):
        pm.train_step(inputs, target)
    assert calls == [("set_device", "cuda:3"), ("init_process_group", "cuda")], calls


def test_a_local_rank_beyond_the_gpus_is_an_error(monkeypatch):
    from autopar.runtime.device import bind_local_device

    monkeypatch.setenv("LOCAL_RANK", "8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=8 but this node has 8 CUDA device"):
        bind_local_device("cuda")

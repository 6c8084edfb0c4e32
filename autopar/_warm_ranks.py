"""Warm the server that :func:`autopar.testing.spawn_world` forks its ranks from.

A process's first trace costs about half a CPU-second more than the ones after it: TorchDynamo,
AOTAutograd and the fake-tensor mode set up what they keep for the whole process (their lazy
imports, rule tables and dispatch caches). spawn_world forks its ranks from a server (Python's
``forkserver``) that imports this module with torch and autopar, so tracing one small model here,
once, saves that set-up in every rank (the test suite forks a few hundred ranks; measured on
GPT tiny's first ``parallelize`` on 2 ranks: 2.7 -> 2.2 CPU-s on rank 0, 1.6 -> 1.2 on rank 1).

Only on builds of torch without an accelerator runtime: a trace runs autograd, and where the
engine has started device threads (a CUDA build with a GPU) a forked child may not run autograd
at all. The warm-up is an optimisation: if it fails, nothing is lost but the time.
"""

from __future__ import annotations

warmed = False
"""Whether this process traced the warm-up model (the ranks forked from it inherit this)."""


def _warm() -> None:
    global warmed
    import torch
    import torch.nn.functional as F
    from torch import nn

    from autopar.analysis import build_graph
    from autopar.cluster import Cluster
    from autopar.passes import trace_cache

    if torch.version.cuda or torch.version.hip or getattr(torch.version, "xpu", None):
        return

    class Block(nn.Module):  # the ops the suite's example models are made of, at other shapes
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 12)
            self.ln = nn.LayerNorm(12)
            self.rms = nn.RMSNorm(12)
            self.qkv = nn.Linear(12, 36)
            self.out = nn.Linear(12, 11, bias=False)

        def forward(self, x):
            h = self.emb(x)
            q, k, v = self.qkv(self.ln(h)).view(*x.shape, 3, 2, 6).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(h.shape)
            h = h + F.gelu(a) + F.silu(self.rms(a)) * torch.sigmoid(a)
            return self.out(F.dropout(h, 0.0, self.training))

    x = torch.randint(0, 11, (3, 5))
    forced = trace_cache._forced
    trace_cache.set_enabled(False)  # (the ranks' trace cache starts empty)
    try:
        build_graph(Block(), (x,), cluster=Cluster.from_spec("1x2xcpu"), example_target=x, collapse_repeats=False,
                    loss_fn=lambda out, target: F.cross_entropy(out.flatten(0, 1), target.flatten()))
    finally:
        trace_cache.set_enabled(forced)
    warmed = True


try:
    _warm()
except Exception:  # noqa: BLE001  (an optimisation only: the ranks trace as they would have)
    pass

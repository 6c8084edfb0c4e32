"""Mixture-of-experts expert computation as one traceable op, local or expert-parallel.

``moe_experts(x, counts, w_gate, w_up, w_down, group)`` runs SwiGLU experts on tokens
already sorted by expert (``x``: (N, d), ``counts``: (E,) tokens per expert, the weights
stacked per expert: (E_local, d, f), (E_local, d, f), (E_local, f, d)):

    y[rows of e] = (silu(x_e @ w_gate[e]) * (x_e @ w_up[e])) @ w_down[e]

With ``group == ""`` every expert is local (E_local = E). With ``group`` naming a
process group of ``ep`` ranks, rank ``r`` of the group holds experts
``[r * E/ep, (r + 1) * E/ep)`` and the op is expert parallelism (GShard, Lepikhin et al.
2020, sec. 3; the seeds' EP section): the token counts are exchanged, the tokens go to
the rank holding their expert with one ``all_to_all_single`` (dispatch), the local
experts run, and the results come back with another (combine). The output has the
input's shape either way, so the caller cannot tell the two apart.

Why one custom op rather than the routing written in plain torch ops:
- the number of tokens an expert (and so a rank) receives depends on the router's
  choices; as an opaque op the traced joint graph keeps static shapes (output = input
  shape) and the data-dependent split sizes live inside the op, where eager
  ``all_to_all_single`` takes them as lists;
- the planner recognises the experts by this op (one forward node, one backward node)
  and knows which parameters are expert weights (its weight arguments);
- ``torch._grouped_mm`` (Mixtral's path) would be the faster kernel but accepts only
  fp32/bf16/fp16 and 16-byte-aligned strides on CPU; a loop over experts runs in fp64 as
  well, which the equivalence tests need, and keeps the per-expert rows exact.

Why an explicit backward op (``moe_experts_backward``) instead of
``_functional_collectives.all_to_all_single_autograd``: the autograd collective would
need the split sizes as traced values (data-dependent symbols under FakeTensor), and
the backward must re-dispatch the input too. The backward sends ``x`` and ``grad_y``
together in one all-to-all (rows of width 2d) instead of saving the received tokens
(a data-dependent shape), then combines ``grad_x`` with a second: per layer, forward 2
all-to-alls of N x d elements, backward one of N x 2d and one of N x d (priced so in
:func:`autopar.cost.comm.moe_all_to_all_bytes`).

The weight gradients of a rank's experts include every token of the ep group routed to
them; replicas of the same experts on other groups still have to be summed (the runtime
does it, :mod:`autopar.runtime.expert`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

__all__ = ["moe_experts", "route_to_experts", "route_top_k", "ep_group_of", "hf_experts_supported",
           "hf_experts_forward"]


def ep_group_of(group: str):
    """The process group named ``group`` (``""``: none, the experts are all local)."""
    if not group:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group)


def _swiglu_forward(x, counts: list[int], w_gate, w_up, w_down):
    """Experts in order over the rows of ``x`` (sorted by expert, ``counts`` rows each)."""
    out, start = [], 0
    for e, n in enumerate(counts):
        xe = x[start:start + n]  # (n, d)
        out.append((F.silu(xe @ w_gate[e]) * (xe @ w_up[e])) @ w_down[e])  # (n, f) -> (n, d)
        start += n
    return torch.cat(out) if out else x.new_empty(0, x.shape[1])


def _swiglu_backward(x, gy, counts: list[int], w_gate, w_up, w_down):
    """(grad_x, grad_w_gate, grad_w_up, grad_w_down) of :func:`_swiglu_forward`."""
    gx, gwg, gwu, gwd = [], torch.zeros_like(w_gate), torch.zeros_like(w_up), torch.zeros_like(w_down)
    start = 0
    for e, n in enumerate(counts):
        xe, ge = x[start:start + n], gy[start:start + n]  # (n, d)
        a, b = xe @ w_gate[e], xe @ w_up[e]  # (n, f)
        s = torch.sigmoid(a)
        silu = a * s
        h = silu * b  # (n, f)
        gwd[e] = h.T @ ge  # (f, d)
        gh = ge @ w_down[e].T  # (n, f)
        ga = gh * b * (s * (1 + a * (1 - s)))  # d silu(a) / da = s (1 + a (1 - s))
        gb = gh * silu
        gwg[e] = xe.T @ ga  # (d, f)
        gwu[e] = xe.T @ gb
        gx.append(ga @ w_gate[e].T + gb @ w_up[e].T)  # (n, d)
        start += n
    return (torch.cat(gx) if gx else x.new_empty(0, x.shape[1])), gwg, gwu, gwd


class _Dispatch:
    """Who sends what to whom for one all-to-all over the ep group, from the local counts.

    ``counts`` (E,) is this rank's tokens per global expert, its rows sorted by expert.
    After the exchange, ``recv`` (ep, E_local) holds how many rows each source rank
    sends for each of this rank's experts; received rows arrive source-major, so
    ``to_local`` reorders them expert-major for the experts and ``from_local`` back."""

    def __init__(self, counts: torch.Tensor, group, n_local: int):
        self.group = group
        ep = dist.get_world_size(group)
        send = counts.reshape(ep, n_local).to(torch.int64)  # (ep, E_local): to rank j, per its expert
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        self.send_splits = send.sum(1).tolist()
        self.recv_splits = recv.sum(1).tolist()
        self.local_counts = recv.sum(0).tolist()  # rows per local expert, over all sources
        # row index of each received row in expert-major order
        starts = torch.cumsum(recv.reshape(-1), 0) - recv.reshape(-1)  # (ep * E_local,) source-major offsets
        starts = starts.reshape(ep, n_local)
        order = [torch.arange(int(starts[s, e]), int(starts[s, e]) + int(recv[s, e]))
                 for e in range(n_local) for s in range(ep)]
        self.order = torch.cat(order).to(counts.device) if order else torch.empty(0, dtype=torch.long)

    def exchange(self, rows: torch.Tensor, *, back: bool = False) -> torch.Tensor:
        """Send ``rows`` (sorted by destination) and return what arrives (by source)."""
        ins, outs = (self.recv_splits, self.send_splits) if back else (self.send_splits, self.recv_splits)
        out = rows.new_empty(sum(outs), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=outs, input_split_sizes=ins,
                               group=self.group)
        return out

    def to_local(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[self.order]

    def from_local(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        out[self.order] = rows
        return out


@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor, group: str) -> torch.Tensor:
    group_ = ep_group_of(group)
    if group_ is None:
        return _swiglu_forward(x, counts.tolist(), w_gate, w_up, w_down)
    d = _Dispatch(counts, group_, w_gate.shape[0])
    local = d.to_local(d.exchange(x))  # dispatch: (M, d), this rank's experts' rows
    y = _swiglu_forward(local, d.local_counts, w_gate, w_up, w_down)
    return d.exchange(d.from_local(y), back=True)  # combine: (N, d)


@moe_experts.register_fake
def _(x, counts, w_gate, w_up, w_down, group):
    return torch.empty_like(x)


@torch.library.custom_op("autopar::moe_experts_backward", mutates_args=())
def moe_experts_backward(grad_y: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor,
                         w_up: torch.Tensor, w_down: torch.Tensor, group: str) -> list[torch.Tensor]:
    group_ = ep_group_of(group)
    if group_ is None:
        return list(_swiglu_backward(x, grad_y, counts.tolist(), w_gate, w_up, w_down))
    d = _Dispatch(counts, group_, w_gate.shape[0])
    both = d.to_local(d.exchange(torch.cat([x, grad_y], dim=1)))  # (M, 2d): x and grad_y in one message
    width = x.shape[1]
    gx, gwg, gwu, gwd = _swiglu_backward(both[:, :width], both[:, width:], d.local_counts, w_gate, w_up, w_down)
    return [d.exchange(d.from_local(gx), back=True), gwg, gwu, gwd]


@moe_experts_backward.register_fake
def _(grad_y, x, counts, w_gate, w_up, w_down, group):
    return [torch.empty_like(x), torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down)]


def _setup(ctx, inputs, output):
    x, counts, w_gate, w_up, w_down, group = inputs
    ctx.save_for_backward(x, counts, w_gate, w_up, w_down)
    ctx.group = group


def _backward(ctx, grad_y):
    x, counts, w_gate, w_up, w_down = ctx.saved_tensors
    gx, gwg, gwu, gwd = moe_experts_backward(grad_y.contiguous(), x, counts, w_gate, w_up, w_down, ctx.group)
    return gx, None, gwg, gwu, gwd, None


moe_experts.register_autograd(_backward, setup_context=_setup)


# FLOPs per token row (N rows, width d, expert width f; the sum over experts is N rows in
# all): forward 3 matmuls of 2 d f; backward recomputes the two input matmuls (2 x 2 d f)
# and takes grad_x and the three weight gradients (6 x 2 d f).
FORWARD_GEMMS, BACKWARD_GEMMS = 3, 8  # (rows, d) x (d, f)-sized GEMMs per row block, as above


@register_flop_formula(torch.ops.autopar.moe_experts)
def _experts_flops(x_shape, counts_shape, w_gate_shape, w_up_shape, w_down_shape, *args, **kwargs) -> int:
    n, d = x_shape
    return FORWARD_GEMMS * 2 * n * d * w_gate_shape[-1]


@register_flop_formula(torch.ops.autopar.moe_experts_backward)
def _experts_backward_flops(grad_y_shape, x_shape, counts_shape, w_gate_shape, *args, **kwargs) -> int:
    n, d = x_shape
    return BACKWARD_GEMMS * 2 * n * d * w_gate_shape[-1]


def route_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing (Mixtral: softmax over the k chosen logits): (weights (T, k), experts (T, k),
    probabilities (T, E) for the balance loss)."""
    probs = torch.softmax(logits.float(), dim=-1)  # (T, E)
    top_logits, experts = torch.topk(logits, k, dim=-1)  # (T, k)
    weights = torch.softmax(top_logits.float(), dim=-1).to(logits.dtype)  # (T, k)
    return weights, experts, probs


def route_to_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, n_experts: int,
                     w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, group: str = "") -> torch.Tensor:
    """Dropless top-k mixture of experts on tokens ``x`` (N, C): ``sum_i weights[:, i] *
    expert_{experts[:, i]}(x)``, (N, C). ``weights``/``experts``: (N, k) from the router; the
    stacked weights as :func:`moe_experts` takes them.

    Written in the ops :mod:`autopar.passes.token_local` recognises as one routing block (a
    stable sort of the rows by expert, counts per expert, the experts op, the inverse
    permutation), so that under data parallelism each rank routes its own tokens, and under
    expert parallelism its rows are what the experts op dispatches."""
    k = experts.shape[1]
    ids = experts.reshape(-1)  # (N*k,): row j*k + i is token j's i-th choice
    order = torch.argsort(ids, stable=True)  # (N*k,) rows sorted by expert
    counts = (ids.unsqueeze(1) == torch.arange(n_experts, device=x.device)).sum(0)  # (E,) rows per expert
    y = moe_experts(x[order // k], counts, w_gate, w_up, w_down, group)  # (N*k, C)
    y = y[torch.argsort(order)].view(x.shape[0], k, x.shape[1])  # back to token order, (N, k, C)
    return (y * weights.unsqueeze(-1)).sum(1)


# -- Hugging Face experts ------------------------------------------------------
#
# transformers' MoE models (Mixtral, Qwen2-MoE, OLMoE, ...) keep their experts as stacked
# ``gate_up_proj`` (E, 2f, d) and ``down_proj`` (E, d, f) and pick the kernel by
# ``config._experts_implementation`` (a grouped matmul by default, or a Python loop over the
# experts that received tokens). autopar traces the gated-SiLU ones through
# :func:`route_to_experts` instead (``autopar.passes.trace``): the same function of the weights,
# as one experts op that the planner recognises and that runs under expert parallelism (the
# grouped matmul leaves the token counts as data in the graph, which an all-to-all dispatch
# cannot size). The user's model is left as it was.


def hf_experts_supported(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module autopar runs as :func:`moe_experts`:
    gated SiLU (``silu(x W_gate) * x W_up``, then ``W_down``), [gate; up] stacked in
    ``gate_up_proj`` (E, 2f, d), ``down_proj`` (E, d, f), no biases or post-expert norm."""
    import sys

    # An experts module of transformers was built by a class its moe integration decorated, so that
    # module is loaded already; when it is not, nothing here is one (and transformers, seconds to
    # import, is not imported for the models that are not Hugging Face's).
    moe, activations = sys.modules.get("transformers.integrations.moe"), sys.modules.get("transformers.activations")
    if moe is None or activations is None:
        return False
    flags = ("has_gate", "is_concatenated", "is_transposed", "has_bias", "has_post_expert_norm")
    if not all(hasattr(module, f) for f in flags) or not isinstance(getattr(module, "num_experts", None), int):
        return False
    _default_apply_gate, SiLUActivation = moe._default_apply_gate, activations.SiLUActivation
    if not module.has_gate or not module.is_concatenated or module.is_transposed or module.has_bias \
            or module.has_post_expert_norm or type(module)._apply_gate is not _default_apply_gate \
            or not isinstance(getattr(module, "act_fn", None), (torch.nn.SiLU, SiLUActivation)):
        return False
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.nn.Parameter) or not isinstance(down, torch.nn.Parameter):
        return False
    E, two_f, d = gate_up.shape if gate_up.dim() == 3 else (0, 0, 0)
    return gate_up.dim() == 3 and two_f % 2 == 0 and tuple(down.shape) == (E, d, two_f // 2)


def hf_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts module's forward (tokens (N, d), the router's (N, k) choices and
    weights) through :func:`route_to_experts`, for a module :func:`hf_experts_supported` accepts.
    Under expert parallelism the module holds E/ep experts (``gate_up_proj``'s dim 0) while
    ``num_experts`` stays E, the router's range."""
    f = self.gate_up_proj.shape[1] // 2
    w_gate = self.gate_up_proj[:, :f].transpose(1, 2)  # (E, d, f)
    w_up = self.gate_up_proj[:, f:].transpose(1, 2)
    w_down = self.down_proj.transpose(1, 2)  # (E, f, d)
    out = route_to_experts(hidden_states, top_k_weights, top_k_index, self.num_experts, w_gate, w_up, w_down)
    return out.to(hidden_states.dtype)

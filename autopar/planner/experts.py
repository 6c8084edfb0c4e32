"""Expert parallelism in the planner: find the expert layers, check ``ep``, price it, record it.

The experts are the forward nodes of :func:`autopar.experts.moe_experts` in the joint
graph (one per MoE block; Hugging Face's gated-SiLU experts are traced as that op too);
their weight arguments are the stacked expert parameters (dim 0 = expert), or views of
them. Grouped matmuls on stacked parameters (other Hugging Face experts) are expert sites
as well, planned and priced but not run under ep. ``ep`` folds over the data-parallel ranks (``dp = replicas x ep``,
ep groups of consecutive dp ranks, stride tp in the world): the experts are cut in
``ep`` parts, everything else stays data parallel.

What a plan with ``ep`` > 1 changes, per unit (layer instance) holding experts:
- parameters (and so gradients and optimizer state, by ZeRO stage) per device: the
  expert parameters count ``1/ep`` of their tp-local size; so do the weight gradients the
  experts op's backward returns, in its working set (``Unit.expert_transient``);
- forward and backward time: the dispatch/combine all-to-alls of
  :func:`autopar.cost.expert_comm.expert_all_to_all_s` on the ep group's link, not overlapped
  with compute, under balanced routing (every rank sends and receives its own
  tokens x top-k rows) or the assumed ``moe_imbalance`` (the busiest rank's rows); a pinned
  ``ep_dispatch`` prices another program's exchange instead (Megatron-LM's all-to-all
  dispatcher, DeepEP's normal kernels: :func:`autopar.cost.expert_comm.deepep_s`), for comparison;
- expert FLOPs per rank are unchanged under balanced routing (each rank runs its
  tokens' share of rows, spread over its experts), but they run as ep times taller GEMMs
  (E/ep experts per rank, each with ep times the rows), which the GEMM efficiency curve
  credits (many small experts, DeepSeek-V3's 256 of width 2048, gain the most).

ZeRO shards an expert parameter's state over the ``dp / ep`` replicas of its part (the dp
ranks holding the same experts), everything else over dp, as the runtime
(:class:`autopar.runtime.zero.ShardedParams`) does: the units carry their held expert
parameters (``Unit.expert_params``) and the stage memory shards them so
(:func:`autopar.planner.state_memory.state_per_param`), and the step program prices the expert
buckets' collectives over the replica group on its own link (``GroupCost.expert_bytes``,
:func:`autopar.cost.step.dp_collective_s`; ranks ``tp * ep`` apart: one NIC per node once ep
spans a node); the plan's ``communication`` lists those buckets on axis ``dp/ep``.
``ep`` is pinned (``fixed={"ep": k}``) or chosen by the search among :func:`ep_options`
(ep dividing dp and every block's expert count), weighed like any other decision by the
simulated step time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torch import fx

from autopar.cluster import Cluster
from autopar.cost.expert_comm import deepep_bytes, deepep_s, expert_all_to_all_bytes, expert_all_to_all_s
from autopar.errors import PlanError
from autopar.passes import meta_keys as mk
from autopar.passes.annotate import DTYPE_NAMES
from autopar.passes.token_local import op_name
from autopar.planner.context import sequence_length
from autopar.planner.fixed import _divisors

__all__ = ["ExpertSite", "find_experts", "runnable_sites", "check_ep", "check_dispatch", "ep_options", "apply_ep",
           "experts_record"]


@dataclass(frozen=True, kw_only=True)
class ExpertSite:
    """One expert node of the traced graph (one MoE block's experts)."""

    layer: str
    """Layer path the node belongs to."""
    module: str
    """Module path of the experts, e.g. "layers.0.moe"."""
    n_experts: int
    rows: int
    """Token rows entering the experts at the traced (global) batch: tokens x top-k."""
    width: int
    """Hidden size of a row."""
    elem_bytes: int
    params: tuple[str, ...]
    """The stacked expert parameters (FQNs)."""
    n_params: int
    """Their elements, all experts."""
    expert_width: int = 0
    """The experts' hidden size f (autopar's experts op; 0 for grouped-matmul sites)."""
    dtype: str = "fp32"
    """The rows' dtype, which picks the device's peak."""
    top_k: int = 0
    """Experts per token: ``rows`` over the tokens of the model's (batch, sequence) token ids (0:
    not told apart, e.g. a model without such an input)."""
    op: str = "autopar::moe_experts"
    """The experts' op: ``autopar::moe_experts`` (what :func:`autopar.parallelize` runs under
    ep), or a grouped matmul (Hugging Face experts autopar does not trace as its op, e.g. with
    biases or another activation; planned and priced under ep only)."""




def _is_experts(node: fx.Node) -> bool:
    return node.op == "call_function" and op_name(node) == "autopar::moe_experts"


# Hugging Face's experts: one grouped matmul per expert projection, tokens sorted by expert
GROUPED_MM = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")
# ops between a stacked expert parameter and the grouped matmul that reads it
_WEIGHT_VIEWS = ("aten::transpose", "aten::t", "aten::permute", "aten::view", "aten::_to_copy", "aten::clone",
                 "aten::contiguous", "aten::_unsafe_view", "aten::slice")


def _param_behind(node: fx.Node) -> fx.Node | None:
    """The parameter placeholder an experts op's weight argument is a view or cast of."""
    while isinstance(node, fx.Node) and node.op == "call_function" and op_name(node) in _WEIGHT_VIEWS:
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "placeholder" and node.meta[mk.TRACE].role is mk.Role.PARAM:
        return node
    return None


def _grouped_sites(gm: fx.GraphModule) -> list[ExpertSite]:
    """One site per module whose forward runs grouped matmuls on stacked expert parameters
    (``gate_up_proj`` (E, 2f, d) and ``down_proj`` (E, d, f), as in Hugging Face's experts that
    autopar does not trace as its op): the rows are the first matmul's input (tokens x top-k,
    sorted by expert)."""
    by_module: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node) in GROUPED_MM and mk.TRACE in node.meta \
                and node.meta[mk.TRACE].role is not mk.Role.BACKWARD:
            by_module.setdefault(node.meta[mk.TRACE].module_path, []).append(node)
    sites = []
    for module, nodes in by_module.items():
        weights = [_param_behind(n.args[1]) for n in nodes]
        if any(w is None for w in weights) or len({w.meta["val"].shape[0] for w in weights}) != 1:
            continue  # not stacked expert parameters (a grouped matmul of something else)
        x = nodes[0].args[0].meta["val"]  # (rows, width)
        sites.append(ExpertSite(
            layer=nodes[0].meta.get(mk.LAYER, ""), module=module, n_experts=int(weights[0].meta["val"].shape[0]),
            rows=int(x.shape[0]), width=int(x.shape[1]), elem_bytes=x.dtype.itemsize,
            params=tuple(w.meta[mk.TRACE].fqn for w in weights),
            n_params=sum(w.meta["val"].numel() for w in weights), op=op_name(nodes[0])))
    return sites


def find_experts(gm: fx.GraphModule) -> list[ExpertSite]:
    """The expert sites of the traced joint graph: autopar's experts op (in graph order), then
    grouped-matmul experts (Hugging Face's MoE models)."""
    sites = []
    for node in gm.graph.nodes:
        if not _is_experts(node):
            continue
        x, _counts, *weights = node.args[:5]
        val = x.meta["val"]  # (rows, width)
        # the stacked parameters, each once (Hugging Face's experts pass views: gate and up are
        # the two halves of one gate_up_proj)
        behind = [_param_behind(w) for w in weights]
        if any(p is None for p in behind):
            continue  # weights that are not parameters: not expert layers the planner can cut
        params = list(dict.fromkeys(behind))
        sites.append(ExpertSite(
            layer=node.meta.get(mk.LAYER, ""), module=node.meta[mk.TRACE].module_path,
            n_experts=int(params[0].meta["val"].shape[0]), rows=int(val.shape[0]), width=int(val.shape[1]),
            elem_bytes=val.dtype.itemsize, params=tuple(p.meta[mk.TRACE].fqn for p in params),
            n_params=sum(p.meta["val"].numel() for p in params), expert_width=int(weights[0].meta["val"].shape[2]),
            dtype=DTYPE_NAMES.get(val.dtype, "fp32")))
    tokens = _tokens(gm)
    return [replace(x, top_k=x.rows // tokens) if tokens and x.rows % tokens == 0 else x
            for x in sites + _grouped_sites(gm)]


def _tokens(gm: fx.GraphModule) -> int:
    """Tokens of the traced batch: its sequences times their length (the token ids' (batch,
    sequence) input, :func:`autopar.planner.context.sequence_length`; 0 without one)."""
    info, seq = gm.meta.get(mk.GRAPH), sequence_length(gm)
    return info.global_batch * seq if info is not None and seq else 0


def check_dispatch(dispatch: str | None, sites: list[ExpertSite]) -> None:
    """One :class:`PlanError` where a pinned ``ep_dispatch`` cannot be priced."""
    if dispatch == "deepep":
        unknown = [x.module for x in sites if not x.top_k]
        if not sites or unknown:
            raise PlanError(f"ep_dispatch='deepep' prices each token once per rank holding one of its experts, "
                            f"which needs the experts per token; "
                            f"{'the model has no expert layers' if not sites else 'not told for ' + unknown[0]} "
                            f"(a (batch, sequence) token-id input tells it); leave ep_dispatch unpinned")


def _dispatch_s(site: ExpertSite, rows: float, ep: int, link, cluster: Cluster, dispatch: str,
                ranks_per_node: int) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's token exchange under ``dispatch``."""
    if dispatch == "deepep":
        return deepep_s(rows=rows, top_k=site.top_k, width=site.width, elem_bytes=site.elem_bytes,
                        n_experts=site.n_experts, ep=ep, ranks_per_node=ranks_per_node, device=cluster.device)
    return expert_all_to_all_s(rows=rows, width=site.width, elem_bytes=site.elem_bytes, n_experts=site.n_experts,
                               ep=ep, link=link, program=dispatch)


def _ranks_per_node(ep: int, tp: int, ep_tp: int, cluster: Cluster) -> int:
    """Ranks of an ep group in one node: consecutive when folded over tp, else tp apart."""
    if cluster.nodes == 1:
        return ep
    return max(1, min(ep, cluster.devices_per_node // (1 if ep_tp > 1 else tp)))


def runnable_sites(sites: list[ExpertSite]) -> bool:
    """Whether :func:`autopar.parallelize` runs these experts under ep (autopar's experts op)."""
    return all(s.op == "autopar::moe_experts" for s in sites)


def check_ep(ep: int | None, sites: list[ExpertSite], *, cluster: Cluster, dp: int | None, tp: int | None,
             etp: int | None = None) -> None:
    """One :class:`PlanError` naming the values when ``ep`` (and ``etp``, the expert tensor-parallel
    size: 1 folds ep over tp too, :mod:`autopar.planner.expert_folding`) cannot be planned."""
    if etp is not None and etp != 1 and etp != tp:
        raise PlanError(f"etp={etp} must be 1 (experts whole, ep folded over tp and dp) or tp"
                        f"{f'={tp}' if tp else ' (pin tp to it)'} (each expert split over tp, the default)")
    if etp == 1 and not sites:
        raise PlanError("etp=1 folds expert parallelism over tp, but the model has no expert layers; drop etp")
    folded = etp == 1 and (tp or 1) > 1
    if folded and ep and ep > 1 and tp:
        if ep % tp or (dp is not None and dp % (ep // tp)):
            raise PlanError(f"ep={ep} with etp=1 folds over tp={tp} and dp: ep must be tp x k with k dividing "
                            f"dp{f'={dp}' if dp else ''}; pick ep among "
                            f"{[tp * k for k in (_divisors(dp) if dp else (1, 2, 4, 8))]}")
    if not ep or ep == 1:
        return
    if not sites:
        raise PlanError(f"ep={ep} but the model has no expert layers (autopar.experts.moe_experts, as in "
                        f"examples/moe.py, or the grouped matmuls of Hugging Face's MoE models); drop ep or "
                        f"route the experts through that op")
    for s in sites:
        if s.n_experts % ep:
            raise PlanError(f"ep={ep} does not divide the {s.n_experts} experts of {s.module}; "
                            f"pick ep among {_divisors(s.n_experts)}")
    if dp is not None and dp % ep and not folded:
        raise PlanError(f"ep={ep} must divide dp={dp}: expert parallelism folds over the data-parallel ranks; "
                        f"pick ep among {_divisors(dp)} or another dp")
    if cluster.world_size % (ep * (1 if folded else tp or 1)):
        raise PlanError(f"ep={ep}{f' x tp={tp}' if tp else ''} does not divide the {cluster.world_size} devices "
                        f"of {cluster.spec}")


def ep_options(sites: list[ExpertSite]) -> tuple[int, ...]:
    """The ep degrees > 1 the search tries: those dividing every block's expert count."""
    if not sites:
        return ()
    n = math.gcd(*(s.n_experts for s in sites))
    return tuple(d for d in _divisors(n) if d > 1)


def _by_layer(sites: list[ExpertSite]) -> dict[str, list[ExpertSite]]:
    out: dict[str, list[ExpertSite]] = {}
    for s in sites:
        out.setdefault(s.layer, []).append(s)
    return out


def apply_ep(units: list, *, names: dict[str, list[str]], sites: list[ExpertSite], ep: int, tp: int,
             microbatch_size: int, global_batch: int, cluster: Cluster, imbalance: float = 1.0,
             local_params: dict[str, float] | None = None, ep_tp: int = 1, dispatch: str = "autopar") -> list:
    """``units`` (``search.Unit``, at ``microbatch_size`` per dp rank) with expert parameters
    (``local_params``: elements per tp rank, by FQN; default whole) divided by ``ep``, the all-to-all time added to forward and backward, and the experts' GEMMs
    priced at their size under ep (:func:`_experts_gemms_s`), all for the busiest rank of an ep
    group, which receives ``imbalance`` times its balanced share of rows.

    ``ep_tp`` = tp: ep folded over tp as well (:mod:`autopar.planner.expert_folding`, whose
    strategy graph the units were priced on): a rank routes 1/tp of its tp group's tokens over
    an ep group of consecutive ranks, and its tp share of the experts (E/tp, whole) is cut by
    the ``ep / tp`` data-parallel part only. The forward's part is made again in the backward under
    ``recompute="moe"`` (``Unit.moe_f_s``). ``dispatch`` (:data:`autopar.planner.fixed.EP_DISPATCHES`)
    picks the program that moves the rows."""
    if ep <= 1 or not sites:
        return units
    link = cluster.link_for_group(ep, stride=1 if ep_tp > 1 else tp)
    per_node = _ranks_per_node(ep, tp, ep_tp, cluster)
    cut = ep // ep_tp  # what is left to cut of the units' expert parameters (the MIP split them over tp)
    extra: dict[str, tuple[float, ...]] = {}  # unit path -> (fwd_s, bwd_s, comm_s, params removed, experts kept)
    for layer, here in _by_layer(sites).items():
        f = b = comm = removed = kept = 0.0
        for s in here:
            rows = s.rows * microbatch_size / global_batch / ep_tp  # (a tp rank's share when folded)
            fs, bs = _dispatch_s(s, rows * imbalance, ep, link, cluster, dispatch, per_node)
            gf, gb = _experts_gemms_s(s, rows, ep, cluster, imbalance)
            held = sum(local_params.get(p, 0.0) for p in s.params) if local_params is not None else s.n_params
            f, b, comm, removed = f + fs + gf, b + bs + gb, comm + fs + bs, removed + held * (1 - 1 / cut)
            kept += held / cut
        for path in names.get(layer, [layer]):
            extra[path] = (f, b, comm, removed, kept)
    out = []
    for u in units:
        if u.path not in extra:
            out.append(u)
            continue
        f, b, comm, removed, kept = extra[u.path]
        other, grad_path = u.expert_transient  # the experts op computes the weight gradients of E/ep experts
        transient = max([other] + [rest + grads / cut for rest, grads in grad_path]) if grad_path else u.transient_bytes
        out.append(replace(u, f_s=u.f_s + f, b_s=u.b_s + b, comm_s=u.comm_s + comm, moe_f_s=u.moe_f_s + f,
                           n_params=max(0.0, u.n_params - removed), expert_params=u.expert_params + kept,
                           transient_bytes=transient))
    return out


def _experts_gemms_s(site: ExpertSite, rows: float, ep: int, cluster: Cluster,
                     imbalance: float = 1.0) -> tuple[float, float]:
    """What ep changes in the experts op's forward and backward time on the busiest rank of an
    ep group. Balanced, a rank runs the same rows as without ep, but over E/ep experts with ep
    times the rows each: taller GEMMs, more efficient on the curve of
    :func:`autopar.cost.compute.gemm_efficiency` (the annotated graph priced rows/E per expert),
    so the change is <= 0. The busiest rank receives ``imbalance`` times its share: that many
    times the FLOPs, in GEMMs that much taller. Grouped-matmul sites: no change."""
    if not site.expert_width:
        return 0.0, 0.0
    from autopar.cost.compute import kernel_time_s
    from autopar.experts import BACKWARD_GEMMS, FORWARD_GEMMS

    def time_s(gemms: int, n: float, m: float) -> float:
        return kernel_time_s(kind="gemm", flops=gemms * 2 * n * site.width * site.expert_width, bytes_moved=0.0,
                             device=cluster.device, dtype=site.dtype, gemm=(m, site.expert_width, site.width))

    m = rows / site.n_experts
    return tuple(time_s(g, rows * imbalance, m * ep * imbalance) - time_s(g, rows, m)
                 for g in (FORWARD_GEMMS, BACKWARD_GEMMS))


def experts_record(sites: list[ExpertSite], *, ep: int, dp: int, tp: int, microbatch_size: int, microbatches: int,
                   global_batch: int, counts: dict[str, int], cluster: Cluster, imbalance: float = 1.0,
                   ep_tp: int = 1, dispatch: str = "autopar") -> dict:
    """The plan's ``experts`` entry: where the experts live and what their all-to-alls cost
    (``ep_tp`` and ``dispatch`` as in :func:`apply_ep`; under "deepep" the messages are its
    dispatches and combines, their bytes what a rank sends on NVLink and RDMA together)."""
    link = cluster.link_for_group(ep, stride=1 if ep_tp > 1 else tp)
    per_node = _ranks_per_node(ep, tp, ep_tp, cluster)
    layers, fwd_bytes, bwd_bytes, time_s, messages = {}, 0.0, 0.0, 0.0, 0
    for s in sites:
        rows = s.rows * microbatch_size / global_batch / ep_tp
        if dispatch == "deepep":
            one = sum(deepep_bytes(rows=rows, top_k=s.top_k, width=s.width, elem_bytes=s.elem_bytes,
                                   n_experts=s.n_experts, ep=ep, ranks_per_node=per_node))
            f, b = (one, one), (one, one)
        else:
            f, b = expert_all_to_all_bytes(rows=rows, width=s.width, elem_bytes=s.elem_bytes,
                                           n_experts=s.n_experts, program=dispatch)
        fs, bs = _dispatch_s(s, rows * imbalance, ep, link, cluster, dispatch, per_node)
        n = counts.get(s.layer, 1) * microbatches
        layers[s.module] = {"layer": s.layer, "op": s.op, "instances": counts.get(s.layer, 1), "n_experts": s.n_experts,
                            "experts_per_rank": s.n_experts // ep, "params": list(s.params),
                            "rows_per_microbatch": rows,
                            "all_to_all_bytes": {"forward": list(f), "backward": list(b)}}
        fwd_bytes += sum(f) * n
        bwd_bytes += sum(b) * n
        time_s += (fs + bs) * n
        messages += (len(f) + len(b)) * n
    folded = ep_tp > 1
    return {
        "ep": ep, "folded_over": "tp x dp" if folded else "dp", "replicas": dp // (ep // ep_tp),
        **({"etp": 1} if folded else {}),
        "ep_groups": (f"{ep} consecutive ranks of the world (the {tp} tp ranks of {ep // tp} dp ranks), each holding "
                      f"E/{ep} experts whole; replicas of one expert part are {ep} ranks apart") if folded else
                     "consecutive dp ranks (stride tp in the world); replicas of one expert part are ep apart",
        "layers": layers,
        "expert_params_per_rank": sum(s.n_params * counts.get(s.layer, 1) for s in sites) / ep,
        "all_to_all": {"count": messages, "bytes": fwd_bytes + bwd_bytes, "forward_bytes": fwd_bytes,
                       "backward_bytes": bwd_bytes, "time_s": time_s,
                       "link": "intra-node" if (ep if folded else ep * tp) <= cluster.devices_per_node
                       or cluster.nodes == 1 else "inter-node", "link_bytes_per_s": link.bytes_per_s},
        "routing": "dropless top-k; " + ("balanced load assumed" if imbalance == 1 else
                                         f"the busiest rank receives {imbalance:g}x its balanced rows (assumed)"),
        "imbalance": imbalance,
        **({"dispatch": dispatch} if dispatch != "autopar" else {}),
    }

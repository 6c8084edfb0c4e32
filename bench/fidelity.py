"""Fidelity: autopar's predictions against published training runs, pinned to their configurations.

    PYTHONPATH=. python bench/fidelity.py              # every row (about 2 minutes on 2 cores)
    PYTHONPATH=. python bench/fidelity.py --only qwen  # rows whose label contains "qwen"
    PYTHONPATH=. python bench/fidelity.py --moe        # the DeepSeek-V3 stand-in (about 60 s)

Each row of bench/calibration.yaml that autopar can express is rebuilt from its
published shape on "meta" (Llama 3.1 8B/70B/405B from examples/llama.py, Qwen3-32B
from Hugging Face transformers' Qwen3ForCausalLM), planned with every decision pinned
to the published one (FSDP = ZeRO-3 over dp, tp, pp, local batch = micro-batch size
per data-parallel rank, torchtitan's op-level selective checkpointing as
``recompute="sac"`` and full as ``"full"``; with tp, sequence parallelism on, as
torchtitan's ``apply_tp`` runs it: ``SequenceParallel`` on the norms, row-parallel outputs
``Shard(1)`` on the sequence, and the head's output split over the vocabulary for a
loss-parallel cross-entropy, which the MIP chooses by itself there:
:mod:`autopar.passes.loss_parallel`), and the plan's predicted tokens/s per GPU and peak
memory are printed next to the measured ones.

The runs were made on Meta's Grand Teton H100s (96 GB HBM2e, 2.4 TB/s, 500 W cap;
both torchtitan benchmark files say so), so the cluster uses the catalog's
"H100-96GB" entry. Planning is done with the memory capacity raised out of the way,
so that a configuration that does not fit still gets a plan; "fits" then compares
the predicted peak with the device's 95 GiB (and the planner's own 10% reserve).

Rows run with torch.compile are marked and planned with ``make_plan(compiled_layers=...)``:
the memory-bound ops of each transformer block (what torchtitan compiles) are priced
as TorchInductor fuses them (:mod:`autopar.passes.fuse`); the rest as eager. Rows run with
Float8 (torchao's tensorwise recipe, which torchtitan applies to every linear but the output
head) are planned with ``make_plan(float8_linears=...)``: those GEMMs at the FP8 peak plus the
casts of their operands (:mod:`autopar.passes.float8`), and tp all-gathers into them moving
float8 (torchao's float8 tensor-parallel styles); not priced: FSDP's float8 all-gather, which
torchtitan leaves off by default. Rows run with async TP are planned with
``make_plan(async_tp=True)``: tp all-gathers into GEMMs and reduce-scatters out of them overlapped
with those GEMMs, less the local copies and sums torch's fused ops add.

The pipeline rows (405B, FSDP8 TP8 PP8) are pinned as torchtitan's pipeline program runs FSDP:
``parallelize_llama.py`` at 9dec370 shards each block with ``reshard_after_forward=False`` under
pp ("to avoid per-microbatch all-gathers"), and torch's ``PipelineStage`` runs each backward with
gradient sync and resharding off until the last micro-batch, so a stage's parameters and
gradients stay whole through the step and are gathered and reduce-scattered once: ZeRO-1's
program (``zero=1``), not ZeRO-3's. The micro-batches are torchtitan's default, one per stage
(8 of 4 sequences; table 6: 8 of 1), and interleaved runs two stages per rank (its
``generate_split_points`` default for multi-stage schedules). The context-parallel rows (8B and
405B) ran torch's own ``context_parallel`` with torchtitan's default "allgather" rotation, local
batch 1 (8B) or 8 (405B) per FSDP group of cp ranks; they are pinned ``cp_variant="torch"``, which
prices that program (:func:`autopar.cost.comm.torch_context_attention_cost`): K and V exchanged
after torchtitan's Llama repeats them to every query head (4x the grouped bytes for 8B, 16x for
405B's one K/V head per tp rank), gathered again in the backward, the fp32 K/V gradients passed
around the ring, and the eager fp32 merges and concatenations of every ring step.

Rows left out, and why: the Float8 rowwise rows (another kernel). Megatron-LM's Qwen3-235B-A22B row
(its plain all-to-all dispatcher: TP2 EP8 PP32 VPP3 DP4, expert tensor-parallel size 1, so ep spans
the tp ranks) is the last row, pinned with ``etp=1`` (:mod:`autopar.planner.expert_folding`),
``zero=1`` (Megatron's distributed optimizer), selective recompute (its norms and the experts'
activation recomputed), on the catalog's H100 (80 GB, cuDNN attention as Transformer Engine runs
it), its blocks priced as fused (TE's fused norms, RoPE, SwiGLU and permutes) and its loss too
(``--cross-entropy-loss-fusion``), its tokens moved as Megatron's all-to-all dispatcher moves them
(``ep_dispatch="megatron"``: the dispatched rows kept for the backward), Megatron's pipeline
layout pinned (``cuts``:
:func:`megatron_cuts`, the embedding and the loss counted as a layer each), and the routing
imbalance of its dropless router measured on the model zoo's long-context pair
(:data:`QWEN3_235B_DROPLESS_IMBALANCE`). The model zoo's long-context rows follow it
(:func:`_qwen3_long`: TP4 EP8 PP8 VPP4 CP 1-8, DeepEP), pinned with the run's
``--recompute-modules layernorm moe`` (``recompute="moe"``) and Transformer Engine's p2p ring
(``cp_variant="te"``: :func:`autopar.cost.comm.te_context_attention_cost`), forced balance at every
cp and dropless at cp 2-8 (the 16k dropless figure is the one the imbalance is fitted on).
DeepSeek-V3 671B (torchtitan, FSDP64 EP32 PP8) is printed apart (``--moe``): its model is
transformers' DeepseekV3 (whose gated-SiLU experts autopar traces as its own experts op), a
stand-in for torchtitan's model. It is planned with ``zero=1``, the program torchtitan's FSDP
runs under pp (as the pipeline rows), the experts' state in chunks over their dp/ep replicas.

The Qwen3 TP rows are planned as torchtitan's Qwen3 TP program runs, not as autopar would lay
them out: its ``apply_non_moe_tp`` wraps ``q_norm`` and ``k_norm`` in ``NoParallel``, whose output
hook redistributes to ``Replicate()``, so q and k are gathered whole after their norms and the
rotary embedding runs on whole heads on every rank (forward, and again in full AC's
recompute); ``make_plan(replicated=torchtitan_qk_replicated)`` keeps those ops' outputs whole
and the MIP prices the gathers and the replicated work.

torchtitan's op-level SAC (``_apply_op_sac`` in its ``parallelize_llama.py``) saves the outputs
of matmuls, attention and reduce-scatters except every second matmul of a block (wk, wo, w3 of
Llama: 36% of a block's forward GEMM FLOPs), and recomputes the rest: autopar prices it as the
pinned-only policy ``recompute="sac"`` (FLOP-free ops and every second forward GEMM re-run in
the backward, their outputs not kept). Activation checkpointing (torchtitan's full and op-level
selective AC through ``torch.utils.checkpoint``, Megatron-LM's recompute) re-runs a block's forward
when its backward begins, what it dropped made again at once: every row is planned with
``make_plan(whole_layer_recompute=True)``, which counts that block's activations alive at once
(autopar's own runtime makes each op again right before its first backward reader).
"""

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from planner_speed import _example  # noqa: E402  (bench/ is on sys.path when run as a script)

from autopar.cluster import Cluster  # noqa: E402
from autopar.cost.devices import HOPPER_FLASH2_ATTENTION_EFFICIENCY, lookup_device  # noqa: E402
from autopar.planner.make import make_plan  # noqa: E402

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Row:
    label: str
    model: str
    """"llama:8b", "llama:70b", "llama:405b" or "qwen3:32b"."""
    nodes: int
    seq: int
    local_batch: int
    """Sequences per data-parallel rank per step."""
    fixed: dict
    tok_s: float | None
    """Measured tokens/s per GPU (None for the OOM row)."""
    mem_gib: float | None
    """Measured peak memory (GiB, torch's reserved memory as torchtitan logs it)."""
    compiled: bool
    source: str
    float8: bool = False
    """torchao's tensorwise Float8 linears (every nn.Linear but the output head)."""
    async_tp: bool = False
    """torch's async TP (tp collectives overlapped with the GEMMs next to them)."""
    device: str = ""
    """The catalog device the run's GPUs are ("": torchtitan's Grand Teton H100, FlashAttention-2:
    :func:`torchtitan_device`)."""
    fused_loss: bool = False
    """The loss (cross-entropy of the head's logits) priced as one fused kernel, as Megatron-LM's
    ``--cross-entropy-loss-fusion`` runs it (torchtitan compiles the blocks only)."""


def _qwen3(dp: int, tp: int, lb: int, tok_s: float | None, mem_gib: float | None, compiled: bool = False) -> Row:
    """A row of torchtitan's Qwen3-32B table (seq 4096, full AC; with tp, sp on the block norms as
    its ``apply_non_moe_tp`` runs it); ``tok_s`` None: the run was out of memory."""
    mesh = f"FSDP{dp}" + (f" TP{tp}" if tp > 1 else "")
    label = f"Qwen3-32B {mesh} lb{lb} AC" + (" (compile)" if compiled else "") + ("" if tok_s else ": OOM")
    return Row(label=label, model="qwen3:32b", nodes=dp * tp // 8, seq=4096, local_batch=lb,
               fixed={"dp": dp, "tp": tp, "pp": 1, "zero": 3, "recompute": "full", **({"sp": True} if tp > 1 else {})},
               tok_s=tok_s, mem_gib=mem_gib, compiled=compiled, source=_QW)


QWEN3_LONG_TFLOPS = {1: (295, 237), 2: (335, 277), 4: (368, 320), 8: (389, 357)}
"""The model zoo's Qwen3-235B-A22B long-context table (``best_practice/qwen3/readme.md``, e865051; 020b813 the same):
TFLOPS per GPU, forced load balance and dropless, at cp 1, 2, 4, 8 with sequences of 16k, 32k, 64k
and 128k tokens (TP4 PP8 VPP4 EP8, etp 1, GBS 256, MBS 1, DeepEP, ``--recompute-modules layernorm
moe``, 256 H100)."""


def megatron_qwen3_235b_flops_per_token(seq: int) -> float:
    """Megatron-LM's own count (``num_floating_point_operations``) for Qwen3-235B-A22B at ``seq``:
    3 x 2 x (experts + attention projections + causal core) + head, per token (204.8 GFLOP at 16k)."""
    return 6 * (4096 * 1536 * 8 * 3 * 94 + (4096 * (8192 + 2 * 512) + 8192 * seq + 8192 * 4096) * 94
                + 4096 * 151936)


def _qwen3_long(cp: int, balanced: bool) -> Row:
    """A row of the long-context table: ``seq = 16k x cp`` split over cp ranks, each micro-batch one
    sequence; Transformer Engine's p2p ring (``cp_variant="te"``), the MoE layers and norms
    recomputed (``recompute="moe"``); tokens/s per GPU from the published TFLOPS by Megatron's count."""
    seq = 16384 * cp
    tflops = QWEN3_LONG_TFLOPS[cp][0 if balanced else 1]
    return Row(label=f"Qwen3-235B-A22B TP4 EP8 (etp=1) PP8 VPP4 CP{cp} seq {seq // 1024}k, "
                     f"{'forced balance' if balanced else 'dropless'} (Megatron-LM, DeepEP)",
               model="qwen3moe:235b", nodes=32, seq=seq, local_batch=32 * cp,
               fixed={"dp": 8, "cp": cp, "tp": 4, "pp": 8, "ep": 8, "etp": 1, "sp": True, "zero": 1, "recompute": "moe",
                      "schedule": "interleaved", "virtual_stages": 4, "microbatch_size": 1, "microbatches": 32 * cp,
                      "moe_imbalance": 1.0 if balanced else QWEN3_235B_DROPLESS_IMBALANCE,
                      "cuts": megatron_cuts(94, 32), "ep_dispatch": "deepep",
                      **({"cp_variant": "te"} if cp > 1 else {})},
               tok_s=tflops * 1e12 / megatron_qwen3_235b_flops_per_token(seq), mem_gib=None, compiled=True,
               device="H100", fused_loss=True,
               source="yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md, long-context table (e865051)")


def megatron_cuts(n_layers: int, n_stages: int) -> list[str]:
    """Megatron-LM's pipeline layout under ``--account-for-embedding-in-pipeline-split`` and
    ``--account-for-loss-in-pipeline-split`` (the model zoo's Qwen3 config), as pinned cuts of a
    Hugging Face decoder: the embedding and the loss count as one layer each, so every stage
    holds (n_layers + 2) / n_stages of them; stage 0 begins with the embedding, the last ends
    with the final norm, head and loss. The names where stages 1.. begin."""
    per, rest = divmod(n_layers + 2, n_stages)
    assert not rest, (n_layers, n_stages)
    # virtual layer i: 0 the embedding, 1..n_layers the decoder layers, n_layers + 1 the loss side
    return [f"model.layers.{i - 1}" if i <= n_layers else "model.norm" for i in range(per, n_layers + 2, per)]


QWEN3_235B_DROPLESS_IMBALANCE = 1.72
"""How much more than its balanced share of token rows the busiest rank of an ep group of 8
receives, Qwen3-235B-A22B under Megatron-LM's dropless top-8 routing (aux loss 1e-3, from
scratch on real data: the model zoo's runs), measured apart from the row it is used in: the
model zoo's long-context table ran the same model on 256 H100s at sequence 16384 (TP4 PP8 VPP4
EP8 etp 1, GBS 256, DeepEP) with forced load balance, 295 TFLOPS/GPU, and dropless, 237. By
Megatron's own FLOP count (``num_floating_point_operations``: 204.8 GFLOP per token there) those
are steps of 11.37 s and 14.16 s; autopar prices that run balanced, its tokens moved as DeepEP
moves them (``ep_dispatch="deepep"``), then finds the imbalance whose added time is the measured
2.78 s (:func:`fit_dropless_imbalance`, ``--fit-imbalance``). Priced with ``recompute="moe"``, the
run's ``--recompute-modules layernorm moe``: each MoE layer's forward, which the imbalance slows,
made again in the backward. (1.73 until 2026-12-07, fitted with ``recompute="full"``, which also
recomputes attention: that moved the balanced time, not the difference.)"""


# Published rows, read at their sources (see bench/calibration.yaml for what was verified).
_TT = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
_ATP = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
_QW = "torchtitan d66b72a6a (PR #1690)"
ROWS = [
    Row(label="Llama3.1-8B FSDP8 lb2 SAC", model="llama:8b", nodes=1, seq=8192, local_batch=2,
        fixed={"dp": 8, "tp": 1, "pp": 1, "zero": 3, "recompute": "sac"},
        tok_s=5762, mem_gib=82.4, compiled=False, source=_TT + " table 1"),
    Row(label="Llama3.1-8B FSDP128 lb2 SAC", model="llama:8b", nodes=16, seq=8192, local_batch=2,
        fixed={"dp": 128, "tp": 1, "pp": 1, "zero": 3, "recompute": "sac"},
        tok_s=5605, mem_gib=67.0, compiled=False, source=_TT + " table 3"),
    Row(label="Llama3.1-8B FSDP8 lb2 SAC (compile)", model="llama:8b", nodes=1, seq=8192, local_batch=2,
        fixed={"dp": 8, "tp": 1, "pp": 1, "zero": 3, "recompute": "sac"},
        tok_s=6667, mem_gib=77.0, compiled=True, source=_TT + " table 1"),
    Row(label="Llama3.1-8B FSDP128 lb2 SAC (compile)", model="llama:8b", nodes=16, seq=8192, local_batch=2,
        fixed={"dp": 128, "tp": 1, "pp": 1, "zero": 3, "recompute": "sac"},
        tok_s=6514, mem_gib=62.0, compiled=True, source=_TT + " table 3"),
    Row(label="Llama3.1-8B FSDP8 TP8 lb12 SAC", model="llama:8b", nodes=8, seq=8192, local_batch=12,
        fixed={"dp": 8, "tp": 8, "pp": 1, "zero": 3, "recompute": "sac", "sp": True},
        tok_s=4378, mem_gib=None, compiled=True, source=_ATP),
    Row(label="Llama3.1-70B FSDP32 TP8 lb16 AC", model="llama:70b", nodes=32, seq=8192, local_batch=16,
        fixed={"dp": 32, "tp": 8, "pp": 1, "zero": 3, "recompute": "full", "sp": True},
        tok_s=597.3, mem_gib=None, compiled=True, source=_ATP),
    Row(label="Llama3.1-8B FSDP8 TP8 lb12 SAC (async TP)", model="llama:8b", nodes=8, seq=8192, local_batch=12,
        fixed={"dp": 8, "tp": 8, "pp": 1, "zero": 3, "recompute": "sac", "sp": True},
        tok_s=4809.4, mem_gib=None, compiled=True, async_tp=True, source=_ATP),
    Row(label="Llama3.1-70B FSDP32 TP8 lb16 AC (async TP)", model="llama:70b", nodes=32, seq=8192, local_batch=16,
        fixed={"dp": 32, "tp": 8, "pp": 1, "zero": 3, "recompute": "full", "sp": True},
        tok_s=652.4, mem_gib=None, compiled=True, async_tp=True, source=_ATP),
    Row(label="Llama3.1-8B FSDP8 lb2 SAC (compile, Float8)", model="llama:8b", nodes=1, seq=8192, local_batch=2,
        fixed={"dp": 8, "tp": 1, "pp": 1, "zero": 3, "recompute": "sac"},
        tok_s=8532, mem_gib=76.8, compiled=True, float8=True, source=_TT + " table 1"),
    Row(label="Llama3.1-8B FSDP128 lb2 SAC (compile, Float8)", model="llama:8b", nodes=16, seq=8192, local_batch=2,
        fixed={"dp": 128, "tp": 1, "pp": 1, "zero": 3, "recompute": "sac"},
        tok_s=8380, mem_gib=61.8, compiled=True, float8=True, source=_TT + " table 3"),
    Row(label="Llama3.1-8B FSDP8 TP8 lb12 SAC (compile, Float8)", model="llama:8b", nodes=8, seq=8192,
        local_batch=12, fixed={"dp": 8, "tp": 8, "pp": 1, "zero": 3, "recompute": "sac", "sp": True},
        tok_s=5078.1, mem_gib=None, compiled=True, float8=True, source=_ATP + " (float8 tensorwise)"),
    Row(label="Llama3.1-70B FSDP32 TP8 lb16 AC (compile, Float8)", model="llama:70b", nodes=32, seq=8192,
        local_batch=16, fixed={"dp": 32, "tp": 8, "pp": 1, "zero": 3, "recompute": "full", "sp": True},
        tok_s=809.8, mem_gib=None, compiled=True, float8=True, source=_ATP + " (float8 tensorwise)"),
    Row(label="Llama3.1-8B FSDP8 TP8 lb12 SAC (compile, Float8, async TP)", model="llama:8b", nodes=8, seq=8192,
        local_batch=12, fixed={"dp": 8, "tp": 8, "pp": 1, "zero": 3, "recompute": "sac", "sp": True},
        tok_s=5570.1, mem_gib=None, compiled=True, float8=True, async_tp=True, source=_ATP + " (float8 tensorwise)"),
    Row(label="Llama3.1-70B FSDP32 TP8 lb16 AC (compile, Float8, async TP)", model="llama:70b", nodes=32, seq=8192,
        local_batch=16, fixed={"dp": 32, "tp": 8, "pp": 1, "zero": 3, "recompute": "full", "sp": True},
        tok_s=942.4, mem_gib=None, compiled=True, float8=True, async_tp=True, source=_ATP + " (float8 tensorwise)"),
    Row(label="Llama3.1-70B FSDP32 TP8 lb16 AC (compile, Float8, async TP; 2024)", model="llama:70b", nodes=32,
        seq=8192, local_batch=16, fixed={"dp": 32, "tp": 8, "pp": 1, "zero": 3, "recompute": "full", "sp": True},
        tok_s=876, mem_gib=67.6, compiled=True, float8=True, async_tp=True, source=_TT + " table 4"),
    Row(label="Llama3.1-70B FSDP32 TP8 lb16 AC (compile, Float8; 2024)", model="llama:70b", nodes=32, seq=8192,
        local_batch=16, fixed={"dp": 32, "tp": 8, "pp": 1, "zero": 3, "recompute": "full", "sp": True},
        tok_s=829, mem_gib=71.9, compiled=True, float8=True, source=_TT + " table 4"),
    *(Row(label=f"Llama3.1-405B FSDP8 TP8 PP8 lb32 AC {name} (compile, Float8, async TP)", model="llama:405b",
          nodes=64, seq=8192, local_batch=32,
          fixed={"dp": 8, "tp": 8, "pp": 8, "zero": 1, "recompute": "full", "sp": True, "schedule": schedule,
                 "microbatch_size": 4, "microbatches": 8, **extra},
          tok_s=tok_s, mem_gib=mem, compiled=True, float8=True, async_tp=True, source=_TT + " table 5")
      for name, schedule, extra, tok_s, mem in (("1F1B", "1f1b", {}, 100, 82.5),
                                                ("interleaved", "interleaved", {"virtual_stages": 2}, 128, 72.7))),
    *(Row(label=f"Llama3.1-405B FSDP{8 // cp} CP{cp} TP8 PP8 seq {seq // 1024}k AC 1F1B (compile, Float8, async TP)",
          model="llama:405b", nodes=64, seq=seq, local_batch=8,
          fixed={"dp": 8, "cp": cp, "tp": 8, "pp": 8, "zero": 1, "recompute": "full", "sp": True, "schedule": "1f1b",
                 "cp_variant": "torch", "microbatch_size": 1, "microbatches": 8},
          tok_s=tok_s, mem_gib=mem, compiled=True, float8=True, async_tp=True, source=_TT + " table 6")
      for cp, seq, tok_s, mem in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                                  (8, 262144, 16, 84.9))),
    *(Row(label=f"Llama3.1-8B FSDP{8 // cp} CP{cp} seq {seq // 1024}k AC (compile, Float8)", model="llama:8b", nodes=1,
          seq=seq, local_batch=1, fixed={"dp": 8, "cp": cp, "tp": 1, "pp": 1, "zero": 3, "recompute": "full",
                                         "cp_variant": "torch"},
          tok_s=tok_s, mem_gib=mem, compiled=True, float8=True, source=_TT + " table 2")
      for cp, seq, tok_s, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                  (8, 262144, 548, 84.5))),
    _qwen3(8, 1, 2, 1874, 81.85, compiled=True),
    _qwen3(8, 1, 2, 1614, 89.33),
    _qwen3(8, 1, 1, 1444, 81.47),
    _qwen3(16, 1, 4, 1518, 78.48),
    _qwen3(8, 4, 16, 1139, 70.20),
    _qwen3(4, 8, 16, 876, 43.45),
    _qwen3(4, 8, 32, 883, 70.79),
    _qwen3(8, 8, 32, 873, 63.27),
    *(_qwen3(dp, tp, lb, None, None)  # the configurations the commit lists as out of memory
      for dp, tp, lb in ((16, 1, 8), (16, 1, 16), (32, 1, 16), (16, 2, 16), (8, 4, 32), (4, 8, 64), (8, 8, 64))),
    # Megatron-LM's plain all-to-all dispatcher row (step 24.2 s = 2048 x 4096 / 24.2 / 256 tok/s/GPU)
    Row(label="Qwen3-235B-A22B TP2 EP8 (etp=1) PP32 VPP3 DP4 mbs1 sel. recompute (Megatron-LM, all-to-all)",
        model="qwen3moe:235b", nodes=32, seq=4096, local_batch=512,
        fixed={"dp": 4, "tp": 2, "pp": 32, "ep": 8, "etp": 1, "sp": True, "zero": 1, "recompute": "selective",
               "schedule": "interleaved", "virtual_stages": 3, "microbatch_size": 1, "microbatches": 512,
               "moe_imbalance": QWEN3_235B_DROPLESS_IMBALANCE, "cuts": megatron_cuts(94, 96),
               "ep_dispatch": "megatron"},
        tok_s=2048 * 4096 / 24.2 / 256, mem_gib=None, compiled=True, device="H100", fused_loss=True,
        source="yanring/Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md (A2A row, main 1e057005)"),
    # the model zoo's long-context table (forced balance; dropless past the 16k pair the imbalance is fitted on)
    *(_qwen3_long(cp, balanced) for balanced in (True, False) for cp in ((1, 2, 4, 8) if balanced else (2, 4, 8))),
]


_CAUSAL_SDPA = "sdpa_is_causal"


def _register_causal_sdpa() -> str:
    """An attention implementation for Hugging Face models that is SDPA with ``is_causal=True``
    and no mask tensor: what HF's own "sdpa" does on a GPU for unpadded batches (``masking_utils.
    _ignore_causal_mask_sdpa`` skips the mask and ``sdpa_attention_forward`` then passes
    ``is_causal``), and what torchtitan's Qwen3 runs. Under autopar's fake trace HF cannot read
    the positions, keeps its packed-sequence check and materialises a (B, 1, T, T) mask, which
    would be priced as a masked, full (non-causal) attention."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(_CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(_CAUSAL_SDPA, lambda *args, **kwargs: None)  # no mask: is_causal
    return _CAUSAL_SDPA


def qwen3_32b(batch: int, seq: int, *, n_layers: int = 64, device: str = "meta"):
    """Qwen3-32B (Qwen/Qwen3-32B config.json: 64 layers, hidden 5120, 64 query and 8
    key/value heads of 128, SwiGLU 25600, vocab 151936, untied head) on "meta" (or ``device``,
    initialised; ``n_layers`` blocks: bench/gpu_blocks.py), bf16, causal SDPA
    (:func:`_register_causal_sdpa`)."""
    import transformers

    config = transformers.Qwen3Config(
        hidden_size=5120, intermediate_size=25600, num_hidden_layers=n_layers, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, use_cache=False,
        attention_dropout=0.0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM._from_config(config, attn_implementation=_register_causal_sdpa(),
                                                            dtype=torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device=device)  # (B, T)
    return model, {"input_ids": ids, "labels": ids.clone()}, None, None


def qwen3_235b_a22b(batch: int, seq: int):
    """Qwen3-235B-A22B (the Megatron-MoE-ModelZoo's ``model_configs/benchmarking/Qwen3-235B-A22B.yaml``,
    as Qwen/Qwen3-235B-A22B's config: 94 layers, every one MoE, hidden 4096, 64 query and 4
    key/value heads of 128 with q/k norms, 128 routed experts of width 1536, top-8 with the
    top-k probabilities renormalised, vocab 151936, untied head) on "meta", bf16, causal SDPA;
    transformers' gated-SiLU experts, which autopar traces as its experts op."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        use_cache=False, attention_dropout=0.0)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM._from_config(config, attn_implementation=_register_causal_sdpa(),
                                                               dtype=torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids.clone()}, None, None


def deepseek_v3_671b(batch: int, seq: int):
    """DeepSeek-V3 671B (transformers' ``DeepseekV3Config`` defaults: 61 layers, the first 3
    dense, hidden 7168, 256 routed experts of 2048 and one shared, top-8 in 8 groups of which 4,
    multi-head latent attention, vocab 129280) on "meta", bf16, causal SDPA."""
    import transformers

    config = transformers.DeepseekV3Config(use_cache=False)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM._from_config(config, attn_implementation=_register_causal_sdpa(),
                                                                 dtype=torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids.clone()}, None, None


def moe_stand_in(zero: int = 1) -> None:
    """torchtitan's DeepSeek-V3 671B run (#2107: 512 H100 80 GB, FSDP64 EP32 PP8 interleaved,
    local batch 16 at seq 4096, full AC, compile, forced load balance; plain all-to-all 346
    tok/s/GPU, 60.18 GiB) planned with ``zero`` (1: the program torchtitan's FSDP runs under pp; see
    the module docstring) and two stages per rank: the run set no
    ``pipeline_parallel_layers_per_stage``, so torchtitan's ``pipeline_parallel.py`` (at d021aa9ca)
    gives a multi-stage schedule two per rank. Its attention is priced as causal SDPA over the
    whole 4096 tokens; the run's config at d021aa9ca uses FlexAttention with a block-causal
    (per-document) mask, which computes less, so this part of the price errs pessimistic. Its
    all-to-all is priced as torchtitan's ``expert_parallel.py`` at d021aa9ca runs it: the counts
    exchanged, then the rows dispatched and combined with autograd's all-to-all, whose backward
    reverses them (the exchanges of ``ep_dispatch="megatron"``). The run's DeepEP figure (579) is
    not priced here: its forced round-robin routing puts a token's 8 experts on one rank, where
    ``ep_dispatch="deepep"`` prices uniform routing (a token meets about 7 of the 32 ranks)."""
    device = torchtitan_device("H100")
    cluster = Cluster(nodes=64, devices_per_node=8, device=device.with_overrides(hbm_bytes=64 * device.hbm_bytes))
    model, inputs, _, _ = deepseek_v3_671b(64 * 16, 4096)
    fixed = {"dp": 64, "ep": 32, "tp": 1, "pp": 8, "zero": zero, "recompute": "full", "schedule": "interleaved",
             "virtual_stages": 2, "microbatch_size": 1, "microbatches": 16, "moe_imbalance": 1.0,
             "ep_dispatch": "megatron"}
    start = time.perf_counter()
    plan = make_plan(model, inputs, cluster=cluster, fixed=fixed, compiled_layers=_in_a_block,
                     whole_layer_recompute=True)
    tok_s = plan.predicted["tokens_per_s"] / 512
    peak = plan.predicted["peak_memory_bytes"] / 2**30
    print(f"DeepSeek-V3 671B FSDP64 EP32 PP8 (zero={zero}, transformers' model): predicted {tok_s:.0f} tok/s/GPU "
          f"against 346 measured ({tok_s / 346 - 1:+.1%}), MFU {plan.predicted['mfu']:.1%} against 9.83%, "
          f"{peak:.1f} GiB against 60.18 ({peak / 60.18 - 1:+.1%}), {time.perf_counter() - start:.0f} s to plan")


def torchtitan_device(name: str):
    """The catalog's ``name`` with FlashAttention-2's efficiency: the kernel these runs' SDPA ran.
    torchtitan's ``ScaledDotProductAttention`` (``torchtitan/models/attention.py`` at d66b72a6a)
    puts FLASH_ATTENTION first and CUDNN_ATTENTION only on B200 (``has_cuda_capability(10, 0)``);
    the Llama runs (9dec370, December 2024) called SDPA with torch's own order, where cuDNN was
    opt-in after pytorch/pytorch#138522. The catalog's Hopper entries carry cuDNN's figure."""
    return lookup_device(name).with_overrides(attention_efficiency=HOPPER_FLASH2_ATTENTION_EFFICIENCY)


def torchtitan_loss(pred, labels):
    """torchtitan's Llama loss (``train.py`` at 9dec370): cross-entropy of the logits upcast to fp32,
    where examples/llama.py's runs in the logits' bf16. At Llama 3's 128k vocabulary the fp32 copy
    and its gradient are several GB of HBM traffic per micro-batch. (Hugging Face's Qwen3 loss,
    as torchtitan's, upcasts too.)"""
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def build(row: Row):
    dp = row.fixed["dp"]
    batch = dp // row.fixed.get("cp", 1) * row.local_batch  # a cp group shares its sequences
    family, size = row.model.split(":")
    if family == "llama":
        model, inputs, _, target = _example("llama").build(size=size, batch=batch, seq=row.seq)
        return model, inputs, torchtitan_loss, target
    if family == "qwen3moe":
        assert size == "235b", row.model
        return qwen3_235b_a22b(batch, row.seq)
    assert family == "qwen3" and size == "32b", row.model
    return qwen3_32b(batch, row.seq)


def _in_a_block(layer: str) -> bool:
    """torchtitan compiles each transformer block on its own (``apply_compile``); the embedding,
    final norm, head and loss run eager. Block paths: "layers.<i>" (examples/llama.py),
    "model.layers.<i>" (Hugging Face)."""
    parts = layer.split(".")
    return len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit()


def _fused_loss_too(layer: str) -> bool:
    """The blocks and the loss: Megatron-LM's fused kernels (TE's in the blocks, its fused
    cross-entropy over the vocabulary-parallel logits)."""
    return _in_a_block(layer) or layer == "<loss>"


def fit_dropless_imbalance() -> float:
    """:data:`QWEN3_235B_DROPLESS_IMBALANCE` from its source pair (printed as it goes): the model
    zoo's Qwen3-235B run at sequence 16384 on 32 x 8 H100 (TP4 PP8 VPP4 EP8, etp 1, DP8, GBS 256,
    MBS 1; Megatron's layout; DeepEP), balanced and at the imbalance that adds the measured 2.78 s,
    by bisection (about 30 s)."""
    seq, gbs = 16384, 256
    per_token = megatron_qwen3_235b_flops_per_token(seq)
    forced, dropless = (gbs * seq * per_token / (256 * tf * 1e12) for tf in QWEN3_LONG_TFLOPS[1])
    print(f"measured (long-context table, seq {seq}): forced balance {forced:.2f} s, dropless {dropless:.2f} s, "
          f"difference {dropless - forced:.2f} s")
    device = lookup_device("H100")
    cluster = Cluster(nodes=32, devices_per_node=8, device=device.with_overrides(hbm_bytes=64 * device.hbm_bytes))
    model, inputs, _, _ = qwen3_235b_a22b(gbs, seq)

    row = _qwen3_long(1, balanced=True)  # (the run as its row pins it: its recompute, norms and MoE layers)

    def step(imbalance: float) -> float:
        return make_plan(model, inputs, cluster=cluster, fixed={**row.fixed, "moe_imbalance": imbalance},
                         compiled_layers=_fused_loss_too, whole_layer_recompute=True).predicted["step_time_s"]

    balanced = step(1.0)
    lo, hi = 1.0, 3.0
    while hi - lo > 0.005:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) - balanced < dropless - forced else (lo, mid)
    print(f"predicted balanced: {balanced:.2f} s with the run's recompute (norms and MoE layers; measured "
          f"{forced:.2f} s); the imbalance adding {dropless - forced:.2f} s: {(lo + hi) / 2:.2f}")
    return (lo + hi) / 2


def torchtitan_float8(path: str) -> bool:
    """The linears torchtitan converts to Float8 (``torchtitan/float8.py`` at 9dec370:
    ``module_filter_fn=lambda mod, fqn: fqn != "output"``): all but the output head."""
    return path != "output"


def torchtitan_qk_replicated(gm) -> set[str]:
    """The forward ops torchtitan's Qwen3 TP program runs on whole heads (``make_plan``'s
    ``replicated``): the outputs of ``q_norm`` and ``k_norm``, which its ``NoParallel`` style
    redistributes to ``Replicate()`` (``torchtitan/distributed/__init__.py`` at d66b72a6a), and
    every op of the attention module between them and SDPA (the rotary embedding), which
    DTensor then runs on replicated inputs; SDPA slices q and k back to the rank's heads. On
    Hugging Face's graph: each norm module's last op, then its users in ``self_attn`` up to SDPA."""
    from autopar.passes import meta_keys as mk

    def forward_in(node, suffixes) -> bool:
        t = node.meta.get(mk.TRACE)
        return t is not None and t.role is mk.Role.FORWARD and t.module_path.endswith(suffixes)

    norms = ("self_attn.q_norm", "self_attn.k_norm")
    frontier = [n for n in gm.graph.nodes if forward_in(n, norms) and any(
        forward_in(u, ("self_attn",)) for u in n.users)]  # each norm's output
    out = {n.name for n in frontier}
    while frontier:
        for user in frontier.pop().users:
            attention = "scaled_dot_product" in str(user.target)
            if user.name not in out and forward_in(user, ("self_attn",)) and not attention:
                out.add(user.name)
                frontier.append(user)
    return out


def predict(row: Row) -> dict:
    device = lookup_device(row.device) if row.device else torchtitan_device("H100-96GB")
    world = row.nodes * 8
    # Capacity out of the way: every pinned configuration gets a plan, fit is judged below.
    cluster = Cluster(nodes=row.nodes, devices_per_node=8, device=device.with_overrides(hbm_bytes=64 * device.hbm_bytes))
    model, inputs, loss_fn, target = build(row)
    fixed = {"microbatch_size": row.local_batch, "microbatches": 1, **row.fixed}  # (pp rows name their own)
    start = time.perf_counter()
    plan = make_plan(model, inputs, cluster=cluster, loss_fn=loss_fn, example_target=target, fixed=fixed,
                     compiled_layers=_fused_loss_too if row.fused_loss else _in_a_block if row.compiled else None,
                     float8_linears=torchtitan_float8 if row.float8 else None, async_tp=row.async_tp,
                     whole_layer_recompute=True,  # (torch.utils.checkpoint's AC, Megatron-LM's recompute)
                     replicated=torchtitan_qk_replicated if row.model == "qwen3:32b" and row.fixed.get("tp", 1) > 1
                     else None)
    wall = time.perf_counter() - start
    peak = plan.predicted["peak_memory_bytes"]
    return {"tok_s": plan.predicted["tokens_per_s"] / world, "mem_gib": peak / GIB, "mfu": plan.predicted["mfu"],
            "fits": peak <= device.hbm_bytes, "fits_reserve": peak <= 0.9 * device.hbm_bytes, "wall_s": wall}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run rows whose label contains this (case-insensitive)")
    parser.add_argument("--moe", action="store_true", help="plan the DeepSeek-V3 stand-in instead of the rows")
    parser.add_argument("--fit-imbalance", action="store_true",
                        help="re-derive QWEN3_235B_DROPLESS_IMBALANCE from its source pair instead of the rows")
    args = parser.parse_args()
    if args.moe:
        moe_stand_in(1)
        return
    if args.fit_imbalance:
        fit_dropless_imbalance()
        return
    rows = [r for r in ROWS if args.only.lower() in r.label.lower()]
    print("| row | GPUs | measured tok/s/GPU | predicted | error | measured GiB | predicted GiB | fits 95 GiB | MFU pred |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors = []
    for row in rows:
        p = predict(row)
        if row.tok_s is None:
            err = "OOM " + ("predicted" if not p["fits"] else "MISSED")
        else:
            e = p["tok_s"] / row.tok_s - 1
            errors.append(abs(e))
            err = f"{e:+.1%}"
        fused = " (TE fused)" if row.device else " (compile)"  # (the Megatron-LM row: Transformer Engine's kernels)
        meas = "OOM" if row.tok_s is None else f"{row.tok_s:.6g}" + (fused if row.compiled else "")
        mem = "-" if row.mem_gib is None else f"{row.mem_gib:.1f}"
        fits = "yes" if p["fits_reserve"] else ("yes (no 10% reserve)" if p["fits"] else "no")
        print(f"| {row.label} | {row.nodes * 8} | {meas} | {p['tok_s']:.0f} | {err} | {mem} | {p['mem_gib']:.1f} | "
              f"{fits} | {p['mfu']:.1%} |", flush=True)
    if errors:
        print(f"\nmean |error| {statistics.mean(errors):.1%} over {len(errors)} rows; "
              f"max {max(errors):.1%}; within 15%: {sum(e <= 0.15 for e in errors)}/{len(errors)}")


if __name__ == "__main__":
    main()

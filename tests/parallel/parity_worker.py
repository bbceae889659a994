"""Parity checks run by every rank of one launch: each named layout trains a tiny MoE model for
three SGD steps and must reproduce one process seeing the same micro-batches.

    torchrun --standalone --nproc-per-node N tests/parallel/parity_worker.py CASE [CASE ...]

"The same micro-batches": the global batch is cut into dp × grad_accum × pipeline micro-batches
in that order, and the reference process accumulates over exactly those chunks. Router
capacity and the load-balancing loss are per micro-batch, so this is the only reference under
which they are defined identically.

Checked per step: the loss (CE, aux, and multi-token prediction's CE) within LOSS_RTOL; after step 1 every parameter's
gradient (gathered from its shards) within GRAD_TOL of the largest reference gradient entry,
and the global gradient norm within GRAD_TOL relative;
the expert token counts of the last micro-batch exactly. With aux-loss-free routing (the *_bias
cases: sigmoid scores, an expert bias moved after every step by the global batch's loads) the
biases after the last step must equal the reference's, which moves them from its own counts.
Rank 0 prints one JSON line per case.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
from dataclasses import fields, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

from moetron.launcher.data.mlm import MaskedLM
from moetron.model.config import MLAConfig, ModelConfig, MoEConfig
from moetron.model.moe import MoELayer
from moetron.model.mtp import mtp_cross_entropy
from moetron.model.packing import Packing
from moetron.model.transformer import build_model
from moetron.parallel.config import ParallelConfig
from moetron.parallel.expert_bias import biased_routers, update_expert_biases
from moetron.parallel.materialize import materialize_and_init
from moetron.parallel.mesh import ParallelMesh, build_mesh, mesh_shape
from moetron.parallel.parallelize import parallelize
from moetron.parallel.sharded_optimizer import ShardedAdamW, assign_owners

LOSS_RTOL = 1e-5
GRAD_TOL = 1e-5
BIAS_TOL = 1e-9  # biases are sums of ±rate: equal loads give equal biases
STEPS, LR, SEED = 3, 0.5, 7
ADAMW_LR = 0.01
BATCH, SEQ = 8, 16

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                    attention="eager",
                    moe=MoEConfig(num_experts=4, top_k=2, d_expert=32, every=2, aux_loss_coef=0.01, z_loss_coef=0.001))

# Aux-loss-free routing, large enough a rate that the bias changes choices within three steps.
BIAS = {"score": "sigmoid", "bias_update_rate": 0.05}
BIAS_GROUPS = {**BIAS, "num_groups": 2, "topk_groups": 1}
BIAS_SEQUENCE = {**BIAS, "aux_loss_type": "sequence"}  # DeepSeek-V3's per-sequence balance loss beside the bias
GLOBAL = {"aux_loss_type": "global_batch", "aux_loss_coef": 0.1}  # Qwen3's loss over the global batch
# Multi-head latent attention (model fields beside MoE ones): q, k 12 wide (8 + 4 rope), v 6, with
# and without a query latent.
MLA = {"n_kv_heads": None, "mla": MLAConfig(kv_lora_rank=16, q_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                            v_head_dim=6)}
MLA_PLAIN_Q = {**MLA, "mla": replace(MLA["mla"], q_lora_rank=0)}
# Qwen2-MoE: q/k/v biases (split with their heads under tp) and a shared expert gated per token.
QWEN2 = {"attention_bias": "qkv", "shared_expert_d_ff": 48, "shared_expert_gate": True}
# GPT-OSS: sink logits split with the heads, a 5-key window on alternate layers (shorter than the 16
# positions), q/k/v/o biases, a biased router, biased experts (dim 0 over ep, F over etp), and the
# clamped SwiGLU with a limit low enough (0.1) to cut many of the gate and up values at init.
GPTOSS = {"attention_sinks": True, "sliding_window": 5, "layer_types": ("sliding", "full", "sliding", "full"),
          "attention_bias": "all", "router_bias": True, "expert_bias": True, "swiglu_limit": 0.1,
          "swiglu_alpha": 1.702, "swiglu_up_offset": 1.0}

ENCODER = {"causal": False}  # trained on masked-LM batches (MLM below)

# name → (parallel layout, model changes (MoE fields, or the position encoding), grad_accum)
CASES = {
    "tp2_sp_bias": (dict(tp=2, sequence_parallel=True), BIAS_SEQUENCE, 1),
    "dp2_ddp_bias": (dict(dp=2, dp_mode="ddp"), BIAS_GROUPS, 2),
    "ep2_fsdp_bias": (dict(dp=2, ep=2), {**BIAS_GROUPS, "aux_loss_type": "sequence"}, 1),
    "pp2_gpipe_bias": (dict(pp=2, microbatches=2, schedule="gpipe"), BIAS, 1),
    "pp2_1f1b_bias": (dict(pp=2, microbatches=2, schedule="1f1b"), BIAS_SEQUENCE, 2),
    "pp2_interleaved_bias": (dict(pp=2, vpp=2, microbatches=2, schedule="interleaved_1f1b"), BIAS, 1),
    "pp2_zero_bubble_bias": (dict(pp=2, microbatches=2, schedule="zero_bubble"), BIAS_GROUPS, 1),
    "tp2_sp_ep2_bias": (dict(dp=2, tp=2, ep=2, sequence_parallel=True), BIAS_GROUPS, 1),
    "pp2_dp2_bias": (dict(pp=2, dp=2, microbatches=2, schedule="1f1b"), BIAS_SEQUENCE, 1),
    "dp2_ddp_global": (dict(dp=2, dp_mode="ddp"), GLOBAL, 2),
    "ep2_fsdp_global_bias": (dict(dp=2, ep=2), {**GLOBAL, **BIAS}, 1),
    "tp2_sp_ep2_global": (dict(dp=2, tp=2, ep=2, sequence_parallel=True), GLOBAL, 1),
    "cp2_dp2_global": (dict(dp=2, cp=2, dp_mode="ddp"), GLOBAL, 1),
    "pp2_1f1b_global": (dict(pp=2, microbatches=2, schedule="1f1b"), GLOBAL, 2),
    "pp2_dp2_interleaved_global": (dict(pp=2, dp=2, vpp=2, microbatches=2, schedule="interleaved_1f1b"), GLOBAL, 1),
    "pp2_dp2_global_ac_full": (dict(pp=2, dp=2, microbatches=2, schedule="1f1b"), GLOBAL, 1),
    "ep2_fsdp_global_ac_selective": (dict(dp=2, ep=2), GLOBAL, 2),
    # train.compile=true: every block compiled (regional), against the eager one-process reference
    # (not with sequence parallel, which the layout rules refuse: compiled it does not match).
    "ep2_fsdp_compiled": (dict(dp=2, ep=2), BIAS, 1),
    "tp2_compiled": (dict(tp=2), {}, 1),
    "pp2_1f1b_compiled": (dict(pp=2, microbatches=2, schedule="1f1b"), {}, 1),
    "dp2_ddp_compiled": (dict(dp=2, dp_mode="ddp"), GLOBAL, 2),
    "tp2": (dict(tp=2), {}, 1),
    "tp2_sp": (dict(tp=2, sequence_parallel=True), {}, 1),
    "tp2_sp_learned": (dict(tp=2, sequence_parallel=True), {"position": "learned"}, 1),
    # T5's bias table split by head columns, one table for all layers; under cp from global positions.
    "tp2_t5": (dict(tp=2), {"position": "t5"}, 1),
    "tp2_sp_t5": (dict(tp=2, sequence_parallel=True), {"position": "t5"}, 1),
    "cp2_t5": (dict(cp=2), {"position": "t5"}, 1),
    "pp2_tp2_sp_sinusoidal": (dict(pp=2, tp=2, sequence_parallel=True, microbatches=2, schedule="1f1b"),
                              {"position": "sinusoidal"}, 1),
    "dp2_fsdp": (dict(dp=2), {}, 2),
    "dp2_ddp": (dict(dp=2, dp_mode="ddp"), {}, 1),
    "ep2_fsdp": (dict(dp=2, ep=2), {}, 1),
    "ep2_ddp_capacity": (dict(dp=2, ep=2, dp_mode="ddp"), {"capacity_factor": 1.0}, 1),
    "pp2_gpipe": (dict(pp=2, microbatches=2, schedule="gpipe"), {}, 1),
    "pp2_1f1b": (dict(pp=2, microbatches=2, schedule="1f1b"), {}, 2),
    "pp2_interleaved": (dict(pp=2, vpp=2, microbatches=2, schedule="interleaved_1f1b"), {}, 1),
    "pp2_zero_bubble": (dict(pp=2, microbatches=2, schedule="zero_bubble"), {}, 1),
    # dp = 2·ep: each expert is held by two ranks, whose gradients are reduced over "edp" only.
    "dp4_ep2": (dict(dp=4, ep=2), {}, 2),
    "dp4_ep2_ddp": (dict(dp=4, ep=2, dp_mode="ddp"), {}, 1),
    "tp2_ep2": (dict(dp=2, tp=2, ep=2), {}, 1),
    "tp2_sp_ep2": (dict(dp=2, tp=2, ep=2, sequence_parallel=True), {}, 1),
    # Expert-tensor parallel: each routed expert's F split over the tp ranks (Megatron-Core's ETP).
    "tp2_etp2": (dict(tp=2, etp=2), {}, 1),
    "tp2_sp_etp2": (dict(tp=2, etp=2, sequence_parallel=True), {}, 1),
    "tp2_sp_etp2_bias": (dict(tp=2, etp=2, sequence_parallel=True), BIAS_GROUPS, 1),
    "tp2_etp2_ep2": (dict(dp=2, tp=2, ep=2, etp=2), {}, 1),
    "tp2_etp2_ddp": (dict(dp=2, tp=2, etp=2, dp_mode="ddp"), {}, 1),
    "pp2_tp2_etp2": (dict(pp=2, tp=2, etp=2, microbatches=2, schedule="1f1b"), {}, 1),
    "pp2_ep2": (dict(pp=2, dp=2, ep=2, microbatches=2, schedule="1f1b"), {}, 1),
    "pp2_tp2": (dict(pp=2, tp=2, microbatches=2, schedule="zero_bubble"), {}, 1),
    "pp2_tp2_sp": (dict(pp=2, tp=2, sequence_parallel=True, microbatches=2, schedule="1f1b"), {}, 1),
    "pp2_dp2_interleaved": (dict(pp=2, dp=2, vpp=2, microbatches=2, schedule="interleaved_1f1b"), {}, 1),
    # HSDP: shard over 2 ranks, replicate over 2 groups; experts (ep2) replicated across the groups.
    "hsdp2x2": (dict(dp=4, dp_mode="hsdp", dp_shard=2), {}, 2),
    "hsdp2x2_ep2": (dict(dp=4, ep=2, dp_mode="hsdp", dp_shard=2), {}, 1),
    # ZeRO-1: replicated weights, AdamW state and update split over the 4 (experts: 2) copies.
    "zero1_dp4": (dict(dp=4, dp_mode="zero1"), {}, 1),
    "zero1_dp4_ep2": (dict(dp=4, ep=2, dp_mode="zero1"), {}, 2),
    "pp2_dp2_tp2_ep2": (dict(pp=2, dp=2, tp=2, ep=2, microbatches=2, schedule="1f1b"), {}, 1),
    # Context parallel: each sequence's 16 positions in 4 chunks, rank r holding chunks r and 3 − r.
    "cp2": (dict(cp=2), {}, 1),
    "cp2_alibi": (dict(cp=2, dp_mode="ddp"), {"position": "alibi"}, 2),
    "cp2_bias_sequence": (dict(cp=2), BIAS_SEQUENCE, 1),
    "cp2_tp2_sp": (dict(cp=2, tp=2, sequence_parallel=True), {}, 1),
    "cp2_ep2": (dict(dp=2, cp=2, ep=2), {}, 1),
    "pp2_cp2": (dict(pp=2, cp=2, microbatches=2, schedule="1f1b"), {}, 1),
    # HSDP sharding over the cp pair of each sequence, replicated over the two dp ranks.
    "cp2_dp2_hsdp": (dict(dp=2, cp=2, dp_mode="hsdp", dp_shard=1), BIAS, 1),
    "zero1_dp2_tp2_etp2": (dict(dp=2, tp=2, etp=2, dp_mode="zero1"), {}, 1),
    "hsdp_dp2_tp2_etp2_ep2": (dict(dp=2, tp=2, etp=2, ep=2, dp_mode="hsdp", dp_shard=2), {}, 1),
    "tp2_sp_ac_selective": (dict(tp=2, sequence_parallel=True), {}, 1),
    "cp2_ac_selective": (dict(cp=2), {}, 1),
    "ep2_fsdp_ac_full": (dict(dp=2, ep=2), {}, 1),
    "ep2_fsdp_ac_selective": (dict(dp=2, ep=2), {}, 1),
    "ep2_ddp_ac_selective": (dict(dp=2, ep=2, dp_mode="ddp"), {}, 1),
    "pp2_1f1b_ac_selective": (dict(pp=2, microbatches=2, schedule="1f1b"), {}, 1),
    "pp2_1f1b_bias_ac_full": (dict(pp=2, microbatches=2, schedule="1f1b"), BIAS_SEQUENCE, 2),
    "tp2_sp_ep2_ac_selective": (dict(dp=2, tp=2, ep=2, sequence_parallel=True), BIAS_GROUPS, 1),
    "pp2_dp2_ac_full": (dict(pp=2, dp=2, microbatches=2, schedule="1f1b"), {}, 2),
    "pp2_dp2_tp2_ep2_etp2": (dict(pp=2, dp=2, tp=2, ep=2, etp=2, sequence_parallel=True, microbatches=2,
                                  schedule="1f1b"), {}, 1),
    # Packed documents (PACKED): attention kept inside each, positions restarting per document.
    "tp2_sp_packed": (dict(tp=2, sequence_parallel=True), {"position": "learned"}, 1),
    "cp2_packed": (dict(cp=2), {}, 1),
    "pp2_1f1b_packed": (dict(pp=2, microbatches=2, schedule="1f1b"), {}, 2),
    "pp2_cp2_packed": (dict(pp=2, cp=2, microbatches=2, schedule="1f1b"), {"position": "sinusoidal"}, 1),
    # MLA: heads split by tp (the rope key's gradient summed), the latent and rope key exchanged by cp.
    "tp2_mla": (dict(tp=2), MLA_PLAIN_Q, 1),
    "tp2_sp_mla": (dict(tp=2, sequence_parallel=True), MLA, 1),
    "cp2_mla": (dict(cp=2), MLA, 1),
    "pp2_1f1b_mla": (dict(pp=2, microbatches=2, schedule="1f1b"), MLA_PLAIN_Q, 2),
    # DeepSeek-V3-like routing beside it; groups scored by their best expert (V2's rule).
    "tp2_ep2_mla": (dict(dp=2, tp=2, ep=2), {**MLA, **BIAS_GROUPS, "group_score_top": 1}, 1),
    "cp2_tp2_sp_mla": (dict(cp=2, tp=2, sequence_parallel=True), MLA_PLAIN_Q, 1),
    "tp2_mla_mtp": (dict(tp=2), {**MLA, "mtp_depth": 1}, 1),  # DeepSeek-V3's pair: the MTP block is MLA too
    "tp2_ep2_qwen2": (dict(dp=2, tp=2, ep=2), QWEN2, 1),
    "tp2_gptoss": (dict(tp=2), GPTOSS, 1),
    "tp2_sp_gptoss": (dict(tp=2, sequence_parallel=True), GPTOSS, 1),
    "cp2_gptoss": (dict(cp=2), GPTOSS, 1),  # the window and sinks on the explicit-bias path
    "tp2_ep2_gptoss": (dict(dp=2, tp=2, ep=2), GPTOSS, 1),
    "tp2_etp2_ep2_gptoss": (dict(dp=2, tp=2, ep=2, etp=2), GPTOSS, 1),  # the down bias added once
    # Multi-token prediction, two depths (the first block dense, the second MoE: layers 4 and 5
    # of every=2) sharing the embedding and the vocabulary-split head; under sp with its own parts
    # on the local S slice; with experts over ep and FSDP wrapping the embedding and head called
    # three times a step; the MTP routers' biases moved with the decoder's.
    "tp2_mtp": (dict(tp=2), {"mtp_depth": 2}, 2),
    "tp2_sp_mtp": (dict(tp=2, sequence_parallel=True), {"mtp_depth": 2, **BIAS}, 1),
    "tp2_ep2_mtp": (dict(dp=2, tp=2, ep=2), {"mtp_depth": 2, **BIAS_GROUPS}, 1),
    # The last stage runs the MTP modules on the ids passed along the stages, with its copy of the
    # embedding (gradients summed with the first stage's); grad_accum 2.
    "pp2_1f1b_mtp": (dict(pp=2, microbatches=2, schedule="1f1b"), {"mtp_depth": 2}, 2),
    "pp2_zero_bubble_mtp": (dict(pp=2, microbatches=2, schedule="zero_bubble"), {"mtp_depth": 1, **BIAS}, 1),
    # The embedding and its copy split over tp by vocabulary rows and over dp by FSDP: the pair sums
    # its local pieces; absolute positions split at the first block, so the copy's output comes split.
    "pp2_tp2_sp_mtp": (dict(pp=2, tp=2, sequence_parallel=True, microbatches=2, schedule="1f1b"),
                       {"mtp_depth": 2, "position": "sinusoidal"}, 1),
    "pp2_dp2_interleaved_mtp": (dict(pp=2, dp=2, vpp=2, microbatches=2, schedule="interleaved_1f1b"),
                                {"mtp_depth": 1}, 1),
    # Four stages: the embedding's pair is stage 0's rank and stage 3's, the middle ones pass the ids on.
    "pp4_gpipe_mtp": (dict(pp=4, microbatches=4, schedule="gpipe"), {"mtp_depth": 2}, 1),
    # Packed documents: the ids travel after the documents' starts and positions.
    "pp2_1f1b_packed_mtp": (dict(pp=2, microbatches=2, schedule="1f1b"), {"mtp_depth": 1}, 1),
    # A masked-LM encoder (MLM): ranks and micro-batches score different numbers of positions, and
    # the loss is the mean over all of the global batch's; the sum of a vocabulary-split loss under
    # tp; a cp rank's chunks holding few of a sequence's scored positions.
    "dp2_ddp_mlm": (dict(dp=2, dp_mode="ddp"), ENCODER, 2),
    "tp2_sp_mlm": (dict(tp=2, sequence_parallel=True), ENCODER, 1),
    "cp2_mlm": (dict(cp=2), ENCODER, 1),
    "pp2_1f1b_mlm": (dict(pp=2, microbatches=2, schedule="1f1b"), ENCODER, 2),
    "cp2_ep2_mlm": (dict(dp=2, cp=2, ep=2), ENCODER, 1),
}

# Cases whose windows hold several documents, each closed by EOD (about one token in five).
EOD = 1
PACKED = {"tp2_sp_packed", "cp2_packed", "pp2_1f1b_packed", "pp2_cp2_packed", "pp2_1f1b_packed_mtp"}
PACKING = Packing(EOD, reset_positions=True)
# Cases trained on BERT's masked-LM batches, (B, 2, S) inputs and targets, ~15% of positions scored
# (at least one per sequence); the mask token is the model's last id.
MLM = {"dp2_ddp_mlm", "tp2_sp_mlm", "cp2_mlm", "pp2_1f1b_mlm", "cp2_ep2_mlm"}


# Cases whose blocks are compiled, as train.compile=true does (the reference stays eager).
COMPILED = {"tp2_compiled", "ep2_fsdp_compiled", "pp2_1f1b_compiled", "dp2_ddp_compiled"}
# Cases stepped with AdamW (a sharded optimizer's state is what they test) instead of SGD.
ADAMW = {"zero1_dp4", "zero1_dp4_ep2", "zero1_dp2_tp2_etp2"}
# Cases run with activation checkpointing (the reference never checkpoints: recomputation must
# not change a loss or a gradient).
ACTIVATION_CHECKPOINT = {"tp2_sp_ac_selective": "selective", "cp2_ac_selective": "selective",
                         "ep2_fsdp_ac_full": "full", "ep2_fsdp_ac_selective": "selective", "ep2_ddp_ac_selective": "selective", "pp2_1f1b_ac_selective": "selective", "pp2_1f1b_bias_ac_full": "full",
                         "tp2_sp_ep2_ac_selective": "selective", "pp2_dp2_ac_full": "full",
                         "pp2_dp2_global_ac_full": "full", "ep2_fsdp_global_ac_selective": "selective"}


def make_optimizer(named_params, adamw: bool, owners=None) -> torch.optim.Optimizer:
    params = [p for _, p in named_params]
    if not adamw:
        return torch.optim.SGD(params, lr=LR)
    kwargs = dict(lr=ADAMW_LR, weight_decay=0.1, foreach=False)
    return ShardedAdamW(params, owners=owners, **kwargs) if owners else torch.optim.AdamW(params, **kwargs)


def cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten(), reduction=reduction)


def batches(packed: bool = False, mlm: bool = False) -> list[torch.Tensor]:
    """Each step's global batch: windows (B, S + 1), or with `mlm` (B, 2, S) inputs and targets."""
    g = torch.Generator().manual_seed(123)
    words = MODEL.vocab_size - int(mlm)  # the last id is MLM's mask token
    out = [torch.randint(0, words, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]
    if packed:
        for b in out:
            b[torch.rand(b.shape, generator=g) < 0.2] = EOD
    if mlm:
        out = [MaskedLM(words, SEED).pairs(b, step) for step, b in enumerate(out)]
    return out


def inputs_targets(micro: torch.Tensor, mlm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (micro[:, 0], micro[:, 1]) if mlm else (micro[:, :-1], micro[:, 1:])


def packed_args(micro_BS1: torch.Tensor, packed: bool) -> tuple[torch.Tensor, ...]:
    return PACKING.model_inputs(micro_BS1[:, :-1]) if packed else ()


def global_batch_loads(model, micro: list[torch.Tensor], dp: int) -> list[dict[int, torch.Tensor]]:
    """For the global-batch balance loss: {layer: routes per expert} summed over the dp ranks'
    j-th micro-batches, for each j (chunk r·J + j is dp rank r's j-th), from a forward that
    only routes (eval mode: no counts are kept)."""
    model.eval()
    with torch.no_grad():
        counts = [{k: s.counts_E.double() for k, s in model(m[:, :-1]).moe.items()} for m in micro]
    model.train()
    per_rank = len(micro) // dp
    return [{k: sum(counts[r * per_rank + j][k] for r in range(dp)) for k in counts[0]} for j in range(per_rank)]


def reference(model_cfg: ModelConfig, chunks: int, adamw: bool = False, dp: int = 1, packed: bool = False,
              mlm: bool = False) -> dict:
    """One process, plain model, SGD, accumulating over `chunks` micro-batches per step. Its CE is
    each micro-batch's mean, averaged; with `mlm`, the mean over all scored positions of the batch.

    With the global-batch balance loss the layout's micro-batch j on each dp rank sees the routes
    of micro-batches 1..j of every dp rank: routed first, then handed to each router in turn."""
    meta = build_model(model_cfg, device="meta")
    model = build_model(model_cfg, device="meta")
    materialize_and_init(meta, [model], seed=SEED, device=torch.device("cpu"), ep_slice=lambda n, t: t)
    opt = make_optimizer(model.named_parameters(), adamw)
    out = {"ce": [], "aux": [], "mtp": [], "counts": [], "grads": None}
    routers = {i: b.ffn.router for i, b in model.layers.items() if isinstance(b.ffn, MoELayer)}
    global_batch = model_cfg.moe.aux_loss_type == "global_batch"
    for batch in batches(packed, mlm):
        ce_sum = aux_sum = mtp_sum = 0.0
        scored = int((batch[:, 1] != -100).sum()) if mlm else 0
        counts = []
        micros = batch.chunk(chunks)
        loads = global_batch_loads(model, micros, dp) if global_batch else []
        for c, micro in enumerate(micros):
            if global_batch:
                j = c % (chunks // dp)  # chunk r·J + j is dp rank r's j-th micro-batch
                for layer, router in routers.items():
                    if j == 0:  # a dp rank's first micro-batch: its running count starts over
                        router.start_batch()
                    router.hooks.batch_sum = lambda counts_E, load_E=loads[j][int(layer)]: load_E
            inputs, targets = inputs_targets(micro, mlm)
            res = model(inputs, *packed_args(micro, packed))
            # MLM: this micro-batch's CE summed, over the batch's scored positions, × chunks (÷ below).
            ce = (cross_entropy(res.logits_BSV, targets, reduction="sum") / scored * chunks if mlm
                  else cross_entropy(res.logits_BSV, targets))
            # Multi-token prediction: λ/D Σ_k CE_k (0 without it).
            mtp = mtp_cross_entropy(res.mtp_logits, targets, cross_entropy)
            ((ce + res.aux_loss + model_cfg.mtp_loss_weight * mtp) / chunks).backward()
            ce_sum, aux_sum, mtp_sum = ce_sum + ce.item(), aux_sum + res.aux_loss.item(), mtp_sum + mtp.item()
            counts.append({k: s.counts_E.tolist() for k, s in res.moe.items()})
        if out["grads"] is None:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        for router in biased_routers([model]).values():  # its own counts: no collective here
            router.update_bias(router.tokens_per_expert_E.clone())
        out["ce"].append(ce_sum / chunks)
        out["aux"].append(aux_sum / chunks)
        out["mtp"].append(mtp_sum / chunks)
        out["counts"].append(counts)
    out["bias"] = {layer: r.expert_bias_E.clone() for layer, r in biased_routers([model]).items()}
    return out


def full_grad(pm, name: str, p: torch.Tensor) -> torch.Tensor:
    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    if name in pm.expert_sharded:
        # Collect every ep rank's experts to compare with the reference's (E, ·, ·) gradient.
        parts = [torch.empty_like(g) for _ in range(pm.mesh.size("ep"))]
        dist.all_gather(parts, g.contiguous(), group=pm.mesh.group("ep"))
        g = torch.cat(parts)
    if name in pm.expert_tp_split:
        # Expert-tensor parallel: each tp rank holds an F slice; join them along that dim.
        parts = [torch.empty_like(g) for _ in range(pm.mesh.size("tp"))]
        dist.all_gather(parts, g.contiguous(), group=pm.mesh.group("tp"))
        g = torch.cat(parts, dim=pm.expert_tp_split[name])
    return g


def case_config(name: str) -> tuple[ParallelConfig, ModelConfig, int, int]:
    """(layout, model, grad_accum, pipeline micro-batches per pass) of case `name`."""
    layout, moe_changes, grad_accum = CASES[name]
    pcfg = ParallelConfig(**layout)
    model_fields = {f.name for f in fields(ModelConfig)} - {"moe"}  # the rest are MoE fields
    model_changes = {k: v for k, v in moe_changes.items() if k in model_fields}
    moe_only = {k: v for k, v in moe_changes.items() if k not in model_fields}
    model_cfg = MODEL.replace(moe=replace(MODEL.moe, **moe_only), **model_changes)
    return pcfg, model_cfg, grad_accum, pcfg.pipeline_chunks


def reference_args(name: str) -> tuple:
    """The arguments of `reference` for case `name`: everything its one process depends on, so
    cases with equal arguments share one reference (dp matters only to the global-batch loss)."""
    pcfg, model_cfg, grad_accum, mb = case_config(name)
    dp = pcfg.dp if model_cfg.moe.aux_loss_type == "global_batch" else 1
    return model_cfg, pcfg.dp * grad_accum * mb, name in ADAMW, dp, name in PACKED, name in MLM


def shared_references(names: list[str]) -> dict[tuple, dict]:
    """{reference_args: reference} for the cases `names`, each distinct reference computed once in
    the launch, by one rank (round robin), and sent to every rank; a reference that raised is
    {"error": ...}, reported by the cases that need it."""
    keys = list(dict.fromkeys(reference_args(n) for n in names))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {}
    for i in range(rank, len(keys), world):
        try:
            mine[i] = reference(*keys[i])
        except Exception as e:  # the cases that need it fail with this message, the others run
            mine[i] = {"error": f"reference: {type(e).__name__}: {e}"[:500]}
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return {keys[i]: ref for part in parts for i, ref in part.items()}


def mesh_for(pcfg: ParallelConfig, meshes: dict[tuple, ParallelMesh]) -> ParallelMesh:
    """A mesh for `pcfg`, one per mesh shape in the launch, reused by each case of that shape.

    Why not a new one per case: a gloo group costs a rendezvous to make and keeps a thread polling
    for as long as it lives (~0.1 core per rank for ~130 groups), and groups cannot be destroyed
    between cases: DTensor's planning caches hold meshes by value, so a later equal mesh would be
    handed a destroyed group."""
    shape = mesh_shape(pcfg)
    if shape not in meshes:
        meshes[shape] = build_mesh(pcfg, dist.get_world_size())
    return ParallelMesh(meshes[shape].mesh, pcfg, meshes[shape].flat)


def run_case(name: str, ref: dict, mesh: ParallelMesh) -> dict:
    """Train case `name` on `mesh` and compare it with its one-process reference `ref`."""
    if "error" in ref:
        raise RuntimeError(ref["error"])
    pcfg, model_cfg, grad_accum, mb = case_config(name)
    adamw = name in ADAMW
    packed = name in PACKED
    pm = parallelize(build_model(model_cfg, device="meta"), mesh, pcfg, seed=SEED, device=torch.device("cpu"),
                     cross_entropy=cross_entropy, activation_checkpoint=ACTIVATION_CHECKPOINT.get(name, "none"),
                     compile=name in COMPILED, microbatch_BS=(BATCH // (pcfg.dp * grad_accum * mb), SEQ),
                     packing=PACKING if packed else None, targets_given=name in MLM)
    owners = assign_owners(pm.named_parameters(), mesh, pm.expert_sharded) if pcfg.dp_mode == "zero1" else None
    opt = make_optimizer(pm.named_parameters(), adamw, owners)
    worst = {"ce": 0.0, "aux": 0.0, "grad": 0.0, "mtp": 0.0}
    counts_ok = True
    dp_rank = mesh.rank("dp")
    # Pipelines: each stage runs once per micro-batch, never on placeholders to learn shapes, on
    # the first step and after every switch between evaluation and training (one per step here).
    forwards = [0]
    for m in pm.modules if pcfg.pp > 1 else ():
        m.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    def one_forward_per_micro_batch() -> bool:
        ran, forwards[0] = forwards[0], 0
        return pcfg.pp == 1 or ran == len(pm.modules) * grad_accum * mb

    forwards_ok, eval_err = True, 0.0
    frames_after_first = None  # compiled cases: frames Dynamo had compiled by the end of step 1
    for step, batch in enumerate(batches(packed, name in MLM)):
        if pcfg.pp > 1:
            # Before the step's update its validation CE is the reference's training CE (no
            # dropout, no jitter); a validation batch holds grad_accum pipeline passes.
            eval_ce, _ = pm.global_losses(pm.evaluate(pm.local_batch(batch), contextlib.nullcontext),
                                          torch.zeros(()))
            eval_err = max(eval_err, abs(eval_ce - ref["ce"][step]) / abs(ref["ce"][step]))
            forwards_ok &= one_forward_per_micro_batch()
        losses = pm.forward_backward(pm.local_batch(batch), grad_accum=grad_accum, autocast=contextlib.nullcontext)
        forwards_ok &= one_forward_per_micro_batch()
        norm = float(pm.clip_grad_norm_(float("inf")))
        ce, aux, mtp = pm.global_losses(losses.ce, losses.aux, losses.mtp)
        worst["ce"] = max(worst["ce"], abs(ce - ref["ce"][step]) / abs(ref["ce"][step]))
        worst["mtp"] = max(worst["mtp"], abs(mtp - ref["mtp"][step]) / max(abs(ref["mtp"][step]), 1e-12))
        worst["aux"] = max(worst["aux"], abs(aux - ref["aux"][step]) / max(abs(ref["aux"][step]), 1e-12))
        last_chunk = (dp_rank + 1) * grad_accum * mb - 1
        for layer, stats in losses.moe.items():
            counts_ok &= stats.counts_E.tolist() == ref["counts"][step][last_chunk][layer]
        if step == 0:
            want_norm = float(torch.stack([g.double().norm() for g in ref["grads"].values()]).norm())
            worst["grad"] = max(worst["grad"], abs(norm - want_norm) / want_norm)
            for pname, p in pm.named_parameters():
                want = ref["grads"][pname]
                got = full_grad(pm, pname, p)
                worst["grad"] = max(worst["grad"], float((got - want).abs().max() / want.abs().max().clamp_min(1e-12)))
        opt.step()
        opt.zero_grad()
        if step == 0:
            frames_after_first = counters["frames"]["total"]
        if model_cfg.moe.bias_update_rate > 0:
            update_expert_biases(pm.modules, mesh, model_cfg.n_layers + model_cfg.mtp_depth, model_cfg.moe.num_experts,
                                 torch.device("cpu"))
    state_ok = True
    if owners is not None:
        # Each parameter's AdamW moments live on exactly one rank of its copies, and no rank holds all.
        held = float(opt.state_elements())
        mine_if_whole = 2.0 * sum(p.numel() for g in opt.param_groups for p in g["params"])
        share = sum(2.0 * p.numel() / owners[id(p)].group_size for g in opt.param_groups for p in g["params"])
        sums = torch.tensor([held, share], dtype=torch.float64)
        dist.all_reduce(sums)
        state_ok = abs(sums[0] - sums[1]) < 0.5 and held < mine_if_whole
    # Steps 2 and 3 route differently (under ep: other row counts per rank, at times none) and
    # must run the graphs step 1 compiled, not compile new ones.
    recompiled = counters["frames"]["total"] - frames_after_first if name in COMPILED else 0
    bias_err = 0.0
    for layer, router in biased_routers(pm.modules).items():
        bias_err = max(bias_err, float((router.expert_bias_E - ref["bias"][layer]).abs().max()))
    if model_cfg.moe.bias_update_rate > 0 and not ref["bias"]:
        bias_err = float("inf")  # the reference has no biased router: the case tests nothing
    t = torch.tensor([worst["ce"], worst["aux"], worst["grad"], float(not counts_ok), bias_err, float(not state_ok),
                      eval_err, float(not forwards_ok), worst["mtp"], recompiled], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ce_err, aux_err, grad_err, counts_bad, bias_err, state_bad, eval_err, forwards_bad, mtp_err, recompiled = t.tolist()
    ok = (ce_err <= LOSS_RTOL and aux_err <= LOSS_RTOL and mtp_err <= LOSS_RTOL and grad_err <= GRAD_TOL
          and not counts_bad
          and bias_err <= BIAS_TOL and not state_bad and eval_err <= LOSS_RTOL and not forwards_bad and not recompiled)
    return {"case": name, "ok": ok, "ce_rel": ce_err, "aux_rel": aux_err, "mtp_rel": mtp_err, "grad_rel": grad_err,
            "counts_equal": not counts_bad, "bias_abs": bias_err, "optimizer_state_sharded": not state_bad,
            "eval_ce_rel": eval_err, "one_stage_forward_per_micro_batch": not forwards_bad,
            "frames_compiled_after_step_1": int(recompiled)}


def compile_cache_counts() -> torch.Tensor:
    """(hits, misses) of the compiled-graph caches, AOTAutograd's and Inductor's, in this process
    so far; a miss compiles the graph and writes it into the cache for the next launch."""
    sections = (counters["aot_autograd"], counters["inductor"])
    return torch.tensor([sum(n for c in sections for k, n in c.items() if k.endswith(end)) for end in ("_hit", "_miss")],
                        dtype=torch.float64)


def compile_cache_use(before: torch.Tensor) -> dict:
    """{"cache_hits", "cache_misses"} over every rank since `before` (compile_cache_counts)."""
    used = compile_cache_counts() - before
    dist.all_reduce(used)
    return {"cache_hits": int(used[0]), "cache_misses": int(used[1])}


def keyed_per_process(mesh) -> bool:
    """Whether compiled graphs that take `mesh` as an input (DTensor's graphs, under TP) are cached
    under keys no other process computes: torch 2.13's DeviceMesh pickles the Python hash it
    caches, and that differs between processes (hash(None) on Python 3.11, a string's hash under
    hash randomization). Such graphs compile again in every new process, as a restarted TP job's do."""
    return mesh.__getstate__().get("_hash") is not None


def main(names: list[str]) -> int:
    torch.set_num_threads(1)
    # A compiled case whose frames Dynamo gives up on (and runs eagerly) fails instead of passing.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    dist.init_process_group("gloo")
    failures = 0
    try:
        refs = shared_references(names)
        meshes: dict[tuple, ParallelMesh] = {}
        for name in names:
            t0 = time.perf_counter()
            try:
                if name in COMPILED:
                    # Each case's blocks are of another type (plain, FSDP-wrapped, pipeline stage):
                    # left in place, the frames compiled for earlier cases count toward the recompile
                    # limit, past which Dynamo would run this case's blocks eagerly, unnoticed.
                    torch._dynamo.reset()
                before = compile_cache_counts()
                pcfg = case_config(name)[0]
                mesh = mesh_for(pcfg, meshes)
                result = run_case(name, refs[reference_args(name)], mesh)
                if name in COMPILED:  # did it read its graphs from the caches or compile them?
                    result.update(compile_cache_use(before))
                    result["keyed_per_process"] = pcfg.tp > 1 and keyed_per_process(mesh.sub("tp"))
            except Exception as e:
                if dist.get_rank() == 0:
                    traceback.print_exc()
                result = {"case": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
                # Every rank reports (any of them may be the one that failed), rank 0 on stdout.
                print(json.dumps(result), flush=True, file=sys.stdout if dist.get_rank() == 0 else sys.stderr)
                return 1
            result["seconds"] = round(time.perf_counter() - t0, 2)
            failures += not result["ok"]
            if dist.get_rank() == 0:
                print(json.dumps(result), flush=True)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

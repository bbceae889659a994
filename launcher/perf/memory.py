"""Memory per rank of a parallel layout, from a ModelConfig and a ParallelConfig alone: weights,
grads, AdamW state and the activations saved for backward on the most loaded rank. Plain Python:
nothing here builds a model or touches a device.

Legend: L layers, D model dim, H query heads, G key/value heads, Dh head dim, F dense FFN hidden dim,
Fe expert hidden dim, Fs shared-expert hidden dim, E experts, K top-k, V vocabulary, S sequence length.

Weights: layers are split evenly over `pp` stages; the first holds the embedding, the last the head
and the multi-token-prediction modules (model/mtp.py), with a copy of the embedding under pp > 1.
Dense weights are split by `tp`; routed expert weights by `ep × etp` (etp = 1 replicates them over
tp). The ranks holding the same weights are the dp × cp ones (experts: dp / ep × cp); how much of
that copy a rank keeps depends on `dp_mode`:
  fsdp   weights, grads and optimizer state split over all of them (ZeRO-3); but under pp > 1 the
         pipeline's micro-batches accumulate the grads unsharded until the schedule's step ends
         (`gradients_held`)
  hsdp   the same inside a shard group of `dp_shard` data-parallel ranks × cp
  zero1  weights and grads whole, optimizer state split over all of them (ZeRO-1)
  ddp    everything whole

Activations: those of the micro-batches in flight (GPipe keeps all of them on the first stage,
1F1B-style schedules at most pp) of S / cp tokens per sequence, plus the K/V gathered from the other
cp ranks, plus the fp32 logits and their gradient on the last stage. Under full activation
checkpointing a block keeps only its input (D per token, split by tp under sequence parallel) and
one block at a time holds everything while it is recomputed. Under expert parallelism (ep > 1) the
routed rows are the busiest rank's: the mean times the expert imbalance (its max / mean routes;
capped by moe.capacity_factor when that is set). Fragmentation and communication buffers are not
included (the planner adds the buffers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetron.launcher.perf.flops import layer_counts, parameter_counts
from moetron.model.config import ModelConfig
from moetron.parallel.config import ParallelConfig

SINGLE_RANK = ParallelConfig()


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes held by the most loaded rank of a layout."""

    weights: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations

    def to_dict(self) -> dict[str, int]:
        # Not dataclasses.asdict, which deep-copies each field: the planner asks this of ~10^5 layouts.
        return {**vars(self), "total": self.total}


def activation_elements_per_token(cfg: ModelConfig, par: ParallelConfig = SINGLE_RANK, *, seq_len: int = 0,
                                  selective: bool = False, expert_imbalance: float = 1.0) -> dict[str, float]:
    """Elements saved for backward per token by one dense and one MoE layer (Korthikanti et al.
    2022, counted for this implementation). Head- and hidden-sized tensors are split by TP (a routed
    expert's hidden ones by etp: 1 keeps them whole on every tp rank); D-sized ones only under
    sequence parallelism. Eager attention also keeps the S-long scores
    and probabilities of every head. `selective` (activation checkpointing that keeps matmul
    outputs only): an FFN keeps its up-projections' outputs, not the activation's; the router its
    logits, not its probabilities. `expert_imbalance`: routes held by the rank whose experts are
    busiest over the mean (1 = balanced; under expert parallelism that rank holds the most)."""
    D, H, G, Dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_head
    tp = par.tp
    d_split = tp if par.sequence_parallel else 1
    # Two norm inputs and outputs: D each.
    residual = 4 * D / d_split
    # q, k, v, the attention output and its copy as W_o's input.
    attention = (3 * H * Dh + 2 * G * Dh) / tp
    if cfg.mla.enabled:  # q and the expanded k (Dq), v, the output and its copy (Dv); the latents
        mla = cfg.mla  # and their norms' outputs, and the rope key, whole on every tp rank
        attention = (H * (2 * mla.qk_head_dim + 3 * mla.v_head_dim) / tp
                     + 2 * (mla.kv_lora_rank + mla.q_lora_rank) + mla.qk_rope_head_dim)
    if cfg.attention == "eager":
        attention += 2 * H * seq_len / tp
    # SwiGLU keeps gate, up, silu(gate) and their product; GeLU/ReLU the pre- and post-activation.
    hidden = 4 if cfg.activation == "swiglu" else 2
    if selective:
        hidden //= 2  # gate and up (or the pre-activation); the rest is recomputed
    dense = hidden * cfg.d_ff / tp
    moe = cfg.moe
    routed = 0.0
    if moe.enabled:
        # Router input and probabilities in fp32 (counted double), then per route: the
        # dispatched row, the expert's hidden tensors and its output row.
        router = (D + moe.num_experts) * (1 if selective else 2)
        routed = router + moe.top_k * (2 * D + hidden * cfg.d_expert_ff / par.etp) * expert_imbalance
        routed += hidden * moe.shared_expert_d_ff / tp
    return {"dense_layer": residual + attention + dense, "moe_layer": residual + attention + routed}


def _gathered_kv_width(cfg: ModelConfig, tp: int) -> float:
    """Elements a rank keeps per position it gathers under context parallelism: K and V of its
    heads; under MLA the latent and rope key, and the keys and values expanded from them."""
    if not cfg.mla.enabled:
        return 2 * cfg.kv_heads * cfg.dim_head / tp
    mla = cfg.mla
    return mla.kv_lora_rank + mla.qk_rope_head_dim + cfg.n_heads * (mla.qk_head_dim + mla.v_head_dim) / tp


def busiest_rank_imbalance(cfg: ModelConfig, ep: int, expert_imbalance: float) -> float:
    """Routed rows on the busiest expert-parallel rank over the mean: `expert_imbalance`, at most
    moe.capacity_factor when capacity is set, and 1 without expert parallelism (every rank then
    holds every expert, so each keeps its own tokens' routes)."""
    if ep == 1 or not cfg.moe.enabled:
        return 1.0
    return min(expert_imbalance, cfg.moe.capacity_factor or expert_imbalance)


def microbatches_in_flight(par: ParallelConfig) -> int:
    """Micro-batches whose activations the first pipeline stage holds at once: GPipe runs every
    forward before any backward; 1F1B-style schedules start backward after at most pp."""
    if par.pp == 1:
        return 1
    return par.microbatches if par.schedule == "gpipe" else min(par.pp, par.microbatches)


def parameters_held(cfg: ModelConfig, par: ParallelConfig) -> tuple[float, float]:
    """(parameters whose weights and grads the most loaded rank keeps, parameters whose optimizer
    state it keeps); see the module docstring for the split by dp_mode."""
    total, embedding, expert, mtp, mtp_expert = parameter_counts(cfg)
    head = 0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size
    stage_layers = (total - embedding - expert - head - mtp) / par.pp
    # The last stage's MTP modules; under pp > 1 with their copy of the embedding.
    tail = head + (mtp - mtp_expert) + (embedding if mtp and par.pp > 1 else 0)
    if par.pp == 1:
        dense_rank = stage_layers + embedding + tail
    else:
        dense_rank = stage_layers + max(embedding, tail)
    dense_rank /= par.tp
    expert_rank = (expert / par.pp + mtp_expert) / (par.ep * par.etp)
    shard, cp = par.shard_group, par.cp
    held = dense_rank + expert_rank
    if par.dp_mode in ("fsdp", "hsdp"):
        held = dense_rank / (shard * cp) + expert_rank / (max(shard // par.ep, 1) * cp)
    if par.dp_mode == "zero1":
        return held, dense_rank / (par.dp * cp) + expert_rank / (max(par.dp // par.ep, 1) * cp)
    return held, held


def gradients_held(cfg: ModelConfig, par: ParallelConfig, chunks: int = 1) -> float:
    """Parameters whose gradients the most loaded rank keeps during a step of `chunks` forward and
    backward passes (grad_accum × pipeline micro-batches). Its weights' share, except under fsdp and
    hsdp in a pipeline of more than one micro-batch: torch's schedules skip the reduce-scatter in
    every backward and run it when their step ends (`perform_reduce_grad`), so the stage's gradients
    accumulate whole meanwhile, as under ddp (bench/plan_check.py, pp2_dp2_1f1b4: 113 MB predicted
    by sharded gradients, 140 MB measured). Gradient accumulation alone keeps them sharded
    (parallel/data_parallel.py's `set_gradient_sync` reduce-scatters every micro-batch)."""
    if chunks > 1 and par.pp > 1 and par.dp_mode in ("fsdp", "hsdp"):
        par = replace(par, dp_mode="ddp")
    return parameters_held(cfg, par)[0]


def activation_bytes_held(cfg: ModelConfig, par: ParallelConfig, *, seq_len: int, micro_batch: int,
                          activation_checkpoint: bool | str = False, activation_bytes: int = 2,
                          expert_imbalance: float = 1.0) -> float:
    """Bytes of saved activations on the most loaded pipeline stage (see the module docstring)."""
    pp, tp, cp = par.pp, par.tp, par.cp
    n_dense, n_moe = layer_counts(cfg)
    mode = {True: "full", False: "none"}.get(activation_checkpoint, activation_checkpoint)
    imbalance = busiest_rank_imbalance(cfg, par.ep, expert_imbalance)
    per_token = activation_elements_per_token(cfg, par, seq_len=seq_len, selective=mode == "selective",
                                              expert_imbalance=imbalance)
    layer_elements = (n_dense * per_token["dense_layer"] + n_moe * per_token["moe_layer"]) / pp
    if mode == "full":
        d_split = tp if par.sequence_parallel else 1
        layer_elements = cfg.n_layers / pp * cfg.d_model / d_split + max(
            per_token["dense_layer"] if n_dense else 0.0, per_token["moe_layer"] if n_moe else 0.0)
    tokens = seq_len // cp * micro_batch
    # Context parallelism keeps the K/V of the other cp ranks' positions for backward.
    layer_elements += (cfg.n_layers / pp) * _gathered_kv_width(cfg, tp) * (seq_len - seq_len // cp) / max(
        seq_len // cp, 1)
    # fp32 logits and their gradient, once more per MTP depth.
    logits = tokens * cfg.vocab_size / tp * 2 * 4 * (1 + cfg.mtp_depth)
    first = layer_elements * tokens * microbatches_in_flight(par) * activation_bytes
    last = (layer_elements + _mtp_elements(cfg, par, per_token, mode)) * tokens * activation_bytes + logits
    return max(first, last) if pp > 1 else last


def _mtp_elements(cfg: ModelConfig, par: ParallelConfig, per_token: dict[str, float], mode: str) -> float:
    """Elements per token the MTP modules save on the last stage: one layer each (its block, as
    the decoder's layer n_layers + k − 1 is built), only its input under full checkpointing."""
    layers = range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth)
    if mode == "full":
        return len(layers) * cfg.d_model / (par.tp if par.sequence_parallel else 1)
    return sum(per_token["moe_layer" if cfg.is_moe_layer(i) else "dense_layer"] for i in layers)


def memory_per_rank(cfg: ModelConfig, par: ParallelConfig = SINGLE_RANK, *, seq_len: int, micro_batch: int,
                    activation_checkpoint: bool | str = False, param_bytes: int = 4, grad_bytes: int = 4,
                    optimizer_bytes: int = 8, activation_bytes: int = 2,
                    expert_imbalance: float = 1.0, chunks: int = 1) -> MemoryEstimate:
    """Weights, grads, AdamW state (two fp32 moments) and saved activations on the most loaded rank
    of layout `par`, for micro-batches of `micro_batch` sequences of `seq_len` tokens.
    `activation_checkpoint`: "none", "selective", "full" (True/False: full/none).
    `expert_imbalance`: the busiest expert-parallel rank's routes over the mean (1 = balanced).
    `chunks`: forward and backward passes per step, grad_accum × pipeline micro-batches (`gradients_held`)."""
    held, optimizer_held = parameters_held(cfg, par)
    activations = activation_bytes_held(cfg, par, seq_len=seq_len, micro_batch=micro_batch,
                                        activation_checkpoint=activation_checkpoint,
                                        activation_bytes=activation_bytes, expert_imbalance=expert_imbalance)
    grads = gradients_held(cfg, par, chunks) * grad_bytes
    in_flight = microbatches_in_flight(par)
    if grads > held * grad_bytes and in_flight == par.microbatches:
        # Whole gradients of a pipeline stage (see gradients_held) when every micro-batch's forward
        # runs before the first backward (GPipe, or no more micro-batches than stages): the peak of
        # activations comes before any gradient, and the first backward frees a micro-batch's
        # activations as the whole gradients appear.
        grads = max(held * grad_bytes, grads - activations / in_flight)
    return MemoryEstimate(weights=int(held * param_bytes), grads=int(grads),
                          optimizer=int(optimizer_held * optimizer_bytes), activations=int(activations))

"""Analytic accounting from a ModelConfig alone: parameters, FLOPs per token by component, KV cache,
and memory per rank. Plain Python: nothing here builds a model or touches a device.

Legend: L layers, D model dim, H query heads, G key/value heads, Dh head dim, F dense FFN hidden dim,
Fe expert hidden dim, Fs shared-expert hidden dim, E experts, K top-k, V vocabulary, S sequence length.

The convention (printed by `moetron flops`):

- A matmul of (m×k)·(k×n) is 2·m·k·n FLOPs. A training step runs each weight matmul three times
  (forward, input gradient, weight gradient), so a weight a token passes through costs 6 FLOPs.
- `params_active` counts the weights of the matmuls one token passes through: per layer W_q, W_k,
  W_v, W_o (GQA-sized), then the dense FFN, or the router plus K experts plus any shared expert;
  then the LM head. Embedding lookups, norms and biases are not matmuls and are excluded.
  MFU built on total instead of active parameters overstates an MoE model's work E/K-fold.
- `flops_per_token` = 6·params_active + the attention scores (QKᵀ and PV) over the full S×S square:
  12·L·H·Dh·S per token (PaLM, appendix B). This is the MFU numerator. A causal kernel skips the
  masked half, so `attention_flops_per_token_causal` (half of it, Megatron-LM's convention) is
  reported beside it; Megatron also leaves the router out, which we count.
- Elementwise work (norms, activations, softmax, RoPE, residual adds, the optimizer) is O(D) per
  token and not counted, as in every peer's formula.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from moetron.model.config import ModelConfig

COMPONENTS = ("attention_projections", "attention_scores", "dense_ffn", "router", "experts",
              "shared_expert", "lm_head")
ATTENTION_COMPONENTS = ("attention_scores",)
CONVENTION = ("6 FLOPs per active weight per token (fwd + input grad + weight grad); attention "
              "scores over the full SxS square (PaLM); causal half shown beside; router and LM head "
              "counted; embeddings, norms, biases, elementwise ops not counted")


# ---------------------------------------------------------------------------------------------
# Parameters


@functools.lru_cache(maxsize=64)
def _layer_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(dense layers, MoE layers); cached, as the layout planner asks it thousands of times."""
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    return cfg.n_layers - moe, moe


def _ffn_matrices(cfg: ModelConfig) -> int:
    """SwiGLU has a gate, an up and a down projection; ReLU and GeLU only up and down."""
    return 3 if cfg.activation == "swiglu" else 2


def _norm_params(cfg: ModelConfig) -> int:
    return cfg.d_model * (2 if cfg.norm == "layernorm" else 1)


def matmul_params(cfg: ModelConfig, *, active: bool = True) -> dict[str, int]:
    """Weights of the matmuls per component, summed over layers. `active`: the K routed experts
    one token passes through; otherwise all E experts. Attention scores have no weights (0)."""
    D, H, G, Dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_head
    n_dense, n_moe = _layer_counts(cfg)
    mats, moe = _ffn_matrices(cfg), cfg.moe
    experts = moe.top_k if active else moe.num_experts
    return {
        "attention_projections": cfg.n_layers * (2 * D * H * Dh + 2 * D * G * Dh),
        "attention_scores": 0,
        "dense_ffn": n_dense * mats * D * cfg.d_ff,
        "router": n_moe * D * moe.num_experts,
        "experts": n_moe * experts * mats * D * cfg.d_expert_ff,
        "shared_expert": n_moe * mats * D * moe.shared_expert_d_ff,
        "lm_head": D * cfg.vocab_size,
    }


def params_embedding(cfg: ModelConfig) -> int:
    """Token embedding, plus the learned position table when there is one."""
    learned = cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0
    return cfg.vocab_size * cfg.d_model + learned


def params_position(cfg: ModelConfig) -> int:
    """Parameters the position encoding adds: learned's n_max × D table, T5's buckets × H bias
    table (one for all layers); sinusoidal, RoPE and ALiBi are computed, not learned."""
    if cfg.position == "learned":
        return cfg.max_seq_len * cfg.d_model
    if cfg.position == "t5":
        return cfg.t5_num_buckets * cfg.n_heads
    return 0


def params_active(cfg: ModelConfig) -> int:
    """Weights of the matmuls one token passes through (see the module docstring)."""
    return sum(matmul_params(cfg, active=True).values())


def params_total(cfg: ModelConfig) -> int:
    """Every parameter the model holds, all experts included; equals sum(p.numel()) of the built model."""
    D, H, G, Dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_head
    n_dense, n_moe = _layer_counts(cfg)
    mats, moe = _ffn_matrices(cfg), cfg.moe
    weights = matmul_params(cfg, active=False)
    if cfg.tie_embeddings:
        weights["lm_head"] = 0  # the head is the embedding matrix
    biases = 0
    if cfg.bias:
        ffn_bias = mats - 1  # the gate (and up) projections have F-sized biases, the down one D
        biases += cfg.n_layers * (H * Dh + 2 * G * Dh + D)
        biases += n_dense * (ffn_bias * cfg.d_ff + D)
        if moe.shared_expert_d_ff:
            biases += n_moe * (ffn_bias * moe.shared_expert_d_ff + D)
    norms = (2 * cfg.n_layers + (cfg.norm_position == "pre")) * _norm_params(cfg)
    t5_table = params_position(cfg) if cfg.position == "t5" else 0  # learned's is in params_embedding
    return params_embedding(cfg) + sum(weights.values()) + biases + norms + t5_table


# ---------------------------------------------------------------------------------------------
# FLOPs per token (training: forward + backward)


def flops_per_token_6n(cfg: ModelConfig) -> int:
    return 6 * params_active(cfg)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """QKᵀ and PV over the full S×S square, forward and backward: 12·L·H·Dh·S (PaLM)."""
    return 12 * cfg.n_layers * cfg.n_heads * cfg.dim_head * seq_len


def attention_flops_per_token_causal(cfg: ModelConfig, seq_len: int) -> int:
    """The unmasked half of the square, as a causal kernel computes it (Megatron-LM)."""
    return attention_flops_per_token(cfg, seq_len) // 2


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """The MFU numerator: 6·params_active + full-square attention."""
    return flops_per_token_6n(cfg) + attention_flops_per_token(cfg, seq_len)


def flops_by_component(cfg: ModelConfig, seq_len: int, *, causal: bool = False) -> dict[str, int]:
    """Training FLOPs per token of each component, in COMPONENTS order; sums to `flops_per_token`
    (or to its causal variant)."""
    out = {name: 6 * n for name, n in matmul_params(cfg, active=True).items()}
    out["attention_scores"] = (attention_flops_per_token_causal if causal else attention_flops_per_token)(cfg, seq_len)
    return out


def training_flops(cfg: ModelConfig, tokens: int, seq_len: int, *, with_attention: bool = True) -> float:
    """FLOPs to train on `tokens` tokens; without attention it is the 6·N·tokens rule of thumb."""
    per_token = flops_per_token(cfg, seq_len) if with_attention else flops_per_token_6n(cfg)
    return float(per_token) * tokens


def attention_crossover_seq_len(cfg: ModelConfig, *, causal: bool) -> float:
    """Sequence length at which the attention scores cost as much as the dense FFN."""
    per_position = attention_flops_per_token(cfg, 1) / (2 if causal else 1)
    return 6 * _ffn_matrices(cfg) * cfg.d_model * cfg.d_ff * cfg.n_layers / per_position


# ---------------------------------------------------------------------------------------------
# KV cache


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_element: int = 2) -> int:
    """Keys and values of every layer for one position: 2·L·G·Dh·bytes (bf16 by default)."""
    return 2 * cfg.n_layers * cfg.kv_heads * cfg.dim_head * bytes_per_element


def kv_cache_bytes(cfg: ModelConfig, seq_len: int, batch: int = 1, bytes_per_element: int = 2) -> int:
    return kv_cache_bytes_per_token(cfg, bytes_per_element) * seq_len * batch


# ---------------------------------------------------------------------------------------------
# Memory per rank


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
        return {**asdict(self), "total": self.total}


def activation_elements_per_token(cfg: ModelConfig, *, tp: int = 1, sequence_parallel: bool = False,
                                  flash_attention: bool = True, seq_len: int = 0, etp: int = 1,
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
    d_split = tp if sequence_parallel else 1
    # Two norm inputs and outputs: D each.
    residual = 4 * D / d_split
    # q, k, v, the attention output and its copy as W_o's input.
    attention = (3 * H * Dh + 2 * G * Dh) / tp
    if not flash_attention:
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
        routed = router + moe.top_k * (2 * D + hidden * cfg.d_expert_ff / etp) * expert_imbalance
        routed += hidden * moe.shared_expert_d_ff / tp
    return {"dense_layer": residual + attention + dense, "moe_layer": residual + attention + routed}


def busiest_rank_imbalance(cfg: ModelConfig, ep: int, expert_imbalance: float) -> float:
    """Routed rows on the busiest expert-parallel rank over the mean: `expert_imbalance`, at most
    moe.capacity_factor when capacity is set, and 1 without expert parallelism (every rank then
    holds every expert, so each keeps its own tokens' routes)."""
    if ep == 1 or not cfg.moe.enabled:
        return 1.0
    return min(expert_imbalance, cfg.moe.capacity_factor or expert_imbalance)


def memory_per_rank(cfg: ModelConfig, *, seq_len: int, micro_batch: int, pp: int = 1, tp: int = 1, ep: int = 1,
                    dp: int = 1, cp: int = 1, etp: int = 1, dp_mode: str = "fsdp", dp_shard: int = 0,
                    sequence_parallel: bool = False, microbatches_in_flight: int | None = None,
                    flash_attention: bool = True, activation_checkpoint: bool | str = False,
                    param_bytes: int = 4, grad_bytes: int = 4,
                    optimizer_bytes: int = 8, activation_bytes: int = 2,
                    expert_imbalance: float = 1.0) -> MemoryEstimate:
    """Weights, grads, AdamW state (two fp32 moments) and saved activations on the most loaded rank.

    Layers are split evenly over `pp` stages; the first holds the embedding, the last the head.
    Dense weights are split by `tp`; routed expert weights by `ep × etp` (etp = 1 replicates them
    over tp). The ranks holding the same weights are the dp × cp ones (experts: dp / ep × cp);
    how much of that copy a rank keeps depends on `dp_mode`:
      fsdp   weights, grads and optimizer state split over all of them (ZeRO-3)
      hsdp   the same inside a shard group of `dp_shard` data-parallel ranks × cp
      zero1  weights and grads whole, optimizer state split over all of them (ZeRO-1)
      ddp    everything whole
    Activations are those of `microbatches_in_flight` micro-batches (1F1B keeps `pp` on the first
    stage) of S / cp tokens per sequence, plus the K/V gathered from the other cp ranks, plus the
    fp32 logits and their gradient on the last stage. With `activation_checkpoint` a block keeps
    only its input (D per token, split by tp under sequence parallel) and one block at a time holds
    everything while it is recomputed. Fragmentation and communication buffers are not included.
    Under expert parallelism (ep > 1) the routed rows are the busiest rank's: the mean times
    `expert_imbalance` (its max / mean routes; capped by moe.capacity_factor when that is set).
    """
    n_dense, n_moe = _layer_counts(cfg)
    total_weights = matmul_params(cfg, active=False)
    expert = total_weights["experts"]
    dense_layers = params_total(cfg) - params_embedding(cfg) - expert
    head = 0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size
    dense_layers -= head
    stage_layers = dense_layers / pp
    if pp == 1:
        dense_rank = stage_layers + params_embedding(cfg) + head
    else:
        dense_rank = stage_layers + max(params_embedding(cfg), head)
    dense_rank /= tp
    expert_rank = expert / pp / (ep * etp)
    shard = dp_shard if dp_mode == "hsdp" and dp_shard else dp
    dense_split, expert_split = shard * cp, max(shard // ep, 1) * cp
    held = dense_rank + expert_rank
    if dp_mode in ("fsdp", "hsdp"):
        held = dense_rank / dense_split + expert_rank / expert_split
    optimizer_held = held
    if dp_mode == "zero1":
        optimizer_held = dense_rank / (dp * cp) + expert_rank / (max(dp // ep, 1) * cp)

    mode = {True: "full", False: "none"}.get(activation_checkpoint, activation_checkpoint)
    imbalance = busiest_rank_imbalance(cfg, ep, expert_imbalance)
    per_token = activation_elements_per_token(cfg, tp=tp, sequence_parallel=sequence_parallel,
                                              flash_attention=flash_attention, seq_len=seq_len, etp=etp,
                                              selective=mode == "selective", expert_imbalance=imbalance)
    layer_elements = (n_dense * per_token["dense_layer"] + n_moe * per_token["moe_layer"]) / pp
    if mode == "full":
        d_split = tp if sequence_parallel else 1
        layer_elements = cfg.n_layers / pp * cfg.d_model / d_split + max(
            per_token["dense_layer"] if n_dense else 0.0, per_token["moe_layer"] if n_moe else 0.0)
    tokens = seq_len // cp * micro_batch
    # Context parallelism keeps the K/V of the other cp ranks' positions for backward.
    layer_elements += (cfg.n_layers / pp) * 2 * cfg.kv_heads * cfg.dim_head / tp * (seq_len - seq_len // cp) / max(
        seq_len // cp, 1)
    in_flight = pp if microbatches_in_flight is None else microbatches_in_flight
    logits = tokens * cfg.vocab_size / tp * 2 * 4  # fp32 logits and their gradient
    first = layer_elements * tokens * in_flight * activation_bytes
    last = layer_elements * tokens * activation_bytes + logits
    activations = max(first, last) if pp > 1 else first + logits
    return MemoryEstimate(weights=int(held * param_bytes), grads=int(held * grad_bytes),
                          optimizer=int(optimizer_held * optimizer_bytes), activations=int(activations))


# ---------------------------------------------------------------------------------------------
# Everything at once, for `moetron flops` and the dashboards


def accounting(cfg: ModelConfig, *, seq_len: int, batch: int = 1, kv_bytes_per_element: int = 2,
               memory: MemoryEstimate | None = None) -> dict:
    """The fields of `moetron flops --json`: parameters, FLOPs per token (both attention
    conventions), per-component breakdown, KV cache, and the memory estimate if given."""
    out = {
        "convention": CONVENTION,
        "seq_len": seq_len,
        "batch": batch,
        "params_total": params_total(cfg),
        "params_embedding": params_embedding(cfg),
        "params_active": params_active(cfg),
        "flops_per_token_6n": flops_per_token_6n(cfg),
        "attention_flops_per_token": attention_flops_per_token(cfg, seq_len),
        "attention_flops_per_token_causal": attention_flops_per_token_causal(cfg, seq_len),
        "flops_per_token": flops_per_token(cfg, seq_len),
        "flops_per_token_causal": flops_per_token_6n(cfg) + attention_flops_per_token_causal(cfg, seq_len),
        "flops_per_step": flops_per_token(cfg, seq_len) * seq_len * batch,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg, kv_bytes_per_element),
        "kv_cache_bytes": kv_cache_bytes(cfg, seq_len, batch, kv_bytes_per_element),
        "components": {
            name: {"params": matmul_params(cfg, active=False)[name],
                   "params_active": matmul_params(cfg, active=True)[name],
                   "flops_per_token": flops_by_component(cfg, seq_len)[name],
                   "flops_per_token_causal": flops_by_component(cfg, seq_len, causal=True)[name]}
            for name in COMPONENTS
        },
    }
    if memory is not None:
        out["memory_per_rank"] = memory.to_dict()
    return out


def human(n: float, unit: str = "") -> str:
    """1234567 → '1.23 M'; decimal prefixes, as GB in the KV-cache figures people quote."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


def summary_rows(acct: dict) -> list[tuple[str, str, str]]:
    """(field, value, note) rows of an `accounting` result, for the CLI table and TensorBoard text."""
    S, B = acct["seq_len"], acct["batch"]
    rows = [
        ("params_total", human(acct["params_total"]), "every parameter, all experts"),
        ("params_embedding", human(acct["params_embedding"]), "token (+ learned position) embedding"),
        ("params_active", human(acct["params_active"]), "matmul weights one token passes through"),
        ("flops_per_token_6n", human(acct["flops_per_token_6n"], "FLOP"), "6 × params_active"),
        ("attention_flops_per_token", human(acct["attention_flops_per_token"], "FLOP"),
         f"12·L·H·Dh·S at S={S}, full square (PaLM)"),
        ("attention_flops_per_token_causal", human(acct["attention_flops_per_token_causal"], "FLOP"),
         "half: the unmasked triangle (Megatron)"),
        ("flops_per_token", human(acct["flops_per_token"], "FLOP"), "6N + full-square attention: the MFU numerator"),
        ("flops_per_token_causal", human(acct["flops_per_token_causal"], "FLOP"), "6N + causal attention"),
        ("flops_per_step", human(acct["flops_per_step"], "FLOP"), f"{B} × {S} tokens"),
        ("kv_cache_bytes_per_token", human(acct["kv_cache_bytes_per_token"], "B"), "2·L·G·Dh·bytes"),
        ("kv_cache_bytes", human(acct["kv_cache_bytes"], "B"), f"batch {B} × {S} positions"),
    ]
    for key, value in acct.get("memory_per_rank", {}).items():
        rows.append((f"memory_per_rank.{key}", human(value, "B"), "estimate, most loaded rank"))
    return rows

"""Analytic accounting from a ModelConfig alone: parameters, FLOPs per token by component and KV
cache (memory per rank of a layout is launcher/perf/memory.py). Plain Python: nothing here builds a
model or touches a device.

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
def layer_counts(cfg: ModelConfig) -> tuple[int, int]:
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
    n_dense, n_moe = layer_counts(cfg)
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
    n_dense, n_moe = layer_counts(cfg)
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
    # qk-norm gains (always RMSNorm): Dh each per head, or the whole q and k widths.
    qk_norms = {"none": 0, "head": 2 * Dh, "projection": (H + G) * Dh}[cfg.qk_norm]
    norms += cfg.n_layers * qk_norms
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
# Everything at once, for `moetron flops` and the dashboards


def accounting(cfg: ModelConfig, *, seq_len: int, batch: int = 1, kv_bytes_per_element: int = 2,
               memory: dict[str, int] | None = None) -> dict:
    """The fields of `moetron flops --json`: parameters, FLOPs per token (both attention
    conventions), per-component breakdown, KV cache, and the memory estimate if given (bytes by
    part, as `MemoryEstimate.to_dict()` of launcher/perf/memory.py gives them)."""
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
        out["memory_per_rank"] = dict(memory)
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

"""Analytic accounting from a ModelConfig alone: parameters, FLOPs per token by component and KV
cache (memory per rank of a layout is launcher/perf/memory.py). Plain Python: nothing here builds a
model or touches a device.

Legend: L layers, D model dim, H query heads, G key/value heads, Dh head dim, F dense FFN hidden dim,
Fe expert hidden dim, Fs shared-expert hidden dim, E experts, K top-k, V vocabulary, S sequence length.

The convention (printed by `moetron flops`):

- A matmul of (m×k)·(k×n) is 2·m·k·n FLOPs. A training step runs each weight matmul three times
  (forward, input gradient, weight gradient), so a weight a token passes through costs 6 FLOPs.
- `params_active` counts the weights of the matmuls one token passes through: per layer W_q, W_k,
  W_v, W_o (GQA-sized; under MLA W_q or W_qa·W_qb, W_kva, W_kvb, W_o), then the dense FFN, or the
  router plus K experts plus any shared expert; then the LM head. Embedding lookups, norms and
  biases are not matmuls and are excluded. MFU built on total instead of active parameters
  overstates an MoE model's work E/K-fold.
- `flops_per_token` = 6·params_active + the attention scores (QKᵀ and PV) over the full S×S square:
  12·L·H·Dh·S per token (PaLM, appendix B; 6·L·H·(Dq + Dv)·S under MLA). This is the MFU
  numerator. A causal kernel skips the masked half, so `attention_flops_per_token_causal` (half
  of it, Megatron-LM's convention) is reported beside it; Megatron also leaves the router out,
  which we count.
- Elementwise work (norms, activations, softmax, RoPE, residual adds, the optimizer) is O(D) per
  token and not counted, as in every peer's formula.
- Multi-token prediction (model.mtp_depth, model/mtp.py) is its own component, "mtp": per depth one
  more block (its matmuls and attention scores), eh_proj, and one more pass through the shared LM
  head. `params_total` includes its parameters (the shared embedding and head counted once);
  `params_active` and `flops_per_token_6n` are the main model's (see "Multi-token prediction" below).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from moetron.model.config import ModelConfig

COMPONENTS = ("attention_projections", "attention_scores", "dense_ffn", "router", "experts",
              "shared_expert", "lm_head", "mtp")
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
    D = cfg.d_model
    n_dense, n_moe = layer_counts(cfg)
    mats, moe = _ffn_matrices(cfg), cfg.moe
    experts = moe.top_k if active else moe.num_experts
    return {
        "attention_projections": cfg.n_layers * _attention_weights(cfg),
        "attention_scores": 0,
        "dense_ffn": n_dense * mats * D * cfg.d_ff,
        "router": n_moe * D * moe.num_experts,
        "experts": n_moe * experts * mats * D * cfg.d_expert_ff,
        "shared_expert": n_moe * (mats * D * moe.shared_expert_d_ff + D * moe.shared_expert_gate),
        "lm_head": D * cfg.vocab_size,
        "mtp": _mtp_matmul_params(cfg, active),
    }


def _attention_weights(cfg: ModelConfig) -> int:
    """One layer's attention projections: W_q, W_k, W_v, W_o (GQA-sized); under MLA W_q (or W_qa
    and W_qb), W_kva (D → R + Dr), W_kvb (R → H·(Dn + Dv)) and W_o (H·Dv → D)."""
    D, H, mla = cfg.d_model, cfg.n_heads, cfg.mla
    if not mla.enabled:
        return 2 * D * H * cfg.dim_head + 2 * D * cfg.kv_heads * cfg.dim_head
    q = (D + H * mla.qk_head_dim) * mla.q_lora_rank if mla.q_lora_rank else D * H * mla.qk_head_dim
    kv = D * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank * H * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv + H * mla.v_head_dim * D


def _score_width(cfg: ModelConfig) -> int:
    """Per head, the width of QKᵀ plus that of PV: 2·Dh, or Dq + Dv under MLA (192 + 128 in V3)."""
    return cfg.mla.qk_head_dim + cfg.mla.v_head_dim if cfg.mla.enabled else 2 * cfg.dim_head


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
    """Weights of the matmuls one token passes through (see the module docstring); the main
    model's, as published counts are (multi-token prediction aside)."""
    return sum(n for name, n in matmul_params(cfg, active=True).items() if name != "mtp")


def params_total(cfg: ModelConfig) -> int:
    """Every parameter the model holds, all experts included; equals sum(p.numel()) of the built model."""
    D, H, G, Dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_head
    n_dense, n_moe = layer_counts(cfg)
    mats, moe = _ffn_matrices(cfg), cfg.moe
    weights = matmul_params(cfg, active=False)
    weights["mtp"] = params_mtp(cfg)  # its norms too; see "Multi-token prediction" below
    if cfg.tie_embeddings:
        weights["lm_head"] = 0  # the head is the embedding matrix
    biases = 0
    if cfg.bias:
        ffn_bias = mats - 1  # the gate (and up) projections have F-sized biases, the down one D
        biases += cfg.n_layers * (H * Dh + 2 * G * Dh + D)
        biases += n_dense * (ffn_bias * cfg.d_ff + D)
        if moe.shared_expert_d_ff:
            biases += n_moe * (ffn_bias * moe.shared_expert_d_ff + D)
    elif cfg.attention_bias != "none":  # q, k, v ("qkv") and o ("all") alone
        biases += cfg.n_layers * (H * Dh + 2 * G * Dh + D * (cfg.attention_bias == "all"))
    # GPT-OSS: a sink logit per head, a bias on the router's logits, biases on each expert's projections.
    biases += cfg.n_layers * H * cfg.attention_sinks + n_moe * moe.num_experts * moe.router_bias
    biases += n_moe * moe.num_experts * ((mats - 1) * cfg.d_expert_ff + D) * moe.expert_bias
    norms = (2 * cfg.n_layers + (cfg.norm_position == "pre")) * _norm_params(cfg)
    # qk-norm gains (always RMSNorm): Dh each per head, or the whole q and k widths.
    qk_norms = {"none": 0, "head": 2 * Dh, "projection": (H + G) * Dh}[cfg.qk_norm]
    norms += cfg.n_layers * qk_norms
    if cfg.mla.enabled:  # MLA's latents' RMSNorm gains: kv_norm (R) and q_norm (Rq)
        norms += cfg.n_layers * (cfg.mla.kv_lora_rank + cfg.mla.q_lora_rank)
    t5_table = params_position(cfg) if cfg.position == "t5" else 0  # learned's is in params_embedding
    return params_embedding(cfg) + sum(weights.values()) + biases + norms + t5_table


# ---------------------------------------------------------------------------------------------
# FLOPs per token (training: forward + backward)


def flops_per_token_6n(cfg: ModelConfig) -> int:
    return 6 * params_active(cfg)


@functools.lru_cache(maxsize=256)
def attended_keys(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    """Keys a query's scores cover, summed over the layers: S in a full layer (causal: S/2, the
    triangle), K = min(W, S) in a sliding one (causal: K − K²/(2S), the band's trapezoid over S)."""
    total = 0.0
    for i in range(cfg.n_layers):
        keys = min(cfg.layer_window(i) or seq_len, seq_len)
        total += keys - keys * keys / (2 * seq_len) if causal else keys
    return total


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """QKᵀ and PV over the full S×S square, forward and backward: 12·L·H·Dh·S (PaLM); a sliding
    layer's queries cover W keys, not S. Under MLA QKᵀ is Dq wide and PV Dv: 6·L·H·(Dq + Dv)·S."""
    return round(6 * cfg.n_heads * _score_width(cfg) * attended_keys(cfg, seq_len))


def attention_flops_per_token_causal(cfg: ModelConfig, seq_len: int) -> int:
    """The unmasked half of the square, as a causal kernel computes it (Megatron-LM); of a
    sliding layer's band, the keys at or before each query."""
    return round(6 * cfg.n_heads * _score_width(cfg) * attended_keys(cfg, seq_len, True))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """The MFU numerator: 6·params_active + full-square attention (+ multi-token prediction's)."""
    return flops_per_token_6n(cfg) + attention_flops_per_token(cfg, seq_len) + mtp_flops_per_token(cfg, seq_len)


def flops_by_component(cfg: ModelConfig, seq_len: int, *, causal: bool = False) -> dict[str, int]:
    """Training FLOPs per token of each component, in COMPONENTS order; sums to `flops_per_token`
    (or to its causal variant)."""
    out = {name: 6 * n for name, n in matmul_params(cfg, active=True).items()}
    out["attention_scores"] = (attention_flops_per_token_causal if causal else attention_flops_per_token)(cfg, seq_len)
    out["mtp"] = mtp_flops_per_token(cfg, seq_len, causal=causal)
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
# Multi-token prediction (model/mtp.py)
#
# Depth k's module is one more decoder block, built as the decoder's layer n_layers + k − 1 would
# be (MoE or dense by that index), plus eh_proj (2D → D) and three norms (enorm, hnorm, the norm
# before the shared head). It reuses the embedding and the LM head: their parameters are counted
# once, with the main model, but the head's matmul runs once more per depth.
#
# DeepSeek publishes its counts without these modules: 671B total and 37B activated are the main
# model's, and its checkpoint's 685B adds "14B of MTP module", which there also counts the copies
# of the embedding and head stored under layer 61 (2·V·D = 1.85B). So `params_total` here (which
# includes the modules) exceeds 671B by the module's own 11.6B (V3 with mtp_depth 1: 682.6B, of
# which 671.0B main model; with the two copies 684.5B); compare the published figure with
# params_total − params_mtp. `params_active` leaves the modules out, as the 37B does.


def _mtp_block(cfg: ModelConfig, layer: int) -> ModelConfig:
    """A one-layer model whose layer is built as the decoder's layer `layer` (>= n_layers) is."""
    moe = cfg.moe if cfg.is_moe_layer(layer) else dataclasses.replace(cfg.moe, num_experts=0)
    moe = dataclasses.replace(moe, every=1, first_dense_layers=0, dense_layers=())
    return cfg.replace(n_layers=1, mtp_depth=0, moe=moe, layer_types=(), sliding_window=cfg.layer_window(layer))


def _one_layer(count, one: ModelConfig) -> int:
    """What the layer of the one-layer model `one` adds to count(cfg)."""
    return count(one) - count(one.replace(n_layers=0))


def _mtp_layers(cfg: ModelConfig) -> range:
    return range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth)


def _mtp_matmul_params(cfg: ModelConfig, active: bool) -> int:
    """Matmul weights of the MTP modules (blocks and eh_proj; K or all E experts by `active`)."""
    if not cfg.mtp_depth:
        return 0

    def weights(c: ModelConfig) -> int:
        return sum(n for name, n in matmul_params(c, active=active).items() if name != "mtp")

    return sum(_one_layer(weights, _mtp_block(cfg, i)) + 2 * cfg.d_model ** 2 for i in _mtp_layers(cfg))


def params_mtp(cfg: ModelConfig) -> int:
    """Every parameter of the MTP modules: blocks (with norms and biases), eh_proj, enorm, hnorm, norm."""
    return sum(_one_layer(params_total, _mtp_block(cfg, i)) + 2 * cfg.d_model ** 2 + 3 * _norm_params(cfg)
               for i in _mtp_layers(cfg))


def params_mtp_experts(cfg: ModelConfig) -> int:
    """The routed-expert weights (all E) among `params_mtp`: what expert parallelism splits."""
    return sum(matmul_params(_mtp_block(cfg, i), active=False)["experts"] for i in _mtp_layers(cfg))


class ParameterCounts(NamedTuple):
    total: int  # params_total
    embedding: int  # params_embedding
    experts: int  # the decoder's routed-expert weights, all E
    mtp: int  # params_mtp
    mtp_experts: int  # params_mtp_experts


@functools.lru_cache(maxsize=64)
def parameter_counts(cfg: ModelConfig) -> ParameterCounts:
    """The counts the memory model splits over a layout; cached, as the layout planner asks for
    them once per memory estimate, ~10^5 times for one model."""
    return ParameterCounts(params_total(cfg), params_embedding(cfg), matmul_params(cfg, active=False)["experts"],
                           params_mtp(cfg), params_mtp_experts(cfg))


def mtp_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = False) -> int:
    """Training FLOPs per token of the MTP modules: each block's matmuls and attention scores,
    eh_proj, and the shared head's matmul once more per depth."""
    attention = attention_flops_per_token_causal if causal else attention_flops_per_token
    out = 0
    for i in _mtp_layers(cfg):
        one = _mtp_block(cfg, i)
        out += 6 * (_one_layer(params_active, one) + 2 * cfg.d_model ** 2 + cfg.d_model * cfg.vocab_size)
        out += attention(one, seq_len)
    return out


# ---------------------------------------------------------------------------------------------
# KV cache


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_element: int = 2) -> int:
    """Keys and values one more position adds: 2·L·G·Dh·bytes (bf16 by default) over the L layers
    that keep every position; a sliding layer keeps only its last W (model/attention.py's
    WindowKVCache), a fixed cost `kv_cache_bytes` adds. Under MLA each layer keeps its latent and
    rope key instead (model/mla.py's LatentCache): (R + Dr)·L·bytes, V3 (512 + 64)·61·2."""
    if cfg.mla.enabled:
        return cfg.n_layers * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * bytes_per_element
    full_layers = sum(not cfg.layer_window(i) for i in range(cfg.n_layers))
    return 2 * full_layers * cfg.kv_heads * cfg.dim_head * bytes_per_element


def kv_cache_bytes_per_token_expanded(cfg: ModelConfig, bytes_per_element: int = 2) -> int:
    """What an MLA layer's cache would hold as ordinary keys and values, L·H·(Dq + Dv)·bytes (V3:
    61·128·(192 + 128)·2, 71× its latent cache); without MLA the same as kv_cache_bytes_per_token."""
    if not cfg.mla.enabled:
        return kv_cache_bytes_per_token(cfg, bytes_per_element)
    return cfg.n_layers * cfg.n_heads * _score_width(cfg) * bytes_per_element


def kv_cache_bytes(cfg: ModelConfig, seq_len: int, batch: int = 1, bytes_per_element: int = 2) -> int:
    window_positions = sum(min(cfg.layer_window(i), seq_len) for i in range(cfg.n_layers))
    windows = 2 * window_positions * cfg.kv_heads * cfg.dim_head * bytes_per_element
    return (kv_cache_bytes_per_token(cfg, bytes_per_element) * seq_len + windows) * batch


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
        "params_mtp": params_mtp(cfg),
        "flops_per_token_6n": flops_per_token_6n(cfg),
        "attention_flops_per_token": attention_flops_per_token(cfg, seq_len),
        "attention_flops_per_token_causal": attention_flops_per_token_causal(cfg, seq_len),
        "flops_per_token": flops_per_token(cfg, seq_len),
        "flops_per_token_causal": sum(flops_by_component(cfg, seq_len, causal=True).values()),
        "flops_per_step": flops_per_token(cfg, seq_len) * seq_len * batch,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg, kv_bytes_per_element),
        "kv_cache_bytes": kv_cache_bytes(cfg, seq_len, batch, kv_bytes_per_element),
        **({"kv_cache_bytes_per_token_expanded": kv_cache_bytes_per_token_expanded(cfg, kv_bytes_per_element)}
           if cfg.mla.enabled else {}),
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
        *([("params_mtp", human(acct["params_mtp"]), "multi-token prediction modules, in params_total "
            "(published totals leave them out)")] if acct.get("params_mtp") else []),
        ("flops_per_token_6n", human(acct["flops_per_token_6n"], "FLOP"), "6 × params_active"),
        ("attention_flops_per_token", human(acct["attention_flops_per_token"], "FLOP"),
         f"12·L·H·Dh·S at S={S}, full square (PaLM)"),
        ("attention_flops_per_token_causal", human(acct["attention_flops_per_token_causal"], "FLOP"),
         "half: the unmasked triangle (Megatron)"),
        ("flops_per_token", human(acct["flops_per_token"], "FLOP"), "6N + full-square attention: the MFU numerator"),
        ("flops_per_token_causal", human(acct["flops_per_token_causal"], "FLOP"), "6N + causal attention"),
        ("flops_per_step", human(acct["flops_per_step"], "FLOP"), f"{B} × {S} tokens"),
        ("kv_cache_bytes_per_token", human(acct["kv_cache_bytes_per_token"], "B"),
         "2·L·G·Dh·bytes (L: full layers; a sliding one holds W positions)"),
        ("kv_cache_bytes", human(acct["kv_cache_bytes"], "B"), f"batch {B} × {S} positions"),
    ]
    if "kv_cache_bytes_per_token_expanded" in acct:  # MLA: q·k and p·v of other widths, the latent cache
        notes = {"attention_flops_per_token": f"6·L·H·(Dq + Dv)·S at S={S}, full square (PaLM)",
                 "kv_cache_bytes_per_token": "(R + Dr)·L·bytes: MLA's latent and rope key per layer"}
        rows = [(name, value, notes.get(name, note)) for name, value, note in rows]
        at = next(i for i, row in enumerate(rows) if row[0] == "kv_cache_bytes_per_token")
        rows.insert(at + 1, ("kv_cache_bytes_per_token_expanded", human(acct["kv_cache_bytes_per_token_expanded"], "B"),
                             "L·H·(Dq + Dv)·bytes: the same keys and values uncompressed"))
    for key, value in acct.get("memory_per_rank", {}).items():
        rows.append((f"memory_per_rank.{key}", human(value, "B"), "estimate, most loaded rank"))
    return rows

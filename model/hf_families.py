"""Hugging Face config.json ↔ ModelConfig for the families beside Mixtral: Qwen3-MoE and OLMoE.

Both are, like Mixtral (model/hf.py), pre-norm RMSNorm decoders with RoPE (rotate-half), GQA, no
biases and top-k softmax routing over SwiGLU experts with no capacity limit. They differ in:
  qwen3_moe  RMSNorm of each query and key head over Dh (q_norm, k_norm: (Dh,)) → qk_norm "head";
             head_dim may differ from D/H; experts moe_intermediate_size wide; dense FFNs
             (intermediate_size wide) where decoder_sparse_step and mlp_only_layers put them
  olmoe      RMSNorm over the whole q (H·Dh) and k (G·Dh) projections → qk_norm "projection";
             head_dim is D/H; every FFN an MoE, experts intermediate_size wide; clip_qkv (unset in
             OLMoE-1B-7B) has no moetron equivalent
In both `norm_topk_prob` says whether the kept top-k probabilities are rescaled to sum to one:
moetron's moe.weighting renormalize (true) or softmax (false, the raw probability).
"""

from __future__ import annotations

from typing import Any

from moetron.model.config import ModelConfig, MoEConfig

FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
TITLES = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE"}
# Which family a moetron model exports as: the qk-norm is what sets them apart.
BY_QK_NORM = {"none": "mixtral", "head": "qwen3_moe", "projection": "olmoe"}

# The transformers config classes' defaults, for keys a config.json leaves out.
_COMMON = {"hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False, "rope_theta": 10000.0,
           "attention_bias": False, "num_experts_per_tok": 8, "norm_topk_prob": False, "hidden_size": 2048}
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {**_COMMON, "vocab_size": 151936, "intermediate_size": 6144, "num_hidden_layers": 24,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-6, "use_sliding_window": False, "decoder_sparse_step": 1,
                  "moe_intermediate_size": 768, "num_experts": 128, "router_aux_loss_coef": 0.001,
                  "mlp_only_layers": []},
    "olmoe": {**_COMMON, "vocab_size": 50304, "intermediate_size": 2048, "num_hidden_layers": 16,
              "num_attention_heads": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "clip_qkv": None, "num_experts": 64, "router_aux_loss_coef": 0.01},
}


def rope_from_hf(h: dict[str, Any]) -> tuple[float, str, float]:
    """(theta, scaling, factor) from transformers 5.x `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    params = h.get("rope_parameters") or {}
    legacy = h.get("rope_scaling") or {}
    theta = params.get("rope_theta", h["rope_theta"])
    kind = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if kind == "default":
        return theta, "none", 1.0
    if kind == "linear":
        return theta, "linear", params.get("factor", legacy.get("factor", 1.0))
    raise ValueError(f"rope type {kind!r}: only default and linear RoPE scaling convert")


def family_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A qwen3_moe or olmoe config.json (as a dict) → ModelConfig; ValueError for what moetron cannot express."""
    family = hf["model_type"]
    h = {**DEFAULTS[family], **{k: v for k, v in hf.items() if v is not None}}
    if "num_experts" not in hf and "num_local_experts" in hf:  # how transformers 5.x writes it
        h["num_experts"] = hf["num_local_experts"]
    h.setdefault("num_key_value_heads", h["num_attention_heads"])
    D, H = h["hidden_size"], h["num_attention_heads"]
    title = TITLES[family]
    if h["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {h['hidden_act']!r}: {title} experts are SwiGLU (silu)")
    if h["attention_bias"]:
        raise ValueError(f"attention_bias: true has no moetron equivalent ({title} has no biases)")
    if h.get("use_sliding_window"):
        raise ValueError("use_sliding_window: true: only full attention converts")
    if h.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv {h['clip_qkv']}: clipping q, k and v has no moetron equivalent; null would")
    if h["num_experts_per_tok"] < 2 and h["norm_topk_prob"]:
        raise ValueError("num_experts_per_tok = 1 with norm_topk_prob: renormalized top-1 has no moetron equivalent")
    head_dim = h.get("head_dim") or D // H
    if family == "olmoe" and head_dim != D // H:
        raise ValueError(f"head_dim {head_dim}: OLMoE's heads are hidden_size / num_attention_heads ({D // H}) wide")
    every, first_dense, dense, d_ff, d_expert = 1, 0, (), h["intermediate_size"], 0
    if family == "qwen3_moe":
        every = h["decoder_sparse_step"]
        first_dense, dense = split_dense_layers(h["mlp_only_layers"])
        d_expert = h["moe_intermediate_size"] if h["moe_intermediate_size"] != d_ff else 0
    return ModelConfig(
        **rope_decoder_keys(h, head_dim, d_ff),
        qk_norm="head" if family == "qwen3_moe" else "projection",
        moe=MoEConfig(num_experts=h["num_experts"], top_k=h["num_experts_per_tok"], d_expert=d_expert,
                      capacity_factor=None, weighting="renormalize" if h["norm_topk_prob"] else "softmax",
                      aux_loss_coef=float(h["router_aux_loss_coef"]), every=every, first_dense_layers=first_dense,
                      dense_layers=dense))


def rope_decoder_keys(h: dict[str, Any], head_dim: int, d_ff: int) -> dict[str, Any]:
    """The ModelConfig keys of a Qwen-MoE or OLMoE config.json (defaults filled in) that describe
    their shared shape: a pre-norm RMSNorm decoder with RoPE, GQA, SwiGLU and no biases."""
    D, H = h["hidden_size"], h["num_attention_heads"]
    theta, scaling, factor = rope_from_hf(h)
    return dict(
        vocab_size=h["vocab_size"], d_model=D, n_layers=h["num_hidden_layers"], n_heads=H,
        n_kv_heads=h["num_key_value_heads"], head_dim=head_dim if head_dim != D // H else None, d_ff=d_ff,
        activation="swiglu", norm="rmsnorm", norm_eps=float(h["rms_norm_eps"]), norm_position="pre",
        position="rope", rope_theta=float(theta), rope_scaling=scaling, rope_scaling_factor=float(factor),
        max_seq_len=h["max_position_embeddings"], dropout=0.0, bias=False,
        tie_embeddings=bool(h["tie_word_embeddings"]), init_std=float(h["initializer_range"]))


def split_dense_layers(mlp_only_layers: list[int]) -> tuple[int, tuple[int, ...]]:
    """Qwen-MoE's mlp_only_layers as (moe.first_dense_layers, moe.dense_layers): the leading run
    0..k−1 and the rest."""
    layers = sorted(set(mlp_only_layers))
    k = next((i for i, layer in enumerate(layers) if layer != i), len(layers))
    return k, tuple(layers[k:])


def dense_layer_list(moe: MoEConfig) -> list[int]:
    """moe.first_dense_layers and moe.dense_layers as Qwen-MoE's mlp_only_layers."""
    return sorted(set(range(moe.first_dense_layers)) | set(moe.dense_layers))


def family_problems(cfg: ModelConfig, family: str) -> list[tuple[str, object, str]]:
    """What keeps `cfg` from being a `family` model beyond what all three share, as (field, value, rule)."""
    moe, out = cfg.moe, []
    if family != "qwen3_moe":
        title = TITLES[family]
        if moe.every != 1:
            out.append(("moe.every", moe.every, f"must be 1: every {title} FFN is an MoE layer"))
        if moe.first_dense_layers or moe.dense_layers:
            key, value = ("moe.first_dense_layers", moe.first_dense_layers) if moe.first_dense_layers else (
                "moe.dense_layers", list(moe.dense_layers))
            out.append((key, value, f"must be empty: {title} has no dense layers"))
    if family == "mixtral" and moe.weighting != "renormalize":
        out.append(("moe.weighting", moe.weighting, "must be renormalize: Mixtral renormalizes top-k weights"))
    if family == "olmoe" and cfg.dim_head * cfg.n_heads != cfg.d_model:
        out.append(("head_dim", cfg.dim_head, f"must be d_model / n_heads ({cfg.d_model / cfg.n_heads:g}) for OLMoE"))
    return out


def family_config_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """The keys of a qwen3_moe or olmoe config.json that differ from Mixtral's (model/hf.py writes the rest)."""
    moe = cfg.moe
    out: dict[str, Any] = {"num_experts": moe.num_experts, "norm_topk_prob": moe.weighting == "renormalize",
                           "attention_bias": False}
    if family == "qwen3_moe":
        return {**out, "intermediate_size": cfg.d_ff, "moe_intermediate_size": cfg.d_expert_ff,
                "decoder_sparse_step": moe.every, "mlp_only_layers": dense_layer_list(moe),
                "use_sliding_window": False}
    return {**out, "intermediate_size": cfg.d_expert_ff, "clip_qkv": None}

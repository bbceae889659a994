"""Hugging Face GPT-OSS (`model_type: gpt_oss`, GptOssForCausalLM) ↔ moetron: config.json and tensors.

Legend: E experts, D model dim, F expert hidden dim, H query heads, R rows of a quantized matrix,
G groups of 32 values in a row.

GPT-OSS is a pre-norm RMSNorm decoder with RoPE (rotate-half, as here), GQA and every FFN an MoE;
what sets it apart maps to moetron's keys:
  attention   biases on q, k, v and o (`attention_bias: true` → attention_bias "all"); one learned
              sink logit per head, self_attn.sinks (H,) → attention_sinks; layers "sliding_attention"
              (a window of `sliding_window` keys: query i sees i − W < j ≤ i) or "full_attention" →
              layer_types sliding / full
  RoPE        YaRN with `truncate: false` (the ramp not rounded to whole pairs) → rope_scaling yarn,
              rope_yarn_truncate false; beta_fast 32 and beta_slow 1 are moetron's, other values refused
  router      mlp.router.weight (E, D) and .bias (E,) → router_bias; softmax over the top-k logits,
              which is moetron's softmax + renormalize
  experts     biased (expert_bias) and fused, input-major like ours: gate_up_proj (E, D, 2F) with gate
              and up in INTERLEAVED columns (gate = [..., 0::2], up = [..., 1::2], also in
              gate_up_proj_bias (E, 2F)); down_proj (E, F, D), down_proj_bias (E, D); the clamped SwiGLU
              gate.clamp(max=limit) · sigmoid(alpha · gate) · (up.clamp(±limit) + 1) → swiglu_limit,
              swiglu_alpha, swiglu_up_offset 1
Published checkpoints (openai/gpt-oss-*) hold the expert matrices in MXFP4 (`quantization_config:
{quant_method: mxfp4}`): gate_up_proj_blocks (E, 2F, D/32, 16) uint8 and _scales (E, 2F, D/32) uint8,
down_proj likewise over F; they are dequantized on load (`dequantize_mxfp4`). Exports are unquantized.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.hf_files import Rows

FAMILY = "gpt_oss"
# GptOssConfig's defaults, for keys a config.json leaves out (rope: its YaRN default, below).
DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "tie_word_embeddings": False, "initializer_range": 0.02,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001, "attention_bias": True, "rope_theta": 150000.0,
}
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
# OCP microscaling FP4 (E2M1): the value of each 4-bit code.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def claims(cfg: ModelConfig) -> str | None:
    """Attention sinks are GPT-OSS's alone among the families moetron converts."""
    return FAMILY if cfg.attention_sinks else None


# ---------------------------------------------------------------------------------------------
# Config


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A gpt_oss config.json (as a dict) → ModelConfig; ValueError for what moetron cannot express."""
    h = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    if "head_dim" in hf and hf["head_dim"] is None:
        h["head_dim"] = h["hidden_size"] // h["num_attention_heads"]
    if "sliding_window" in hf:  # null is GptOssConfig's "no window", not its default 128
        h["sliding_window"] = hf["sliding_window"]
    if "num_experts" in hf and "num_local_experts" not in hf:
        h["num_local_experts"] = hf["num_experts"]
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise ValueError(f"quantization {quant!r}: only unquantized and mxfp4 GPT-OSS checkpoints convert")
    if h["num_experts_per_tok"] < 2:
        raise ValueError("num_experts_per_tok = 1: GPT-OSS's softmax over one kept logit has no moetron equivalent")
    D, H, L = h["hidden_size"], h["num_attention_heads"], h["num_hidden_layers"]
    window, layer_types = _layer_types_from_hf(h, L)
    rope = _rope_from_hf(hf, h)
    return ModelConfig(
        vocab_size=h["vocab_size"], d_model=D, n_layers=L, n_heads=H, n_kv_heads=h["num_key_value_heads"],
        head_dim=h["head_dim"] if h["head_dim"] != D // H else None, d_ff=h["intermediate_size"],
        activation="swiglu", norm="rmsnorm", norm_eps=float(h["rms_norm_eps"]), norm_position="pre",
        position="rope", max_seq_len=h["max_position_embeddings"], dropout=0.0, bias=False,
        tie_embeddings=bool(h["tie_word_embeddings"]), init_std=float(h["initializer_range"]),
        attention_bias="all" if h["attention_bias"] else "none", attention_sinks=True,
        sliding_window=window, layer_types=layer_types, **rope,
        moe=MoEConfig(num_experts=h["num_local_experts"], top_k=h["num_experts_per_tok"], capacity_factor=None,
                      score="softmax", weighting="renormalize", aux_loss_coef=float(h["router_aux_loss_coef"]),
                      router_bias=True, expert_bias=True, swiglu_limit=float(h["swiglu_limit"]),
                      swiglu_alpha=float(h["swiglu_alpha"]), swiglu_up_offset=1.0))


def _layer_types_from_hf(h: dict[str, Any], n_layers: int) -> tuple[int, tuple[str, ...]]:
    """(sliding_window, layer_types): GptOssConfig's default alternates, sliding first."""
    hf_types = h.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    if any(t not in names for t in hf_types):
        raise ValueError(f"layer_types {hf_types}: only sliding_attention and full_attention convert")
    types = tuple(names[t] for t in hf_types)
    if "sliding" not in types:
        return 0, ()
    if not h["sliding_window"]:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
    return int(h["sliding_window"]), types


def _rope_from_hf(hf: dict[str, Any], h: dict[str, Any]) -> dict[str, Any]:
    """moetron's rope keys from `rope_parameters` (transformers 5.x) or `rope_scaling` + `rope_theta`
    (4.x); none of them: GptOssConfig's YaRN. Only the YaRN transformers computes with moetron's
    formula converts: beta_fast 32, beta_slow 1, no mscale, attention_factor 0.1·ln(factor) + 1."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or DEFAULT_ROPE)
    theta = float(params.get("rope_theta") or h["rope_theta"])
    kind = params.get("rope_type") or params.get("type") or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']}: only whole-head RoPE converts")
    if kind == "default":
        return {"rope_theta": theta}
    if kind == "linear":
        return {"rope_theta": theta, "rope_scaling": "linear", "rope_scaling_factor": float(params["factor"])}
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r}: only default, linear and yarn RoPE convert")
    original = params.get("original_max_position_embeddings") or h["max_position_embeddings"]
    factor = float(params.get("factor") or h["max_position_embeddings"] / original)
    mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    unlike = {"beta_fast": (params.get("beta_fast") or 32) != 32, "beta_slow": (params.get("beta_slow") or 1) != 1,
              "mscale": bool(params.get("mscale") and params.get("mscale_all_dim")),
              "attention_factor": params.get("attention_factor") not in (None, mscale)}
    for key, bad in unlike.items():
        if bad:
            raise ValueError(f"yarn {key} {params.get(key)!r}: moetron's YaRN has beta_fast 32, beta_slow 1 and "
                             f"attention factor 0.1·ln(factor) + 1")
    # null: moetron's default, max_seq_len, so that a config written from one reads back equal.
    original = int(original) if original != h["max_position_embeddings"] else None
    return {"rope_theta": theta, "rope_scaling": "yarn", "rope_scaling_factor": factor,
            "rope_original_max_seq_len": original, "rope_yarn_truncate": bool(params.get("truncate", True))}


def problems(cfg: ModelConfig, family: str = FAMILY) -> list[tuple[str, object, str]]:
    """What keeps `cfg` from being a GPT-OSS model, as (field, value, rule). Absent router, expert or
    output-projection biases export as zeros; absent sinks are not claimed by this family."""
    rules = [("norm", "rmsnorm"), ("norm_position", "pre"), ("position", "rope"), ("activation", "swiglu"),
             ("bias", False), ("causal", True), ("qk_norm", "none"), ("mtp_depth", 0), ("mla.kv_lora_rank", 0),
             ("moe.shared_expert_d_ff", 0), ("moe.score", "softmax"), ("moe.weighting", "renormalize"),
             ("moe.route_scale", 1.0), ("moe.num_groups", 0), ("moe.bias_update_rate", 0.0), ("moe.every", 1),
             ("moe.first_dense_layers", 0), ("moe.dense_layers", ()), ("moe.swiglu_up_offset", 1.0)]
    out = []
    for key, want in rules:
        value = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) if "." in key else getattr(cfg, key)
        if value != want:
            out.append((key, value, f"must be {want!r}: GPT-OSS has no equivalent"))
    if not cfg.moe.enabled:
        out.append(("moe.num_experts", cfg.moe.num_experts, "must be > 0: every GPT-OSS FFN is an MoE layer"))
    if cfg.moe.swiglu_limit <= 0:
        out.append(("moe.swiglu_limit", cfg.moe.swiglu_limit, "must be > 0: GPT-OSS always clamps its SwiGLU"))
    if cfg.rope_scaling == "ntk":
        out.append(("rope_scaling", cfg.rope_scaling, "must be none, linear or yarn for GPT-OSS"))
    return out


def config_to_hf(cfg: ModelConfig, family: str = FAMILY) -> dict[str, Any]:
    """The keys of a gpt_oss config.json beyond those model/hf.py's `common_hf_keys` writes."""
    moe = cfg.moe
    out: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"], "num_local_experts": moe.num_experts, "attention_bias": cfg.attention_bias != "none",
        "swiglu_alpha": moe.swiglu_alpha, "swiglu_limit": moe.swiglu_limit,
        # transformers builds a sliding mask whether or not a layer slides, and needs a window for it.
        "sliding_window": cfg.sliding_window or cfg.max_seq_len,
        "layer_types": [("sliding_attention" if cfg.layer_window(i) else "full_attention") for i in range(cfg.n_layers)],
    }
    if cfg.rope_scaling == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling_factor,
                "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": cfg.rope_original_len,
                "truncate": cfg.rope_yarn_truncate}
        out |= {"rope_parameters": rope, "rope_scaling": rope}
    return out


# ---------------------------------------------------------------------------------------------
# Tensors

_ATTN = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
         "attn.wo": "self_attn.o_proj"}
_PLAIN = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn.sinks.weight": "self_attn.sinks", "ffn.router.gate.weight": "mlp.router.weight"}


def dequantize_mxfp4(blocks_ERGB: torch.Tensor, scales_ERG: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     ) -> torch.Tensor:
    """An MXFP4 expert matrix → (E, in, R), GPT-OSS's input-major layout. Row r of expert e holds G
    groups of 32 values; each byte of blocks (E, R, G, 16) two FP4 E2M1 codes, the low nibble first;
    scales (E, R, G) the group's power of two, biased by 127 (E8M0). One expert at a time, so the
    index tensors stay small on the 120B model's 128 × 5760 × 2880 matrices."""
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks_ERGB.device)
    out = []
    for blocks_RGB, scales_RG in zip(blocks_ERGB, scales_ERG):
        low, high = lut[(blocks_RGB & 0x0F).long()], lut[(blocks_RGB >> 4).long()]
        values_RG32 = torch.stack([low, high], dim=-1).flatten(-2)
        values_RG32 = values_RG32 * torch.exp2(scales_RG.float() - 127.0)[..., None]
        out.append(values_RG32.flatten(-2).t().to(dtype))
    return torch.stack(out)


def _expert_matrix(get: Callable[[str], torch.Tensor], keys: set[str], name: str) -> torch.Tensor:
    """`name` (…experts.gate_up_proj or .down_proj) as stored, or dequantized from MXFP4."""
    if f"{name}_blocks" in keys:
        return dequantize_mxfp4(get(f"{name}_blocks"), get(f"{name}_scales"))
    return get(name)


def tensors_from_hf(get: Callable[[str], torch.Tensor], keys: set[str],
                    cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(moetron name, tensor) for every parameter, reading Hugging Face tensors through `get`."""
    yield "embed.weight", get("model.embed_tokens.weight")
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _ATTN.items():
            yield f"{ours}{mine}.weight", get(f"{hf}{theirs}.weight")
            if cfg.attention_bias != "none":
                yield f"{ours}{mine}.bias", get(f"{hf}{theirs}.bias")
        for mine, theirs in _PLAIN.items():
            yield f"{ours}{mine}", get(f"{hf}{theirs}")
        yield f"{ours}ffn.router.gate.bias", get(f"{hf}mlp.router.bias")
        experts = f"{hf}mlp.experts."
        # De-interleave: GPT-OSS's fused columns alternate gate, up, gate, up, …
        gate_up_ED2F, bias_E2F = _expert_matrix(get, keys, f"{experts}gate_up_proj"), get(f"{experts}gate_up_proj_bias")
        yield f"{ours}ffn.experts.w_gate_EDF", gate_up_ED2F[..., 0::2]
        yield f"{ours}ffn.experts.w_up_EDF", gate_up_ED2F[..., 1::2]
        yield f"{ours}ffn.experts.b_gate_EF", bias_E2F[..., 0::2]
        yield f"{ours}ffn.experts.b_up_EF", bias_E2F[..., 1::2]
        yield f"{ours}ffn.experts.w_down_EFD", _expert_matrix(get, keys, f"{experts}down_proj")
        yield f"{ours}ffn.experts.b_down_ED", get(f"{experts}down_proj_bias")
    yield "norm.weight", get("model.norm.weight")
    if not cfg.tie_embeddings:
        yield "head.weight", get("lm_head.weight")


def tensors_to_hf(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, contiguous tensor) as GptOssForCausalLM's `save_pretrained` writes them;
    biases moetron's model lacks (router, experts, the output projection under "qkv") as zeros."""
    cfg, sd = model.cfg, model.state_dict()
    yield "model.embed_tokens.weight", sd["embed.weight"]
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _ATTN.items():
            w = sd[f"{ours}{mine}.weight"]
            yield f"{hf}{theirs}.weight", w
            if cfg.attention_bias == "all" or (cfg.attention_bias == "qkv" and mine != "attn.wo"):
                yield f"{hf}{theirs}.bias", sd[f"{ours}{mine}.bias"]
            elif cfg.attention_bias == "qkv":
                yield f"{hf}{theirs}.bias", w.new_zeros(w.shape[0])
        for mine, theirs in _PLAIN.items():
            yield f"{hf}{theirs}", sd[f"{ours}{mine}"]
        router_w = sd[f"{ours}ffn.router.gate.weight"]
        router_b = sd[f"{ours}ffn.router.gate.bias"] if cfg.moe.router_bias else router_w.new_zeros(router_w.shape[0])
        yield f"{hf}mlp.router.bias", router_b
        yield from _experts_to_hf(sd, f"{ours}ffn.experts.", f"{hf}mlp.experts.", cfg.moe.expert_bias)
    yield "model.norm.weight", sd["norm.weight"]
    if not cfg.tie_embeddings:
        yield "lm_head.weight", sd["head.weight"]


def _experts_to_hf(sd, ours: str, hf: str, biased: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's experts in GPT-OSS's fused, interleaved layout (zero biases unless `biased`)."""
    gate_EDF, up_EDF, down_EFD = sd[f"{ours}w_gate_EDF"], sd[f"{ours}w_up_EDF"], sd[f"{ours}w_down_EFD"]
    E, D, F = gate_EDF.shape
    dtype = gate_EDF.dtype
    b_gate_EF, b_up_EF, b_down_ED = ((sd[f"{ours}b_gate_EF"], sd[f"{ours}b_up_EF"], sd[f"{ours}b_down_ED"]) if biased
                                     else (torch.zeros(E, F, dtype=dtype), torch.zeros(E, F, dtype=dtype),
                                           torch.zeros(E, D, dtype=dtype)))
    # Built an expert at a time: the stacks may be `Rows` read from a checkpoint one expert at a time.
    yield f"{hf}gate_up_proj", Rows((E, D, 2 * F), dtype,
                                    lambda e: torch.stack([gate_EDF[e], up_EDF[e]], dim=-1).flatten(-2))
    yield f"{hf}gate_up_proj_bias", torch.stack([b_gate_EF, b_up_EF], dim=-1).flatten(-2).contiguous()
    yield f"{hf}down_proj", down_EFD
    yield f"{hf}down_proj_bias", b_down_ED.contiguous()

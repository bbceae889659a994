"""Hugging Face Qwen2-MoE (`model_type: qwen2_moe`, Qwen2MoeForCausalLM: Qwen1.5-MoE-A2.7B,
Qwen2-57B-A14B) ↔ moetron: config.json and tensors.

Legend: E experts, D model dim, F expert hidden dim, Fs shared-expert hidden dim.

Qwen2-MoE is a pre-norm RMSNorm decoder with RoPE (rotate-half, as here), GQA and top-k softmax
routing over SwiGLU experts with no capacity limit, like Qwen3-MoE (model/hf_families.py), from
which it differs in:
  attention     biases on q, k and v, none on o (`qkv_bias`, true unless a transformers 5.x
                config.json says otherwise) → attention_bias "qkv"; no qk-norm
  shared expert every MoE layer adds an always-on SwiGLU FFN `shared_expert_intermediate_size`
                wide, its output scaled per token by sigmoid(x · w), w = mlp.shared_expert_gate.weight
                (1, D) → moe.shared_expert_d_ff and moe.shared_expert_gate
Dense layers (`intermediate_size` wide) are where decoder_sparse_step and mlp_only_layers put
them, as in Qwen3-MoE; norm_topk_prob true is moetron's renormalize, false its softmax weighting.
Sliding-window attention (`use_sliding_window: true`) does not convert.

Tensors, per layer (`model.layers.{i}.` on their side, `layers.{i}.` on ours):
  self_attn.{q,k,v}_proj.weight / .bias, o_proj.weight  attn.w{q,k,v}.weight / .bias, attn.wo.weight
  input_layernorm / post_attention_layernorm            attn_norm / ffn_norm
  mlp.gate.weight (E, D)                                ffn.router.gate.weight
  mlp.experts.{e}.gate_proj / up_proj / down_proj       ffn.experts.w_gate_EDF / w_up_EDF / w_down_EFD
    (or transformers 5.x's fused mlp.experts.gate_up_proj (E, 2F, D) and down_proj (E, D, F))
  mlp.shared_expert.gate_proj / up_proj / down_proj     ffn.shared.w_gate / w_up / w_down
  mlp.shared_expert_gate.weight (1, D)                  ffn.shared_gate.weight
  dense layers: mlp.gate_proj / up_proj / down_proj     ffn.w_gate / w_up / w_down
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.hf import experts_from_hf, experts_to_hf
from moetron.model.hf_families import dense_layer_list, rope_decoder_keys, split_dense_layers

FAMILY = "qwen2_moe"
TITLE = "Qwen2-MoE"
# Qwen2MoeConfig's defaults, for keys a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
    "num_attention_heads": 16, "hidden_act": "silu", "max_position_embeddings": 32768, "initializer_range": 0.02,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0, "use_sliding_window": False,
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "router_aux_loss_coef": 0.001,
    "mlp_only_layers": [], "qkv_bias": True,
}


def claims(cfg: ModelConfig) -> str | None:
    """The gated shared expert is Qwen2-MoE's alone among the families moetron converts."""
    return FAMILY if cfg.moe.shared_expert_gate else None


# ---------------------------------------------------------------------------------------------
# Config


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A qwen2_moe config.json (as a dict) → ModelConfig; ValueError for what moetron cannot express."""
    h = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    h.setdefault("num_key_value_heads", h["num_attention_heads"])
    D, H = h["hidden_size"], h["num_attention_heads"]
    if h["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {h['hidden_act']!r}: {TITLE} experts are SwiGLU (silu)")
    if h["use_sliding_window"]:
        raise ValueError("use_sliding_window: true: only full attention converts")
    if h["num_experts_per_tok"] < 2 and h["norm_topk_prob"]:
        raise ValueError("num_experts_per_tok = 1 with norm_topk_prob: renormalized top-1 has no moetron equivalent")
    if h["shared_expert_intermediate_size"] < 1:
        raise ValueError(f"shared_expert_intermediate_size {h['shared_expert_intermediate_size']}: "
                         f"moetron's gated shared expert needs a width")
    head_dim = h.get("head_dim") or D // H
    first_dense, dense = split_dense_layers(h["mlp_only_layers"])
    d_ff = h["intermediate_size"]
    return ModelConfig(
        **rope_decoder_keys(h, head_dim, d_ff),
        attention_bias="qkv" if h["qkv_bias"] else "none",
        moe=MoEConfig(num_experts=h["num_experts"], top_k=h["num_experts_per_tok"],
                      d_expert=h["moe_intermediate_size"] if h["moe_intermediate_size"] != d_ff else 0,
                      capacity_factor=None, weighting="renormalize" if h["norm_topk_prob"] else "softmax",
                      aux_loss_coef=float(h["router_aux_loss_coef"]), every=h["decoder_sparse_step"],
                      first_dense_layers=first_dense, dense_layers=dense,
                      shared_expert_d_ff=h["shared_expert_intermediate_size"], shared_expert_gate=True))


def problems(cfg: ModelConfig, family: str = FAMILY) -> list[tuple[str, object, str]]:
    """What keeps `cfg` from being a Qwen2-MoE model, as (field, value, rule)."""
    rules = [("norm", "rmsnorm"), ("norm_position", "pre"), ("position", "rope"), ("activation", "swiglu"),
             ("bias", False), ("causal", True), ("qk_norm", "none"), ("attention_sinks", False),
             ("sliding_window", 0), ("mtp_depth", 0), ("mla.kv_lora_rank", 0), ("moe.score", "softmax"),
             ("moe.route_scale", 1.0), ("moe.num_groups", 0), ("moe.bias_update_rate", 0.0),
             ("moe.router_bias", False), ("moe.expert_bias", False), ("moe.swiglu_limit", 0.0),
             ("moe.swiglu_alpha", 1.0), ("moe.swiglu_up_offset", 0.0), ("moe.shared_expert_gate", True)]
    out = []
    for key, want in rules:
        value = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) if "." in key else getattr(cfg, key)
        if value != want:
            out.append((key, value, f"must be {want!r}: {TITLE} has no equivalent"))
    if cfg.attention_bias == "all":
        out.append(("attention_bias", cfg.attention_bias, f"must be qkv or none: {TITLE}'s o_proj has no bias"))
    if cfg.rope_scaling not in ("none", "linear"):
        out.append(("rope_scaling", cfg.rope_scaling, f"must be none or linear for {TITLE}"))
    if not cfg.moe.enabled:
        out.append(("moe.num_experts", cfg.moe.num_experts, f"must be > 0: {TITLE} is an MoE"))
    return out


def config_to_hf(cfg: ModelConfig, family: str = FAMILY) -> dict[str, Any]:
    """The keys of a qwen2_moe config.json beyond those model/hf.py's `common_hf_keys` writes."""
    moe = cfg.moe
    return {"architectures": ["Qwen2MoeForCausalLM"], "intermediate_size": cfg.d_ff, "moe_intermediate_size": cfg.d_expert_ff,
            "shared_expert_intermediate_size": moe.shared_expert_d_ff, "num_experts": moe.num_experts,
            "norm_topk_prob": moe.weighting == "renormalize", "decoder_sparse_step": moe.every,
            "mlp_only_layers": dense_layer_list(moe), "qkv_bias": cfg.attention_bias == "qkv",
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}


# ---------------------------------------------------------------------------------------------
# Tensors

_ATTN = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj"}
_PLAIN = {"attn.wo.weight": "self_attn.o_proj.weight", "attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_FFN = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def _layer_names(cfg: ModelConfig, layer: int) -> dict[str, str]:
    """moetron → Hugging Face names of one layer's tensors that map one to one, in file order."""
    names: dict[str, str] = {}
    for mine, theirs in _ATTN.items():
        names[f"{mine}.weight"] = f"{theirs}.weight"
        if cfg.attention_bias == "qkv":
            names[f"{mine}.bias"] = f"{theirs}.bias"
    names |= _PLAIN
    if not cfg.is_moe_layer(layer):
        return names | {f"ffn.{mine}.weight": f"mlp.{theirs}.weight" for mine, theirs in _FFN.items()}
    names["ffn.router.gate.weight"] = "mlp.gate.weight"
    names |= {f"ffn.shared.{mine}.weight": f"mlp.shared_expert.{theirs}.weight" for mine, theirs in _FFN.items()}
    return names | {"ffn.shared_gate.weight": "mlp.shared_expert_gate.weight"}


def tensors_from_hf(get: Callable[[str], torch.Tensor], keys: set[str],
                    cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(moetron name, tensor) for every parameter, reading Hugging Face tensors through `get`."""
    yield "embed.weight", get("model.embed_tokens.weight")
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _layer_names(cfg, i).items():
            yield f"{ours}{mine}", get(f"{hf}{theirs}")
        if cfg.is_moe_layer(i):
            for key, tensor in experts_from_hf(get, keys, f"{hf}mlp.experts.", _EXPERT_NAMES, cfg.moe.num_experts):
                yield f"{ours}ffn.experts.{key}", tensor
    yield "norm.weight", get("model.norm.weight")
    if not cfg.tie_embeddings:
        yield "head.weight", get("lm_head.weight")


def tensors_to_hf(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, contiguous tensor) as Qwen2MoeForCausalLM's `save_pretrained` writes them."""
    cfg, sd = model.cfg, model.state_dict()
    yield "model.embed_tokens.weight", sd["embed.weight"]
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _layer_names(cfg, i).items():
            yield f"{hf}{theirs}", sd[f"{ours}{mine}"]
        if cfg.is_moe_layer(i):
            yield from experts_to_hf(sd, f"{ours}ffn.experts.", f"{hf}mlp.experts.", _EXPERT_NAMES,
                                     cfg.moe.num_experts)
    yield "model.norm.weight", sd["norm.weight"]
    if not cfg.tie_embeddings:
        yield "lm_head.weight", sd["head.weight"]

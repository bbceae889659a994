"""Hugging Face interop for DeepSeek-V2 and DeepSeek-V3 (model_type deepseek_v2, deepseek_v3):
multi-head latent attention (model/mla.py) and fine-grained experts with shared ones.

Legend: D model dim, H heads, R kv_lora_rank, Dn / Dr / Dv the nope, rope and value head dims,
Dq = Dn + Dr, E experts, F expert hidden dim.

Config (config.json → moetron):
  q_lora_rank (null → 0), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim → mla.*
  first_k_dense_replace → moe.first_dense_layers (layer i is MoE when i ≥ it)
  moe_layer_freq f (DeepSeek's own key; transformers ignores it): layer i ≥ k is MoE when
      i % f == 0 → the other ones in moe.dense_layers (moetron's `every` counts (i + 1) % every)
  n_routed_experts, num_experts_per_tok, moe_intermediate_size → moe.num_experts, top_k, d_expert
  n_shared_experts × moe_intermediate_size → moe.shared_expert_d_ff; intermediate_size → d_ff
  routed_scaling_factor → moe.route_scale
  V2: softmax scores; topk_method greedy (no groups) or group_limited_greedy (n_group, topk_group
      → moe.num_groups, topk_groups; a group scores its best expert: moe.group_score_top 1);
      weights never renormalized (transformers' V2 ignores norm_topk_prob: true is refused)
  V3: sigmoid scores, norm_topk_prob → moe.weighting renormalize / softmax, groups always (n_group 1:
      none) scored by their best two (moe.group_score_top 2), e_score_correction_bias → the router's
      expert_bias_E (moe.bias_update_rate 0.001, V3's γ, so that the buffer exists); and
      num_nextn_predict_layers → mtp_depth (model/hf_mtp.py converts those tensors)
  aux_loss_alpha, seq_aux (DeepSeek's keys) → moe.aux_loss_coef, aux_loss_type sequence
  rope_parameters yarn with mscale = mscale_all_dim → rope_scaling yarn, mla.yarn_mscale (the
      softmax scale carries the temperature, as transformers' yarn_apply_mscale); linear as is
Anything else moetron cannot express (attention or MLP biases, GQA, fp8 quantization, other rope
types) is refused in one line.

Tensors, per layer (`model.layers.{i}.` on their side, `layers.{i}.` on ours):
  self_attn.q_proj | q_a_proj, q_a_layernorm, q_b_proj   attn.wq | wq_a, q_norm, wq_b
  self_attn.kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj attn.wkv_a, kv_norm, wkv_b
  self_attn.o_proj, input_layernorm, post_attention_layernorm   attn.wo, attn_norm, ffn_norm
  mlp.gate_proj / up_proj / down_proj (dense layers)      ffn.w_gate / w_up / w_down
  mlp.gate.weight, mlp.gate.e_score_correction_bias (V3)  ffn.router.gate.weight, ffn.router.expert_bias_E
  mlp.experts.{e}.gate_proj / up_proj / down_proj         ffn.experts.w_gate_EDF / w_up_EDF / w_down_EFD
      (or, as transformers 5.x holds them, mlp.experts.gate_up_proj (E, 2F, D) and down_proj (E, D, F))
  mlp.shared_experts.gate_proj / up_proj / down_proj      ffn.shared.w_gate / w_up / w_down
RoPE layout: DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), … (always in V2;
V3 when rope_interleave, the default), moetron pairs i with i + Dr/2 (rotate-half). Permuting the
Dr rope output rows of W_q / W_qb (per head) and W_kva to evens-then-odds makes rotate-half give
the same q·k; export permutes back and writes rope_interleave: true. A V3 config with
rope_interleave: false (rotate-half weights, which only some re-exports hold) is refused: the
tensor mapping sees the ModelConfig alone, which does not record the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from moetron.model import hf_mtp
from moetron.model.config import MLAConfig, ModelConfig, MoEConfig
from moetron.model.hf import experts_from_hf, experts_to_hf

FAMILIES = ("deepseek_v2", "deepseek_v3")
ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
# DeepSeek-V3's bias update speed γ (§2.1.2), given to an imported V3 router so it keeps its bias.
V3_BIAS_UPDATE_RATE = 0.001

# transformers' DeepseekV2Config / DeepseekV3Config defaults, for keys a config.json leaves out.
_COMMON = {"hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "attention_bias": False, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "kv_lora_rank": 512, "q_lora_rank": 1536, "first_k_dense_replace": 0, "moe_layer_freq": 1,
           "rope_theta": 10000.0, "aux_loss_alpha": 0.001, "seq_aux": True}
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {**_COMMON, "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
                    "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
                    "mlp_bias": False, "n_routed_experts": 64, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
                    "topk_method": "greedy", "norm_topk_prob": False, "num_experts_per_tok": None,
                    "moe_intermediate_size": 1407, "scoring_func": "softmax"},
    "deepseek_v3": {**_COMMON, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "num_hidden_layers": 61, "num_attention_heads": 128, "max_position_embeddings": 4096,
                    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                    "first_k_dense_replace": 3, "norm_topk_prob": True, "rope_interleave": True,
                    "num_nextn_predict_layers": 1, "scoring_func": "sigmoid"},
}

# The (gate, up, down) projections of one expert in a DeepSeek folder.
_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def claims(cfg: ModelConfig) -> str | None:
    """MLA models are DeepSeek's: V3 with sigmoid scores, V2 with softmax."""
    if not cfg.mla.enabled:
        return None
    return "deepseek_v3" if cfg.moe.score == "sigmoid" else "deepseek_v2"


# ---------------------------------------------------------------------------------------------
# Config


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A deepseek_v2 / deepseek_v3 config.json (as a dict) → ModelConfig; ValueError in one line
    for what moetron cannot express."""
    family = hf["model_type"]
    h = {**DEFAULTS[family], **{k: v for k, v in hf.items() if v is not None or k == "q_lora_rank"}}
    _refuse_unexpressible(h, family)
    theta, scaling, factor, original, mscale = _rope_from_hf(h)
    H = h["num_attention_heads"]
    mla = MLAConfig(kv_lora_rank=h["kv_lora_rank"], q_lora_rank=h["q_lora_rank"] or 0,
                    qk_nope_head_dim=h["qk_nope_head_dim"], qk_rope_head_dim=h["qk_rope_head_dim"],
                    v_head_dim=h["v_head_dim"], yarn_mscale=mscale)
    return ModelConfig(
        vocab_size=h["vocab_size"], d_model=h["hidden_size"], n_layers=h["num_hidden_layers"], n_heads=H,
        d_ff=h["intermediate_size"], activation="swiglu", norm="rmsnorm", norm_eps=float(h["rms_norm_eps"]),
        norm_position="pre", position="rope", rope_theta=float(theta), rope_scaling=scaling,
        rope_scaling_factor=float(factor), rope_original_max_seq_len=original,
        max_seq_len=h["max_position_embeddings"], dropout=0.0, bias=False,
        tie_embeddings=bool(h["tie_word_embeddings"]), init_std=float(h["initializer_range"]),
        mtp_depth=int(h.get("num_nextn_predict_layers") or 0) if family == "deepseek_v3" else 0,
        mla=mla, moe=_moe_from_hf(h, family))


def _refuse_unexpressible(h: dict[str, Any], family: str) -> None:
    """One-line ValueErrors for a config.json (defaults filled in) moetron cannot express."""
    if h["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {h['hidden_act']!r}: DeepSeek's experts are SwiGLU (silu)")
    if not h["num_experts_per_tok"]:
        raise ValueError(f"num_experts_per_tok {h['num_experts_per_tok']}: a {family} config must set it (>= 1)")
    if h.get("quantization_config"):
        method = h["quantization_config"].get("quant_method", "?")
        raise ValueError(f"quantization_config ({method}): quantized weights do not convert; dequantize them "
                         f"to bf16 first (e.g. DeepSeek's fp8_cast_bf16.py) and drop the key")
    if h["attention_bias"] or h.get("mlp_bias"):
        raise ValueError("attention_bias/mlp_bias: true has no moetron equivalent (MLA here has no biases)")
    if h.get("num_key_value_heads") not in (None, h["num_attention_heads"]):
        raise ValueError(f"num_key_value_heads {h['num_key_value_heads']}: MLA gives every head its key "
                         f"(must equal num_attention_heads, {h['num_attention_heads']})")
    want = "sigmoid" if family == "deepseek_v3" else "softmax"
    if h["scoring_func"] != want:
        raise ValueError(f"scoring_func {h['scoring_func']!r}: transformers' {family} scores by {want}")
    if family == "deepseek_v2" and h["norm_topk_prob"]:
        raise ValueError("norm_topk_prob: true in deepseek_v2: transformers' DeepseekV2 ignores it (never "
                         "renormalizes) while DeepSeek's code renormalizes; no released V2 sets it")
    if family == "deepseek_v2" and h["topk_method"] not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method {h['topk_method']!r}: deepseek_v2 converts greedy and group_limited_greedy")
    if family == "deepseek_v3" and h["num_experts_per_tok"] < 2 and h["norm_topk_prob"]:
        raise ValueError("num_experts_per_tok = 1 with norm_topk_prob: renormalized top-1 has no moetron equivalent")
    if family == "deepseek_v3" and not h["rope_interleave"]:
        raise ValueError("rope_interleave: false: only DeepSeek's interleaved rope layout converts")
    if h["moe_layer_freq"] < 1:
        raise ValueError(f"moe_layer_freq {h['moe_layer_freq']}: must be >= 1")


def _moe_from_hf(h: dict[str, Any], family: str) -> MoEConfig:
    d_expert, k, freq = h["moe_intermediate_size"], h["first_k_dense_replace"], h["moe_layer_freq"]
    groups = {}
    if family == "deepseek_v3" and (h.get("n_group") or 1) > 1:
        groups = dict(num_groups=h["n_group"], topk_groups=h["topk_group"], group_score_top=2)
    elif family == "deepseek_v2" and h["topk_method"] == "group_limited_greedy":
        groups = dict(num_groups=h["n_group"], topk_groups=h["topk_group"], group_score_top=1)
    v3 = family == "deepseek_v3"
    return MoEConfig(
        num_experts=h["n_routed_experts"], top_k=h["num_experts_per_tok"],
        d_expert=d_expert if d_expert != h["intermediate_size"] else 0, capacity_factor=None,
        score="sigmoid" if v3 else "softmax", weighting="renormalize" if h["norm_topk_prob"] else "softmax",
        route_scale=float(h["routed_scaling_factor"]), bias_update_rate=V3_BIAS_UPDATE_RATE if v3 else 0.0,
        aux_loss_coef=float(h["aux_loss_alpha"]), aux_loss_type="sequence" if h["seq_aux"] else "micro_batch",
        shared_expert_d_ff=h["n_shared_experts"] * d_expert, first_dense_layers=k,
        dense_layers=tuple(i for i in range(k, h["num_hidden_layers"]) if i % freq), **groups)


def _rope_from_hf(h: dict[str, Any]) -> tuple[float, str, float, int | None, float]:
    """(theta, scaling, factor, original length or None, yarn mscale) from transformers 5.x
    `rope_parameters` or DeepSeek's `rope_scaling`."""
    params = h.get("rope_parameters") or h.get("rope_scaling") or {}
    theta = params.get("rope_theta", h["rope_theta"])
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return theta, "none", 1.0, None, 1.0
    if kind == "linear":
        return theta, "linear", params["factor"], None, 1.0
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r}: deepseek converts default, linear and yarn RoPE")
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or h["max_position_embeddings"] / original
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    # moetron's YaRN under MLA: cos and sin unscaled, softmax scale × (0.1·m·ln f + 1)², which is
    # transformers' when mscale = mscale_all_dim (attention_factor 1) and both are set.
    if not mscale or mscale != mscale_all:
        raise ValueError(f"yarn mscale {mscale} / mscale_all_dim {mscale_all}: moetron's YaRN under MLA needs "
                         f"both set and equal")
    for key, allowed in (("beta_fast", (None, 32)), ("beta_slow", (None, 1)), ("truncate", (None, True)),
                         ("attention_factor", (None, 1.0))):
        if params.get(key) not in allowed:
            raise ValueError(f"yarn {key} {params[key]}: moetron's YaRN takes {allowed[-1]} (or the key left out)")
    return theta, "yarn", factor, original, float(mscale_all)


def problems(cfg: ModelConfig, family: str) -> list[tuple[str, object, str]]:
    """What keeps `cfg` from being a `family` model, as (field, value, rule)."""
    title, moe = {"deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3"}[family], cfg.moe
    rules = [("norm", "rmsnorm"), ("norm_position", "pre"), ("activation", "swiglu"), ("causal", True)]
    out = [(k, getattr(cfg, k), f"must be {want!r} for {title}") for k, want in rules if getattr(cfg, k) != want]
    if cfg.rope_scaling not in ("none", "linear", "yarn"):
        out.append(("rope_scaling", cfg.rope_scaling, f"must be none, linear or yarn for {title}"))
    if cfg.rope_scaling == "yarn" and cfg.mla.yarn_mscale <= 0:
        out.append(("mla.yarn_mscale", cfg.mla.yarn_mscale, f"must be > 0 for {title}'s yarn"))
    if not moe.enabled:
        out.append(("moe.num_experts", moe.num_experts, f"must be > 0: {title} is an MoE"))
        return out
    if moe.shared_expert_d_ff % cfg.d_expert_ff:
        out.append(("moe.shared_expert_d_ff", moe.shared_expert_d_ff,
                    f"must be a multiple of the expert width ({cfg.d_expert_ff}): {title} has n_shared_experts"))
    plain = [("shared_expert_gate", False), ("router_bias", False), ("expert_bias", False), ("swiglu_limit", 0.0),
             ("swiglu_alpha", 1.0), ("swiglu_up_offset", 0.0)]
    out += [(f"moe.{k}", getattr(moe, k), f"must be {want!r}: {title} has no equivalent")
            for k, want in plain if getattr(moe, k) != want]
    if _moe_layer_freq(cfg) is None:
        key, value = ("moe.every", moe.every) if moe.every != 1 else ("moe.dense_layers", list(moe.dense_layers))
        out.append((key, value, f"makes MoE layers {title} cannot: its are i >= first_k_dense_replace with "
                    f"i % moe_layer_freq == 0"))
    score_top = moe.group_score_top or (moe.top_k // moe.topk_groups if moe.num_groups else 0)
    if family == "deepseek_v2":
        for key, want in (("weighting", "softmax"), ("bias_update_rate", 0.0)):
            if getattr(moe, key) != want:
                out.append((f"moe.{key}", getattr(moe, key), f"must be {want!r}: {title}'s router has no equivalent"))
        if moe.num_groups and score_top != 1:
            out.append(("moe.group_score_top", moe.group_score_top,
                        f"must be 1: {title} scores a group by its best expert"))
        if cfg.mtp_depth:
            out.append(("mtp_depth", cfg.mtp_depth, f"must be 0: {title} has no multi-token prediction"))
    elif moe.num_groups and score_top != 2:
        out.append(("moe.group_score_top", moe.group_score_top, f"must be 2: {title} scores a group by its best two"))
    return out


def _moe_layer_freq(cfg: ModelConfig) -> int | None:
    """DeepSeek's moe_layer_freq f that makes exactly moetron's MoE layers (i ≥ k, i % f == 0), or None."""
    k, n = cfg.moe.first_dense_layers, cfg.n_layers
    moe_layers = [cfg.is_moe_layer(i) for i in range(n)]
    return next((f for f in range(1, n + 1) if moe_layers == [i >= k and i % f == 0 for i in range(n)]), None)


def config_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """The keys of a deepseek config.json beyond what model/hf.py's common_hf_keys writes (or
    where they differ)."""
    moe, mla = cfg.moe, cfg.mla
    out: dict[str, Any] = {
        "intermediate_size": cfg.d_ff, "moe_intermediate_size": cfg.d_expert_ff, "head_dim": mla.qk_rope_head_dim,
        "kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank or None,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim, "n_routed_experts": moe.num_experts,
        "n_shared_experts": moe.shared_expert_d_ff // cfg.d_expert_ff, "routed_scaling_factor": moe.route_scale,
        "first_k_dense_replace": moe.first_dense_layers, "moe_layer_freq": _moe_layer_freq(cfg),
        "norm_topk_prob": moe.weighting == "renormalize", "attention_bias": False,
        "aux_loss_alpha": moe.aux_loss_coef, "seq_aux": moe.aux_loss_type == "sequence",
        "scoring_func": "sigmoid" if family == "deepseek_v3" else "softmax",
    }
    if cfg.rope_scaling == "yarn":
        yarn = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling_factor,
                "original_max_position_embeddings": cfg.rope_original_len, "beta_fast": 32, "beta_slow": 1,
                "mscale": mla.yarn_mscale, "mscale_all_dim": mla.yarn_mscale}
        out |= {"rope_parameters": yarn, "rope_scaling": {**yarn, "type": "yarn"}}
    if family == "deepseek_v2":
        grouped = {"topk_method": "group_limited_greedy", "n_group": moe.num_groups, "topk_group": moe.topk_groups}
        return {**out, "mlp_bias": False, **(grouped if moe.num_groups else {"topk_method": "greedy",
                                                                              "n_group": None, "topk_group": None})}
    return {**out, "rope_interleave": True, "n_group": moe.num_groups or 1, "topk_group": moe.topk_groups or 1,
            "topk_method": "noaux_tc", "num_nextn_predict_layers": cfg.mtp_depth}


# ---------------------------------------------------------------------------------------------
# Tensors

_ATTN_NAMES = {"attn.wq": "self_attn.q_proj", "attn.wq_a": "self_attn.q_a_proj",
               "attn.q_norm": "self_attn.q_a_layernorm", "attn.wq_b": "self_attn.q_b_proj",
               "attn.wkv_a": "self_attn.kv_a_proj_with_mqa",
               "attn.kv_norm": "self_attn.kv_a_layernorm", "attn.wkv_b": "self_attn.kv_b_proj",
               "attn.wo": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_DENSE_NAMES = {"ffn.w_gate": "mlp.gate_proj", "ffn.w_up": "mlp.up_proj", "ffn.w_down": "mlp.down_proj"}
_SHARED_NAMES = {"ffn.shared.w_gate": "mlp.shared_experts.gate_proj", "ffn.shared.w_up": "mlp.shared_experts.up_proj",
                 "ffn.shared.w_down": "mlp.shared_experts.down_proj"}


def _layer_names(cfg: ModelConfig, moe: bool) -> dict[str, str]:
    """moetron → Hugging Face name stems of a layer's tensors that map one to one (rope rows aside)."""
    q = ("attn.wq_a", "attn.q_norm", "attn.wq_b") if cfg.mla.q_lora_rank else ("attn.wq",)
    names = {k: v for k, v in _ATTN_NAMES.items() if not k.startswith("attn.wq") and k != "attn.q_norm" or k in q}
    if not moe:
        return {**names, **_DENSE_NAMES}
    return {**names, **(_SHARED_NAMES if cfg.moe.shared_expert_d_ff else {})}


def _rope_rows(w_XI: torch.Tensor, cfg: ModelConfig, name: str, to_half: bool) -> torch.Tensor:
    """`w_XI` (out, in) with its rope output rows moved from DeepSeek's interleaved pairs to
    rotate-half order (evens, then odds) when `to_half`, else back. Views and one reshape: meta-safe."""
    mla, Dr = cfg.mla, cfg.mla.qk_rope_head_dim
    if name == "attn.wkv_a":
        head_XI, rope_NDrI = w_XI[: mla.kv_lora_rank], w_XI[mla.kv_lora_rank :][None]
    else:  # a query projection: H heads of [nope | rope]
        w_HDqI = w_XI.view(-1, mla.qk_head_dim, w_XI.shape[-1])
        head_XI, rope_NDrI = w_HDqI[:, : mla.qk_nope_head_dim], w_HDqI[:, mla.qk_nope_head_dim :]
    N, I = rope_NDrI.shape[0], rope_NDrI.shape[-1]
    pairs = (N, Dr // 2, 2, I) if to_half else (N, 2, Dr // 2, I)
    moved_NDrI = rope_NDrI.reshape(pairs).transpose(1, 2).reshape(N, Dr, I)
    if name == "attn.wkv_a":
        return torch.cat([head_XI, moved_NDrI[0]])
    return torch.cat([head_XI, moved_NDrI], dim=1).reshape(w_XI.shape)


def layer_tensors_from_hf(get: Callable[[str], torch.Tensor], keys: set[str], cfg: ModelConfig, hf: str, ours: str,
                          moe: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(moetron name, tensor) of one decoder layer, HF prefix `hf` (e.g. "model.layers.3.") to
    ours (e.g. "layers.3."); `moe`: the layer's FFN is an MoE layer. For the MTP blocks too."""
    for mine, theirs in _layer_names(cfg, moe).items():
        w = get(f"{hf}{theirs}.weight")
        if mine in ("attn.wq", "attn.wq_b", "attn.wkv_a"):
            w = _rope_rows(w, cfg, mine, to_half=True)
        yield f"{ours}{mine}.weight", w
    if not moe:
        return
    yield f"{ours}ffn.router.gate.weight", get(f"{hf}mlp.gate.weight")
    bias_key = f"{hf}mlp.gate.e_score_correction_bias"
    if cfg.moe.bias_update_rate > 0:
        yield f"{ours}ffn.router.expert_bias_E", get(bias_key).float()
    for key, w in experts_from_hf(get, keys, f"{hf}mlp.experts.", _EXPERT_NAMES, cfg.moe.num_experts):
        yield f"{ours}ffn.experts.{key}", w


def tensors_from_hf(get: Callable[[str], torch.Tensor], keys: set[str],
                    cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(moetron name, tensor) for every parameter (and the V3 router's bias), read through `get`."""
    yield "embed.weight", get("model.embed_tokens.weight")
    for i in range(cfg.n_layers):
        yield from layer_tensors_from_hf(get, keys, cfg, f"model.layers.{i}.", f"layers.{i}.", cfg.is_moe_layer(i))
    yield "norm.weight", get("model.norm.weight")
    if not cfg.tie_embeddings:
        yield "head.weight", get("lm_head.weight")
    if cfg.mtp_depth:
        if not any(k.startswith(f"model.layers.{cfg.n_layers}.") for k in keys):
            raise ValueError(f"num_nextn_predict_layers {cfg.mtp_depth}: the folder holds no model.layers."
                             f"{cfg.n_layers}.* (multi-token prediction) tensors (transformers' save_pretrained "
                             f"drops them); set it to 0 in config.json to convert without them")
        yield from hf_mtp.mtp_tensors_from_hf(get, keys, cfg)


def ignored_hf_keys(keys: set[str], cfg: ModelConfig) -> set[str]:
    """Layers past num_hidden_layers (DeepSeek-V3's multi-token prediction module) when mtp_depth is 0."""
    if cfg.mtp_depth:
        return set()
    return {k for k in keys if k.startswith("model.layers.") and int(k.split(".")[2]) >= cfg.n_layers}


def layer_tensors_to_hf(sd, cfg: ModelConfig, ours: str, hf: str, moe: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, contiguous tensor) of one decoder layer from the state dict `sd`, in the
    per-expert layout `save_pretrained` writes, rope rows back in DeepSeek's interleaved pairs."""
    for mine, theirs in _layer_names(cfg, moe).items():
        w = sd[f"{ours}{mine}.weight"]
        if mine in ("attn.wq", "attn.wq_b", "attn.wkv_a"):
            w = _rope_rows(w, cfg, mine, to_half=False)
        yield f"{hf}{theirs}.weight", w.contiguous()
    if not moe:
        return
    yield f"{hf}mlp.gate.weight", sd[f"{ours}ffn.router.gate.weight"]
    if claims(cfg) == "deepseek_v3":
        # A router without aux-loss-free balancing chooses by the scores alone: a zero correction.
        bias = f"{ours}ffn.router.expert_bias_E"
        yield f"{hf}mlp.gate.e_score_correction_bias", (sd[bias] if cfg.moe.bias_update_rate > 0
                                                         else torch.zeros(cfg.moe.num_experts))
    yield from experts_to_hf(sd, f"{ours}ffn.experts.", f"{hf}mlp.experts.", _EXPERT_NAMES, cfg.moe.num_experts)


def tensors_to_hf(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, contiguous tensor) of every tensor of a deepseek folder."""
    cfg, sd = model.cfg, model.state_dict()
    yield "model.embed_tokens.weight", sd["embed.weight"]
    for i in range(cfg.n_layers):
        yield from layer_tensors_to_hf(sd, cfg, f"layers.{i}.", f"model.layers.{i}.", cfg.is_moe_layer(i))
    yield "model.norm.weight", sd["norm.weight"]
    if not cfg.tie_embeddings:
        yield "lm_head.weight", sd["head.weight"]
    if cfg.mtp_depth:
        yield from hf_mtp.mtp_tensors_to_hf(model)

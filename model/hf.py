"""Hugging Face interop for Mixtral, Qwen3-MoE and OLMoE: config.json ↔ ModelConfig, safetensors ↔ Decoder.

The two later families' configs are mapped in model/hf_families.py; their tensors are named as
Mixtral's below, plus self_attn.q_norm / k_norm (their qk-norm gains), with experts named
mlp.experts.{e}.gate_proj / up_proj / down_proj and Qwen3's dense FFNs mlp.gate_proj / up_proj /
down_proj. The fused layout of transformers 5.x modules (below) is the same for all three.

Legend: E experts, D model dim, F expert hidden dim.

Mixtral is a pre-norm RMSNorm decoder with RoPE (rotate-half layout, as here), GQA, no biases and
every FFN a top-k MoE of SwiGLU experts with renormalized weights and no capacity limit. Expert
weights appear in two layouts:
  per expert (what `save_pretrained` writes, in every transformers version)
      model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight  (F, D)  gate
      ...                                          .w3.weight  (F, D)  up
      ...                                          .w2.weight  (D, F)  down
      model.layers.{i}.block_sparse_moe.gate.weight             (E, D)  router
  fused (the module state of transformers 5.x, `mlp.` instead of `block_sparse_moe.`)
      model.layers.{i}.mlp.experts.gate_up_proj  (E, 2F, D)  gate rows first, then up
      model.layers.{i}.mlp.experts.down_proj     (E, D, F)
      model.layers.{i}.mlp.gate.weight           (E, D)
Both are read; the per-expert layout is written. Hugging Face stores Linear weights (out, in);
our experts are input-major (E, in, out), so every expert matrix is transposed on the way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.hf_families import (
    ARCHITECTURES,
    BY_QK_NORM,
    FAMILIES,
    TITLES,
    family_config_from_hf,
    family_config_to_hf,
    family_problems,
    rope_from_hf,
)
from moetron.model.hf_files import HFFolder, shard_names, shard_plan, write_index, write_shard
from moetron.model.transformer import Decoder

CONFIG_FILE = "config.json"

# MixtralConfig's defaults, for keys a config.json leaves out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32, "initializer_range": 0.02, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "rope_theta": 1e6, "sliding_window": None, "num_experts_per_tok": 2,
    "num_local_experts": 8, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Families mapped in modules of their own: model_type → module under moetron.model. Each module
# provides, for the model_types it lists:
#   claims(cfg) -> str | None            the model_type a ModelConfig exports as, or None
#   config_from_hf(hf: dict) -> ModelConfig
#   config_to_hf(cfg, family) -> dict    the whole config.json but the keys common_hf_keys() writes
#   problems(cfg, family) -> list[(field, value, rule)]
#   tensors_from_hf(get, keys, cfg) / tensors_to_hf(model): as this module's functions below
#   ignored_hf_keys(keys, cfg) -> set[str]   optional: tensors a folder may hold that are left
#                                        unread on purpose (any other unread one is refused)
# Conversions stream (`moetron convert` never holds the whole model), so both run twice: first
# on meta tensors (shapes and dtypes, no data) to plan the files, then on the data. They must
# therefore use only ops that work on meta tensors, read tensors only through `get` and
# `model.state_dict()` (a mapping that may load each tensor as it is looked up: look each up
# once, in the order you yield), use nothing of `model` but `.cfg` and `.state_dict()` (it may
# be a `Weights`, below), and yield in the same order every time. A stacked expert tensor
# ([E, ...]) of `model.state_dict()` may be a `Rows` (model/hf_files.py) that reads one expert at a
# time: index it by expert (`w_E[e]`), and yield what is built from a whole stack as a `Rows` too.
_FAMILY_MODULES: dict[str, str] = {"gpt_oss": "hf_gpt_oss", "deepseek_v2": "hf_deepseek", "deepseek_v3": "hf_deepseek",
                                   "qwen2_moe": "hf_qwen2_moe"}


def family_module(family: str):
    """The module mapping `family`, for the families not written out in this module."""
    import importlib

    return importlib.import_module(f"moetron.model.{_FAMILY_MODULES[family]}")


def known_families() -> tuple[str, ...]:
    return FAMILIES + tuple(_FAMILY_MODULES)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A Mixtral, Qwen3-MoE or OLMoE config.json (as a dict) → ModelConfig; ValueError for what
    moetron cannot express."""
    family = hf.get("model_type", "mixtral")
    if family in _FAMILY_MODULES:
        return family_module(family).config_from_hf(hf)
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r}: only {', '.join(known_families())} convert")
    if family != "mixtral":
        return family_config_from_hf(hf)
    # null means "the default" except where it has a meaning of its own.
    h = {**HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k in ("head_dim", "sliding_window")}}
    if "num_key_value_heads" in hf and hf["num_key_value_heads"] is None:
        h["num_key_value_heads"] = h["num_attention_heads"]
    if h["hidden_act"] != "silu":
        raise ValueError(f"hidden_act {h['hidden_act']!r}: Mixtral experts are SwiGLU (silu)")
    if h.get("attention_bias") or h.get("mlp_bias"):
        raise ValueError("attention_bias/mlp_bias: Mixtral has no biases")
    if h["num_experts_per_tok"] < 2:
        # Mixtral renormalizes the kept weights, so top-1 gives every token weight 1.0; moetron's
        # top-1 uses the raw probability (Switch) and refuses renormalization.
        raise ValueError("num_experts_per_tok = 1: Mixtral's renormalized top-1 has no moetron equivalent")
    theta, scaling, factor = rope_from_hf(h)
    # Sliding-window attention equals full attention on sequences no longer than the window.
    max_seq_len = h["max_position_embeddings"]
    if h["sliding_window"]:
        max_seq_len = min(max_seq_len, h["sliding_window"])
    head_dim = h["head_dim"] if h["head_dim"] not in (None, h["hidden_size"] // h["num_attention_heads"]) else None
    return ModelConfig(
        vocab_size=h["vocab_size"], d_model=h["hidden_size"], n_layers=h["num_hidden_layers"],
        n_heads=h["num_attention_heads"], n_kv_heads=h["num_key_value_heads"], head_dim=head_dim,
        d_ff=h["intermediate_size"], activation="swiglu", norm="rmsnorm", norm_eps=float(h["rms_norm_eps"]),
        norm_position="pre", position="rope", rope_theta=float(theta), rope_scaling=scaling,
        rope_scaling_factor=float(factor), max_seq_len=max_seq_len, dropout=0.0, bias=False,
        tie_embeddings=bool(h["tie_word_embeddings"]), init_std=float(h["initializer_range"]),
        moe=MoEConfig(num_experts=h["num_local_experts"], top_k=h["num_experts_per_tok"], capacity_factor=None,
                      weighting="renormalize", aux_loss_coef=float(h["router_aux_loss_coef"]),
                      jitter=float(h["router_jitter_noise"]), every=1))


def hf_family(cfg: ModelConfig) -> str:
    """The Hugging Face family `cfg` exports as: its qk-norm decides (none: Mixtral, head: Qwen3-MoE,
    projection: OLMoE), unless a family of its own module claims it first."""
    for name in dict.fromkeys(_FAMILY_MODULES.values()):
        claimed = family_module(next(f for f, m in _FAMILY_MODULES.items() if m == name)).claims(cfg)
        if claimed:
            return claimed
    return BY_QK_NORM[cfg.qk_norm]


def hf_problems(cfg: ModelConfig) -> list[tuple[str, object, str]]:
    """What keeps `cfg` from being a model of its family (`hf_family`), as (field, value, rule)."""
    family = hf_family(cfg)
    if family in _FAMILY_MODULES:
        return family_module(family).problems(cfg, family)
    title = TITLES[family]
    rules = [("norm", "rmsnorm"), ("norm_position", "pre"), ("position", "rope"), ("activation", "swiglu"),
             ("bias", False)]
    out = [(k, getattr(cfg, k), f"must be {want!r} for {title}") for k, want in rules if getattr(cfg, k) != want]
    if cfg.rope_scaling not in ("none", "linear"):
        out.append(("rope_scaling", cfg.rope_scaling, f"must be none or linear for {title}"))
    plain = [("attention_bias", "none"), ("attention_sinks", False), ("sliding_window", 0), ("mtp_depth", 0),
             ("mla.kv_lora_rank", 0), ("moe.shared_expert_gate", False), ("moe.router_bias", False),
             ("moe.expert_bias", False), ("moe.swiglu_limit", 0.0), ("moe.swiglu_alpha", 1.0),
             ("moe.swiglu_up_offset", 0.0)]
    for key, want in plain:
        value = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) if "." in key else getattr(cfg, key)
        if value != want:
            out.append((key, value, f"must be {want!r}: {title} has no equivalent"))
    moe = cfg.moe
    if not moe.enabled:
        out.append(("moe.num_experts", moe.num_experts, f"must be > 0: {title} is an MoE"))
    if moe.shared_expert_d_ff:
        out.append(("moe.shared_expert_d_ff", moe.shared_expert_d_ff, f"must be 0: {title} has no shared expert"))
    # Hugging Face's routers take the top-k of the softmax itself, unscaled, over all experts.
    for key, want in (("score", "softmax"), ("route_scale", 1.0), ("num_groups", 0), ("bias_update_rate", 0.0)):
        if getattr(moe, key) != want:
            out.append((f"moe.{key}", getattr(moe, key), f"must be {want!r}: {title}'s router has no equivalent"))
    return out + family_problems(cfg, family)


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32, *, eos_id: int | None = None) -> dict[str, Any]:
    """ModelConfig → the config.json of its family (`hf_family`), readable by transformers 4.x and 5.x.
    `eos_id` is the tokenizer's end-of-text token, so that Hugging Face's `generate` stops where ours does.

    A capacity factor is not carried over: Hugging Face's MoE layers are dropless, which is also how
    a capacity-trained model is best evaluated.
    """
    for key, value, rule in hf_problems(cfg):
        raise ValueError(f"model.{key} = {value!r}: {rule}")
    family = hf_family(cfg)
    out = common_hf_keys(cfg, family, dtype, eos_id)
    if family in _FAMILY_MODULES:
        return {**out, **family_module(family).config_to_hf(cfg, family)}
    if family == "mixtral":
        return {**out, "sliding_window": None, "num_local_experts": cfg.moe.num_experts,
                "router_jitter_noise": cfg.moe.jitter}
    return {**out, **family_config_to_hf(cfg, family)}


def common_hf_keys(cfg: ModelConfig, family: str, dtype: torch.dtype, eos_id: int | None) -> dict[str, Any]:
    """The config.json keys every family shares (a family module overrides what differs)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    legacy_scaling = None
    if cfg.rope_scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling_factor}
        legacy_scaling = {"type": "linear", "rope_type": "linear", "factor": cfg.rope_scaling_factor}
    dtype_name = next(name for name, dt in _DTYPES.items() if dt == dtype)
    special = {} if eos_id is None else {"eos_token_id": eos_id}
    out = {
        **special,
        # A family of its own module writes its architecture in its config_to_hf.
        "architectures": [ARCHITECTURES.get(family, "")], "model_type": family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_expert_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_head, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta, "rope_scaling": legacy_scaling, "rope_parameters": rope,
        "attention_dropout": 0.0, "num_experts_per_tok": cfg.moe.top_k,
        "router_aux_loss_coef": cfg.moe.aux_loss_coef, "output_router_logits": False, "use_cache": True,
        "dtype": dtype_name, "torch_dtype": dtype_name,
    }
    return out


# ---------------------------------------------------------------------------------------------
# Tensors

_ATTN = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
         "attn.wo": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORM = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
_DENSE = {"ffn.w_gate": "mlp.gate_proj", "ffn.w_up": "mlp.up_proj", "ffn.w_down": "mlp.down_proj"}
# Per family: the MoE block's prefix as `save_pretrained` writes it, and its experts' (gate, up, down) names.
_EXPERTS = {"mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
            "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
            "olmoe": ("mlp.", ("gate_proj", "up_proj", "down_proj"))}


def _plain_names(cfg: ModelConfig, layer: int) -> dict[str, str]:
    """moetron → Hugging Face name stems of one layer's tensors that map one to one."""
    names = {**_ATTN, **(_QK_NORM if cfg.qk_norm != "none" else {})}
    return names if cfg.is_moe_layer(layer) else {**names, **_DENSE}


def tensors_from_hf(get: Callable[[str], torch.Tensor], keys: set[str],
                    cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(moetron name, tensor) for every parameter, reading Hugging Face tensors through `get`."""
    family = hf_family(cfg)
    if family in _FAMILY_MODULES:
        yield from family_module(family).tensors_from_hf(get, keys, cfg)
        return
    per_expert, (w_gate, w_up, w_down) = _EXPERTS[family]
    yield "embed.weight", get("model.embed_tokens.weight")
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _plain_names(cfg, i).items():
            yield f"{ours}{mine}.weight", get(f"{hf}{theirs}.weight")
        if not cfg.is_moe_layer(i):
            continue
        moe = f"{hf}{per_expert}" if f"{hf}{per_expert}gate.weight" in keys else f"{hf}mlp."
        yield f"{ours}ffn.router.gate.weight", get(f"{moe}gate.weight")
        for key, tensor in experts_from_hf(get, keys, f"{moe}experts.", (w_gate, w_up, w_down), cfg.moe.num_experts):
            yield f"{ours}ffn.experts.{key}", tensor
    yield "norm.weight", get("model.norm.weight")
    if not cfg.tie_embeddings:
        yield "head.weight", get("lm_head.weight")


def experts_from_hf(get: Callable[[str], torch.Tensor], keys: set[str], prefix: str, names: tuple[str, str, str],
                    num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """("w_gate_EDF" | "w_up_EDF" | "w_down_EFD", tensor) of one MoE layer's experts under `prefix`
    ("model.layers.{i}.mlp.experts."): the fused layout of transformers 5.x modules when the
    folder holds it, else per expert, `names` being the (gate, up, down) projections' names."""
    if f"{prefix}gate_up_proj" in keys:
        gate_EFD, up_EFD = get(f"{prefix}gate_up_proj").chunk(2, dim=1)
        yield "w_gate_EDF", gate_EFD.transpose(1, 2)
        yield "w_up_EDF", up_EFD.transpose(1, 2)
        yield "w_down_EFD", get(f"{prefix}down_proj").transpose(1, 2)
        return
    for key, name in zip(("w_gate_EDF", "w_up_EDF", "w_down_EFD"), names):
        # Filled expert by expert rather than stacked: one expert's matrix held beside the result, not E.
        first = get(f"{prefix}0.{name}.weight").t()
        w_E = first.new_empty((num_experts, *first.shape))
        w_E[0] = first
        for e in range(1, num_experts):
            w_E[e] = get(f"{prefix}{e}.{name}.weight").t()
        yield key, w_E


def experts_to_hf(sd: Mapping[str, torch.Tensor], ours: str, prefix: str, names: tuple[str, str, str],
                  num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """One MoE layer's experts (moetron's under `ours`, "layers.{i}.ffn.experts.") in the
    per-expert layout `save_pretrained` writes under `prefix`, `names` as for `experts_from_hf`."""
    for name, key in zip(names, ("w_gate_EDF", "w_up_EDF", "w_down_EFD")):
        w_E = sd[f"{ours}{key}"]
        for e in range(num_experts):
            yield f"{prefix}{e}.{name}.weight", w_E[e].t().contiguous()
        del w_E  # streamed from a checkpoint, the next one is read while this name still holds it


def tensors_to_hf(model: Decoder | Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, contiguous tensor) in the per-expert layout `save_pretrained` writes."""
    cfg, sd = model.cfg, model.state_dict()
    family = hf_family(cfg)
    if family in _FAMILY_MODULES:
        yield from family_module(family).tensors_to_hf(model)
        return
    per_expert, hf_names = _EXPERTS[family]
    yield "model.embed_tokens.weight", sd["embed.weight"]
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _plain_names(cfg, i).items():
            yield f"{hf}{theirs}.weight", sd[f"{ours}{mine}.weight"]
        if not cfg.is_moe_layer(i):
            continue
        moe = f"{hf}{per_expert}"
        yield f"{moe}gate.weight", sd[f"{ours}ffn.router.gate.weight"]
        yield from experts_to_hf(sd, f"{ours}ffn.experts.", f"{moe}experts.", hf_names, cfg.moe.num_experts)
    yield "model.norm.weight", sd["norm.weight"]
    if not cfg.tie_embeddings:
        yield "lm_head.weight", sd["head.weight"]


# ---------------------------------------------------------------------------------------------
# Folders, read and written one tensor at a time (model/hf_files.py)


class Weights:
    """A model's config and its tensors by name, without its modules: all `tensors_to_hf` reads
    (`cfg`, `state_dict()`), so a conversion can hand it meta tensors (to plan the files) or a
    mapping that loads each tensor when it is looked up (to stream them)."""

    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]):
        self.cfg, self._tensors = cfg, tensors

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        return self._tensors


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir}: no {CONFIG_FILE} there")
    return json.loads(path.read_text())


def hf_dtype(hf_cfg: dict[str, Any], folder: HFFolder) -> torch.dtype:
    """The dtype a folder's weights are meant in: config.json's, else its first floating tensor's."""
    named = _DTYPES.get(hf_cfg.get("dtype") or hf_cfg.get("torch_dtype") or "")
    if named is not None:
        return named
    return next(t.dtype for t in map(folder.meta, sorted(folder.keys())) if t.dtype.is_floating_point)


def ignored_hf_keys(keys: set[str], cfg: ModelConfig) -> set[str]:
    """Tensors of a Hugging Face folder that no conversion reads, on purpose: RoPE tables some
    checkpoints store, a tied head's copy, and what a family module's `ignored_hf_keys` names."""
    out = {k for k in keys if k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        out.add("lm_head.weight")
    family = hf_family(cfg)
    if family in _FAMILY_MODULES and hasattr(family_module(family), "ignored_hf_keys"):
        out |= set(family_module(family).ignored_hf_keys(keys, cfg))
    return out


def plan_from_hf(folder: HFFolder, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{moetron name: meta tensor of the model's shape, in `dtype`} in the order `tensors_from_hf`
    yields them (a tied head right after the embedding, which it copies), once the folder holds
    exactly what `cfg`'s family reads: ValueError naming the first tensor missing, of another
    shape, or left unread. Reads headers only."""
    asked: set[str] = set()

    def get(key: str) -> torch.Tensor:
        asked.add(key)
        try:
            return folder.meta(key)
        except KeyError as e:
            raise ValueError(e.args[0]) from None

    with torch.device("meta"):
        params = Decoder(cfg).to(dtype).state_dict()
    plan: dict[str, torch.Tensor] = {}
    for name, tensor in tensors_from_hf(get, folder.keys(), cfg):
        if name not in params or params[name].shape != tensor.shape:
            implied = tuple(params[name].shape) if name in params else "no such tensor"
            raise ValueError(f"{folder.folder}: {name} has shape {tuple(tensor.shape)}, the config implies {implied}")
        plan[name] = params[name]
        if name == "embed.weight" and cfg.tie_embeddings:
            plan["head.weight"] = params["head.weight"]
    missing = sorted(set(params) - set(plan))
    if missing:
        raise ValueError(f"{folder.folder}: no weights for {missing[:3]}")
    unread = sorted(folder.keys() - asked - ignored_hf_keys(folder.keys(), cfg))
    if unread:
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise ValueError(f"{folder.folder}: tensor {unread[0]}{more} is not one the {hf_family(cfg)} "
                         f"conversion expects")
    return plan


def read_from_hf(folder: HFFolder, cfg: ModelConfig, plan: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(moetron name, tensor in the plan's dtype) in the plan's order, read as they are needed."""
    for name, tensor in tensors_from_hf(folder.read, folder.keys(), cfg):
        tensor = tensor.to(plan[name].dtype)
        yield name, tensor
        if name == "embed.weight" and cfg.tie_embeddings:
            yield "head.weight", tensor


def open_hf_folder(hf_dir: str | Path) -> tuple[dict[str, Any], ModelConfig, HFFolder]:
    """(config.json, its ModelConfig, the open folder; close it) of a Hugging Face folder. An unknown
    family is refused before the files are looked at. A DeepSeek-V3 folder whose config counts
    multi-token-prediction layers but holds none of their tensors (what transformers' save_pretrained
    writes: it neither loads nor saves them) converts without them."""
    hf_cfg = read_hf_config(hf_dir)
    cfg = config_from_hf(hf_cfg)
    folder = HFFolder(hf_dir)
    if cfg.mtp_depth and not any(k.startswith(f"model.layers.{cfg.n_layers}.") for k in folder.keys()):
        cfg = cfg.replace(mtp_depth=0)
    return hf_cfg, cfg, folder


def load_hf(hf_dir: str | Path, *, dtype: torch.dtype | None = None) -> Decoder:
    """Build a Decoder from a Hugging Face folder (config.json + safetensors, sharded or not) of a
    family `known_families()` lists. `dtype` defaults to the checkpoint's."""
    hf_cfg, cfg, folder = open_hf_folder(hf_dir)
    try:
        dtype = dtype or hf_dtype(hf_cfg, folder)
        plan = plan_from_hf(folder, cfg, dtype)
        with torch.device("cpu"):
            model = Decoder(cfg).to(dtype)
        params = model.state_dict()
        with torch.no_grad():
            for name, tensor in read_from_hf(folder, cfg, plan):
                if name != "head.weight" or not cfg.tie_embeddings:
                    params[name].copy_(tensor)
    finally:
        folder.close()
    return model


class _Looked(dict):
    """A dict that remembers which keys were looked up."""

    def __init__(self, items: Mapping[str, torch.Tensor]):
        super().__init__(items)
        self.looked: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.looked.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default=None):
        return self[key] if key in self else default


def plan_to_hf(cfg: ModelConfig, meta: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, meta tensor) of every tensor `tensors_to_hf` writes, in its order, from
    the model's tensors as meta tensors (shapes and dtypes, no data); ValueError naming a tensor
    of the model that the family's folder has no place for (it would be lost)."""
    looked = _Looked(meta)
    plan = [(name, torch.empty(t.shape, dtype=t.dtype, device="meta")) for name, t in tensors_to_hf(Weights(cfg, looked))]
    unread = sorted(set(meta) - looked.looked - ({"head.weight"} if cfg.tie_embeddings else set()))
    if unread:
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise ValueError(f"tensor {unread[0]}{more} has no place in a {hf_family(cfg)} folder")
    return plan


def write_hf(weights: Weights, out_dir: str | Path, dtype: torch.dtype, plan: list[tuple[str, torch.Tensor]], *,
             eos_id: int | None = None, max_shard_bytes: int = 5 * 2**30,
             on_tensor: Callable[[int], None] | None = None) -> list[Path]:
    """Write config.json and safetensors shards (with an index when there is more than one) into
    `out_dir` (created if need be), each tensor written as `tensors_to_hf(weights)` yields it, in
    the order and shapes of `plan` (`plan_to_hf`). `on_tensor(bytes)` after each tensor."""
    out_dir = Path(out_dir)
    hf_cfg = config_to_hf(weights.cfg, dtype, eos_id=eos_id)
    shards = shard_plan(plan, max_shard_bytes)
    names = shard_names(len(shards))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2) + "\n")
    tensors = tensors_to_hf(weights)
    for name, shard in zip(names, shards):
        write_shard(out_dir / name, shard, tensors, on_tensor)
    if len(shards) > 1:
        write_index(out_dir, shards, names)
    return [out_dir / n for n in names]


def save_hf(model: Decoder, out_dir: str | Path, *, eos_id: int | None = None,
            max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write `model` as a Hugging Face folder of its family (`hf_family`): see `write_hf`."""
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    plan = plan_to_hf(model.cfg, {k: torch.empty_like(v, device="meta") for k, v in tensors.items()})
    return write_hf(Weights(model.cfg, tensors), out_dir, model.embed.weight.dtype, plan, eos_id=eos_id,
                    max_shard_bytes=max_shard_bytes)

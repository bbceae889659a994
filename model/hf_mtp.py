"""Hugging Face tensors of the multi-token-prediction modules (model/mtp.py), as DeepSeek-V3's
checkpoints store them. A family module (model/hf_deepseek.py) calls these when mtp_depth > 0.

Legend: L = num_hidden_layers (the decoder's layers), V vocabulary, D model dim.

DeepSeek-V3 keeps depth k's module as one more layer, model.layers.{L + k − 1}. (layer 61 of V3):

    HF (model.layers.{L+k−1}.)            moetron (mtp.{L+k−1}.)
    enorm.weight            (D,)           enorm.weight
    hnorm.weight            (D,)           hnorm.weight
    eh_proj.weight          (D, 2D)        eh_proj.weight      (first D inputs: the embedding)
    shared_head.norm.weight (D,)           norm.weight
    input_layernorm, self_attn.*,          block.*             (the family's own layer names)
      post_attention_layernorm, mlp.*
    embed_tokens.weight     (V, D)         — the shared embed.weight
    shared_head.head.weight (V, D)         — the shared head.weight (embed.weight when tied)

The last two are copies of the main model's embedding and head: read (a folder's tensors must all
be read) but not kept, since the modules share the model's own; written as copies, so the folder
has what DeepSeek's loaders expect. transformers' DeepseekV3ForCausalLM drops all of layer L on
load (its `_keys_to_ignore_on_load_unexpected`); vLLM, SGLang and transformers' MtpModel read them.

The block's tensors are the family's: its module's `layer_tensors_from_hf(get, keys, cfg, hf, ours,
moe)` and `layer_tensors_to_hf(sd, cfg, ours, hf, moe)` convert them, as for any of its layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from moetron.model.config import ModelConfig

# moetron name under mtp.{i}. → Hugging Face name under model.layers.{i}., one to one.
_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight"}


def mtp_layers(cfg: ModelConfig) -> range:
    """The layer indices of the MTP modules: L .. L + mtp_depth − 1 (also their keys in `Decoder.mtp`)."""
    return range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth)


def _family(cfg: ModelConfig):
    from moetron.model.hf import family_module, hf_family

    return family_module(hf_family(cfg))


def mtp_tensors_from_hf(get: Callable[[str], torch.Tensor], keys: set[str],
                        cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(moetron name, tensor) of every MTP module, read through `get` from model.layers.{L+k−1}.*;
    meta-safe. The stored copies of the embedding and head are looked up (so the folder reads
    whole) and checked by shape only."""
    family = _family(cfg)
    for i in mtp_layers(cfg):
        hf, ours = f"model.layers.{i}.", f"mtp.{i}."
        for copy in ("embed_tokens.weight", "shared_head.head.weight"):
            shape = tuple(get(f"{hf}{copy}").shape)
            if shape != (cfg.vocab_size, cfg.d_model):
                raise ValueError(f"{hf}{copy}: shape {shape}, the shared embedding and head are "
                                 f"{(cfg.vocab_size, cfg.d_model)}")
        for mine, theirs in _OWN.items():
            yield f"{ours}{mine}", get(f"{hf}{theirs}")
        yield from family.layer_tensors_from_hf(get, keys, cfg, hf, f"{ours}block.", cfg.is_moe_layer(i))


def mtp_tensors_to_hf(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, contiguous tensor) of every MTP module in DeepSeek-V3's layout, from
    `model.cfg` and `model.state_dict()` (a Decoder, or hf.py's `Weights`)."""
    cfg, sd = model.cfg, model.state_dict()
    family = _family(cfg)
    for i in mtp_layers(cfg):
        hf, ours = f"model.layers.{i}.", f"mtp.{i}."
        yield f"{hf}embed_tokens.weight", sd["embed.weight"].contiguous()
        for mine, theirs in _OWN.items():
            yield f"{hf}{theirs}", sd[f"{ours}{mine}"].contiguous()
        yield from family.layer_tensors_to_hf(sd, cfg, f"{ours}block.", hf, cfg.is_moe_layer(i))
        yield f"{hf}shared_head.head.weight", sd["embed.weight" if cfg.tie_embeddings else "head.weight"].contiguous()

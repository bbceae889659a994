"""The decoder: embedding → N blocks (attention + dense FFN or MoE) → final norm → LM head.

Legend: B batch, S sequence, D model dim, V vocabulary.

Layers live in a ModuleDict keyed by their index so that pipeline stages can drop the ones
they do not own and checkpoints keep the same keys on every layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from moetron.model.attention import Attention, KVCache, WindowKVCache
from moetron.model.config import ModelConfig
from moetron.model.layers import FeedForward, build_norm
from moetron.model.mla import LatentCache, MLAttention
from moetron.model.moe import MoELayer, MoEStats
from moetron.model.mtp import MTPModule, ids_ahead
from moetron.model.parallel_hooks import ParallelHooks
from moetron.model.positions import (
    RelativePositionBias,
    alibi_slopes,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    sinusoidal_table,
)


@dataclass
class ModelOutput:
    """Logits plus what the MoE layers report: summed aux losses and per-layer stats."""

    logits_BSV: torch.Tensor
    aux_loss: torch.Tensor
    moe: dict[int, MoEStats] = field(default_factory=dict)
    # Multi-token prediction (model/mtp.py), training only: depth k's logits (B, S, V) for the
    # token k + 1 places ahead, k = 1..mtp_depth; empty when off, in eval mode and when decoding.
    mtp_logits: list[torch.Tensor] = field(default_factory=list)


class Block(nn.Module):
    """Pre-norm x + f(norm(x)) or post-norm norm(x + f(x)), for attention then FFN/MoE."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.attn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = MLAttention.from_config(cfg) if cfg.mla.enabled else Attention(
            cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_head,
            backend=cfg.attention, bias=cfg.bias, dropout=cfg.dropout,
            qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps, causal=cfg.causal,
            proj_bias=cfg.attention_bias, sinks=cfg.attention_sinks, window=cfg.layer_window(layer))
        self.ffn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ffn = MoELayer(cfg) if cfg.is_moe_layer(layer) else FeedForward(
            cfg.d_model, cfg.d_ff, cfg.activation, cfg.bias, cfg.dropout)

    def forward(self, x_BSD: torch.Tensor, **attn_kwargs) -> tuple[torch.Tensor, MoEStats | None]:
        if self.pre_norm:
            x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), **attn_kwargs)
            y_BSD, stats = self._ffn(self.ffn_norm(x_BSD))
            return x_BSD + y_BSD, stats
        x_BSD = self.attn_norm(x_BSD + self.attn(x_BSD, **attn_kwargs))
        y_BSD, stats = self._ffn(x_BSD)
        return self.ffn_norm(x_BSD + y_BSD), stats

    def _ffn(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, MoEStats | None]:
        if isinstance(self.ffn, MoELayer):
            return self.ffn(x_BSD)
        return self.ffn(x_BSD), None

    def init_weights(self, std: float, out_std: float) -> None:
        for norm in (self.attn_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attn.init_weights(std, out_std)
        self.ffn.init_weights(std, out_std)


class Decoder(nn.Module):
    """A decoder-only language model. Any of `embed`, `layers`, `norm`, `head` may be absent on
    a pipeline stage; `forward` then takes hidden states instead of token ids or returns them.
    `mtp`: the multi-token-prediction modules (model/mtp.py), None without them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        # One table for every layer, as in T5; attention looks it up for its own queries and keys.
        self.t5_bias = (RelativePositionBias(cfg.t5_num_buckets, cfg.n_heads, cfg.t5_max_distance)
                        if cfg.position == "t5" else None)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.norm_position == "pre" else None
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Keyed by layer index after the decoder's (n_layers + k − 1 for depth k), as DeepSeek's
        # checkpoints number them; the last pipeline stage holds them.
        self.mtp = nn.ModuleDict({str(i): MTPModule(cfg, Block(cfg, i)) for i in range(
            cfg.n_layers, cfg.n_layers + cfg.mtp_depth)}) if cfg.mtp_depth else None
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.register_buffer("rope_inv_freq", _rope_inv_freq(cfg), persistent=False)
        self.register_buffer("alibi_slopes_H", alibi_slopes(cfg.n_heads), persistent=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        # sequence_shards (sequence parallelism) and token_positions (context parallelism): how
        # many positions a hidden-state input stands for, and which. Default: 0..S−1 (+ start_pos).
        self.hooks = ParallelHooks()

    def forward(self, x: torch.Tensor, doc_start_BL: torch.Tensor | None = None,
                positions_BL: torch.Tensor | None = None, *, caches: list[KVCache] | None = None,
                start_pos: int = 0, mtp_ids_BS: torch.Tensor | None = None) -> ModelOutput:
        """x: token ids (B, S) on the first stage, else hidden states (B, S, D). With `caches`,
        positions start at `start_pos` and each layer's keys and values are appended to its cache.
        `mtp_ids_BS`: the token ids, for a stage that takes hidden states and holds the
        multi-token-prediction modules (the last pipeline stage); they run while training only.

        Packed documents (model/packing.py), both over the L positions of the whole sequences
        (L = S, or more where parallel/ holds a part of each): `doc_start_BL` keeps attention inside
        each document; `positions_BL` replaces 0..L−1 for the position encodings (RoPE, learned,
        sinusoidal), e.g. restarting per document. ALiBi and T5's bias keep token distances, which
        within a document are the same.
        """
        hooks = self.hooks
        # Token ids on the first stage; the last one may hold a copy of the embedding for MTP.
        takes_ids = not torch.is_floating_point(x)
        S = x.shape[1] if takes_ids else x.shape[1] * hooks.sequence_shards
        attn_kwargs: dict = {}
        if hooks.token_positions is not None:
            if caches is not None:
                raise ValueError("KV-cache decoding runs on one process, not under context parallelism")
            index_S = attn_kwargs["positions_S"] = hooks.token_positions(S, x.device)
        else:
            index_S = torch.arange(start_pos, start_pos + S, device=x.device)
        if doc_start_BL is not None:
            if caches is not None:
                raise ValueError("KV-cache decoding takes one document, without doc_start_BL")
            attn_kwargs["doc_start_BL"] = doc_start_BL
        positions = positions_BL[:, index_S] if positions_BL is not None else index_S
        h_BSD = self._embed(x, positions) if takes_ids else x
        attn_kwargs |= self._position_kwargs(positions)
        aux = h_BSD.new_zeros((), dtype=torch.float32)
        stats: dict[int, MoEStats] = {}
        for name, block in self.layers.items():
            cache = caches[int(name)] if caches is not None else None
            h_BSD, layer_stats = block(h_BSD, cache=cache, **attn_kwargs)
            if layer_stats is not None:
                stats[int(name)] = layer_stats
                aux = aux + layer_stats.aux_loss + layer_stats.z_loss
        if self.norm is not None:
            h_BSD = self.norm(h_BSD)
        out_BSV = self.head(h_BSD) if self.head is not None else h_BSD
        ahead: list[torch.Tensor] = []
        if self.mtp is not None and self.head is not None and self.training and caches is None:
            ahead, aux = self._predict_ahead(h_BSD, x if takes_ids else mtp_ids_BS, attn_kwargs, aux, stats)
        return ModelOutput(out_BSV, aux, stats, ahead)

    def _predict_ahead(self, h_BSD: torch.Tensor, ids_BS: torch.Tensor | None, attn_kwargs: dict,
                       aux: torch.Tensor, stats: dict[int, MoEStats]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Multi-token prediction (model/mtp.py) from the final-normed states h_BSD: each depth's
        logits (B, S, V), and `aux` plus its MoE blocks' losses (their stats go into `stats`)."""
        if ids_BS is None:
            raise ValueError("multi-token prediction needs the token ids (mtp_ids_BS) beside hidden states")
        if self.hooks.token_positions is not None:
            raise ValueError("multi-token prediction needs whole sequences, not context parallelism")
        logits = []
        for name, module in self.mtp.items():
            k = int(name) - self.cfg.n_layers + 1
            e_BSD = self.embed(ids_ahead(ids_BS, k))
            h_BSD, logits_BSV, layer_stats = module(h_BSD, e_BSD, self.head, **attn_kwargs)
            logits.append(logits_BSV)
            if layer_stats is not None:
                stats[int(name)] = layer_stats
                aux = aux + layer_stats.aux_loss + layer_stats.z_loss
        return logits, aux

    def blocks(self) -> list[Block]:
        """The decoder's blocks held here, then those of its MTP modules: what parallel/ splits,
        wraps and checkpoints as layers."""
        return [*self.layers.values(), *(module.block for module in (self.mtp or {}).values())]

    def _position_kwargs(self, positions: torch.Tensor) -> dict:
        """What attention needs of the position encoding, for positions (S,) or (B, S)."""
        cfg = self.cfg
        if cfg.position == "rope":
            cos, sin = rope_cos_sin(positions, self.rope_inv_freq)
            # MLA folds YaRN's temperature into its softmax scale instead (model/mla.py).
            mscale = 1.0 if cfg.mla.enabled else rope_attention_factor(cfg.rope_scaling, cfg.rope_scaling_factor)
            return {"rope": (cos * mscale, sin * mscale) if mscale != 1.0 else (cos, sin)}
        if cfg.position == "alibi":
            return {"alibi_slopes_H": self.alibi_slopes_H}
        if cfg.position == "t5":
            return {"t5_bias": self.t5_bias}
        return {}

    def _embed(self, ids_BS: torch.Tensor, positions_S: torch.Tensor) -> torch.Tensor:
        h_BSD = self.embed(ids_BS)
        if self.pos_embed is not None:
            h_BSD = h_BSD + self.pos_embed(positions_S)
        elif self.cfg.position == "sinusoidal":
            # As Vaswani et al.: token embeddings scaled by √d_model, else the unit-amplitude table
            # drowns embeddings initialized at std 0.02 (the tiny model then did not learn at all).
            h_BSD = h_BSD * math.sqrt(self.cfg.d_model) + sinusoidal_table(positions_S, self.cfg.d_model).to(h_BSD.dtype)
        return self.embed_dropout(h_BSD)

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, std) everywhere; the projections that write into the residual stream get
        std / sqrt(2·n_layers) so its variance stays flat with depth (GPT-2, Megatron)."""
        cfg = self.cfg
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        if self.embed is not None:
            nn.init.normal_(self.embed.weight, std=std)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed.weight, std=std)
        if self.t5_bias is not None:
            nn.init.normal_(self.t5_bias.weight, std=std)
        for block in self.layers.values():
            block.init_weights(std, out_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.head is not None and not cfg.tie_embeddings:
            nn.init.normal_(self.head.weight, std=std)
        # Last, so the decoder's weights are those of the same model without MTP (same seed).
        for module in (self.mtp or {}).values():
            module.init_weights(std, out_std)
        self.rope_inv_freq.copy_(_rope_inv_freq(cfg))
        self.alibi_slopes_H.copy_(alibi_slopes(cfg.n_heads))

    def set_kernel_backend(self, backend: str | None) -> None:
        """Run the fused ops (grouped GEMM, flash attention) with `backend`: "triton", "torch",
        "interpret" (Triton's CPU interpreter), or None/"auto": per op and pass, the path measured
        faster on this GPU model (kernels/measured_backends.py), torch on the CPU."""
        backend = None if backend == "auto" else backend
        for module in self.modules():
            if hasattr(module, "kernel_backend"):
                module.kernel_backend = backend

    def new_caches(self, batch: int, max_len: int, *, dtype=None, device=None,
                   ) -> list[KVCache | WindowKVCache | LatentCache]:
        """One empty KV cache per layer, for `generate`: under MLA the latent and the rope key; a
        sliding layer's holds its window's positions only."""
        cfg = self.cfg
        ref = self.embed.weight
        if cfg.mla.enabled:
            return [LatentCache.empty(batch, max_len, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim,
                                      dtype=dtype or ref.dtype, device=device or ref.device) for _ in range(cfg.n_layers)]
        kw = dict(dtype=dtype or ref.dtype, device=device or ref.device)
        # A sliding layer keeps only its last `window` positions (the window's keys).
        return [WindowKVCache.empty(batch, cfg.kv_heads, cfg.layer_window(i), cfg.dim_head, **kw)
                if 0 < cfg.layer_window(i) < max_len else KVCache.empty(batch, cfg.kv_heads, max_len, cfg.dim_head, **kw)
                for i in range(cfg.n_layers)]


def _rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    # Under MLA only the decoupled qk_rope_head_dim dims of q and k rotate.
    rope_dim = cfg.mla.qk_rope_head_dim if cfg.mla.enabled else cfg.dim_head
    return rope_inv_freq(rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor,
                         cfg.rope_original_len, truncate=cfg.rope_yarn_truncate)


def build_model(cfg: ModelConfig, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Decoder:
    """Build and initialize. On "meta" nothing is allocated: parallelize, `to_empty`, then `init_weights`."""
    with torch.device(device):
        model = Decoder(cfg).to(dtype)
    if str(device) != "meta":
        model.init_weights()
    return model

"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 §2.1; DeepSeek-V3, 2412.19437 §2.1.1)
and its KV cache, which keeps the compressed latent instead of keys and values.

Legend: B batch, S query positions, L key positions (cache length), D model dim, H heads,
R kv_lora_rank (the latent), Rq q_lora_rank, Dn qk_nope_head_dim, Dr qk_rope_head_dim,
Dq = Dn + Dr a query's or key's head dim, Dv v_head_dim.

    q_BHSDq      = x · W_q, or W_qb · RMSNorm(x · W_qa) when q_lora_rank > 0   (heads [nope | rope])
    [c | k_rope] = x · W_kva                   c (B, S, R) the latent, k_rope (B, S, Dr) ONE key head
    c            = RMSNorm(c)                  kv_norm
    [k_nope | v] = c · W_kvb                   per head: Dn + Dv
    k_BHSDq      = [k_nope | k_rope]           k_rope shared by every head
    o            = softmax(q·kᵀ · scale) v · W_o, scale = Dq^-0.5 (× YaRN's temperature², see below)

RoPE (rotate-half, model/positions.py, Dr wide) turns only q's rope part and k_rope. The latent and
k_rope are what a cache keeps (`LatentCache`): R + Dr numbers per position and layer (V3: 576)
instead of the keys and values, H·(Dq + Dv) (V3: 128·(192 + 128) = 40,960). Keys and values are
re-expanded from the latent on every step — the plain form of the paper, which can also absorb
W_kvb into W_q and W_o; that saves the expansion at decode time and is not built here.

YaRN (rope_scaling yarn) scales the softmax scale by (0.1 · mla.yarn_mscale · ln(factor) + 1)² —
every q·k dim, as DeepSeek's `mscale_all_dim` does — instead of scaling cos and sin (which would
reach the rope dims only); the Decoder leaves cos and sin alone under MLA.

Context parallelism exchanges the latent and k_rope (`hooks.kv_exchange.gather_kv` with two one-head
tensors of different widths, R and Dr) rather than expanded keys and values: cheaper, and the
heads' expansion then runs on every position here. Tensor parallelism splits W_q / W_qb, W_kvb (by
heads) and W_o; the down projections and their norms are replicated (parallel/tensor_parallel.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetron.model.attention import append_positions, attention_bias, eager_attention
from moetron.model.config import MLAConfig, ModelConfig
from moetron.model.parallel_hooks import ParallelHooks
from moetron.model.positions import apply_rope


@dataclass
class LatentCache:
    """The normed latent c and the rotated k_rope of one layer for positions [0, length), as one-head
    tensors (B, 1, L, R) and (B, 1, L, Dr), preallocated to `max_len`."""

    c_B1LR: torch.Tensor
    k_rope_B1LDr: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int, *, dtype, device) -> "LatentCache":
        return cls(torch.zeros(batch, 1, max_len, kv_lora_rank, dtype=dtype, device=device),
                   torch.zeros(batch, 1, max_len, rope_dim, dtype=dtype, device=device))

    def append(self, c_B1SR: torch.Tensor, k_rope_B1SDr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions and return the latent and k_rope of all positions so far."""
        c, k_rope = append_positions((self.c_B1LR, self.k_rope_B1LDr), (c_B1SR, k_rope_B1SDr), self.length,
                                     "latent cache")
        self.length = c.shape[2]
        return c, k_rope


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """Dq^-0.5, times YaRN's temperature squared under rope_scaling yarn (module docstring)."""
    scale = cfg.mla.qk_head_dim**-0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_scaling_factor > 1.0:
        scale *= (0.1 * cfg.mla.yarn_mscale * math.log(cfg.rope_scaling_factor) + 1.0) ** 2
    return scale


class MLAttention(nn.Module):
    """Multi-head latent attention; `forward` takes what `Attention.forward` takes (model/attention.py),
    ALiBi and T5's bias aside (MLA is a RoPE model: config.py refuses the others)."""

    def __init__(self, d_model: int, n_heads: int, mla: MLAConfig, *, softmax_scale: float | None = None,
                 backend: str = "sdpa", dropout: float = 0.0, causal: bool = True, latent_norm_eps: float = 1e-6):
        super().__init__()
        self.n_heads, self.causal, self.backend = n_heads, causal, backend
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.qk_dim, self.kv_lora_rank, self.q_lora_rank = mla.qk_head_dim, mla.kv_lora_rank, mla.q_lora_rank
        self.scale = self.qk_dim**-0.5 if softmax_scale is None else softmax_scale
        # Which flash-attention implementation the "triton" backend runs; None: automatic.
        self.kernel_backend: str | None = None
        if mla.q_lora_rank:
            # The latents' norms use eps 1e-6 whatever model.norm_eps is, as DeepSeek's code does.
            self.wq_a = nn.Linear(d_model, mla.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(mla.q_lora_rank, eps=latent_norm_eps)
            self.wq_b = nn.Linear(mla.q_lora_rank, n_heads * self.qk_dim, bias=False)
        else:
            self.wq = nn.Linear(d_model, n_heads * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(d_model, mla.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(mla.kv_lora_rank, eps=latent_norm_eps)
        self.wkv_b = nn.Linear(mla.kv_lora_rank, n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(n_heads * self.v_dim, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)
        # kv_exchange (context parallelism): gathers the latents and rope keys of every position.
        self.hooks = ParallelHooks()

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "MLAttention":
        return cls(cfg.d_model, cfg.n_heads, cfg.mla, softmax_scale=mla_softmax_scale(cfg), backend=cfg.attention,
                   dropout=cfg.dropout, causal=cfg.causal)

    def forward(
        self,
        x_BSD: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        alibi_slopes_H: torch.Tensor | None = None,
        cache: LatentCache | None = None,
        positions_S: torch.Tensor | None = None,
        t5_bias=None,
        doc_start_BL: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `Attention.forward`: `rope` the (cos, sin) of the S new positions (Dr wide), `cache` the
        earlier positions' latents, `positions_S` the queries' global positions under context
        parallelism, `doc_start_BL` the packed documents' starts. `alibi_slopes_H` and `t5_bias` are
        never set for MLA (a RoPE model)."""
        B, S, _ = x_BSD.shape
        q_BHSDq = self._queries(x_BSD)
        c_BSR, k_rope_BSDr = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_B1SR, k_rope_B1SDr = self.kv_norm(c_BSR)[:, None], k_rope_BSDr[:, None]
        if rope is not None:
            q_nope_BHSDn, q_rope_BHSDr = q_BHSDq.split([self.nope_dim, self.rope_dim], dim=-1)
            q_BHSDq = torch.cat([q_nope_BHSDn, apply_rope(q_rope_BHSDr, *rope)], dim=-1)
            k_rope_B1SDr = apply_rope(k_rope_B1SDr, *rope)
        if cache is not None:
            c_B1SR, k_rope_B1SDr = cache.append(c_B1SR, k_rope_B1SDr)
        if positions_S is not None and self.hooks.kv_exchange is not None:
            c_B1SR, k_rope_B1SDr = self.hooks.kv_exchange.gather_kv(c_B1SR, k_rope_B1SDr)
        k_BHLDq, v_BHLDv = self._keys_values(c_B1SR, k_rope_B1SDr)
        o_BHSDv = self._attend(q_BHSDq, k_BHLDq, v_BHLDv, positions_S, doc_start_BL)
        return self.dropout(self.wo(o_BHSDv.transpose(1, 2).reshape(B, S, -1)))

    def _queries(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """→ q (B, H, S, Dq) before RoPE; heads from the projection's width, which TP splits."""
        B, S, _ = x_BSD.shape
        q_BSX = self.wq_b(self.q_norm(self.wq_a(x_BSD))) if self.q_lora_rank else self.wq(x_BSD)
        return q_BSX.view(B, S, -1, self.qk_dim).transpose(1, 2)

    def _keys_values(self, c_B1LR: torch.Tensor, k_rope_B1LDr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent expanded per head: keys [k_nope | k_rope] (B, H, L, Dq), values (B, H, L, Dv)."""
        B, _, L, _ = c_B1LR.shape
        kv_BHLX = self.wkv_b(c_B1LR[:, 0]).view(B, L, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope_BHLDn, v_BHLDv = kv_BHLX.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope_BHLDr = k_rope_B1LDr.expand(-1, k_nope_BHLDn.shape[1], -1, -1)
        return torch.cat([k_nope_BHLDn, k_rope_BHLDr], dim=-1), v_BHLDv

    def _attend(self, q_BHSDq, k_BHLDq, v_BHLDv, positions_S=None, doc_start_BL=None) -> torch.Tensor:
        """softmax(q·kᵀ · scale + mask) v → (B, H, S, Dv). Every backend (eager, SDPA, the flash kernel)
        takes Dv ≠ Dq as is; queries at `positions_S` (context parallelism) take the explicit-mask
        path, as in Attention."""
        S, L = q_BHSDq.shape[2], k_BHLDq.shape[2]
        if self.backend == "triton" and positions_S is None:
            return self._flash(q_BHSDq, k_BHLDq, v_BHLDv, doc_start_BL)
        if self.backend == "sdpa" and positions_S is None and doc_start_BL is None and S == L:
            return F.scaled_dot_product_attention(q_BHSDq, k_BHLDq, v_BHLDv, is_causal=self.causal, scale=self.scale)
        bias = attention_bias(S, L, causal=self.causal, slopes_H=None, device=q_BHSDq.device,
                              q_positions_S=positions_S, doc_start_BL=doc_start_BL)
        if self.backend == "eager":
            return eager_attention(q_BHSDq, k_BHLDq, v_BHLDv, bias, self.scale)
        return F.scaled_dot_product_attention(q_BHSDq, k_BHLDq, v_BHLDv, scale=self.scale,
                                              attn_mask=None if bias is None else bias.to(q_BHSDq.dtype))

    def _flash(self, q_BHSDq, k_BHLDq, v_BHLDv, doc_start_BL) -> torch.Tensor:
        """The flash kernel takes q/k's head dim Dq and v's Dv apart (V3: 192 and 128), so v goes in
        as it is and the output comes out Dv wide."""
        from moetron.kernels.flash_attention import flash_attention

        return flash_attention(q_BHSDq, k_BHLDq, v_BHLDv, causal=self.causal, softmax_scale=self.scale,
                               doc_start_BS=doc_start_BL, backend=self.kernel_backend)

    def init_weights(self, std: float, out_std: float) -> None:
        norms = (self.q_norm, self.kv_norm) if self.q_lora_rank else (self.kv_norm,)
        for norm in norms:
            norm.reset_parameters()
        projections = (self.wq_a, self.wq_b) if self.q_lora_rank else (self.wq,)
        for lin in (*projections, self.wkv_a, self.wkv_b):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)

"""Causal self-attention: MHA, GQA and MQA, with RoPE, ALiBi or T5's bias, sliding windows, attention
sinks and a KV cache for decoding.

Legend: B batch, S query positions, L key positions (cache length), D model dim,
H query heads, G key/value heads (H % G == 0), Dh head dim, X = H·Dh and Y = G·Dh the q and k widths.

Queries and keys may be RMS-normalized before RoPE (qk-norm): per head (Qwen3) or over the whole
projection (OLMoE). Being applied to q and k themselves, it holds for every backend and the cache.

A sliding window of W (GPT-OSS, Mistral): query i sees keys i − W < j ≤ i, itself and the W − 1
before it (transformers' `sliding_window_overlay`: kv_idx > q_idx − W); it is one more mask term,
so every path that builds a mask takes it. A layer with a window keeps only its last W positions
when decoding (`WindowKVCache`). Attention sinks (GPT-OSS): one learned logit per query head joins
every query's softmax as an extra key with no value, so a query may put weight on "nothing":
p_j = exp(s_j) / (Σ_j' exp(s_j') + exp(sink_h)).

Backends all compute the same thing: "eager" is the plain reference (scores materialized,
softmax in fp32), "sdpa" is torch's scaled_dot_product_attention, "triton" the flash kernel.
T5's relative bias is a full (H, S, L) tensor, which the flash kernel's bias path (ALiBi slopes
only) cannot take: with it every backend runs the reference bias path (eager, or SDPA with the
bias as its mask). SDPA takes no per-head extra logit, so with sinks the "sdpa" backend runs the eager
reference (which materializes the scores and the sink column); the flash kernel takes them itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetron.model.parallel_hooks import ParallelHooks
from moetron.model.positions import RelativePositionBias, alibi_bias, apply_rope


def append_positions(held: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...], length: int,
                     what: str) -> tuple[torch.Tensor, ...]:
    """Write each of `new` (B, ·, S, ·) into its preallocated buffer of `held` (B, ·, max_len, ·) at
    positions [length, length + S) → the buffers' views of positions [0, length + S). Positions past
    max_len are refused, the error naming the cache (`what`)."""
    end = length + new[0].shape[2]
    if end > held[0].shape[2]:
        raise ValueError(f"{what} holds {held[0].shape[2]} positions; {end} requested")
    for buffer, x in zip(held, new):
        buffer[:, :, length:end] = x
    return tuple(buffer[:, :, :end] for buffer in held)


@dataclass
class KVCache:
    """Keys and values of one layer for positions [0, length), preallocated to `max_len`."""

    k_BGLDh: torch.Tensor
    v_BGLDh: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, batch: int, kv_heads: int, max_len: int, head_dim: int, *, dtype, device) -> "KVCache":
        shape = (batch, kv_heads, max_len, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def append(self, k_BGSDh: torch.Tensor, v_BGSDh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions and return keys and values for all positions so far."""
        k, v = append_positions((self.k_BGLDh, self.v_BGLDh), (k_BGSDh, v_BGSDh), self.length, "KV cache")
        self.length = k.shape[2]
        return k, v


@dataclass
class WindowKVCache:
    """Keys and values of a sliding-window layer: only the last `window` positions (W), shifted left
    as new ones arrive, so memory stays W positions however long the generation (a full layer's
    `KVCache` holds them all). `length` counts every position appended so far."""

    k_BGWDh: torch.Tensor
    v_BGWDh: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, batch: int, kv_heads: int, window: int, head_dim: int, *, dtype, device) -> "WindowKVCache":
        shape = (batch, kv_heads, window, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def append(self, k_BGSDh: torch.Tensor, v_BGSDh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions; return the held ones (up to W) followed by the new S: (B, G, L, Dh)
        each. The queries are the last S of those L keys, and the window mask counts offsets only, so
        the positions that fell out of the buffer are exactly those no query here may see."""
        W = self.k_BGWDh.shape[2]
        held = min(self.length, W)
        k_BGLDh = torch.cat([self.k_BGWDh[:, :, :held], k_BGSDh], dim=2)
        v_BGLDh = torch.cat([self.v_BGWDh[:, :, :held], v_BGSDh], dim=2)
        kept = min(k_BGLDh.shape[2], W)
        self.k_BGWDh[:, :, :kept] = k_BGLDh[:, :, -kept:]
        self.v_BGWDh[:, :, :kept] = v_BGLDh[:, :, -kept:]
        self.length += k_BGSDh.shape[2]
        return k_BGLDh, v_BGLDh


class SinkLogits(nn.Module):
    """The attention sinks' learned logits, one per query head: `weight` (H,). A module of its own so
    tensor parallelism can shard it with the heads (each rank holds and returns its H/tp logits)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def forward(self) -> torch.Tensor:
        return self.weight


def attention_bias(
    n_queries: int, n_keys: int, *, causal: bool, slopes_H: torch.Tensor | None, device,
    q_positions_S: torch.Tensor | None = None, t5_bias: RelativePositionBias | None = None,
    doc_start_BL: torch.Tensor | None = None, window: int = 0,
) -> torch.Tensor | None:
    """Additive bias (H or 1, S, L): -inf above the causal diagonal, ALiBi's linear distance penalty
    or T5's learned bias of the offset's bucket; with packed documents (B, H or 1, S, L), -inf
    also before the start of each query's document (`doc_start_BL`, model/packing.py); with a
    `window` W > 0, -inf on keys W or more positions before their query (it sees W keys at most).

    Keys are positions 0..L−1. Queries are the last `n_queries` of them (prefill: equal; decode:
    one), or the positions `q_positions_S`, in any order (context parallelism's local tokens).
    """
    if not causal and slopes_H is None and t5_bias is None and doc_start_BL is None and not window:
        return None
    q_pos = torch.arange(n_keys - n_queries, n_keys, device=device) if q_positions_S is None else q_positions_S
    k_pos = torch.arange(n_keys, device=device)
    bias = torch.zeros(1, n_queries, n_keys, device=device)
    if slopes_H is not None:
        bias = alibi_bias(slopes_H, q_pos, k_pos)
    if t5_bias is not None:
        bias = t5_bias.bias(q_pos, k_pos).float()
    if causal:
        bias = bias.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    if window:
        bias = bias.masked_fill(k_pos[None, None, :] <= q_pos[None, :, None] - window, float("-inf"))
    if doc_start_BL is not None:
        before_B1SL = (k_pos[None, None, None, :] < doc_start_BL[:, q_pos][:, None, :, None])
        bias = bias[None].masked_fill(before_B1SL, float("-inf"))
    return bias


def eager_attention(q_BHSDh, k_BGLDh, v_BGLDh, bias, scale: float, sinks_H: torch.Tensor | None = None,
                    ) -> torch.Tensor:
    """The reference: repeat K/V per group, materialize scores, softmax in fp32 (or fp64 for fp64
    inputs: the float64 references must not be rounded to fp32 here). `sinks_H` (H,): each head's
    sink logit joins every query's softmax as one more column, whose probability is then dropped
    (it has no value), as transformers' GPT-OSS `eager_attention_forward` does."""
    groups = q_BHSDh.shape[1] // k_BGLDh.shape[1]
    k_BHLDh = k_BGLDh.repeat_interleave(groups, dim=1)
    v_BHLDh = v_BGLDh.repeat_interleave(groups, dim=1)
    softmax_dtype = torch.promote_types(q_BHSDh.dtype, torch.float32)
    scores_BHSL = (q_BHSDh @ k_BHLDh.transpose(-1, -2)).to(softmax_dtype) * scale
    if bias is not None:
        scores_BHSL = scores_BHSL + bias
    if sinks_H is None:
        probs_BHSL = scores_BHSL.softmax(dim=-1).to(v_BHLDh.dtype)
        return probs_BHSL @ v_BHLDh
    sink_BHS1 = sinks_H.to(scores_BHSL.dtype).view(1, -1, 1, 1).expand(*scores_BHSL.shape[:-1], 1)
    probs_BHSL = torch.cat([scores_BHSL, sink_BHS1], dim=-1).softmax(dim=-1)[..., :-1].to(v_BHLDh.dtype)
    return probs_BHSL @ v_BHLDh


class Attention(nn.Module):
    """Multi-head causal self-attention with `n_kv_heads` key/value heads.

    `bias` puts a bias on every projection; `proj_bias` on some only: "qkv" on the query, key and
    value projections (Qwen2), "all" on the output projection too (GPT-OSS). `sinks`: a learned sink
    logit per head (`self.sinks`); `window`: the sliding window W (0: every earlier position).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
                 backend: str = "sdpa", bias: bool = False, dropout: float = 0.0,
                 qk_norm: str = "none", norm_eps: float = 1e-5, causal: bool = True,
                 proj_bias: str = "none", sinks: bool = False, window: int = 0):
        super().__init__()
        # False: a bidirectional encoder's attention (no mask; no KV cache, which only decoding needs).
        self.causal = causal
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.backend = backend
        # Which flash-attention implementation the "triton" backend runs; None: automatic.
        self.kernel_backend: str | None = None
        self.scale = head_dim**-0.5
        self.window = window
        qkv_bias, out_bias = bias or proj_bias in ("qkv", "all"), bias or proj_bias == "all"
        self.wq = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * head_dim, d_model, bias=out_bias)
        self.sinks = SinkLogits(n_heads) if sinks else None
        self.dropout = nn.Dropout(dropout)
        # RMSNorm of q and k before RoPE (ModelConfig.qk_norm): per head over Dh, or over the whole
        # projection (which a tensor-parallel shard of the heads cannot compute alone).
        self.qk_norm = qk_norm
        whole = qk_norm == "projection"
        q_width, k_width = (n_heads * head_dim, n_kv_heads * head_dim) if whole else (head_dim, head_dim)
        self.q_norm = nn.RMSNorm(q_width, eps=norm_eps) if qk_norm != "none" else None
        self.k_norm = nn.RMSNorm(k_width, eps=norm_eps) if qk_norm != "none" else None
        # kv_exchange (context parallelism): gathers the keys and values of every position of the
        # sequences, in global order. None: the S local positions are the whole sequence.
        self.hooks = ParallelHooks()

    def forward(
        self,
        x_BSD: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        alibi_slopes_H: torch.Tensor | None = None,
        cache: KVCache | WindowKVCache | None = None,
        positions_S: torch.Tensor | None = None,
        t5_bias: RelativePositionBias | None = None,
        doc_start_BL: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`rope` is (cos, sin) for the S new positions; `cache` holds the earlier ones.
        `doc_start_BL`: where the document of each of the L positions of the sequences begins
        (packed documents, model/packing.py); a query then sees only the keys of its own document.
        `t5_bias`: the model's shared relative-bias table, looked up here for these queries and keys
        (a decode step: the newest position against every cached one). A layer with a window takes a
        `WindowKVCache`, which hands back the last W cached positions and the new ones.

        `positions_S`: the global positions of the S queries when they are not 0..S−1 (context
        parallelism: two chunks of a longer sequence, whose keys `hooks.kv_exchange` gathers). The mask
        and the ALiBi bias are then built from them, so only the explicit-bias paths apply (eager,
        or SDPA with a mask, also for backend "triton"): the causal fast paths assume the queries
        and keys are the same aligned square. The window and the sinks hold on every path.
        """
        B, S, _ = x_BSD.shape
        q_BHSDh, k_BGSDh = self._queries_keys(x_BSD)
        v_BGSDh = self.wv(x_BSD).view(B, S, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q_BHSDh, k_BGSDh = apply_rope(q_BHSDh, *rope), apply_rope(k_BGSDh, *rope)
        if cache is not None:
            k_BGSDh, v_BGSDh = cache.append(k_BGSDh, v_BGSDh)
        if positions_S is not None:
            if self.hooks.kv_exchange is not None:
                k_BGSDh, v_BGSDh = self.hooks.kv_exchange.gather_kv(k_BGSDh, v_BGSDh)
            o_BHSDh = self._attend_at(q_BHSDh, k_BGSDh, v_BGSDh, alibi_slopes_H, positions_S, t5_bias, doc_start_BL)
            return self.dropout(self.wo(o_BHSDh.transpose(1, 2).reshape(B, S, -1)))
        o_BHSDh = self._attend(q_BHSDh, k_BGSDh, v_BGSDh, alibi_slopes_H, t5_bias, doc_start_BL)
        return self.dropout(self.wo(o_BHSDh.transpose(1, 2).reshape(B, S, -1)))

    def _queries_keys(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected (and qk-normed) queries (B, H, S, Dh) and keys (B, G, S, Dh), before RoPE."""
        B, S, _ = x_BSD.shape
        q_BSX, k_BSY = self.wq(x_BSD), self.wk(x_BSD)
        if self.qk_norm == "projection":
            q_BSX, k_BSY = self.q_norm(q_BSX), self.k_norm(k_BSY)
        # Heads are derived from the projection width so tensor parallelism can shard it.
        q_BSHDh, k_BSGDh = q_BSX.view(B, S, -1, self.head_dim), k_BSY.view(B, S, -1, self.head_dim)
        if self.qk_norm == "head":
            q_BSHDh, k_BSGDh = self.q_norm(q_BSHDh), self.k_norm(k_BSGDh)
        return q_BSHDh.transpose(1, 2), k_BSGDh.transpose(1, 2)

    def _attend(self, q_BHSDh, k_BGLDh, v_BGLDh, slopes_H, t5_bias=None, doc_start_BL=None) -> torch.Tensor:
        S, L = q_BHSDh.shape[2], k_BGLDh.shape[2]
        if t5_bias is not None:
            return self._attend_at(q_BHSDh, k_BGLDh, v_BGLDh, slopes_H, None, t5_bias, doc_start_BL)
        sinks_H = self.sinks() if self.sinks is not None else None
        if self.backend == "triton":
            from moetron.kernels.flash_attention import flash_attention

            return flash_attention(q_BHSDh, k_BGLDh, v_BGLDh, causal=self.causal, alibi_slopes_H=slopes_H,
                                   softmax_scale=self.scale, doc_start_BS=doc_start_BL, sinks_H=sinks_H,
                                   window=self.window, backend=self.kernel_backend)
        if doc_start_BL is not None:
            return self._attend_at(q_BHSDh, k_BGLDh, v_BGLDh, slopes_H, None, None, doc_start_BL)
        # SDPA has no per-head extra logit: with sinks the eager reference runs.
        sdpa = self.backend == "sdpa" and sinks_H is None
        if sdpa and slopes_H is None and S == L and not self.window:
            return F.scaled_dot_product_attention(
                q_BHSDh, k_BGLDh, v_BGLDh, is_causal=self.causal, scale=self.scale,
                enable_gqa=q_BHSDh.shape[1] != k_BGLDh.shape[1])
        bias = attention_bias(S, L, causal=self.causal, slopes_H=slopes_H, device=q_BHSDh.device, window=self.window)
        if sdpa:
            return F.scaled_dot_product_attention(
                q_BHSDh, k_BGLDh, v_BGLDh, attn_mask=None if bias is None else bias.to(q_BHSDh.dtype),
                scale=self.scale, enable_gqa=q_BHSDh.shape[1] != k_BGLDh.shape[1])
        return eager_attention(q_BHSDh, k_BGLDh, v_BGLDh, bias, self.scale, sinks_H)

    def _attend_at(self, q_BHSDh, k_BGLDh, v_BGLDh, slopes_H, q_positions_S, t5_bias=None,
                   doc_start_BL=None) -> torch.Tensor:
        """Queries at global positions `q_positions_S` (None: the last S of the keys) over keys at
        positions 0..L−1, with the bias (and window) materialized: eager, else SDPA with it as the
        mask; with sinks always eager (SDPA cannot add their column)."""
        bias = attention_bias(q_BHSDh.shape[2], k_BGLDh.shape[2], causal=self.causal, slopes_H=slopes_H,
                              device=q_BHSDh.device, q_positions_S=q_positions_S, t5_bias=t5_bias,
                              doc_start_BL=doc_start_BL, window=self.window)
        if self.backend == "eager" or self.sinks is not None:
            return eager_attention(q_BHSDh, k_BGLDh, v_BGLDh, bias, self.scale,
                                   self.sinks() if self.sinks is not None else None)
        return F.scaled_dot_product_attention(
            q_BHSDh, k_BGLDh, v_BGLDh, attn_mask=None if bias is None else bias.to(q_BHSDh.dtype),
            scale=self.scale, enable_gqa=q_BHSDh.shape[1] != k_BGLDh.shape[1])

    def init_weights(self, std: float, out_std: float) -> None:
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
        for lin, s in ((self.wq, std), (self.wk, std), (self.wv, std), (self.wo, out_std)):
            nn.init.normal_(lin.weight, std=s)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        if self.sinks is not None:
            # Logit 0: a sink weighs like one more key whose score is 0.
            nn.init.zeros_(self.sinks.weight)

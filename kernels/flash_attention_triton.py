"""Triton kernels for flash attention: forward (online softmax, logsumexp saved) and backward
(dQ, dK, dV recomputing the probabilities from the logsumexp), FlashAttention-2 style.

Legend: B batch, H query heads, G key/value heads (H % G == 0; query head h reads KV head
h // (H // G)), S_Q query positions, S_K key positions, Dq the head dim of q and k (and dq, dk),
Dv the head dim of v (and o, do, dv); names write either as D.

Head dims (the HEAD_DQ / HEAD_DV constexprs) need not be equal (MLA: Dq 192, Dv 128) nor powers
of two. Triton's tiles are powers of two, so a head dim is held in a tile of the next power of two
(BLOCK_DQ / BLOCK_DV, kernels/attention_tiles.py: 192 in 256, 48 in 64) whose extra columns are
loaded as zeros and never stored: zeros add nothing to q·kᵀ, to p·v or to the gradients' dots, so
every feature below works unchanged. Powers of two compile exactly as without the column mask.
The padding costs dot work (192 in 256: a third more on the q/k side) where a split into two
power-of-two parts (128 + 64) would not; the split needs every dot, load and accumulator of the
q/k side twice, in all three kernels, for a saving worth measuring on a GPU first.

Positions: key j sits at j; query i at i + Q_OFFSET, Q_OFFSET = max(S_K - S_Q, 0), so a decode
step with a KV cache (S_Q < S_K) puts its queries at the end. Causal: key j is visible to query i
when j <= i + Q_OFFSET. ALiBi adds slope_h * (j - (i + Q_OFFSET)) to the scaled logit.

Inside the kernels logits are in base 2 (scaled by log2(e)) so the exponentials are exp2; the
logsumexp the kernels exchange with the op layer is in natural log, as torch.logsumexp gives.
Tiles that no mask can touch run without one (the MASK constexpr), which is most of them.

Documents (the DOCS constexpr; kernels/flash_attention.py defines doc_start): query i sees key j
only if j >= start_i, the first position of its document. A query tile skips the key tiles wholly
before the smallest start among its rows (varlen's saving) and masks those before the largest;
a key tile in dK/dV walks only the queries of documents that reach it, found by a binary search
over the non-decreasing starts, and masks those whose document begins inside it. With DOCS off
the kernels compile exactly as without documents.

Sliding window (the WINDOW constexpr, `window` W at run time, causal only): query i sees key j only
if j > i + Q_OFFSET - W. The window start is a second left bound beside the document start (each
row's first visible key is the later of the two), so it shares the documents' split of a query
tile's key tiles: none before the first row's bound, masked while some row's bound falls inside,
unmasked from there to the diagonal. A key tile in dK/dV walks only the query tiles whose windows
reach it. Keys outside every window are never loaded: the cost is O(S * W), not O(S^2).

Sinks (the SINKS constexpr, GPT-OSS): a logit per query head that joins every row's softmax with
no value. The forward pass opens each row's online softmax with it (running max = sink, sum = 1);
the logsumexp then includes it, so the backward's probabilities need no change, and d sink is a
row reduction done beside delta (_attn_bwd_delta_kernel).

This module imports triton; the op layer (flash_attention.py) imports it only when a Triton
backend runs, so `import moetron.kernels` works where triton is absent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetron.kernels.attention_tiles import (
    SHIPPED_CONFIGS,
    AttnConfig,
    AttnConfigs,
    attention_configs,
    head_dim_constexprs,
)
from moetron.kernels.backend import device_guard, upcast
from moetron.kernels.kernel_spec import KernelSpec

LOG2E = 1.4426950408889634


@triton.jit
def _rows_mask(offs_s, n_rows, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Which entries of rows `offs_s` of a (seq, HEAD_D) matrix, BLOCK_D wide, exist: rows < n_rows,
    and columns < HEAD_D when HEAD_D < BLOCK_D (a power-of-two head dim compiles without a column mask)."""
    mask = offs_s[:, None] < n_rows
    if HEAD_D < BLOCK_D:
        mask = mask & (tl.arange(0, BLOCK_D)[None, :] < HEAD_D)
    return mask


@triton.jit
def _load_rows(base, stride_s, offs_s, n_rows, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr,
        UPCAST: tl.constexpr):
    """Rows `offs_s` of a (seq, HEAD_D) matrix → (len(offs_s), BLOCK_D), BLOCK_D the power of two
    the tile takes; columns from HEAD_D on read as zeros (they add nothing to a dot), and rows
    ≥ n_rows too when MASK. UPCAST widens to fp32 (the interpreter's numpy has no bf16 dot)."""
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = base + offs_s[:, None] * stride_s + offs_d[None, :]
    if MASK:
        tile = tl.load(ptrs, mask=_rows_mask(offs_s, n_rows, HEAD_D, BLOCK_D), other=0.0)
    elif HEAD_D < BLOCK_D:
        tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_D, other=0.0)
    else:
        tile = tl.load(ptrs)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _store_rows(base, stride_s, offs_s, n_rows, tile, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store a (len(offs_s), BLOCK_D) tile into rows `offs_s` < n_rows, columns < HEAD_D, of a
    (seq, HEAD_D) matrix, converted to the matrix's dtype."""
    ptrs = base + offs_s[:, None] * stride_s + tl.arange(0, BLOCK_D)[None, :]
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=_rows_mask(offs_s, n_rows, HEAD_D, BLOCK_D))


@triton.jit
def _load_vec(base, offs, n, MASK: tl.constexpr):
    """Entries `offs` of a length-n vector; past-the-end entries read as zeros when MASK."""
    if MASK:
        return tl.load(base + offs, mask=offs < n, other=0.0)
    return tl.load(base + offs)


@triton.jit
def _scores(q, k, offs_n, pos_q, slope2, qk_scale, ALIBI: tl.constexpr):
    """Scores in log2 units of a query tile against a key tile → (BLOCK_M, BLOCK_N), ALiBi added."""
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if ALIBI:
        s += slope2 * (offs_n[None, :] - pos_q[:, None]).to(tl.float32)
    return s


@triton.jit
def _visible(offs_n, pos_q, start_q, S_K, CAUSAL: tl.constexpr, LEFT: tl.constexpr):
    """Which (query, key) pairs of a tile exist and may be attended → (BLOCK_M, BLOCK_N) bool;
    `start_q` (BLOCK_M,) is each query's first visible key (document or window start), read only
    when LEFT."""
    visible = offs_n[None, :] < S_K
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= pos_q[:, None])
    if LEFT:
        visible = visible & (offs_n[None, :] >= start_q[:, None])
    return visible


@triton.jit
def _left_key_tiles(doc_base, pos_q, rows, window, BLOCK_N: tl.constexpr, DOCS: tl.constexpr,
        WINDOW: tl.constexpr):
    """For a query tile whose rows see keys only from a first position on (the document start
    when DOCS, the window start pos_q - window + 1 when WINDOW, the later of the two when both)
    → (start_q, n_lo, n_left): each row's first visible key; the first key tile any row (where
    `rows`) sees; the first key tile from which every row's bound has passed, so that no left
    mask touches it."""
    start_q = tl.zeros_like(pos_q)
    if DOCS:
        start_q = tl.load(doc_base + pos_q, mask=rows, other=0)
    if WINDOW:
        start_q = tl.maximum(start_q, pos_q - window + 1)
    lo = tl.min(tl.where(rows, start_q, 2147483647), 0)
    n_lo = (max(lo, 0) // BLOCK_N) * BLOCK_N
    n_left = max(n_lo, tl.cdiv(max(tl.max(tl.where(rows, start_q, 0), 0), 0), BLOCK_N) * BLOCK_N)
    return start_q, n_lo, n_left


@triton.jit
def _first_start_after(doc_base, key, lo, hi):
    """The first position p in [lo, hi) whose document starts after `key`, else hi: a binary
    search, as the starts are non-decreasing."""
    hi = max(hi, lo)  # a tensor, as the loop needs, even where Triton passed hi as the constant 1
    while lo < hi:
        mid = (lo + hi) // 2
        after = tl.load(doc_base + mid) > key
        lo = tl.where(after, lo, mid + 1)
        hi = tl.where(after, mid, hi)
    return lo


@triton.jit
def _attn_fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, n_lo, n_hi, pos_q, start_q, slope2,
        qk_scale, S_K, HEAD_DQ: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr,
        LEFT: tl.constexpr):
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, stride_ks, offs_n, S_K, HEAD_DQ, BLOCK_DQ, MASK, UPCAST)
        v = _load_rows(v_base, stride_vs, offs_n, S_K, HEAD_DV, BLOCK_DV, MASK, UPCAST)
        s = _scores(q, k, offs_n, pos_q, slope2, qk_scale, ALIBI)
        if MASK:
            s = tl.where(_visible(offs_n, pos_q, start_q, S_K, CAUSAL, LEFT), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if LEFT:
            # A row whose document or window begins after this tile has no key in it; while its running
            # max is still -inf, exp2(-inf - -inf) would be NaN. Any finite reference gives p = 0, alpha = 0.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_left(acc, l_i, m_i, q, k_base, v_base, doc_base, stride_ks, stride_vs, n_full, n_hi, pos_q, rows, window,
        slope2, qk_scale, S_K, HEAD_DQ: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DQ: tl.constexpr,
        BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr, DOCS: tl.constexpr,
        WINDOW: tl.constexpr):
    """The key tiles of one causal query tile with a left bound (documents, window): none before
    n_lo; masked up to n_left (some row's bound falls inside) and from n_full (the diagonal, the end
    of the keys); unmasked between."""
    start_q, n_lo, n_left = _left_key_tiles(doc_base, pos_q, rows, window, BLOCK_N, DOCS, WINDOW)
    acc, l_i, m_i = _attn_fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, n_lo, min(n_left, n_full),
                                    pos_q, start_q, slope2, qk_scale, S_K, HEAD_DQ, HEAD_DV, BLOCK_DQ, BLOCK_DV,
                                    BLOCK_N, True, True, ALIBI, UPCAST, True)
    acc, l_i, m_i = _attn_fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, n_left, n_full, pos_q,
                                    start_q, slope2, qk_scale, S_K, HEAD_DQ, HEAD_DV, BLOCK_DQ, BLOCK_DV, BLOCK_N,
                                    False, True, ALIBI, UPCAST, False)
    acc, l_i, m_i = _attn_fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, max(n_full, n_lo), n_hi,
                                    pos_q, start_q, slope2, qk_scale, S_K, HEAD_DQ, HEAD_DV, BLOCK_DQ, BLOCK_DV,
                                    BLOCK_N, True, True, ALIBI, UPCAST, True)
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, slopes_ptr, doc_start_ptr, sinks_ptr,
        stride_qb, stride_qh, stride_qs, stride_kb, stride_kg, stride_ks,
        stride_vb, stride_vg, stride_vs, stride_ob, stride_oh, stride_os, stride_db,
        H, GROUP, S_Q, S_K, Q_OFFSET, window, qk_scale,
        HEAD_DQ: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr, DOCS: tl.constexpr,
        WINDOW: tl.constexpr, SINKS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    g = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q = _load_rows(q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh, stride_qs, offs_m, S_Q, HEAD_DQ,
                   BLOCK_DQ, True, UPCAST)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + g.to(tl.int64) * stride_kg
    v_base = v_ptr + b.to(tl.int64) * stride_vb + g.to(tl.int64) * stride_vg
    pos_q = offs_m + Q_OFFSET
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(slopes_ptr + h).to(tl.float32) * 1.4426950408889634

    # Key tiles [0, n_full) are visible to every query of this tile and lie inside S_K;
    # [n_full, n_hi) need the causal and/or key-bound mask.
    n_full = (S_K // BLOCK_N) * BLOCK_N
    n_hi = S_K
    if CAUSAL:
        n_full = min(n_full, ((m0 + Q_OFFSET + 1) // BLOCK_N) * BLOCK_N)
        n_hi = min(S_K, m0 + BLOCK_M + Q_OFFSET)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if SINKS:
        # The sink is one more logit of every row, without a value: it opens the online softmax
        # (running max = sink, running sum = exp2(sink - sink) = 1) and adds nothing to acc.
        m_i = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        l_i = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    if DOCS or WINDOW:
        acc, l_i, m_i = _attn_fwd_left(acc, l_i, m_i, q, k_base, v_base, doc_start_ptr + b.to(tl.int64) * stride_db,
                                       stride_ks, stride_vs, n_full, n_hi, pos_q, offs_m < S_Q, window, slope2,
                                       qk_scale, S_K, HEAD_DQ, HEAD_DV, BLOCK_DQ, BLOCK_DV, BLOCK_N, ALIBI, UPCAST,
                                       DOCS, WINDOW)
    else:
        acc, l_i, m_i = _attn_fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, 0, n_full, pos_q, pos_q,
                                        slope2, qk_scale, S_K, HEAD_DQ, HEAD_DV, BLOCK_DQ, BLOCK_DV, BLOCK_N, False,
                                        CAUSAL, ALIBI, UPCAST, False)
        acc, l_i, m_i = _attn_fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, n_full, n_hi, pos_q,
                                        pos_q, slope2, qk_scale, S_K, HEAD_DQ, HEAD_DV, BLOCK_DQ, BLOCK_DV, BLOCK_N,
                                        True, CAUSAL, ALIBI, UPCAST, False)

    if WINDOW:
        # A row past S_Q (never stored) may sit beyond every key's window and have l = 0; a sum
        # of 1 keeps 0/0 and log(0) out of it.
        l_i = tl.where(offs_m < S_Q, l_i, 1.0)
    o = acc / l_i[:, None]
    o_base = o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    _store_rows(o_base, stride_os, offs_m, S_Q, o, HEAD_DV, BLOCK_DV)
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    tl.store(lse_ptr + pid_bh.to(tl.int64) * S_Q + offs_m, lse, mask=offs_m < S_Q)


@triton.jit
def _attn_bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, lse_ptr, sinks_ptr, dsinks_ptr, stride_ob, stride_oh,
        stride_os, stride_dob, stride_doh, stride_dos, H, S_Q, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, SINKS: tl.constexpr):
    # delta_i = sum_d o_id * do_id, the row term of the softmax backward; with SINKS also this
    # tile's share of d sink_h (flash_attention_bwd_triton derives it), one partial sum per program.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o = _load_rows(o_ptr + b * stride_ob + h * stride_oh, stride_os, offs_m, S_Q, HEAD_DV, BLOCK_DV, True, False)
    do = _load_rows(do_ptr + b * stride_dob + h * stride_doh, stride_dos, offs_m, S_Q, HEAD_DV, BLOCK_DV, True, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + pid_bh.to(tl.int64) * S_Q + offs_m, delta, mask=offs_m < S_Q)
    if SINKS:
        lse = tl.load(lse_ptr + pid_bh.to(tl.int64) * S_Q + offs_m, mask=offs_m < S_Q, other=0.0)
        p_sink = tl.exp(tl.load(sinks_ptr + h).to(tl.float32) - lse)
        share = -tl.sum(tl.where(offs_m < S_Q, p_sink * delta, 0.0), 0)
        tl.store(dsinks_ptr + pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m, share)


@triton.jit
def _attn_dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_base, stride_qs, stride_dos, m_lo, m_hi,
        offs_n, window, slope2, qk_scale, S_Q, Q_OFFSET, HEAD_DQ: tl.constexpr, HEAD_DV: tl.constexpr,
        BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
        ALIBI: tl.constexpr, UPCAST: tl.constexpr, DOCS: tl.constexpr, WINDOW: tl.constexpr):
    for m0 in range(m_lo, m_hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q = _load_rows(q_base, stride_qs, offs_m, S_Q, HEAD_DQ, BLOCK_DQ, MASK, UPCAST)
        do = _load_rows(do_base, stride_dos, offs_m, S_Q, HEAD_DV, BLOCK_DV, MASK, UPCAST)
        lse2 = _load_vec(lse_base, offs_m, S_Q, MASK) * 1.4426950408889634
        delta = _load_vec(delta_base, offs_m, S_Q, MASK)
        s_t = tl.dot(k, tl.trans(q)) * qk_scale  # keys x queries
        pos_q = offs_m + Q_OFFSET
        if ALIBI:
            s_t += slope2 * (offs_n[:, None] - pos_q[None, :]).to(tl.float32)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASK:
            visible = offs_m[None, :] < S_Q
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= pos_q[None, :])
            if DOCS:
                start_q = tl.load(doc_base + pos_q, mask=offs_m < S_Q, other=0)
                visible = visible & (offs_n[:, None] >= start_q[None, :])
            if WINDOW:
                visible = visible & (offs_n[:, None] > pos_q[None, :] - window)
            p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _attn_dkdv_ranges(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_base, stride_qs, stride_dos, m_lo,
        m_diag_hi, m_full, m_free, m_tail, m_hi, offs_n, window, slope2, qk_scale, S_Q, Q_OFFSET, HEAD_DQ: tl.constexpr,
        HEAD_DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
        CAUSAL: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr, DOCS: tl.constexpr, WINDOW: tl.constexpr):
    """One query head's share of a key tile: query tiles [m_lo, m_diag_hi) and [m_tail, m_hi)
    masked, [m_full, m_free) without a mask."""
    dk, dv = _attn_dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_base, stride_qs, stride_dos,
                              m_lo, m_diag_hi, offs_n, window, slope2, qk_scale, S_Q, Q_OFFSET, HEAD_DQ, HEAD_DV,
                              BLOCK_DQ, BLOCK_DV, BLOCK_M, True, CAUSAL, ALIBI, UPCAST, DOCS, WINDOW)
    dk, dv = _attn_dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_base, stride_qs, stride_dos,
                              m_full, m_free, offs_n, window, slope2, qk_scale, S_Q, Q_OFFSET, HEAD_DQ, HEAD_DV,
                              BLOCK_DQ, BLOCK_DV, BLOCK_M, False, CAUSAL, ALIBI, UPCAST, False, False)
    dk, dv = _attn_dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_base, stride_qs, stride_dos,
                              m_tail, m_hi, offs_n, window, slope2, qk_scale, S_Q, Q_OFFSET, HEAD_DQ, HEAD_DV, BLOCK_DQ,
                              BLOCK_DV, BLOCK_M, True, CAUSAL, ALIBI, UPCAST, DOCS, WINDOW)
    return dk, dv


@triton.jit
def _doc_query_tiles(doc_base, n0, m_full, m_even, S_Q, S_K, Q_OFFSET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the key tile [n0, n0 + BLOCK_N) with documents → (m_free, m_hi): the queries in
    [m_full, m_free) (whole tiles) lie in documents begun by n0 and below the diagonal, so they
    see the whole key tile unmasked; from m_hi on they lie in documents begun after the tile and
    see none of it (a key is seen only by the queries of its own document)."""
    p_free = _first_start_after(doc_base, n0, min(n0 + 1, S_K), S_K)
    p_end = _first_start_after(doc_base, n0 + BLOCK_N - 1, p_free, S_K)
    m_free = max(m_full, min(m_even, (max(p_free - Q_OFFSET, 0) // BLOCK_M) * BLOCK_M))
    m_hi = min(S_Q, max(p_end - Q_OFFSET, 0))
    return m_free, m_hi


@triton.jit
def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, slopes_ptr, doc_start_ptr,
        stride_qb, stride_qh, stride_qs, stride_kb, stride_kg, stride_ks,
        stride_vb, stride_vg, stride_vs, stride_dob, stride_doh, stride_dos, stride_db,
        H, G, GROUP, S_Q, S_K, Q_OFFSET, window, qk_scale, sm_scale,
        HEAD_DQ: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr, DOCS: tl.constexpr,
        WINDOW: tl.constexpr):
    # One program per (key tile, batch, KV head); it sums over the GROUP query heads sharing
    # that KV head, so GQA needs neither repeated K/V nor atomics.
    pid_n = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = _load_rows(k_ptr + b * stride_kb + g.to(tl.int64) * stride_kg, stride_ks, offs_n, S_K, HEAD_DQ, BLOCK_DQ, True,
                   UPCAST)
    v = _load_rows(v_ptr + b * stride_vb + g.to(tl.int64) * stride_vg, stride_vs, offs_n, S_K, HEAD_DV, BLOCK_DV, True,
                   UPCAST)
    dk, dv = tl.zeros((BLOCK_N, BLOCK_DQ), dtype=tl.float32), tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)

    # Query tiles [m_lo, m_full) straddle the causal diagonal; [m_full, m_even) see every
    # key of this tile and lie inside S_Q; [m_even, S_Q) is the ragged tail (which may also
    # straddle the diagonal), so only the middle range runs without a mask. With documents or a
    # window that range ends at m_free, and no query from m_hi on sees this tile.
    m_lo = 0
    m_full = 0
    if CAUSAL:
        m_lo = (max(n0 - Q_OFFSET, 0) // BLOCK_M) * BLOCK_M
        m_full = max(m_lo, tl.cdiv(max(n0 + BLOCK_N - 1 - Q_OFFSET, 0), BLOCK_M) * BLOCK_M)
    m_even = (S_Q // BLOCK_M) * BLOCK_M
    m_diag_hi, m_free, m_tail, m_hi = min(m_full, m_even), m_even, max(m_lo, m_even), S_Q
    doc_base = doc_start_ptr
    if DOCS:
        doc_base = doc_start_ptr + b * stride_db
        m_free, m_hi = _doc_query_tiles(doc_base, n0, m_full, m_even, S_Q, S_K, Q_OFFSET, BLOCK_M, BLOCK_N)
    if WINDOW:
        # A query at p sees the whole tile once p >= n0 + BLOCK_N - 1 (m_full) while p < n0 + window,
        # and none of it from p = n0 + BLOCK_N - 1 + window on.
        m_free = max(m_full, min(m_free, (max(n0 + window - Q_OFFSET, 0) // BLOCK_M) * BLOCK_M))
        m_hi = min(m_hi, max(n0 + BLOCK_N - 1 + window - Q_OFFSET, 0))
    if DOCS or WINDOW:
        m_diag_hi, m_tail = min(m_full, m_hi), m_free
    for r in range(0, GROUP):
        h = g * GROUP + r
        bh = b * H + h
        q_base = q_ptr + b * stride_qb + h.to(tl.int64) * stride_qh
        do_base = do_ptr + b * stride_dob + h.to(tl.int64) * stride_doh
        slope2 = 0.0
        if ALIBI:
            slope2 = tl.load(slopes_ptr + h).to(tl.float32) * 1.4426950408889634
        dk, dv = _attn_dkdv_ranges(dk, dv, k, v, q_base, do_base, lse_ptr + bh * S_Q, delta_ptr + bh * S_Q, doc_base,
                                   stride_qs, stride_dos, m_lo, m_diag_hi, m_full, m_free, m_tail, m_hi, offs_n, window,
                                   slope2, qk_scale, S_Q, Q_OFFSET, HEAD_DQ, HEAD_DV, BLOCK_DQ, BLOCK_DV, BLOCK_M,
                                   CAUSAL, ALIBI, UPCAST, DOCS, WINDOW)

    # dk (B, G, S_K, Dq) and dv (B, G, S_K, Dv) are contiguous, allocated by the wrapper.
    _store_rows(dk_ptr + pid_bg.to(tl.int64) * S_K * HEAD_DQ, HEAD_DQ, offs_n, S_K, dk * sm_scale, HEAD_DQ, BLOCK_DQ)
    _store_rows(dv_ptr + pid_bg.to(tl.int64) * S_K * HEAD_DV, HEAD_DV, offs_n, S_K, dv, HEAD_DV, BLOCK_DV)


@triton.jit
def _attn_dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, n_lo, n_hi, pos_q, start_q, slope2,
        qk_scale, S_K, HEAD_DQ: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr,
        LEFT: tl.constexpr):
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, stride_ks, offs_n, S_K, HEAD_DQ, BLOCK_DQ, MASK, UPCAST)
        v = _load_rows(v_base, stride_vs, offs_n, S_K, HEAD_DV, BLOCK_DV, MASK, UPCAST)
        s = _scores(q, k, offs_n, pos_q, slope2, qk_scale, ALIBI)
        p = tl.math.exp2(s - lse2[:, None])
        if MASK:
            p = tl.where(_visible(offs_n, pos_q, start_q, S_K, CAUSAL, LEFT), p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _attn_dq_left(dq, q, do, lse2, delta, k_base, v_base, doc_base, stride_ks, stride_vs, n_full, n_hi, pos_q, rows,
        window, slope2, qk_scale, S_K, HEAD_DQ: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DQ: tl.constexpr,
        BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr, DOCS: tl.constexpr,
        WINDOW: tl.constexpr):
    """The key tiles of one causal query tile with a left bound, split as in _attn_fwd_left."""
    start_q, n_lo, n_left = _left_key_tiles(doc_base, pos_q, rows, window, BLOCK_N, DOCS, WINDOW)
    dq = _attn_dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, n_lo, min(n_left, n_full), pos_q,
                        start_q, slope2, qk_scale, S_K, HEAD_DQ, HEAD_DV, BLOCK_DQ, BLOCK_DV, BLOCK_N, True, True,
                        ALIBI, UPCAST, True)
    dq = _attn_dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, n_left, n_full, pos_q, start_q,
                        slope2, qk_scale, S_K, HEAD_DQ, HEAD_DV, BLOCK_DQ, BLOCK_DV, BLOCK_N, False, True, ALIBI,
                        UPCAST, False)
    dq = _attn_dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, max(n_full, n_lo), n_hi, pos_q,
                        start_q, slope2, qk_scale, S_K, HEAD_DQ, HEAD_DV, BLOCK_DQ, BLOCK_DV, BLOCK_N, True, True,
                        ALIBI, UPCAST, True)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, slopes_ptr, doc_start_ptr,
        stride_qb, stride_qh, stride_qs, stride_kb, stride_kg, stride_ks,
        stride_vb, stride_vg, stride_vs, stride_dob, stride_doh, stride_dos, stride_db,
        H, GROUP, S_Q, S_K, Q_OFFSET, window, qk_scale, sm_scale,
        HEAD_DQ: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr, DOCS: tl.constexpr,
        WINDOW: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    g = (h // GROUP).to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_mask = offs_m < S_Q
    q = _load_rows(q_ptr + b * stride_qb + h.to(tl.int64) * stride_qh, stride_qs, offs_m, S_Q, HEAD_DQ, BLOCK_DQ, True,
                   UPCAST)
    do = _load_rows(do_ptr + b * stride_dob + h.to(tl.int64) * stride_doh, stride_dos, offs_m, S_Q, HEAD_DV, BLOCK_DV,
                    True, UPCAST)
    lse2 = tl.load(lse_ptr + pid_bh.to(tl.int64) * S_Q + offs_m, mask=row_mask, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + pid_bh.to(tl.int64) * S_Q + offs_m, mask=row_mask, other=0.0)
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(slopes_ptr + h).to(tl.float32) * 1.4426950408889634
    pos_q = offs_m + Q_OFFSET
    k_base = k_ptr + b * stride_kb + g * stride_kg
    v_base = v_ptr + b * stride_vb + g * stride_vg

    # The same split of key tiles as the forward pass.
    n_full = (S_K // BLOCK_N) * BLOCK_N
    n_hi = S_K
    if CAUSAL:
        n_full = min(n_full, ((m0 + Q_OFFSET + 1) // BLOCK_N) * BLOCK_N)
        n_hi = min(S_K, m0 + BLOCK_M + Q_OFFSET)
    dq = tl.zeros((BLOCK_M, BLOCK_DQ), dtype=tl.float32)
    if DOCS or WINDOW:
        dq = _attn_dq_left(dq, q, do, lse2, delta, k_base, v_base, doc_start_ptr + b * stride_db, stride_ks, stride_vs,
                           n_full, n_hi, pos_q, row_mask, window, slope2, qk_scale, S_K, HEAD_DQ, HEAD_DV, BLOCK_DQ,
                           BLOCK_DV, BLOCK_N, ALIBI, UPCAST, DOCS, WINDOW)
    else:
        dq = _attn_dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, 0, n_full, pos_q, pos_q,
                            slope2, qk_scale, S_K, HEAD_DQ, HEAD_DV, BLOCK_DQ, BLOCK_DV, BLOCK_N, False, CAUSAL, ALIBI,
                            UPCAST, False)
        dq = _attn_dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, n_full, n_hi, pos_q, pos_q,
                            slope2, qk_scale, S_K, HEAD_DQ, HEAD_DV, BLOCK_DQ, BLOCK_DV, BLOCK_N, True, CAUSAL, ALIBI,
                            UPCAST, False)

    # dq is contiguous (B, H, S_Q, Dq), allocated by the wrapper.
    _store_rows(dq_ptr + pid_bh.to(tl.int64) * S_Q * HEAD_DQ, HEAD_DQ, offs_m, S_Q, dq * sm_scale, HEAD_DQ, BLOCK_DQ)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    # The kernels take any batch/head/sequence strides but read head dims contiguously.
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_args(q_BHSD, k_BGSD, v_BGSD, causal, alibi_slopes_H, softmax_scale, backend, doc_start_BS, window):
    """Shapes (Dq q's and k's head dim, Dv v's), the constexpr flags every attention kernel takes
    and the scalars they share."""
    B, H, S_Q, Dq = q_BHSD.shape
    G, S_K, Dv = k_BGSD.shape[1], k_BGSD.shape[2], v_BGSD.shape[3]
    flags = head_dim_constexprs(Dq, Dv) | dict(CAUSAL=causal, ALIBI=alibi_slopes_H is not None,
                                               UPCAST=upcast(backend, q_BHSD.dtype), DOCS=doc_start_BS is not None,
                                               WINDOW=window > 0)
    scalars = dict(GROUP=H // G, S_Q=S_Q, S_K=S_K, Q_OFFSET=max(S_K - S_Q, 0), window=window,
                   qk_scale=softmax_scale * LOG2E)
    return B, H, G, S_Q, S_K, Dq, Dv, flags, scalars


def _as_fp32(t_H, like):
    # Without ALiBi or sinks the kernels never read this pointer; any fp32 tensor on the device will do.
    if t_H is None:
        return like
    return t_H.to(device=like.device, dtype=torch.float32).contiguous()


def _doc_starts(doc_start_BS, causal, S_Q, S_K, like):
    """(doc_start, its batch stride) as the kernels read it: int32, contiguous along S."""
    # Without documents the kernels never read this pointer; any tensor on the device will do.
    if doc_start_BS is None:
        return like, 0
    # The document kernels assume causal attention and read a start at every query position.
    if not causal or S_Q > S_K or tuple(doc_start_BS.shape) != (like.shape[0], S_K):
        raise ValueError(f"flash_attention: doc_start_BS {tuple(doc_start_BS.shape)} needs causal attention, "
                         f"S_Q <= S_K and shape (B, S_K) = ({like.shape[0]}, {S_K}); got causal={causal}, S_Q={S_Q}")
    starts_BS = doc_start_BS.to(device=like.device, dtype=torch.int32).contiguous()
    return starts_BS, starts_BS.stride(0)


def _check_window(window, causal, S_Q, S_K):
    # The window kernels bound each query's keys from the left only and assume the causal bound on
    # the right; a query must see at least itself.
    if window < 0 or (window > 0 and (not causal or S_Q > S_K)):
        raise ValueError(f"flash_attention: window={window} needs window >= 0, and for a window causal "
                         f"attention with S_Q <= S_K; got causal={causal}, S_Q={S_Q}, S_K={S_K}")


def flash_attention_fwd_triton(q_BHSD, k_BGSD, v_BGSD, causal, alibi_slopes_H, softmax_scale, backend,
                               config: AttnConfig | None = None, *, doc_start_BS=None, sinks_H=None, window=0):
    """Returns (o_BHSD, lse_BHS): the attention output, v's head dim Dv wide, and the natural-log
    logsumexp of each row of scaled (and biased) logits, the sink included, which the backward
    pass needs. q and k share a head dim Dq, which may differ from Dv (MLA). `config`
    overrides the shipped tile (bench/kernels.py --tune tries candidates through it).
    `doc_start_BS` (B, S_K), causal only: where each position's document begins; `sinks_H` (H,):
    each head's sink logit; `window` (0: none): a query sees the `window` positions up to its own
    (kernels/flash_attention.py)."""
    q_BHSD, k_BGSD, v_BGSD = (_inner_contiguous(t) for t in (q_BHSD, k_BGSD, v_BGSD))
    B, H, G, S_Q, S_K, Dq, Dv, flags, scalars = _launch_args(q_BHSD, k_BGSD, v_BGSD, causal, alibi_slopes_H,
                                                             softmax_scale, backend, doc_start_BS, window)
    _check_window(window, causal, S_Q, S_K)
    cfg = config or attention_configs(Dq, q_BHSD.dtype, backend == "interpret", Dv).fwd
    o_BHSD = torch.empty(B, H, S_Q, Dv, dtype=q_BHSD.dtype, device=q_BHSD.device)
    lse_BHS = torch.empty(B, H, S_Q, dtype=torch.float32, device=q_BHSD.device)
    doc_start, stride_db = _doc_starts(doc_start_BS, causal, S_Q, S_K, lse_BHS)
    if o_BHSD.numel() == 0:
        return o_BHSD, lse_BHS
    with device_guard(q_BHSD):
        _attn_fwd_kernel[(_cdiv(S_Q, cfg.BLOCK_M), B * H)](
            q_BHSD, k_BGSD, v_BGSD, o_BHSD, lse_BHS, _as_fp32(alibi_slopes_H, lse_BHS), doc_start,
            _as_fp32(sinks_H, lse_BHS),
            *q_BHSD.stride()[:3], *k_BGSD.stride()[:3], *v_BGSD.stride()[:3], *o_BHSD.stride()[:3], stride_db,
            H, scalars["GROUP"], S_Q, S_K, scalars["Q_OFFSET"], window, scalars["qk_scale"],
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, **flags, SINKS=sinks_H is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return o_BHSD, lse_BHS


def flash_attention_bwd_triton(do_BHSD, q_BHSD, k_BGSD, v_BGSD, o_BHSD, lse_BHS, causal, alibi_slopes_H,
                               softmax_scale, backend, configs: AttnConfigs | None = None, *, doc_start_BS=None,
                               sinks_H=None, window=0):
    """Returns (dq_BHSD, dk_BGSD, dv_BGSD, dsinks_H), contiguous, in the inputs' dtypes, dq and dk
    q's head dim Dq wide, dv v's Dv; dsinks_H is empty, shape (0,), without sinks. `configs`
    overrides the shipped tiles (its fwd entry is unused); `doc_start_BS`, `sinks_H` and `window`
    as in the forward.

    The sink's gradient: row (b, h, i) has logits z_j = s_ij over its visible keys and z_sink =
    sink_h, p = softmax(z), o_i = sum_j p_j v_j (the sink has no value, v_sink = 0). With
    dp_c = dL/dp_c = dO_i . v_c, the softmax backward gives dL/dz_c = p_c (dp_c - sum_c' p_c' dp_c'),
    and sum_c' p_c' dp_c' = dO_i . o_i = delta_i. For the sink dp_sink = 0, so

        dL/d sink_h = -sum_(b,i) p_sink,bhi * delta_bhi,   p_sink,bhi = exp(sink_h - lse_bhi),

    while the keys' ds_ij = p_ij (dp_ij - delta_i) is unchanged (lse includes the sink).
    """
    do_BHSD, q_BHSD, k_BGSD, v_BGSD, o_BHSD = (
        _inner_contiguous(t) for t in (do_BHSD, q_BHSD, k_BGSD, v_BGSD, o_BHSD))
    lse_BHS = lse_BHS.contiguous()
    B, H, G, S_Q, S_K, Dq, Dv, flags, scalars = _launch_args(q_BHSD, k_BGSD, v_BGSD, causal, alibi_slopes_H,
                                                             softmax_scale, backend, doc_start_BS, window)
    _check_window(window, causal, S_Q, S_K)
    cfgs = configs or attention_configs(Dq, q_BHSD.dtype, backend == "interpret", Dv)
    dq_BHSD = torch.empty(B, H, S_Q, Dq, dtype=q_BHSD.dtype, device=q_BHSD.device)
    dk_BGSD = torch.empty(B, G, S_K, Dq, dtype=k_BGSD.dtype, device=k_BGSD.device)
    dv_BGSD = torch.empty(B, G, S_K, Dv, dtype=v_BGSD.dtype, device=v_BGSD.device)
    dsinks_H = q_BHSD.new_zeros(0) if sinks_H is None else torch.zeros_like(sinks_H)
    if S_Q == 0 or dk_BGSD.numel() == 0:
        return dq_BHSD.zero_(), dk_BGSD.zero_(), dv_BGSD.zero_(), dsinks_H
    delta_BHS = torch.empty_like(lse_BHS)
    # One partial d sink per (batch, head, query tile), summed below in a fixed order: no atomics,
    # so the gradient is the same from run to run.
    n_m = _cdiv(S_Q, cfgs.dq.BLOCK_M)
    dsinks_BHT = lse_BHS if sinks_H is None else torch.empty(B, H, n_m, dtype=torch.float32, device=lse_BHS.device)
    slopes = _as_fp32(alibi_slopes_H, lse_BHS)
    doc_start, stride_db = _doc_starts(doc_start_BS, causal, S_Q, S_K, lse_BHS)
    strides = (*q_BHSD.stride()[:3], *k_BGSD.stride()[:3], *v_BGSD.stride()[:3], *do_BHSD.stride()[:3], stride_db)
    tail = (scalars["Q_OFFSET"], window, scalars["qk_scale"], softmax_scale)
    with device_guard(q_BHSD):
        _attn_bwd_delta_kernel[(n_m, B * H)](
            o_BHSD, do_BHSD, delta_BHS, lse_BHS, _as_fp32(sinks_H, lse_BHS), dsinks_BHT, *o_BHSD.stride()[:3],
            *do_BHSD.stride()[:3], H, S_Q, HEAD_DV=Dv, BLOCK_DV=flags["BLOCK_DV"], BLOCK_M=cfgs.dq.BLOCK_M,
            SINKS=sinks_H is not None, num_warps=4,
        )
        _attn_bwd_dkdv_kernel[(_cdiv(S_K, cfgs.dkdv.BLOCK_N), B * G)](
            q_BHSD, k_BGSD, v_BGSD, do_BHSD, lse_BHS, delta_BHS, dk_BGSD, dv_BGSD, slopes, doc_start, *strides,
            H, G, scalars["GROUP"], S_Q, S_K, *tail,
            BLOCK_M=cfgs.dkdv.BLOCK_M, BLOCK_N=cfgs.dkdv.BLOCK_N, **flags,
            num_warps=cfgs.dkdv.num_warps, num_stages=cfgs.dkdv.num_stages,
        )
        _attn_bwd_dq_kernel[(n_m, B * H)](
            q_BHSD, k_BGSD, v_BGSD, do_BHSD, lse_BHS, delta_BHS, dq_BHSD, slopes, doc_start, *strides,
            H, scalars["GROUP"], S_Q, S_K, *tail,
            BLOCK_M=cfgs.dq.BLOCK_M, BLOCK_N=cfgs.dq.BLOCK_N, **flags,
            num_warps=cfgs.dq.num_warps, num_stages=cfgs.dq.num_stages,
        )
    if sinks_H is not None:
        dsinks_H = dsinks_BHT.sum((0, 2)).to(sinks_H.dtype)
    return dq_BHSD, dk_BGSD, dv_BGSD, dsinks_H


# Variants (causal, alibi, docs, sinks, window) compiled ahead of time besides the plain causal one,
# by (element size, tile width): every code path at least once, on the tiles that would run it
# (GPT-OSS: bf16, D=64, causal with sinks, every other layer windowed; DeepSeek-V3's MLA: bf16,
# Dq=192 and Dv=128 on the 256-wide tiles, packed documents).
_AOT_EXTRA_VARIANTS = {
    (2, 64): ((True, False, False, True, True),),
    (2, 128): ((False, True, False, False, False), (True, False, True, False, False), (True, False, False, True, True),
               (True, False, True, True, True)),
    (2, 256): ((True, False, True, False, False),),
}
# The (Dq, Dv) pairs compiled per tile width, where not (width, width) alone: on the 256-wide tiles
# MLA's 192/128, the pair that runs there (the extra variants above compile with it), and 256/256,
# which fills the most shared memory.
_AOT_HEAD_DIMS = {256: ((192, 128), (256, 256))}


def _spec_args(size: int, Dq: int, Dv: int) -> dict:
    """Runtime arguments shaped like a Mixtral-8x7B layer (32 query heads over 8 KV heads, 4k
    positions; batch strides as for one sequence: a kernel never steps past it)."""
    H, G, S = 32, 8, 4096
    dtype = {2: torch.bfloat16, 4: torch.float32}[size]
    args = dict(stride_qb=H * S * Dq, stride_qh=S * Dq, stride_qs=Dq, stride_kb=G * S * Dq, stride_kg=S * Dq,
                stride_ks=Dq, stride_vb=G * S * Dv, stride_vg=S * Dv, stride_vs=Dv, stride_dob=H * S * Dv,
                stride_doh=S * Dv, stride_dos=Dv, stride_ob=H * S * Dv, stride_oh=S * Dv, stride_os=Dv)
    args |= dict(H=H, G=G, GROUP=H // G, S_Q=S, S_K=S, Q_OFFSET=0, qk_scale=0.1, sm_scale=0.1)
    args |= dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr"], dtype)
    return args | dict.fromkeys(["lse_ptr", "delta_ptr", "slopes_ptr", "sinks_ptr", "dsinks_ptr"], torch.float32)


def _variant_specs(Dq: int, Dv: int, cfgs: AttnConfigs, variant: tuple, args: dict):
    """The forward, dK/dV and dQ kernels of one variant (causal, alibi, docs, sinks, window)."""
    causal, alibi, docs, sinks, window = variant
    dtype = args["q_ptr"]
    flags = head_dim_constexprs(Dq, Dv) | dict(CAUSAL=causal, ALIBI=alibi, UPCAST=False, DOCS=docs, WINDOW=window)
    run_args = args | dict(doc_start_ptr=torch.int32 if docs else torch.float32,
                           stride_db=args["S_K"] if docs else 0, window=128 if window else 0)
    dims = f"D={Dq}" if Dq == Dv else f"D={Dq},Dv={Dv}"
    tag = f"{dtype},{dims},causal={causal},alibi={alibi}" + "".join(
        f",{name}=True" for name, on in (("docs", docs), ("sinks", sinks), ("window", window)) if on)
    for name, kernel, cfg in (("fwd", _attn_fwd_kernel, cfgs.fwd), ("dkdv", _attn_bwd_dkdv_kernel, cfgs.dkdv),
                              ("dq", _attn_bwd_dq_kernel, cfgs.dq)):
        consts = flags | dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N)
        if name == "fwd":
            consts |= dict(SINKS=sinks)
        yield KernelSpec(f"attention_{name}[{tag}]", kernel, run_args, consts, cfg.num_warps, cfg.num_stages)


def compile_specs():
    """Every shipped configuration, for compiling ahead of time (see moetron.kernels.aot), with
    arguments shaped like a real layer (_spec_args). Each tile width is compiled causal without
    ALiBi, documents, sinks or a window, the training case; some also with those
    (_AOT_EXTRA_VARIANTS), to compile those code paths too (they use the same tiles). Pointers a
    variant does not read are passed the logsumexp (fp32) and a batch stride of 0 or a window of 0,
    as the launchers do."""
    plain = (True, False, False, False, False)
    for (size, width), cfgs in SHIPPED_CONFIGS.items():
        for i, (Dq, Dv) in enumerate(_AOT_HEAD_DIMS.get(width, ((width, width),))):
            args = _spec_args(size, Dq, Dv)
            # The extra variants run on the first head-dim pair of a width, the one a model uses.
            variants = (plain,) + (_AOT_EXTRA_VARIANTS.get((size, width), ()) if i == 0 else ())
            for variant in variants:
                yield from _variant_specs(Dq, Dv, cfgs, variant, args)
            dims = f"D={Dq}" if Dq == Dv else f"D={Dq},Dv={Dv}"
            for sinks in sorted({v[3] for v in variants}):
                consts = dict(HEAD_DV=Dv, BLOCK_DV=head_dim_constexprs(Dq, Dv)["BLOCK_DV"], BLOCK_M=cfgs.dq.BLOCK_M,
                              SINKS=sinks)
                yield KernelSpec(f"attention_delta[{args['q_ptr']},{dims}" + (",sinks=True]" if sinks else "]"),
                                 _attn_bwd_delta_kernel, args, consts, 4, 3)

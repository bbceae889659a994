"""Scaled dot-product attention with causal masking, grouped-query heads, ALiBi and packed documents.

Legend: B batch, H query heads, G key/value heads (H % G == 0; query head h reads KV head
h // (H // G)), S_Q query positions, S_K key positions, Dq the head dim of q and k, Dv the head
dim of v and of the output (equal in most models; MLA's differ, DeepSeek-V3: 192 and 128). Names
write either as D: q_BHSD, k_BGSD, dq, dk are Dq wide; v_BGSD, o_BHSD, do, dv are Dv wide.

Positions: key j sits at j, query i at i + max(S_K - S_Q, 0): with a KV cache (S_Q < S_K) the
queries are the last S_Q positions; with S_Q >= S_K queries and keys both start at 0.
Causal masking hides keys after the query's position. ALiBi adds slope_h * (j - pos_i) to the
scaled logit of query i and key j (a penalty growing with distance into the past).

Documents ("varlen" packing): a training sequence may hold several documents, and attention
must not cross from one into another. `doc_start_BS` (B, S_K) gives, for each position j, the
position where the document holding j begins — the sequence-start offsets `cu_seqlens` of varlen
flash attention, spread over positions (model/packing.py builds it). Query i (at pos_i) sees key
j iff doc_start[b, pos_i] <= j <= pos_i. Starts must be non-decreasing along S with
doc_start[b, j] <= j; that is not checked (it would synchronize with the device): the Triton
kernels rely on it to skip the tiles of other documents, which is where varlen's speed comes from.

Sliding window (`window` W > 0, causal only): query i (at pos_i) sees key j iff pos_i - W < j <= pos_i,
itself and the W - 1 positions before it. This is Hugging Face's `sliding_window=W`
(transformers' masking_utils: `kv_idx > q_idx - sliding_window` on top of causal), so a GPT-OSS
layer with sliding_window=128 attends to 128 keys. It combines with documents (both bounds hold).

Attention sinks (`sinks_H`, GPT-OSS): one learned logit per query head joins every row's softmax as
an extra key without a value: p_ij = exp(s_ij) / (exp(sink_h) + sum_j' exp(s_ij')), o_i = sum_j p_ij v_j.
The sink is not scaled and sees no mask or ALiBi. This is transformers' GPT-OSS eager attention
(the sink column concatenated to the scaled, masked logits, softmax over all, the column dropped).
The logsumexp the ops exchange includes the sink term.

Layers: Triton kernels (flash_attention_triton) → the ops `moetron::flash_attention_fwd` (returns
the output and the logsumexp) and `moetron::flash_attention_bwd` (custom ops with fake
implementations, so torch.compile traces them) → the function `flash_attention`. The torch path
is `flash_attention_reference`, plain eager torch, and `flash_attention_reference_backward`.
Under "auto" each op (forward, backward) runs the path recorded for its pass and device class
(kernels/measured_backends.py).
"""

from __future__ import annotations

import math

import torch

from moetron.kernels.attention_tiles import MAX_HEAD_DIM
from moetron.kernels.backend import resolve_backend
from moetron.kernels.measured_backends import PASSES


def _logits(q_BHSD, k_BGSD, causal, alibi_slopes_H, scale, ct, doc_start_BS=None, window=0):
    """Scaled logits s_BHQK in dtype `ct`, ALiBi added, the causal mask, the mask of keys before
    each query's document start and the mask of keys W or more positions back applied (-inf)."""
    B, H, S_Q, D = q_BHSD.shape
    G, S_K = k_BGSD.shape[1], k_BGSD.shape[2]
    q_BGRSD = q_BHSD.to(ct).reshape(B, G, H // G, S_Q, D)
    s_BHQK = (q_BGRSD @ k_BGSD.to(ct)[:, :, None].transpose(-1, -2)).reshape(B, H, S_Q, S_K) * scale
    pos_q = torch.arange(S_Q, device=q_BHSD.device) + max(S_K - S_Q, 0)
    pos_k = torch.arange(S_K, device=q_BHSD.device)
    if alibi_slopes_H is not None:
        distance_QK = (pos_k[None, :] - pos_q[:, None]).to(ct)
        s_BHQK = s_BHQK + alibi_slopes_H.to(ct)[:, None, None] * distance_QK
    if causal:
        s_BHQK = s_BHQK.masked_fill(pos_k[None, :] > pos_q[:, None], float("-inf"))
    if window > 0:
        s_BHQK = s_BHQK.masked_fill(pos_k[None, :] <= pos_q[:, None] - window, float("-inf"))
    if doc_start_BS is not None:
        before_BQK = pos_k[None, None, :] < doc_start_BS[:, pos_q][:, :, None]
        s_BHQK = s_BHQK.masked_fill(before_BQK[:, None], float("-inf"))
    return s_BHQK


def _logsumexp(s_BHQK, sinks_H, ct):
    """lse_BHQ over each row of logits, the sink's exp(sink_h) included when there are sinks."""
    lse_BHQ = torch.logsumexp(s_BHQK, dim=-1)
    if sinks_H is None:
        return lse_BHQ
    return torch.logaddexp(lse_BHQ, sinks_H.to(ct)[None, :, None])


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def flash_attention_reference(
    q_BHSD: torch.Tensor,
    k_BGSD: torch.Tensor,
    v_BGSD: torch.Tensor,
    causal: bool = True,
    alibi_slopes_H: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    doc_start_BS: torch.Tensor | None = None,
    sinks_H: torch.Tensor | None = None,
    window: int = 0,
):
    """Plain eager attention, differentiable (in the sinks too), any float dtype (computed in fp32,
    or fp64 for fp64 inputs), any head dims (v's may differ from q's and k's). K/V heads are
    broadcast over their query heads, never copied. Returns o_BHSD (B, H, S_Q, Dv), or (o_BHSD,
    lse_BHS) with the natural-log logsumexp of each row of logits (and sink)."""
    B, H, S_Q, Dq = q_BHSD.shape
    G, S_K, Dv = k_BGSD.shape[1], k_BGSD.shape[2], v_BGSD.shape[3]
    scale = Dq**-0.5 if softmax_scale is None else softmax_scale
    ct = _compute_dtype(q_BHSD.dtype)
    s_BHQK = _logits(q_BHSD, k_BGSD, causal, alibi_slopes_H, scale, ct, doc_start_BS, window)
    lse_BHS = _logsumexp(s_BHQK, sinks_H, ct)
    p_BGRQK = torch.exp(s_BHQK - lse_BHS[..., None]).reshape(B, G, H // G, S_Q, S_K)
    o_BHSD = (p_BGRQK @ v_BGSD.to(ct)[:, :, None]).reshape(B, H, S_Q, Dv).to(q_BHSD.dtype)
    return (o_BHSD, lse_BHS.float()) if return_lse else o_BHSD


def flash_attention_reference_backward(do_BHSD, q_BHSD, k_BGSD, v_BGSD, causal, alibi_slopes_H, softmax_scale,
                                       doc_start_BS=None, sinks_H=None, window=0):
    """(dq_BHSD, dk_BGSD, dv_BGSD, dsinks_H) of flash_attention_reference by the softmax backward
    formulas, recomputing the probabilities (no autograd: it runs inside a custom op, below
    autograd). dq and dk are Dq wide, dv Dv. dsinks_H is empty, shape (0,), without sinks."""
    B, H, S_Q, Dq = q_BHSD.shape
    G, S_K, Dv = k_BGSD.shape[1], k_BGSD.shape[2], v_BGSD.shape[3]
    ct = _compute_dtype(q_BHSD.dtype)
    s_BHQK = _logits(q_BHSD, k_BGSD, causal, alibi_slopes_H, softmax_scale, ct, doc_start_BS, window)
    lse_BHQ = _logsumexp(s_BHQK, sinks_H, ct)
    p_BGRQK = torch.exp(s_BHQK - lse_BHQ[..., None]).reshape(B, G, H // G, S_Q, S_K)
    do_BGRQD = do_BHSD.to(ct).reshape(B, G, H // G, S_Q, Dv)
    q_BGRQD = q_BHSD.to(ct).reshape(B, G, H // G, S_Q, Dq)
    dv_BGSD = torch.einsum("bgrqk,bgrqd->bgkd", p_BGRQK, do_BGRQD)
    dp_BGRQK = do_BGRQD @ v_BGSD.to(ct)[:, :, None].transpose(-1, -2)
    # delta = sum_j p_ij dp_ij = dO_i . O_i; the sink's dp is 0 (it has no value), so the same
    # formulas hold with sinks, and d sink_h = -sum_(b,i) p_sink,bhi delta_bhi (see the Triton backward).
    delta_BGRQ = (p_BGRQK * dp_BGRQK).sum(-1)
    ds_BGRQK = p_BGRQK * (dp_BGRQK - delta_BGRQ[..., None])
    dq_BHSD = (ds_BGRQK @ k_BGSD.to(ct)[:, :, None]).reshape(B, H, S_Q, Dq) * softmax_scale
    dk_BGSD = torch.einsum("bgrqk,bgrqd->bgkd", ds_BGRQK, q_BGRQD) * softmax_scale
    dsinks_H = q_BHSD.new_zeros(0)
    if sinks_H is not None:
        p_sink_BHQ = torch.exp(sinks_H.to(ct)[None, :, None] - lse_BHQ)
        dsinks_H = -(p_sink_BHQ * delta_BGRQ.reshape(B, H, S_Q)).sum((0, 2)).to(sinks_H.dtype)
    return dq_BHSD.to(q_BHSD.dtype), dk_BGSD.to(k_BGSD.dtype), dv_BGSD.to(v_BGSD.dtype), dsinks_H


def _pass_backend(backend: str, pass_: str, q_BHSD: torch.Tensor) -> str:
    """`backend` as given, or for "auto" the path recorded for this pass on q's device."""
    return resolve_backend(backend, q_BHSD.device, "attention", pass_, q_BHSD.dtype) if backend == "auto" else backend


@torch.library.custom_op("moetron::flash_attention_fwd", mutates_args=())
def _fwd_op(
    q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, causal: bool,
    alibi_slopes_H: torch.Tensor | None, softmax_scale: float, backend: str,
    doc_start_BS: torch.Tensor | None = None, sinks_H: torch.Tensor | None = None, window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    backend = _pass_backend(backend, "fwd", q_BHSD)
    if backend == "torch":
        return flash_attention_reference(q_BHSD, k_BGSD, v_BGSD, causal, alibi_slopes_H, softmax_scale, True,
                                         doc_start_BS, sinks_H, window)
    from moetron.kernels.flash_attention_triton import flash_attention_fwd_triton

    return flash_attention_fwd_triton(q_BHSD, k_BGSD, v_BGSD, causal, alibi_slopes_H, softmax_scale, backend,
                                      doc_start_BS=doc_start_BS, sinks_H=sinks_H, window=window)


@_fwd_op.register_fake
def _(q_BHSD, k_BGSD, v_BGSD, causal, alibi_slopes_H, softmax_scale, backend, doc_start_BS=None, sinks_H=None,
      window=0):
    B, H, S_Q, _ = q_BHSD.shape
    return q_BHSD.new_empty(B, H, S_Q, v_BGSD.shape[3]), q_BHSD.new_empty(B, H, S_Q, dtype=torch.float32)


@torch.library.custom_op("moetron::flash_attention_bwd", mutates_args=())
def _bwd_op(
    do_BHSD: torch.Tensor, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor,
    o_BHSD: torch.Tensor, lse_BHS: torch.Tensor, causal: bool, alibi_slopes_H: torch.Tensor | None,
    softmax_scale: float, backend: str, doc_start_BS: torch.Tensor | None = None,
    sinks_H: torch.Tensor | None = None, window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq_BHSD, dk_BGSD, dv_BGSD, dsinks_H); dsinks_H is empty, shape (0,), without sinks (an op
    returns tensors, never None)."""
    backend = _pass_backend(backend, "bwd", q_BHSD)
    if backend == "torch":
        return flash_attention_reference_backward(do_BHSD, q_BHSD, k_BGSD, v_BGSD, causal, alibi_slopes_H,
                                                  softmax_scale, doc_start_BS, sinks_H, window)
    from moetron.kernels.flash_attention_triton import flash_attention_bwd_triton

    return flash_attention_bwd_triton(do_BHSD, q_BHSD, k_BGSD, v_BGSD, o_BHSD, lse_BHS, causal, alibi_slopes_H,
                                      softmax_scale, backend, doc_start_BS=doc_start_BS, sinks_H=sinks_H,
                                      window=window)


@_bwd_op.register_fake
def _(do_BHSD, q_BHSD, k_BGSD, v_BGSD, o_BHSD, lse_BHS, causal, alibi_slopes_H, softmax_scale, backend,
      doc_start_BS=None, sinks_H=None, window=0):
    dsinks_H = q_BHSD.new_empty(0) if sinks_H is None else torch.empty_like(sinks_H)
    return torch.empty_like(q_BHSD), torch.empty_like(k_BGSD), torch.empty_like(v_BGSD), dsinks_H


def _setup_context(ctx, inputs, output):
    q_BHSD, k_BGSD, v_BGSD, causal, alibi_slopes_H, softmax_scale, backend, doc_start_BS, sinks_H, window = inputs
    o_BHSD, lse_BHS = output
    ctx.save_for_backward(q_BHSD, k_BGSD, v_BGSD, o_BHSD, lse_BHS, alibi_slopes_H, doc_start_BS, sinks_H)
    ctx.causal, ctx.softmax_scale, ctx.backend, ctx.window = causal, softmax_scale, backend, window


def _backward(ctx, do_BHSD, dlse_BHS):
    # The logsumexp is an auxiliary output for the backward pass; its gradient is not propagated
    # (flash_attention returns only the attention output).
    q_BHSD, k_BGSD, v_BGSD, o_BHSD, lse_BHS, alibi_slopes_H, doc_start_BS, sinks_H = ctx.saved_tensors
    dq, dk, dv, dsinks = _bwd_op(do_BHSD, q_BHSD, k_BGSD, v_BGSD, o_BHSD, lse_BHS, ctx.causal, alibi_slopes_H,
                                 ctx.softmax_scale, ctx.backend, doc_start_BS, sinks_H, ctx.window)
    return dq, dk, dv, None, None, None, None, None, None if sinks_H is None else dsinks, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _check_doc_start(doc_start_BS: torch.Tensor, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, causal: bool) -> None:
    """One-line ValueErrors for a doc_start_BS that cannot mask these q and k."""
    B, S_Q, S_K = q_BHSD.shape[0], q_BHSD.shape[2], k_BGSD.shape[2]
    if not causal:
        raise ValueError("flash_attention: doc_start_BS masks documents within causal attention; pass causal=True")
    if doc_start_BS.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"flash_attention: doc_start_BS must be int32 or int64, got {doc_start_BS.dtype}")
    if tuple(doc_start_BS.shape) != (B, S_K):
        raise ValueError(f"flash_attention: doc_start_BS must have shape (B, S_K) = ({B}, {S_K}), "
                         f"got {tuple(doc_start_BS.shape)}")
    if doc_start_BS.device != q_BHSD.device:
        raise ValueError(f"flash_attention: doc_start_BS must be on q's device {q_BHSD.device}, "
                         f"got {doc_start_BS.device}")
    if S_Q > S_K:
        # A query past the last key would have no entry in doc_start_BS to say where its document begins.
        raise ValueError(f"flash_attention: doc_start_BS needs S_Q <= S_K, got S_Q={S_Q}, S_K={S_K}")


def _check_sinks_window(sinks_H, window, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, causal: bool) -> None:
    """One-line ValueErrors for sinks_H and a window that cannot apply to these q and k."""
    H, S_Q, S_K = q_BHSD.shape[1], q_BHSD.shape[2], k_BGSD.shape[2]
    if sinks_H is not None:
        if tuple(sinks_H.shape) != (H,) or not sinks_H.is_floating_point():
            raise ValueError(f"flash_attention: sinks_H must be a float tensor of shape ({H},), "
                             f"got {sinks_H.dtype} {tuple(sinks_H.shape)}")
        if sinks_H.device != q_BHSD.device:
            raise ValueError(f"flash_attention: sinks_H must be on q's device {q_BHSD.device}, got {sinks_H.device}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"flash_attention: window must be an int >= 0 (0: no window), got {window!r}")
    if window and not causal:
        raise ValueError("flash_attention: a sliding window applies on top of causal attention; pass causal=True")
    if window and S_Q > S_K:
        # Queries past the keys' end would see no key at all once the window has passed them.
        raise ValueError(f"flash_attention: a sliding window needs S_Q <= S_K, got S_Q={S_Q}, S_K={S_K}")


def _check_kernel_inputs(backend: str, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor) -> None:
    """One-line ValueErrors for inputs the Triton kernels cannot take."""
    if q_BHSD.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"flash_attention: backend={backend!r} takes fp32, fp16 or bf16, got {q_BHSD.dtype}")
    if k_BGSD.shape[2] == 0:
        raise ValueError("flash_attention: no keys to attend to (S_K == 0)")
    if max(q_BHSD.shape[3], v_BGSD.shape[3]) > MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: backend={backend!r} takes head dims up to {MAX_HEAD_DIM}, got "
                         f"q/k {q_BHSD.shape[3]} and v {v_BGSD.shape[3]}")


def flash_attention(
    q_BHSD: torch.Tensor,
    k_BGSD: torch.Tensor,
    v_BGSD: torch.Tensor,
    causal: bool = True,
    alibi_slopes_H: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    *,
    doc_start_BS: torch.Tensor | None = None,
    sinks_H: torch.Tensor | None = None,
    window: int = 0,
    backend: str | None = None,
) -> torch.Tensor:
    """o_BHSD = softmax(scale * q k^T + alibi, causal, window and document mask; sink) v, differentiable
    in q, k, v and sinks_H. q and k share a head dim Dq; v's Dv (the output's) may differ (MLA).

    `softmax_scale` defaults to 1/sqrt(Dq). `doc_start_BS`: int32 or int64 (B, S_K) on q's device,
    where the document of each key position begins (module docstring); only with causal=True and
    S_Q <= S_K. `sinks_H`: (H,) float logits on q's device, one extra softmax column per query
    head without a value (GPT-OSS). `window`: 0 for none, else W >= 1: a query sees itself and
    the W - 1 positions before it, as Hugging Face's `sliding_window=W` (module docstring); only
    with causal=True and S_Q <= S_K. `backend`: None or "auto" picks, for the forward and
    the backward each, the path recorded for this CUDA device (Triton where unmeasured; see
    kernels/measured_backends.py) and torch elsewhere; "interpret" runs the Triton kernels on CPU
    (tests). The Triton path takes fp32, fp16 and bf16 with head dims Dq and Dv each from 1 to 256
    (not only powers of two: 192, 96, 48 alike); the torch path any float dtype and head dims.
    """
    if q_BHSD.dim() != 4 or k_BGSD.dim() != 4 or v_BGSD.dim() != 4 or v_BGSD.shape[:3] != k_BGSD.shape[:3]:
        raise ValueError(
            f"flash_attention: expected q_BHSD, k_BGSD, v_BGSD 4-D with k and v alike but for the head dim; got "
            f"{tuple(q_BHSD.shape)}, {tuple(k_BGSD.shape)}, {tuple(v_BGSD.shape)}"
        )
    (B, H, _, D), (Bk, G, _, Dk) = q_BHSD.shape, k_BGSD.shape
    if B != Bk or D != Dk or G == 0 or H % G:
        raise ValueError(
            f"flash_attention: q_BHSD {tuple(q_BHSD.shape)} and k_BGSD {tuple(k_BGSD.shape)} need the same "
            f"batch and head dim and a number of query heads divisible by the KV heads"
        )
    if not (q_BHSD.dtype == k_BGSD.dtype == v_BGSD.dtype):
        raise ValueError(f"flash_attention: dtypes differ: {q_BHSD.dtype}, {k_BGSD.dtype}, {v_BGSD.dtype}")
    if alibi_slopes_H is not None and tuple(alibi_slopes_H.shape) != (H,):
        raise ValueError(f"flash_attention: alibi_slopes_H must have shape ({H},), got {tuple(alibi_slopes_H.shape)}")
    if doc_start_BS is not None:
        _check_doc_start(doc_start_BS, q_BHSD, k_BGSD, causal)
    _check_sinks_window(sinks_H, window, q_BHSD, k_BGSD, causal)
    request = "auto" if backend is None else backend
    kernels = sorted({resolve_backend(request, q_BHSD.device, "attention", p, q_BHSD.dtype)
                      for p in PASSES["attention"]} - {"torch"})
    if kernels:
        _check_kernel_inputs(kernels[0], q_BHSD, k_BGSD, v_BGSD)
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    # A window of S_K or more hides nothing; capping it keeps the kernels' position arithmetic in int32.
    window = min(window, k_BGSD.shape[2])
    o_BHSD, _ = _fwd_op(q_BHSD, k_BGSD, v_BGSD, causal, alibi_slopes_H, scale, request, doc_start_BS, sinks_H, window)
    return o_BHSD

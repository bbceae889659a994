"""moetron.kernels.flash_attention against plain eager attention, on fresh random inputs.

Legend: B batch, H query heads, G key/value heads, S_Q / S_K query / key positions, D head dim.
Triton tests run compiled on a GPU or interpreted on CPU, each in its own process (a bad
pointer in an interpreted kernel corrupts memory instead of raising). Under the interpreter the
tiles are 32 wide, so lengths of 45-100 cover two tiles plus a ragged edge; document boundaries
at 0, 1, 31, 33, 64 fall on, beside and between tile edges.
"""

import math

import pytest
import torch

from moetron.kernels.flash_attention import flash_attention, flash_attention_reference


def _naive_attention(q_BHSD, k_BGSD, v_BGSD, causal, alibi_slopes_H, scale):
    """Independent of flash_attention_reference: repeat K/V per query head, one head at a time,
    explicit positions, softmax, all in float64."""
    B, H, S_Q, D = q_BHSD.shape
    G, S_K = k_BGSD.shape[1], k_BGSD.shape[2]
    out = []
    for h in range(H):
        q, k, v = q_BHSD[:, h], k_BGSD[:, h // (H // G)], v_BGSD[:, h // (H // G)]
        s = torch.einsum("bid,bjd->bij", q, k) * scale
        for i in range(S_Q):
            pos = i + max(S_K - S_Q, 0)
            for j in range(S_K):
                if alibi_slopes_H is not None:
                    s[:, i, j] = s[:, i, j] + float(alibi_slopes_H[h]) * (j - pos)
                if causal and j > pos:
                    s[:, i, j] = float("-inf")
        out.append(torch.einsum("bij,bjd->bid", torch.softmax(s, dim=-1), v))
    return torch.stack(out, dim=1)


def _inputs(B, H, G, S_Q, S_K, D, dtype, device, alibi):
    q = torch.randn(B, H, S_Q, D, device=device, dtype=dtype)
    k = torch.randn(B, G, S_K, D, device=device, dtype=dtype)
    v = torch.randn(B, G, S_K, D, device=device, dtype=dtype)
    # ALiBi's geometric slopes 2^(-8h/H), the bias the paper uses.
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=device) / H) if alibi else None
    return q, k, v, slopes


def _reference_grads(q, k, v, causal, slopes, do, doc_start_BS=None):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64, lse64 = flash_attention_reference(q64, k64, v64, causal, slopes, None, return_lse=True,
                                           doc_start_BS=doc_start_BS)
    o64.backward(do.double())
    return o64, lse64, q64.grad, k64.grad, v64.grad


def _check_against_reference(case, q, k, v, causal, slopes, backend, close, doc_start_BS=None):
    """The kernels' output, logsumexp and gradients (of one random output gradient) against the
    float64 reference's, within `close`'s tolerance for q's dtype; → the kernels' (o, dq, dk)."""
    dtype, D = q.dtype, q.shape[3]
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    o = flash_attention(q1, k1, v1, causal, slopes, doc_start_BS=doc_start_BS, backend=backend)
    do = torch.randn_like(o)
    o.backward(do)
    o64, lse64, dq64, dk64, dv64 = _reference_grads(q, k, v, causal, slopes, do, doc_start_BS)
    _, lse = torch.ops.moetron.flash_attention_fwd(q, k, v, causal, slopes, D**-0.5, backend, doc_start_BS)
    close(o, o64, dtype, f"{case} o")
    close(lse, lse64, torch.float32, f"{case} logsumexp")
    close(q1.grad, dq64, dtype, f"{case} dq")
    close(k1.grad, dk64, dtype, f"{case} dk")
    close(v1.grad, dv64, dtype, f"{case} dv")
    return o, q1.grad, k1.grad


CASES = {
    # name: (B, H, G, S_Q, S_K, D, causal, alibi, dtype)
    "d32-causal": (1, 2, 2, 70, 70, 32, True, False, torch.float32),
    "d64-full-gqa-alibi": (1, 4, 2, 70, 70, 64, False, True, torch.float32),
    "d128-causal-mqa": (1, 4, 1, 45, 45, 128, True, False, torch.float32),
    "d64-decode-kvcache-alibi": (1, 4, 2, 37, 90, 64, True, True, torch.float32),
    "d64-more-queries-than-keys": (1, 2, 1, 90, 37, 64, True, False, torch.float32),
    "d32-one-query": (2, 4, 2, 1, 77, 32, True, True, torch.float32),
    "d64-bf16-causal-gqa-alibi": (1, 4, 2, 70, 70, 64, True, True, torch.bfloat16),
    "d32-fp16-full": (1, 2, 1, 45, 70, 32, False, False, torch.float16),
}


@pytest.mark.forked
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(case, triton_target, close):
    backend, device = triton_target
    B, H, G, S_Q, S_K, D, causal, alibi, dtype = CASES[case]
    q, k, v, slopes = _inputs(B, H, G, S_Q, S_K, D, dtype, device, alibi)
    o, dq, dk = _check_against_reference(case, q, k, v, causal, slopes, backend, close)
    assert o.dtype == dtype and dq.dtype == dtype and dk.dtype == dtype


@pytest.mark.forked
def test_triton_strided_inputs_and_scale(triton_target, close):
    """q, k, v as transposed views of (B, S, heads, D) projections, the layout a model produces,
    and an explicit softmax scale."""
    backend, device = triton_target
    B, S, H, G, D = 2, 50, 4, 2, 64
    q = torch.randn(B, S, H, D, device=device).transpose(1, 2)
    k = torch.randn(B, S, G, D, device=device).transpose(1, 2)
    v = torch.randn(B, S, G, D, device=device).transpose(1, 2)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    o = flash_attention(qs, ks, vs, True, None, 0.3, backend=backend)
    do = torch.randn_like(o)
    o.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = flash_attention_reference(q64, k64, v64, True, None, 0.3)
    o64.backward(do.double())
    close(o, o64, torch.float32, "strided o")
    for name, got, want in (("dq", qs.grad, q64.grad), ("dk", ks.grad, k64.grad), ("dv", vs.grad, v64.grad)):
        close(got, want, torch.float32, f"strided {name}")


@pytest.mark.parametrize("causal,alibi,S_Q,S_K", [(True, True, 5, 9), (False, True, 7, 7), (True, False, 9, 4)])
def test_reference_matches_naive_attention(causal, alibi, S_Q, S_K, close):
    """The reference itself against a per-head, per-entry loop (positions, GQA, ALiBi sign)."""
    q, k, v, slopes = _inputs(2, 4, 2, S_Q, S_K, 8, torch.float64, torch.device("cpu"), alibi)
    got = flash_attention(q, k, v, causal, slopes)
    want = _naive_attention(q, k, v, causal, slopes, 1 / math.sqrt(8))
    close(got, want, torch.float64, "reference vs naive")


def test_torch_backend_gradcheck():
    q, k, v, slopes = _inputs(1, 4, 2, 5, 7, 8, torch.float64, torch.device("cpu"), alibi=True)
    fn = lambda q, k, v: flash_attention(q, k, v, True, slopes)  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v)))


@pytest.mark.parametrize("documents", [False, True])
def test_traced_by_torch_compile(documents, compiles_like_eager):
    q, k, v, slopes = _inputs(1, 4, 2, 9, 9, 16, torch.float32, torch.device("cpu"), alibi=True)
    doc_start = _doc_starts(9, [[4]]) if documents else None

    def loss(q, k, v):
        return flash_attention(q, k, v, True, slopes, doc_start_BS=doc_start).square().sum()

    compiles_like_eager(loss, q, k, v)


def _doc_starts(S, bounds_per_row, device=torch.device("cpu")):
    """doc_start_BS (B, S) int64 from the positions where documents begin in each row (0 implied)."""
    rows = []
    for bounds in bounds_per_row:
        start_S = torch.zeros(S, dtype=torch.int64)
        for b in sorted(bounds):
            start_S[b:] = b
        rows.append(start_S)
    return torch.stack(rows).to(device)


def _per_document_attention(q_BHSD, k_BGSD, v_BGSD, slopes, doc_start_BS, scale):
    """The oracle for documents: each document's queries and keys cut out and attended causally
    on their own (no document mask anywhere), the pieces put back in place."""
    S_Q, S_K = q_BHSD.shape[2], k_BGSD.shape[2]
    offset = S_K - S_Q  # queries are the last S_Q positions
    out = torch.full_like(q_BHSD, float("nan"))
    for b in range(q_BHSD.shape[0]):
        bounds = sorted(set(doc_start_BS[b].tolist())) + [S_K]
        for start, end in zip(bounds[:-1], bounds[1:]):
            q_lo, q_hi = max(start - offset, 0), end - offset
            if q_hi <= 0:
                continue
            out[b : b + 1, :, q_lo:q_hi] = flash_attention_reference(
                q_BHSD[b : b + 1, :, q_lo:q_hi], k_BGSD[b : b + 1, :, start:end], v_BGSD[b : b + 1, :, start:end],
                True, slopes, scale)
    return out


# name: (S, document starts per batch row)
DOC_LAYOUTS = {
    "tile-edges": (90, [[1, 31, 33, 64], [32, 64, 65]]),
    "one-token-docs": (90, [[5, 6, 7, 40, 89], []]),
    "every-token": (70, [list(range(70)), [69]]),
    "long-then-short": (100, [[97, 98], [3]]),
}


@pytest.mark.parametrize("layout", list(DOC_LAYOUTS))
@pytest.mark.parametrize("alibi,S_Q", [(False, None), (True, None), (True, 37)])
def test_reference_with_documents_matches_per_document_attention(layout, alibi, S_Q, close):
    """flash_attention_reference with doc_start equals each document attended alone (fp64, GQA;
    S_Q < S_K: a window of queries at the end, as with a KV cache)."""
    S, bounds = DOC_LAYOUTS[layout]
    q, k, v, slopes = _inputs(2, 4, 2, S_Q or S, S, 16, torch.float64, torch.device("cpu"), alibi)
    doc_start = _doc_starts(S, bounds)
    got = flash_attention_reference(q, k, v, True, slopes, None, doc_start_BS=doc_start)
    want = _per_document_attention(q, k, v, slopes, doc_start, 16**-0.5)
    close(got, want, torch.float64, f"{layout} reference vs per document")


DOC_CASES = {
    # name: (layout in DOC_LAYOUTS, H, G, S_Q (None: all S positions), D, alibi, dtype)
    "d32-tile-edges-gqa": ("tile-edges", 4, 2, None, 32, False, torch.float32),
    "d32-one-token-docs-alibi": ("one-token-docs", 4, 2, None, 32, True, torch.float32),
    "d32-every-token-mqa": ("every-token", 2, 1, None, 32, False, torch.float32),
    "d64-decode-window-alibi": ("tile-edges", 2, 1, 37, 64, True, torch.float32),
    "d64-bf16-long-then-short-gqa": ("long-then-short", 4, 2, None, 64, False, torch.bfloat16),
}


@pytest.mark.forked
@pytest.mark.parametrize("case", list(DOC_CASES))
def test_triton_with_documents_matches_reference(case, triton_target, close):
    backend, device = triton_target
    layout, H, G, S_Q, D, alibi, dtype = DOC_CASES[case]
    S, bounds = DOC_LAYOUTS[layout]
    q, k, v, slopes = _inputs(2, H, G, S_Q or S, S, D, dtype, device, alibi)
    doc_start = _doc_starts(S, bounds, device).int()
    _check_against_reference(case, q, k, v, True, slopes, backend, close, doc_start)


@pytest.mark.forked
def test_triton_one_document_equals_plain_causal(triton_target, close):
    """doc_start all zeros (one document per row) gives what causal attention without it gives."""
    backend, device = triton_target
    q, k, v, slopes = _inputs(2, 4, 2, 70, 70, 32, torch.float32, device, alibi=True)
    do = torch.randn_like(q)
    results = []
    for doc_start in (None, torch.zeros(2, 70, dtype=torch.int64, device=device)):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        o = flash_attention(*qkv, True, slopes, doc_start_BS=doc_start, backend=backend)
        o.backward(do)
        results.append([o] + [t.grad for t in qkv])
    for name, plain, docs in zip(("o", "dq", "dk", "dv"), *results):
        close(docs, plain, torch.float32, f"one document {name}")


def test_reference_one_document_equals_plain_causal_and_gradcheck(close):
    """On the torch path: doc_start all zeros changes nothing; the op's backward with documents
    (flash_attention_reference_backward) agrees with finite differences."""
    q, k, v, slopes = _inputs(2, 2, 1, 5, 7, 4, torch.float64, torch.device("cpu"), alibi=True)
    zeros = torch.zeros(2, 7, dtype=torch.int32)
    close(flash_attention(q, k, v, True, slopes, doc_start_BS=zeros), flash_attention(q, k, v, True, slopes),
          torch.float64, "one document")
    doc_start = _doc_starts(7, [[3, 4], [6]])
    fn = lambda q, k, v: flash_attention(q, k, v, True, slopes, doc_start_BS=doc_start)  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v)))


def test_document_kernels_are_compiled_ahead_of_time():
    """The sm_90 compile test (test_sm90_compile.py) covers the document code path of every kernel."""
    pytest.importorskip("triton")
    from moetron.kernels.flash_attention_triton import compile_specs

    names = [spec.name for spec in compile_specs()]
    for kind in ("fwd", "dkdv", "dq"):
        assert any(n.startswith(f"attention_{kind}[") and "docs=True" in n for n in names), kind


def test_checks_arguments():
    q, k = torch.randn(1, 3, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="divisible"):
        flash_attention(q, k, k)
    with pytest.raises(ValueError, match="alibi"):
        flash_attention(q, q, q, alibi_slopes_H=torch.ones(2))
    with pytest.raises(ValueError, match="CUDA"):
        flash_attention(q, q, q, backend="triton")


@pytest.mark.parametrize("causal,doc_start,q_len,match", [
    (False, torch.zeros(1, 5, dtype=torch.int64), 5, "causal=True"),
    (True, torch.zeros(1, 5), 5, "int32 or int64"),
    (True, torch.zeros(5, dtype=torch.int64), 5, r"shape \(B, S_K\) = \(1, 5\)"),
    (True, torch.zeros(1, 6, dtype=torch.int32), 5, r"shape \(B, S_K\)"),
    (True, torch.zeros(1, 5, dtype=torch.int32), 6, "S_Q <= S_K"),
])
def test_checks_doc_start(causal, doc_start, q_len, match):
    q, k = torch.randn(1, 2, q_len, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=match) as err:
        flash_attention(q, k, k, causal, doc_start_BS=doc_start)
    assert "\n" not in str(err.value)

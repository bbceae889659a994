"""Attention sinks and sliding windows in moetron.kernels.flash_attention (GPT-OSS's attention).

Legend: B batch, H query heads, G key/value heads, S_Q / S_K query / key positions, D head dim,
W window (a query sees itself and the W - 1 positions before it).
The references: a per-head softmax over the logits with the sink appended as one more column
(what transformers' GPT-OSS eager attention does), and transformers' own function and mask. The
Triton kernels run interpreted on CPU (tiles of 32), each test in its own process; windows of
1, 7 (inside a tile), 45 and 95 (not multiples of the tile; 95 wide enough to leave whole tiles
unmasked) and 100 (longer than the sequence).
"""

import math
import types

import pytest
import torch

from moetron.kernels.flash_attention import flash_attention, flash_attention_reference


def _inputs(B, H, G, S_Q, S_K, D, dtype=torch.float32, sinks=True):
    q = torch.randn(B, H, S_Q, D, dtype=dtype)
    k = torch.randn(B, G, S_K, D, dtype=dtype)
    v = torch.randn(B, G, S_K, D, dtype=dtype)
    # Sinks around the size of a row's logsumexp, so that p_sink is neither ~0 nor ~1.
    sinks_H = (torch.randn(H) + math.log(S_K) / 2).to(dtype) if sinks else None
    return q, k, v, sinks_H


def _softmax_with_sink_column(q_BHSD, k_BGSD, v_BGSD, sinks_H, window, scale):
    """One head at a time, K/V repeated, positions spelled out (queries are the last S_Q), the sink
    appended as a last column of the masked logits, softmax over all, the column dropped.
    Returns (o_BHSD, lse_BHS) with the logsumexp over the row and its sink."""
    B, H, S_Q, _ = q_BHSD.shape
    G, S_K = k_BGSD.shape[1], k_BGSD.shape[2]
    pos_q, pos_k = torch.arange(S_Q)[:, None] + max(S_K - S_Q, 0), torch.arange(S_K)[None, :]
    allowed = (pos_k <= pos_q) & ((pos_k > pos_q - window) if window else True)
    outs, lses = [], []
    for h in range(H):
        k, v = k_BGSD[:, h // (H // G)], v_BGSD[:, h // (H // G)]
        s = (q_BHSD[:, h] @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        if sinks_H is not None:
            s = torch.cat([s, sinks_H[h].expand(B, S_Q, 1)], dim=-1)
        outs.append(torch.softmax(s, dim=-1)[..., :S_K] @ v)
        lses.append(torch.logsumexp(s, dim=-1))
    return torch.stack(outs, 1), torch.stack(lses, 1)


@pytest.mark.parametrize("window,S_Q,sinks", [(0, 9, True), (1, 9, True), (3, 9, True), (4, 5, True),
                                               (3, 9, False), (20, 9, True)])
def test_reference_matches_softmax_with_sink_column(window, S_Q, sinks, close):
    """fp64, GQA; S_Q = 5 < S_K = 9 puts the queries at the end, as with a KV cache."""
    q, k, v, sinks_H = _inputs(2, 4, 2, S_Q, 9, 8, torch.float64, sinks)
    o, lse = flash_attention_reference(q, k, v, True, None, 0.3, True, sinks_H=sinks_H, window=window)
    o_want, lse_want = _softmax_with_sink_column(q, k, v, sinks_H, window, 0.3)
    close(o, o_want, torch.float64, "o")
    close(lse.double(), lse_want, torch.float32, "logsumexp")
    close(flash_attention(q, k, v, softmax_scale=0.3, sinks_H=sinks_H, window=window), o_want, torch.float64, "op")


@pytest.mark.parametrize("window", [None, 1, 5])
def test_matches_transformers_gpt_oss_attention(window, close):
    """transformers' GPT-OSS eager attention with its sliding-window causal mask (sliding_window=W)
    gives what flash_attention(window=W, sinks_H=...) gives, forward and every gradient (sinks too):
    so a window of W means W keys, as there."""
    pytest.importorskip("transformers")
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    B, H, G, S, D = 2, 4, 2, 11, 8
    q, k, v, sinks_H = (t.requires_grad_() for t in _inputs(B, H, G, S, S, D, torch.float64))
    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    allowed_SS = mask_fn(0, 0, torch.arange(S)[:, None], torch.arange(S)[None, :])
    mask_11SS = torch.zeros(S, S, dtype=torch.float64).masked_fill(~allowed_SS, torch.finfo(torch.float64).min)
    module = types.SimpleNamespace(sinks=sinks_H, num_key_value_groups=H // G, training=False)
    want_BSHD, _ = eager_attention_forward(module, q, k, v, mask_11SS[None, None], D**-0.5)
    got_BSHD = flash_attention(q, k, v, sinks_H=sinks_H, window=window or 0).transpose(1, 2)
    do = torch.randn_like(want_BSHD)
    grads_want = torch.autograd.grad(want_BSHD, (q, k, v, sinks_H), do)
    grads_got = torch.autograd.grad(got_BSHD, (q, k, v, sinks_H), do)  # the op's backward formulas
    close(got_BSHD, want_BSHD, torch.float64, "o")
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads_got, grads_want):
        close(got, want, torch.float64, name)


def test_torch_backend_gradcheck_with_sinks_window_and_documents():
    """The torch path's backward (flash_attention_reference_backward, d sinks included) against
    finite differences, with a window, documents and ALiBi at once."""
    q, k, v, sinks_H = _inputs(2, 2, 1, 6, 7, 4, torch.float64)
    slopes_H = torch.tensor([0.5, 0.25], dtype=torch.float64)
    doc_start = torch.tensor([[0, 0, 0, 3, 3, 3, 3], [0, 1, 1, 1, 1, 1, 1]])

    def fn(q, k, v, sinks_H):
        return flash_attention(q, k, v, True, slopes_H, doc_start_BS=doc_start, sinks_H=sinks_H, window=3)

    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v, sinks_H)))


def _reference_grads(q, k, v, sinks_H, window, do, doc_start_BS=None):
    """fp64 autograd through flash_attention_reference: (o, lse, dq, dk, dv, dsinks)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s64 = None if sinks_H is None else sinks_H.detach().double().requires_grad_()
    o64, lse64 = flash_attention_reference(q64, k64, v64, True, None, None, True, doc_start_BS, s64, window)
    o64.backward(do.double())
    return o64, lse64, q64.grad, k64.grad, v64.grad, None if s64 is None else s64.grad


CASES = {
    # name: (H, G, S_Q, S_K, D, window, sinks, dtype); tiles are 32 under the interpreter.
    "w1-sinks-gqa": (4, 2, 45, 45, 32, 1, True, torch.float32),
    "w7-inside-a-tile-mqa": (2, 1, 70, 70, 32, 7, False, torch.float32),
    "w45-not-a-tile-multiple-sinks-d64": (2, 1, 70, 70, 64, 45, True, torch.float32),
    "w100-past-the-sequence-sinks": (2, 2, 70, 70, 32, 100, True, torch.float32),
    # Windows over two tiles wide leave whole tiles inside every row's window: the unmasked ranges.
    # 95 = 3 * 32 - 1 puts a window's edge on a tile's last row.
    "w95-unmasked-middle-tiles-sinks": (2, 1, 100, 100, 32, 95, True, torch.float32),
    "sinks-only-gqa": (4, 2, 45, 45, 32, 0, True, torch.float32),
    "w20-decode-kvcache-sinks": (4, 2, 37, 90, 32, 20, True, torch.float32),
    "w7-bf16-sinks-gqa": (4, 2, 45, 45, 32, 7, True, torch.bfloat16),
}


@pytest.mark.forked
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(case, triton_target, close):
    backend, device = triton_target
    H, G, S_Q, S_K, D, window, sinks, dtype = CASES[case]
    q, k, v, sinks_H = (None if t is None else t.to(device) for t in _inputs(1, H, G, S_Q, S_K, D, dtype, sinks))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks_H.clone().requires_grad_()] if sinks else [])
    o = flash_attention(*leaves[:3], sinks_H=leaves[3] if sinks else None, window=window, backend=backend)
    do = torch.randn_like(o)
    o.backward(do)
    o64, lse64, *grads64 = _reference_grads(q, k, v, sinks_H, window, do)
    _, lse = torch.ops.moetron.flash_attention_fwd(q, k, v, True, None, D**-0.5, backend, None, sinks_H, window)

    close(o, o64, dtype, f"{case} o")
    close(lse, lse64, torch.float32, f"{case} logsumexp (sink included)")
    for name, leaf, want in zip(("dq", "dk", "dv", "dsinks"), leaves, grads64):
        assert leaf.grad.dtype == leaf.dtype
        close(leaf.grad, want, dtype, f"{case} {name}")


@pytest.mark.forked
def test_triton_window_with_documents_matches_reference(triton_target, close):
    """A window of 13 and documents beginning at 1, 31, 33 and 64 (beside and between tile edges):
    each query sees from the later of its window's and its document's start."""
    backend, device = triton_target
    q, k, v, sinks_H = (t.to(device) for t in _inputs(2, 4, 2, 90, 90, 32))
    doc_start = torch.zeros(2, 90, dtype=torch.int32, device=device)
    for start in (1, 31, 33, 64):
        doc_start[0, start:] = start
    doc_start[1, 50:] = 50
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks_H)]
    o = flash_attention(*leaves[:3], doc_start_BS=doc_start, sinks_H=leaves[3], window=13, backend=backend)
    do = torch.randn_like(o)
    o.backward(do)
    o64, _, *grads64 = _reference_grads(q, k, v, sinks_H, 13, do, doc_start)
    close(o, o64, torch.float32, "o")
    for name, leaf, want in zip(("dq", "dk", "dv", "dsinks"), leaves, grads64):
        close(leaf.grad, want, torch.float32, name)


@pytest.mark.forked
def test_triton_never_reads_tiles_outside_the_window(triton_target, close):
    """With W = 8 and 96 positions (three tiles of 32), NaN in what no window reaches stays out:
    keys 0-31 poisoned leave the last query tile's o and dq exact (the forward and dQ skip the
    first key tile), queries 64-95 poisoned leave dK and dV of keys 0-31 exact (dK/dV stop at
    the query tiles whose windows reach them). A masked tile that was loaded would spread NaN (0 * NaN)."""
    backend, device = triton_target
    q, k, v, sinks_H = (t.to(device) for t in _inputs(1, 2, 1, 96, 96, 32))
    do = torch.randn_like(q)
    o64, _, dq64, dk64, dv64, _ = _reference_grads(q, k, v, sinks_H, 8, do)

    def run(q, k, v, do):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = flash_attention(*leaves, sinks_H=sinks_H, window=8, backend=backend)
        o.backward(do)
        return o, leaves[0].grad, leaves[1].grad, leaves[2].grad

    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, :, :32], poisoned_v[:, :, :32] = float("nan"), float("nan")
    o, dq, _, _ = run(q, poisoned_k, poisoned_v, do)
    close(o[:, :, 64:], o64[:, :, 64:], torch.float32, "o of the last query tile, keys 0-31 poisoned")
    close(dq[:, :, 64:], dq64[:, :, 64:], torch.float32, "dq of the last query tile, keys 0-31 poisoned")

    poisoned_q, poisoned_do = q.clone(), do.clone()
    poisoned_q[:, :, 64:], poisoned_do[:, :, 64:] = float("nan"), float("nan")
    _, _, dk, dv = run(poisoned_q, k, v, poisoned_do)
    close(dk[:, :, :32], dk64[:, :, :32], torch.float32, "dk of keys 0-31, queries 64-95 poisoned")
    close(dv[:, :, :32], dv64[:, :, :32], torch.float32, "dv of keys 0-31, queries 64-95 poisoned")


def test_traced_by_torch_compile_with_sinks_and_window(close):
    """The ops' schemas and fake implementations take the sinks and the window: torch.compile
    traces the whole graph, and its gradients (d sinks too) equal eager ones."""
    q, k, v, sinks_H = _inputs(1, 4, 2, 9, 9, 16)

    def loss(q, k, v, sinks_H):
        return flash_attention(q, k, v, sinks_H=sinks_H, window=4).square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    a = [t.clone().requires_grad_() for t in (q, k, v, sinks_H)]
    b = [t.clone().requires_grad_() for t in (q, k, v, sinks_H)]
    compiled(*a).backward()
    loss(*b).backward()
    for name, x, y in zip(("q", "k", "v", "sinks"), a, b):
        close(x.grad, y.grad, torch.float32, f"compiled d{name}")


def test_sink_and_window_kernels_are_compiled_ahead_of_time():
    """The sm_90 compile test (test_sm90_compile.py) covers the sink and window code paths."""
    pytest.importorskip("triton")
    from moetron.kernels.flash_attention_triton import compile_specs

    names = [spec.name for spec in compile_specs()]
    for kind in ("fwd", "dkdv", "dq"):
        assert any(n.startswith(f"attention_{kind}[") and "sinks=True,window=True" in n for n in names), kind
    assert any(n.startswith("attention_delta[") and "sinks=True" in n for n in names)


@pytest.mark.parametrize("kwargs,S_Q,match", [
    (dict(window=-1), 5, "window must be an int >= 0"),
    (dict(window=2.0), 5, "window must be an int >= 0"),
    (dict(window=2, causal=False), 5, "causal=True"),
    (dict(window=2), 6, "S_Q <= S_K"),
    (dict(sinks_H=torch.zeros(3)), 5, r"shape \(2,\)"),
    (dict(sinks_H=torch.zeros(2, dtype=torch.int64)), 5, "float tensor"),
])
def test_checks_sinks_and_window(kwargs, S_Q, match):
    q, k = torch.randn(1, 2, S_Q, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=match) as err:
        flash_attention(q, k, k, **kwargs)
    assert "\n" not in str(err.value)

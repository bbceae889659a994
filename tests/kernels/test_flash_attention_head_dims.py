"""Head dims in moetron.kernels.flash_attention: q/k's Dq apart from v's Dv (DeepSeek-V3's MLA: 192
and 128) and dims that are not powers of two (192, 96, 48), forward and backward, with every feature.

Legend: B batch, H query heads, G key/value heads, S_Q / S_K query / key positions, Dq the head dim
of q and k, Dv of v and the output, W window.
The oracle: plain softmax(q kᵀ · scale + mask) v in float64, one head at a time, K/V repeated, the
masks (causal, documents, window) and ALiBi spelled out position by position, the sink appended as
one more column; its gradients by autograd, apart from the reference's backward formulas. The Triton
kernels run interpreted on CPU (tiles of 32; 192 sits in a 256-wide tile), each test in its own process.
"""

import math

import pytest
import torch

from moetron.kernels.attention_tiles import attention_configs, head_block
from moetron.kernels.flash_attention import flash_attention, flash_attention_reference


def _softmax_attention(q_BHSD, k_BGSD, v_BGSD, causal, slopes_H, scale, doc_start_BS=None, sinks_H=None, window=0):
    """o (B, H, S_Q, Dv) and lse (B, H, S_Q) by the definition, in float64."""
    q_BHSD, k_BGSD, v_BGSD = (t.double() for t in (q_BHSD, k_BGSD, v_BGSD))
    B, H, S_Q, _ = q_BHSD.shape
    G, S_K = k_BGSD.shape[1], k_BGSD.shape[2]
    pos_q, pos_k = torch.arange(S_Q)[:, None] + max(S_K - S_Q, 0), torch.arange(S_K)[None, :]
    allowed_BQK = torch.ones(B, S_Q, S_K, dtype=torch.bool)
    if causal:
        allowed_BQK &= pos_k <= pos_q
    if window:
        allowed_BQK &= pos_k > pos_q - window
    if doc_start_BS is not None:
        allowed_BQK &= pos_k[None] >= doc_start_BS[:, pos_q[:, 0]].cpu()[:, :, None]
    outs, lses = [], []
    for h in range(H):
        k, v = k_BGSD[:, h // (H // G)], v_BGSD[:, h // (H // G)]
        s = q_BHSD[:, h] @ k.transpose(-1, -2) * scale
        if slopes_H is not None:
            s = s + float(slopes_H[h]) * (pos_k - pos_q).double()
        s = s.masked_fill(~allowed_BQK, float("-inf"))
        if sinks_H is not None:
            s = torch.cat([s, sinks_H[h].double().expand(B, S_Q, 1)], dim=-1)
        outs.append(torch.softmax(s, dim=-1)[..., :S_K] @ v)
        lses.append(torch.logsumexp(s, dim=-1))
    return torch.stack(outs, 1), torch.stack(lses, 1)


def _inputs(B, H, G, S_Q, S_K, Dq, Dv, dtype, device, alibi=False, sinks=False):
    q = torch.randn(B, H, S_Q, Dq, device=device, dtype=dtype)
    k = torch.randn(B, G, S_K, Dq, device=device, dtype=dtype)
    v = torch.randn(B, G, S_K, Dv, device=device, dtype=dtype)
    slopes_H = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=device) / H) if alibi else None
    # Sinks around the size of a row's logsumexp, so that p_sink is neither ~0 nor ~1.
    sinks_H = (torch.randn(H, device=device) + math.log(S_K) / 2).to(dtype) if sinks else None
    return q, k, v, slopes_H, sinks_H


def _oracle_grads(q, k, v, sinks_H, do, **kw):
    """(o, lse, dq, dk, dv, dsinks) of _softmax_attention, float64 autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s64 = None if sinks_H is None else sinks_H.detach().double().requires_grad_()
    o, lse = _softmax_attention(*leaves, sinks_H=s64, **kw)
    o.backward(do.double())
    return o, lse, *(t.grad for t in leaves), None if s64 is None else s64.grad


def _doc_starts(S, starts, device):
    """doc_start_BS (1, S) from the positions where documents begin (0 implied)."""
    start_S = torch.zeros(S, dtype=torch.int32)
    for b in sorted(starts):
        start_S[b:] = b
    return start_S[None].to(device)


@pytest.mark.parametrize("Dq,Dv,causal,alibi,S_Q", [(12, 8, True, True, 5), (8, 12, False, False, 7),
                                                     (6, 6, True, False, 9)])
def test_reference_matches_softmax_attention(Dq, Dv, causal, alibi, S_Q, close):
    """flash_attention_reference with Dq ≠ Dv (either wider) against the definition, fp64, GQA; S_Q =
    5 < S_K = 9 puts the queries at the end, as with a KV cache."""
    q, k, v, slopes_H, _ = _inputs(2, 4, 2, S_Q, 9, Dq, Dv, torch.float64, torch.device("cpu"), alibi)
    o, lse = flash_attention_reference(q, k, v, causal, slopes_H, 0.3, return_lse=True)
    o_want, lse_want = _softmax_attention(q, k, v, causal, slopes_H, 0.3)
    assert o.shape == (2, 4, S_Q, Dv)
    close(o, o_want, torch.float64, "o")
    close(lse.double(), lse_want, torch.float32, "logsumexp")


def test_torch_backend_gradcheck_with_different_head_dims():
    """The torch path's backward formulas (flash_attention_reference_backward: dq, dk Dq wide, dv Dv)
    against finite differences, with ALiBi, documents, sinks and a window at once."""
    q, k, v, slopes_H, sinks_H = _inputs(2, 2, 1, 6, 7, 6, 4, torch.float64, torch.device("cpu"), True, True)
    doc_start = torch.tensor([[0, 0, 0, 3, 3, 3, 3], [0, 1, 1, 1, 1, 1, 1]])

    def fn(q, k, v, sinks_H):
        return flash_attention(q, k, v, True, slopes_H, doc_start_BS=doc_start, sinks_H=sinks_H, window=3)

    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v, sinks_H)))


CASES = {
    # name: (H, G, S_Q, S_K, Dq, Dv, causal, alibi, document starts, sinks, W, dtype)
    # DeepSeek-V3's MLA at width 1/4 (Dq = 32 + 16, Dv = 32) and at full width (192 in a 256 tile).
    "dq48-dv32-causal-gqa": (4, 2, 45, 45, 48, 32, True, False, None, False, 0, torch.float32),
    "dq192-dv128-causal-documents": (2, 2, 40, 40, 192, 128, True, False, [1, 31, 33], False, 0, torch.float32),
    "d192-full-alibi-mqa": (2, 1, 37, 45, 192, 192, False, True, None, False, 0, torch.float32),
    "dq96-dv64-decode-kvcache-alibi": (4, 2, 20, 70, 96, 64, True, True, None, False, 0, torch.float32),
    "dq48-dv32-sinks-window-documents": (4, 2, 45, 45, 48, 32, True, False, [20], True, 7, torch.float32),
    "dq32-dv48-v-wider": (2, 1, 45, 45, 32, 48, True, False, None, True, 0, torch.float32),
    "dq48-dv32-bf16-gqa": (4, 2, 45, 45, 48, 32, True, True, None, False, 0, torch.bfloat16),
}


@pytest.mark.forked
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_softmax_attention_and_reference(case, triton_target, close):
    backend, device = triton_target
    H, G, S_Q, S_K, Dq, Dv, causal, alibi, starts, sinks, window, dtype = CASES[case]
    q, k, v, slopes_H, sinks_H = _inputs(1, H, G, S_Q, S_K, Dq, Dv, dtype, device, alibi, sinks)
    doc_start = None if starts is None else _doc_starts(S_K, starts, device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks_H.clone().requires_grad_()] if sinks else [])
    kw = dict(doc_start_BS=doc_start, window=window)
    o = flash_attention(*leaves[:3], causal, slopes_H, sinks_H=leaves[3] if sinks else None, backend=backend, **kw)
    do = torch.randn_like(o)
    o.backward(do)
    scale = Dq**-0.5
    o64, lse64, *grads64 = _oracle_grads(q, k, v, sinks_H, do, causal=causal, slopes_H=slopes_H, scale=scale, **kw)
    _, lse = torch.ops.moetron.flash_attention_fwd(q, k, v, causal, slopes_H, scale, backend, doc_start, sinks_H,
                                                   window)
    o_ref = flash_attention_reference(*(t.double() for t in (q, k, v)), causal, slopes_H, None, False, doc_start,
                                      None if sinks_H is None else sinks_H.double(), window)

    assert o.shape == (1, H, S_Q, Dv) and o.dtype == dtype
    close(o, o64, dtype, f"{case} o")
    close(o, o_ref, dtype, f"{case} o vs reference")
    close(lse, lse64, torch.float32, f"{case} logsumexp")
    for name, leaf, want in zip(("dq", "dk", "dv", "dsinks"), leaves, grads64):
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype, name
        close(leaf.grad, want, dtype, f"{case} {name}")


@pytest.mark.forked
def test_triton_never_reads_past_the_head_dims(triton_target, close):
    """q, k, v and dO as views of rows 64 wide whose columns past Dq = 48 (Dv = 40) hold NaN: the
    tiles are 64 wide, and a column read past a head dim would spread NaN (0 * NaN) into every
    result. 70 causal positions run both masked tiles (the diagonal, the ragged end) and unmasked ones."""
    backend, device = triton_target
    Dq, Dv, S = 48, 40, 70

    def poisoned_view(shape, width):
        full = torch.full((*shape, 64), float("nan"), device=device)
        full[..., :width] = torch.randn(*shape, width, device=device)
        return full[..., :width]

    q, k, v = poisoned_view((1, 4, S), Dq), poisoned_view((1, 2, S), Dq), poisoned_view((1, 2, S), Dv)
    do = poisoned_view((1, 4, S), Dv)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = flash_attention(*leaves, True, None, backend=backend)
    o.backward(do)
    o64, _, *grads64 = _oracle_grads(q, k, v, None, do, causal=True, slopes_H=None, scale=Dq**-0.5)
    close(o, o64, torch.float32, "o")
    for name, leaf, want in zip(("dq", "dk", "dv"), leaves, grads64):
        close(leaf.grad, want, torch.float32, name)


def test_traced_by_torch_compile_with_different_head_dims(compiles_like_eager):
    """The forward op's fake implementation gives the output v's head dim, so torch.compile traces
    Dq ≠ Dv whole, and its gradients equal eager ones."""
    q, k, v, slopes_H, _ = _inputs(1, 4, 2, 9, 9, 12, 8, torch.float32, torch.device("cpu"), alibi=True)

    def loss(q, k, v):
        return flash_attention(q, k, v, True, slopes_H).square().sum()

    compiles_like_eager(loss, q, k, v)


def test_head_blocks_and_tiles():
    """A head dim sits in the next power of two (at least 16); the tiles follow the wider of Dq and
    Dv; past 256 the kernels refuse."""
    assert [head_block(d) for d in (1, 8, 16, 17, 48, 96, 128, 192, 256)] == [16, 16, 16, 32, 64, 128, 128, 256, 256]
    assert attention_configs(192, torch.bfloat16, False, 128) == attention_configs(256, torch.bfloat16, False)
    assert attention_configs(48, torch.float32, False, 32) == attention_configs(64, torch.float32, False)
    assert attention_configs(32, torch.float32, False, 96) == attention_configs(128, torch.float32, False)
    with pytest.raises(ValueError, match="head dims 1 to 256"):
        attention_configs(128, torch.bfloat16, False, 320)


def test_checks_head_dims():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="but for the head dim"):
        flash_attention(q, k, torch.randn(1, 2, 6, 4))
    with pytest.raises(ValueError, match="head dims up to 256"):
        flash_attention(torch.randn(1, 2, 5, 320), torch.randn(1, 2, 5, 320), k, backend="interpret")


def test_mla_head_dims_are_compiled_ahead_of_time():
    """The sm_90 compile test (test_sm90_compile.py) covers MLA's Dq = 192, Dv = 128 in every kernel,
    with packed documents too."""
    pytest.importorskip("triton")
    from moetron.kernels.flash_attention_triton import compile_specs

    names = [spec.name for spec in compile_specs()]
    for kind in ("fwd", "dkdv", "dq"):
        assert any(n.startswith(f"attention_{kind}[torch.bfloat16,D=192,Dv=128,") and "docs=True" in n
                   for n in names), kind
    assert any(n.startswith("attention_delta[torch.bfloat16,D=192,Dv=128") for n in names)

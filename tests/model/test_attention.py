"""Attention backends against each other and against a per-query loop; ALiBi slopes against the
paper's reference rule (and BLOOM's implementation in transformers when installed).

Legend: B batch, S query positions, L key positions, D model dim, H query heads, G key/value
heads, Dh head dim.
"""

import importlib.util
import math

import pytest
import torch

from moetron.model.attention import Attention, KVCache, attention_bias, eager_attention
from moetron.model.positions import alibi_slopes, apply_rope, rope_cos_sin, rope_inv_freq

D, H, DH = 32, 4, 8
BACKENDS = ["eager", "sdpa"] + (["triton"] if importlib.util.find_spec("moetron.kernels.flash_attention") else [])


def _position_kwargs(position: str, positions_S: torch.Tensor) -> dict:
    if position == "rope":
        return {"rope": rope_cos_sin(positions_S, rope_inv_freq(DH, 10000.0))}
    if position == "alibi":
        return {"alibi_slopes_H": alibi_slopes(H)}
    return {}


def _attention(backend: str, kv_heads: int, seed: int = 0) -> Attention:
    torch.manual_seed(seed)
    attn = Attention(D, H, kv_heads, DH, backend=backend)
    attn.init_weights(std=0.2, out_std=0.2)
    return attn


@pytest.mark.parametrize("position", ["rope", "alibi", "none"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_backends_agree(kv_heads, position):
    """Every backend gives the eager reference's output and gradients (input and all weights),
    on a full causal pass and on a KV-cache decode step (queries fewer than keys)."""
    x_BSD = torch.randn(2, 11, D, generator=torch.Generator().manual_seed(1))
    dy_BSD = torch.randn(2, 11, D, generator=torch.Generator().manual_seed(2))
    results = {}
    for backend in BACKENDS:
        attn = _attention(backend, kv_heads)
        x = x_BSD.clone().requires_grad_()
        y_BSD = attn(x, **_position_kwargs(position, torch.arange(11)))
        (y_BSD * dy_BSD).sum().backward()
        # Decode: prefill 7 positions, then one more, reading the first 7 from the cache.
        with torch.no_grad():
            cache = KVCache.empty(2, kv_heads, 11, DH, dtype=torch.float32, device="cpu")
            attn(x_BSD[:, :7], cache=cache, **_position_kwargs(position, torch.arange(7)))
            y_step = attn(x_BSD[:, 7:8], cache=cache, **_position_kwargs(position, torch.arange(7, 8)))
        results[backend] = [y_BSD.detach(), y_step, x.grad] + [p.grad for p in attn.parameters()]
        torch.testing.assert_close(y_step, y_BSD.detach()[:, 7:8], rtol=1e-5, atol=1e-6)
    for backend in BACKENDS[1:]:
        for what, a, b in zip(["out", "decode", "dx"] + [n for n, _ in attn.named_parameters()],
                              results[backend], results["eager"]):
            # Relative to the largest entry: fp32 sums in a different order.
            err, scale = (a - b).abs().max().item(), b.abs().max().item()
            assert err <= 1e-5 * scale, f"{backend} {what}: max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("position", ["alibi", "none"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_eager_equals_per_query_loop(kv_heads, position):
    """eager_attention against a loop over batch, head and query: query head h reads key/value
    head h // (H/G), softmax over keys j ≤ i of q·k/sqrt(Dh) − slope_h·(i − j)."""
    gen = torch.Generator().manual_seed(3)
    S = 6
    q_BHSDh = torch.randn(2, H, S, DH, generator=gen, dtype=torch.float64)
    k_BGLDh = torch.randn(2, kv_heads, S, DH, generator=gen, dtype=torch.float64)
    v_BGLDh = torch.randn(2, kv_heads, S, DH, generator=gen, dtype=torch.float64)
    slopes_H = alibi_slopes(H).double() if position == "alibi" else None
    bias = attention_bias(S, S, causal=True, slopes_H=slopes_H, device="cpu")
    out = eager_attention(q_BHSDh, k_BGLDh, v_BGLDh, bias.double(), DH**-0.5)
    expected = torch.zeros_like(out)
    for b in range(2):
        for h in range(H):
            g = h // (H // kv_heads)
            for i in range(S):
                scores = [float(q_BHSDh[b, h, i] @ k_BGLDh[b, g, j]) / math.sqrt(DH)
                          - (float(slopes_H[h]) * (i - j) if slopes_H is not None else 0.0) for j in range(i + 1)]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                expected[b, h, i] = sum(w * v_BGLDh[b, g, j] for j, w in enumerate(weights)) / sum(weights)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def _paper_slopes(n: int) -> list[float]:
    """The ALiBi authors' reference rule: a geometric sequence starting at 2^(-8/n) with the same
    ratio for a power of two n; otherwise the closest smaller power of two, then every other slope
    of twice that power."""
    if math.log2(n).is_integer():
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]
    closest = 2 ** math.floor(math.log2(n))
    return _paper_slopes(closest) + _paper_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("n_heads", [1, 2, 4, 8, 16, 3, 6, 12, 20])
def test_alibi_slopes(n_heads):
    """2^(-8h/H), h = 1..H, for powers of two; the paper's rule otherwise."""
    slopes_H = alibi_slopes(n_heads)
    torch.testing.assert_close(slopes_H, torch.tensor(_paper_slopes(n_heads)), rtol=1e-6, atol=0)
    if math.log2(n_heads).is_integer():
        powers = torch.tensor([2.0 ** (-8.0 * h / n_heads) for h in range(1, n_heads + 1)])
        torch.testing.assert_close(slopes_H, powers, rtol=1e-6, atol=0)


@pytest.mark.oracles
@pytest.mark.parametrize("n_heads", [4, 6, 12])
def test_alibi_slopes_equal_bloom(n_heads):
    """BLOOM's build_alibi_tensor (transformers) is slope_h × key position; read slopes at position 1."""
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    alibi = bloom.build_alibi_tensor(torch.ones(1, 3, dtype=torch.long), n_heads, torch.float32)
    torch.testing.assert_close(alibi_slopes(n_heads), alibi[:, 0, 1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("qk_norm", ["head", "projection"])
def test_qk_norm_normalizes_q_and_k_before_rope_on_every_path(qk_norm):
    """q and k are RMS-normalized (per head over Dh, or over the whole H·Dh / G·Dh projection) with
    their gains, then rotated: the module equals that written out by hand, on both backends, and a
    KV-cache decode continues the full pass exactly."""
    torch.manual_seed(0)
    attn = Attention(D, H, 2, DH, backend="eager", qk_norm=qk_norm, norm_eps=1e-6)
    attn.init_weights(std=0.2, out_std=0.2)
    with torch.no_grad():
        attn.q_norm.weight.normal_(1.0, 0.3)
        attn.k_norm.weight.normal_(1.0, 0.3)
    x_BSD = torch.randn(2, 10, D)
    rope = rope_cos_sin(torch.arange(10), rope_inv_freq(DH, 10000.0))

    def rms(t, gain):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * gain

    q, k = attn.wq(x_BSD), attn.wk(x_BSD)
    if qk_norm == "projection":
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q_BHSDh, k_BGSDh = (t.view(2, 10, -1, DH) for t in (q, k))
    if qk_norm == "head":
        q_BHSDh, k_BGSDh = rms(q_BHSDh, attn.q_norm.weight), rms(k_BGSDh, attn.k_norm.weight)
    q_BHSDh, k_BGSDh = apply_rope(q_BHSDh.transpose(1, 2), *rope), apply_rope(k_BGSDh.transpose(1, 2), *rope)
    v_BGSDh = attn.wv(x_BSD).view(2, 10, -1, DH).transpose(1, 2)
    o_BHSDh = eager_attention(q_BHSDh, k_BGSDh, v_BGSDh, attention_bias(10, 10, causal=True, slopes_H=None,
                                                                         device="cpu"), DH**-0.5)
    want_BSD = attn.wo(o_BHSDh.transpose(1, 2).reshape(2, 10, -1))
    with torch.no_grad():
        assert torch.allclose(attn(x_BSD, rope=rope), want_BSD, atol=1e-5)
        attn.backend = "sdpa"
        assert torch.allclose(attn(x_BSD, rope=rope), want_BSD, atol=1e-5)
        cache = KVCache.empty(2, 2, 10, DH, dtype=torch.float32, device="cpu")
        attn(x_BSD[:, :7], rope=tuple(t[:7] for t in rope), cache=cache)
        step_BSD = attn(x_BSD[:, 7:], rope=tuple(t[7:] for t in rope), cache=cache)
        assert torch.allclose(step_BSD, want_BSD[:, 7:], atol=1e-5)

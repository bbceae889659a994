"""Position encodings against the properties the literature states for them
(../shared/reference/transformer-architecture.txt, "Positional encodings") and against their
papers' formulas written out independently here.

Legend: S positions, D model dim, Dh head dim.
"""

import math

import pytest
import torch

from moetron.model.config import ModelConfig
from moetron.model.positions import apply_rope, rope_attention_factor, rope_cos_sin, rope_inv_freq, sinusoidal_table
from moetron.model.transformer import build_model

DH = 16


def _rope(x_SDh: torch.Tensor, positions_S: torch.Tensor, **scaling) -> torch.Tensor:
    cos, sin = rope_cos_sin(positions_S, rope_inv_freq(x_SDh.shape[-1], 10000.0, **scaling))
    return apply_rope(x_SDh, cos, sin)


def _score(q_Dh, k_Dh, m: int, n: int, **scaling) -> float:
    """q rotated at position m, dotted with k rotated at position n (float64 tensors)."""
    q = _rope(q_Dh[None].double(), torch.tensor([m]), **scaling)[0]
    k = _rope(k_Dh[None].double(), torch.tensor([n]), **scaling)[0]
    return float(q @ k)


@pytest.mark.parametrize("scaling", [{}, {"scaling": "linear", "factor": 4.0}, {"scaling": "ntk", "factor": 8.0},
                                     {"scaling": "yarn", "factor": 8.0, "original_len": 64}],
                         ids=["plain", "linear", "ntk", "yarn"])
def test_rope_score_depends_only_on_relative_offset(scaling):
    """q·k after rotation at (m, n) equals that at (m + δ, n + δ) for any δ — and does change
    with the offset n − m (so the check is not vacuous)."""
    gen = torch.Generator().manual_seed(0)
    q_Dh, k_Dh = torch.randn(DH, generator=gen), torch.randn(DH, generator=gen)
    for m, n in [(0, 0), (3, 7), (9, 2), (100, 131)]:
        base = _score(q_Dh, k_Dh, m, n, **scaling)
        for delta in (1, 17, 1000):
            assert math.isclose(_score(q_Dh, k_Dh, m + delta, n + delta, **scaling), base, rel_tol=1e-4, abs_tol=1e-4)
    by_offset = [_score(q_Dh, k_Dh, 5, 5 + offset, **scaling) for offset in range(6)]
    assert max(by_offset) - min(by_offset) > 0.1


def test_rope_equals_paper_rotation_up_to_pairing():
    """apply_rope pairs dim i with i + Dh/2; the RoPE paper rotates pairs (2i, 2i+1) by angle
    m·θ_i, θ_i = 10000^(-2i/Dh), written here as complex multiplication. The two agree after
    interleaving the halves."""
    S = 9
    x_SDh = torch.randn(S, DH, dtype=torch.float64)
    positions_S = torch.arange(S) * 3
    theta_F = 10000.0 ** (-torch.arange(0, DH, 2, dtype=torch.float64) / DH)
    half = DH // 2
    interleave = torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).flatten()
    x_pairs = x_SDh[:, interleave]  # (x_0, x_h, x_1, x_{h+1}, …): pair i at (2i, 2i+1)
    z = torch.complex(x_pairs[:, 0::2], x_pairs[:, 1::2]) * torch.polar(
        torch.ones(S, half, dtype=torch.float64), positions_S[:, None].double() * theta_F[None])
    paper_SDh = torch.stack([z.real, z.imag], dim=-1).flatten(1)
    ours_SDh = _rope(x_SDh, positions_S)[:, interleave]
    torch.testing.assert_close(ours_SDh, paper_SDh, rtol=1e-5, atol=1e-5)


def test_rope_linear_scaling_is_position_interpolation():
    """"linear" with factor f at position p rotates exactly as the plain RoPE at p / f."""
    positions_S = torch.arange(0, 64, 4)
    cos, sin = rope_cos_sin(positions_S, rope_inv_freq(DH, 10000.0, "linear", 4.0))
    cos_ref, sin_ref = rope_cos_sin(positions_S / 4.0, rope_inv_freq(DH, 10000.0))
    torch.testing.assert_close(cos, cos_ref)
    torch.testing.assert_close(sin, sin_ref)


def test_rope_ntk_scaling_keeps_the_highest_frequency_and_stretches_the_lowest_by_the_factor():
    """NTK-aware scaling (base × f^(Dh/(Dh−2))) leaves θ_0 = 1 alone and divides the lowest
    frequency by exactly f, interpolating between."""
    plain, ntk = rope_inv_freq(DH, 10000.0), rope_inv_freq(DH, 10000.0, "ntk", 8.0)
    assert ntk[0] == plain[0] == 1.0
    assert math.isclose(float(plain[-1] / ntk[-1]), 8.0, rel_tol=1e-5)
    assert bool(((plain / ntk)[1:] > (plain / ntk)[:-1]).all())


def test_sinusoidal_table_is_vaswani():
    """PE[pos, 2i] = sin(pos / 10000^(2i/D)), PE[pos, 2i+1] = cos(·), evaluated with math here."""
    d = 12
    table_SD = sinusoidal_table(torch.arange(50), d)
    expected = [[(math.sin if j % 2 == 0 else math.cos)(pos / 10000 ** ((j - j % 2) / d)) for j in range(d)]
                for pos in range(50)]
    torch.testing.assert_close(table_SD, torch.tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize("offset", [1, 5, 37])
def test_sinusoidal_shift_is_a_fixed_linear_map(offset):
    """PE(pos + k) = M_k · PE(pos) with one matrix M_k for every pos: fit M_k by least squares on
    300 positions, then check it on 300 others it never saw. Positions are spread over 0..60000 so
    even the slowest frequency (period ≈ 2π·10000^(1−2/D)) turns enough for the fit to see it."""
    d = 32
    gen = torch.Generator().manual_seed(offset)
    fit_S, held_S = torch.randint(0, 60_000, (2, 300), generator=gen)

    def pe(positions_S):
        return sinusoidal_table(positions_S, d).double()

    m_DD = torch.linalg.lstsq(pe(fit_S), pe(fit_S + offset)).solution
    torch.testing.assert_close(pe(held_S) @ m_DD, pe(held_S + offset), rtol=0, atol=1e-4)
    # The map is specific to k: M_k does not carry PE(pos) to PE(pos + k + 1).
    assert (pe(held_S) @ m_DD - pe(held_S + offset + 1)).abs().max() > 0.1


def _yarn_by_the_paper(head_dim: int, theta: float, factor: float, original_len: int) -> list[float]:
    """YaRN's "NTK-by-parts" (Peng et al. 2023, eq. 17–18) written out with math: pair i turns
    r_i = L / (2π·θ^(2i/Dh)) times over the original context L; γ ramps from 0 at r = 1 (fully
    interpolated, θ_i / s) to 1 at r = 32 (kept), over pair indices rounded outward."""
    def pair_at(r):
        return head_dim * math.log(original_len / (r * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(pair_at(32)), 0), min(math.ceil(pair_at(1)), head_dim - 1)
    out = []
    for i in range(head_dim // 2):
        freq = theta ** (-2 * i / head_dim)
        interpolated = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(freq / factor * interpolated + freq * (1 - interpolated))
    return out


@pytest.mark.parametrize("head_dim,theta,factor,original_len", [(64, 10000.0, 4.0, 256), (128, 500000.0, 8.0, 8192),
                                                                 (16, 10000.0, 16.0, 256)])
def test_rope_yarn_frequencies_follow_the_paper(head_dim, theta, factor, original_len):
    """High frequencies kept, low ones divided by the factor, a linear ramp between; the
    attention temperature √(1/t) = 0.1·ln(s) + 1."""
    ours = rope_inv_freq(head_dim, theta, "yarn", factor, original_len).double()
    paper = torch.tensor(_yarn_by_the_paper(head_dim, theta, factor, original_len), dtype=torch.float64)
    torch.testing.assert_close(ours, paper, rtol=1e-6, atol=0)
    plain = rope_inv_freq(head_dim, theta).double()
    assert ours[0] == plain[0] and math.isclose(float(plain[-1] / ours[-1]), factor, rel_tol=1e-6)
    assert math.isclose(rope_attention_factor("yarn", factor), 0.1 * math.log(factor) + 1)
    assert rope_attention_factor("ntk", factor) == rope_attention_factor("yarn", 1.0) == 1.0


@pytest.mark.parametrize("head_dim,theta,factor,original_len", [(64, 10000.0, 4.0, 256), (128, 500000.0, 8.0, 8192),
                                                                 (32, 10000.0, 16.0, 2048)])
def test_rope_yarn_equals_transformers(head_dim, theta, factor, original_len):
    """transformers' ROPE_INIT_FUNCTIONS["yarn"] (beta_fast 32, beta_slow 1, truncate): same
    frequencies and the same cos/sin factor."""
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    hf_cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=int(original_len * factor),
                         rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                                          "original_max_position_embeddings": original_len})
    inv_freq, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(head_dim, theta, "yarn", factor, original_len), inv_freq.float(),
                               rtol=1e-6, atol=0)
    assert math.isclose(rope_attention_factor("yarn", factor), attention_factor, rel_tol=1e-12)


def test_yarn_scales_the_model_s_cos_and_sin_by_its_temperature():
    """The Decoder hands attention cos and sin × (0.1·ln s + 1), so q·k is scaled by its square."""
    cfg = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, d_ff=32, max_seq_len=64,
                      rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_seq_len=16)
    model = build_model(cfg)
    seen = {}
    model.layers["0"].attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    model(torch.zeros(1, 5, dtype=torch.long))
    cos, sin = rope_cos_sin(torch.arange(5), rope_inv_freq(16, 10000.0, "yarn", 4.0, 16))
    mscale = 0.1 * math.log(4.0) + 1
    torch.testing.assert_close(seen["rope"][0], cos * mscale)
    torch.testing.assert_close(seen["rope"][1], sin * mscale)


def test_sinusoidal_input_is_scaled_token_embedding_plus_table():
    """Vaswani et al. §3.4: the first block sees embed(ids)·√d_model + PE(pos)."""
    cfg = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, d_ff=32, max_seq_len=64, position="sinusoidal")
    model = build_model(cfg)
    seen = {}
    model.layers["0"].register_forward_pre_hook(lambda m, args: seen.update(h=args[0]))
    ids = torch.randint(0, 16, (2, 7))
    model(ids)
    expected = model.embed.weight[ids] * math.sqrt(32) + sinusoidal_table(torch.arange(7), 32)
    torch.testing.assert_close(seen["h"], expected)

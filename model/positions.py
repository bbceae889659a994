"""Position encodings: sinusoidal and learned (added to embeddings), RoPE and ALiBi (inside attention).

Legend: S positions, D model dim, Dh head dim, H heads, B batch.
"""

from __future__ import annotations

import math

import torch


def sinusoidal_table(positions_S: torch.Tensor, d_model: int) -> torch.Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...) (Vaswani et al. 2017) → (S, D)."""
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    angles_SF = positions_S.to(torch.float64)[:, None] * inv_freq[None, :]
    pe_SD = torch.stack([angles_SF.sin(), angles_SF.cos()], dim=-1).flatten(1)
    return pe_SD.to(torch.float32)


def rope_inv_freq(head_dim: int, theta: float, scaling: str = "none", factor: float = 1.0) -> torch.Tensor:
    """Rotation frequencies theta^(-2i/Dh), i < Dh/2, with optional context-extension scaling.

    "linear" (position interpolation, Chen et al. 2023) divides every frequency by `factor`;
    "ntk" (NTK-aware) raises the base by factor^(Dh/(Dh-2)), stretching low frequencies most.
    """
    if scaling == "ntk":
        theta = theta * factor ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling == "linear":
        inv_freq = inv_freq / factor
    return inv_freq.to(torch.float32)


def rope_cos_sin(positions_S: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position × frequency, each (S, Dh), laid out for `apply_rope`'s half rotation."""
    angles_SF = positions_S.to(torch.float32)[:, None] * inv_freq[None, :].to(positions_S.device)
    angles_SDh = torch.cat([angles_SF, angles_SF], dim=-1)
    return angles_SDh.cos(), angles_SDh.sin()


def apply_rope(x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+Dh/2}) by position × frequency_i.

    This pairs dimension i with i + Dh/2 (GPT-NeoX / Llama / Mixtral layout) rather than 2i with
    2i+1 (the RoPE paper); the two differ by a fixed permutation of head dims, so the property
    that q·k depends only on the relative offset is the same, and Hugging Face weights load as is.
    """
    half = x_BHSDh.shape[-1] // 2
    rotated = torch.cat([-x_BHSDh[..., half:], x_BHSDh[..., :half]], dim=-1)
    return (x_BHSDh * cos_SDh + rotated * sin_SDh).to(x_BHSDh.dtype)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Per-head ALiBi slopes (Press et al. 2021): 2^(-8h/H) for h = 1..H when H is a power of two.

    Otherwise take the slopes of the closest smaller power of two n, then every other slope of 2n
    for the remaining heads, as the paper's reference code does. → (H,)
    """

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    n = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(n)
    if n < n_heads:
        slopes += power_of_two(2 * n)[0::2][: n_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes_H: torch.Tensor, q_positions_S: torch.Tensor, k_positions_S: torch.Tensor) -> torch.Tensor:
    """Additive score bias -slope_h × (i - j) for query i and key j → (H, Sq, Sk)."""
    distance_QK = (k_positions_S[None, :] - q_positions_S[:, None]).to(torch.float32)
    return slopes_H[:, None, None].to(distance_QK.device) * distance_QK[None]

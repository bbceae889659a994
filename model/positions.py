"""Position encodings: sinusoidal and learned (added to embeddings), RoPE, ALiBi and T5's relative
bias (inside attention).

Legend: S query positions, L key positions, D model dim, Dh head dim, H heads, B batch, N buckets.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def sinusoidal_table(positions_S: torch.Tensor, d_model: int) -> torch.Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...) (Vaswani et al. 2017) → (S, D),
    or (B, S, D) for positions (B, S) (restarting per packed document)."""
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    angles_SF = positions_S.to(torch.float64)[..., None] * inv_freq.to(positions_S.device)
    pe_SD = torch.stack([angles_SF.sin(), angles_SF.cos()], dim=-1).flatten(-2)
    return pe_SD.to(torch.float32)


def rope_inv_freq(head_dim: int, theta: float, scaling: str = "none", factor: float = 1.0,
                  original_len: int = 2048, *, truncate: bool = True) -> torch.Tensor:
    """Rotation frequencies theta^(-2i/Dh), i < Dh/2, with optional context-extension scaling.

    "linear" (position interpolation, Chen et al. 2023) divides every frequency by `factor`;
    "ntk" (NTK-aware) raises the base by factor^(Dh/(Dh-2)), stretching low frequencies most;
    "yarn" (Peng et al. 2023, "NTK-by-parts") keeps the frequencies that turn more than
    beta_fast = 32 times over the `original_len` positions trained on, divides by `factor` those
    that turn less than beta_slow = 1 time, and ramps linearly in between (pair index, rounded
    outward as transformers' `truncate`, or not with truncate=False, as GPT-OSS). Its attention
    temperature is `rope_attention_factor`.
    """
    if scaling == "ntk":
        theta = theta * factor ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling == "linear":
        inv_freq = inv_freq / factor
    elif scaling == "yarn":
        inv_freq = _yarn_blend(inv_freq, head_dim, theta, factor, original_len, truncate=truncate)
    return inv_freq.to(torch.float32)


def _yarn_blend(inv_freq_F: torch.Tensor, head_dim: int, theta: float, factor: float, original_len: int,
                beta_fast: float = 32.0, beta_slow: float = 1.0, *, truncate: bool = True) -> torch.Tensor:
    def pair_turning(rotations: float) -> float:
        # The pair index i whose wavelength 2π·theta^(2i/Dh) fits `rotations` times in original_len.
        return head_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp would divide by zero
    interpolated_F = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq_F / factor * interpolated_F + inv_freq_F * (1 - interpolated_F)


def rope_attention_factor(scaling: str, factor: float) -> float:
    """What cos and sin are multiplied by: YaRN's 0.1·ln(factor) + 1 (so q·k by its square, the
    paper's 1/t), 1 for every other scaling."""
    if scaling != "yarn" or factor <= 1.0:
        return 1.0
    return 0.1 * math.log(factor) + 1.0


def rope_cos_sin(positions_S: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position × frequency, each (S, Dh) — or (B, 1, S, Dh) for positions (B, S), one
    row per sequence, broadcast over heads — laid out for `apply_rope`'s half rotation."""
    if positions_S.dim() == 2:
        positions_S = positions_S[:, None]
    angles_SF = positions_S.to(torch.float32)[..., None] * inv_freq.to(positions_S.device)
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


def t5_relative_bucket(q_positions_S: torch.Tensor, k_positions_L: torch.Tensor, num_buckets: int,
                       max_distance: int) -> torch.Tensor:
    """T5's causal buckets (`_relative_position_bucket(bidirectional=False)`) → int64 (S, L).

    Only offsets n = q − k ≥ 0 are told apart (a key after its query gets bucket 0, and the causal
    mask hides it anyway): n < N/2 has its own bucket; larger n share N/2 log-spaced buckets up to
    `max_distance`, past which every offset falls into the last bucket — which is why the bias
    itself has no length limit.
    """
    n_SL = (q_positions_S[:, None] - k_positions_L[None, :]).clamp_min(0)
    exact = num_buckets // 2
    # clamp_min(exact) keeps the log finite where the exact branch is taken anyway; fp32 as in T5,
    # whose rounding decides the bucket of offsets on a boundary.
    log_ratio_SL = torch.log(n_SL.clamp_min(exact).float() / exact) / math.log(max_distance / exact)
    far_SL = (exact + (log_ratio_SL * (num_buckets - exact)).long()).clamp_max(num_buckets - 1)
    return torch.where(n_SL < exact, n_SL, far_SL)


class RelativePositionBias(nn.Embedding):
    """T5's learned relative position bias: a table (N, H), one scalar per offset bucket and head,
    one table shared by every layer (T5 computes it in the first layer and passes it on).

    Being an embedding of bucket ids, tensor parallelism splits it as a column-parallel embedding
    (Shard(1)): each tp rank holds and looks up its own H/tp heads' columns.
    """

    def __init__(self, num_buckets: int, n_heads: int, max_distance: int):
        super().__init__(num_buckets, n_heads)
        self.max_distance = max_distance

    def bias(self, q_positions_S: torch.Tensor, k_positions_L: torch.Tensor) -> torch.Tensor:
        """Additive score bias of each query over each key → (H local, S, L), in the table's dtype."""
        buckets_SL = t5_relative_bucket(q_positions_S, k_positions_L, self.num_embeddings, self.max_distance)
        return self(buckets_SL).permute(2, 0, 1)

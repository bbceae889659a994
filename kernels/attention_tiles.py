"""Tile sizes of the flash-attention kernels (kernels/flash_attention_triton.py): the shipped
configurations per (element size, tile width), the widths that head dims take (powers of two;
192 takes 256, 48 takes 64), and the small ones the interpreter runs.

Plain Python, no Triton import: the benchmarks and the AOT compiler read these without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttnConfig:
    BLOCK_M: int  # query rows per tile
    BLOCK_N: int  # key rows per tile
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class AttnConfigs:
    fwd: AttnConfig
    dkdv: AttnConfig  # a program owns BLOCK_N keys and walks over the queries
    dq: AttnConfig  # a program owns BLOCK_M queries and walks over the keys


# Shipped for Hopper, by (element size, tile width): the power of two the wider of the q/k and v head
# dims takes (head_block), at least 32; every one is compiled for sm_90 by the tests.
# Forward tiles follow Triton's fused-attention tutorial on H100. The 16-bit backward tiles were
# tuned on an H200 (bench/kernel_speed.py --tune, causal, D=128, S 2048-8192): dK/dV over 32x64
# tiles ran the whole backward 2.6-2.7x faster than the tutorial's 32x128 with 5 stages, and dQ
# over 128x64 with 8 warps 1.05x; D=32/64 take the same dK/dV tile (untimed). fp32 (tf32) and
# the largest head dims take smaller tiles to stay inside 227 KiB of shared memory. Width 256
# (DeepSeek-V3's MLA, Dq 192 and Dv 128; untimed) keeps the registers per thread of the 128
# tiles: half the query rows in the forward and dQ, twice the warps in dK/dV, two stages.
SHIPPED_CONFIGS = {
    (2, 32): AttnConfigs(AttnConfig(128, 64, 4, 4), AttnConfig(32, 64, 4, 4), AttnConfig(128, 32, 4, 5)),
    (2, 64): AttnConfigs(AttnConfig(128, 64, 4, 4), AttnConfig(32, 64, 4, 4), AttnConfig(128, 32, 4, 5)),
    (2, 128): AttnConfigs(AttnConfig(128, 64, 8, 3), AttnConfig(32, 64, 4, 4), AttnConfig(128, 64, 8, 3)),
    (2, 256): AttnConfigs(AttnConfig(64, 64, 8, 2), AttnConfig(32, 64, 8, 2), AttnConfig(64, 64, 8, 2)),
    (4, 32): AttnConfigs(AttnConfig(64, 64, 4, 3), AttnConfig(32, 64, 4, 3), AttnConfig(64, 32, 4, 3)),
    (4, 64): AttnConfigs(AttnConfig(64, 64, 4, 3), AttnConfig(32, 64, 4, 3), AttnConfig(64, 32, 4, 3)),
    (4, 128): AttnConfigs(AttnConfig(64, 32, 4, 2), AttnConfig(32, 64, 4, 2), AttnConfig(64, 32, 4, 2)),
    (4, 256): AttnConfigs(AttnConfig(32, 32, 4, 2), AttnConfig(32, 32, 8, 2), AttnConfig(32, 32, 4, 2)),
}
MAX_HEAD_DIM = 256
# Under the interpreter small tiles let small test shapes cover several tiles and ragged edges.
_SMALL = AttnConfig(32, 32, 4, 1)
INTERPRET_CONFIGS = AttnConfigs(_SMALL, _SMALL, _SMALL)


def head_block(head_dim: int) -> int:
    """The width of the tiles that hold `head_dim` columns: the power of two >= head_dim (Triton's
    tiles are powers of two), at least 16 (tl.dot's least inner size). The columns past head_dim
    are loaded as zeros and never stored (kernels/flash_attention_triton.py)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def head_dim_constexprs(qk_head_dim: int, v_head_dim: int) -> dict:
    """The head-dim constexprs every attention kernel takes: q/k's and v's dims and their tiles' widths."""
    return dict(HEAD_DQ=qk_head_dim, HEAD_DV=v_head_dim, BLOCK_DQ=head_block(qk_head_dim),
                BLOCK_DV=head_block(v_head_dim))


def attention_configs(head_dim: int, dtype: torch.dtype, interpret: bool, v_head_dim: int | None = None) -> AttnConfigs:
    """The tiles for q/k head dim `head_dim` and v head dim `v_head_dim` (default: head_dim)."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    if not (1 <= head_dim <= MAX_HEAD_DIM and 1 <= v_head_dim <= MAX_HEAD_DIM):
        raise ValueError(f"flash_attention: the Triton kernels take head dims 1 to {MAX_HEAD_DIM}, "
                         f"got q/k {head_dim} and v {v_head_dim}")
    if interpret:
        return INTERPRET_CONFIGS
    return SHIPPED_CONFIGS[(dtype.itemsize, max(32, head_block(max(head_dim, v_head_dim))))]

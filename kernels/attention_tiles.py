"""Tile sizes of the flash-attention kernels (kernels/flash_attention_triton.py): the shipped
configurations per (element size, head dim), and the small ones the interpreter runs.

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


# Shipped for Hopper, by (element size, head dim); every one is compiled for sm_90 by the tests.
# Forward tiles follow Triton's fused-attention tutorial on H100. The 16-bit backward tiles were
# tuned on an H200 (bench/kernel_speed.py --tune, causal, D=128, S 2048-8192): dK/dV over 32x64
# tiles ran the whole backward 2.6-2.7x faster than the tutorial's 32x128 with 5 stages, and dQ
# over 128x64 with 8 warps 1.05x; D=32/64 take the same dK/dV tile (untimed). fp32 (tf32) and
# the largest head dims take smaller tiles to stay inside 227 KiB of shared memory.
SHIPPED_CONFIGS = {
    (2, 32): AttnConfigs(AttnConfig(128, 64, 4, 4), AttnConfig(32, 64, 4, 4), AttnConfig(128, 32, 4, 5)),
    (2, 64): AttnConfigs(AttnConfig(128, 64, 4, 4), AttnConfig(32, 64, 4, 4), AttnConfig(128, 32, 4, 5)),
    (2, 128): AttnConfigs(AttnConfig(128, 64, 8, 3), AttnConfig(32, 64, 4, 4), AttnConfig(128, 64, 8, 3)),
    (4, 32): AttnConfigs(AttnConfig(64, 64, 4, 3), AttnConfig(32, 64, 4, 3), AttnConfig(64, 32, 4, 3)),
    (4, 64): AttnConfigs(AttnConfig(64, 64, 4, 3), AttnConfig(32, 64, 4, 3), AttnConfig(64, 32, 4, 3)),
    (4, 128): AttnConfigs(AttnConfig(64, 32, 4, 2), AttnConfig(32, 64, 4, 2), AttnConfig(64, 32, 4, 2)),
}
HEAD_DIMS = (32, 64, 128)
# Under the interpreter small tiles let small test shapes cover several tiles and ragged edges.
_SMALL = AttnConfig(32, 32, 4, 1)
INTERPRET_CONFIGS = AttnConfigs(_SMALL, _SMALL, _SMALL)


def attention_configs(head_dim: int, dtype: torch.dtype, interpret: bool) -> AttnConfigs:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"flash_attention: the Triton kernels take head dims {HEAD_DIMS}, got {head_dim}")
    return INTERPRET_CONFIGS if interpret else SHIPPED_CONFIGS[(dtype.itemsize, head_dim)]

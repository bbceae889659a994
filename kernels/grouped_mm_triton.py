"""Triton kernels for the grouped GEMM: y[rows of e] = x[rows of e] @ w[e] and its weight gradient.

Legend: T rows (tokens sorted by group), K input features, N output features, E groups.
`offsets_E[e]` is the cumulative end row of group e (int32); rows past offsets_E[-1] belong to no
group and come out as zeros.

The forward kernel also computes dX (dy_TN @ w_ENK is the same problem with w's strides swapped).
Neither kernel reads the group sizes on the host: the grid is sized by an upper bound on the number
of row tiles, and each program finds its group from `offsets_E` itself, so a launch never waits
for the device and can be captured in a CUDA graph.

This module imports triton; the op layer (grouped_mm.py) imports it only when a Triton backend
runs, so `import moetron.kernels` works where triton is absent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moetron.kernels.backend import device_guard, upcast
from moetron.kernels.kernel_spec import KernelSpec


@dataclass(frozen=True)
class GemmConfig:
    BLOCK_M: int  # rows of x per tile (forward) or rows of x reduced per step (wgrad)
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int  # row tiles that share a column tile before moving on, for L2 reuse
    num_warps: int
    num_stages: int


# Shipped configurations for Hopper, by element size; each is compiled for sm_90 by the tests.
# 16-bit: tuned on an H200 by bench/kernel_speed.py --tune (Mixtral 8x4096x14336 and DeepSeek
# 64x2048x1408 expert shapes, top-2/top-6 of 16k tokens): the 128x256 tile with 4 stages was the
# fastest of six candidates on all 8 forward/dX shapes (1.00-1.13x the 3-stage one, also for
# N = 1408, which 256 does not divide); 128x128 stays for N under 256. The dW tile: 64x128x128
# with 4 warps and 3 stages, 1.19-1.37x the 8-warp 4-stage one. fp32 runs as tf32, untuned.
FORWARD_CONFIGS = {
    "wide16": GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    "square16": GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    "fp32": GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3),
}
WGRAD_CONFIGS = {
    "square16": GemmConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3),
    "fp32": GemmConfig(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=3),
}
# Under the interpreter small tiles let small test shapes cover several tiles and ragged edges.
INTERPRET_CONFIG = GemmConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)


def forward_config(N: int, dtype: torch.dtype, interpret: bool) -> GemmConfig:
    if interpret:
        return INTERPRET_CONFIG
    if dtype.itemsize == 4:
        return FORWARD_CONFIGS["fp32"]
    return FORWARD_CONFIGS["wide16" if N >= 256 else "square16"]


def wgrad_config(dtype: torch.dtype, interpret: bool) -> GemmConfig:
    if interpret:
        return INTERPRET_CONFIG
    return WGRAD_CONFIGS["fp32" if dtype.itemsize == 4 else "square16"]


@triton.jit
def _grouped_mm_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr,
    T, K, N, E, NUM_M_TILES,
    stride_xt, stride_xk, stride_we, stride_wk, stride_wn, stride_yt, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
):
    # Program -> (row tile, column tile), GROUP_M row tiles at a time so that the w tiles they
    # share stay in L2.
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pids_per_band = GROUP_M * num_n
    first_m = (pid // pids_per_band) * GROUP_M
    band_m = min(NUM_M_TILES - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_band) % band_m
    pid_n = (pid % pids_per_band) // band_m

    # Row tile -> group. Groups 0..E-1 are the experts; "group" E is the tail of rows past the
    # last offset, which this kernel fills with zeros (its K loop runs zero times).
    idx_e = tl.arange(0, BLOCK_E)
    ends = tl.load(offsets_ptr + idx_e, mask=idx_e < E, other=T)
    starts = tl.load(offsets_ptr + idx_e - 1, mask=(idx_e > 0) & (idx_e <= E), other=0)
    starts = tl.where(idx_e <= E, starts, T)
    tile_ends = tl.cumsum(tl.cdiv(ends - starts, BLOCK_M), 0)
    e = tl.sum((tile_ends <= pid_m).to(tl.int32), 0)
    if e > E:
        return  # a spare program: the grid is an upper bound on the number of row tiles
    tile_end = tl.sum(tl.where(idx_e == e, tile_ends, 0), 0)
    start = tl.sum(tl.where(idx_e == e, starts, 0), 0)
    end = tl.sum(tl.where(idx_e == e, ends, 0), 0)
    tiles = tl.cdiv(end - start, BLOCK_M)

    rows = start + (pid_m - (tile_end - tiles)) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    # 64-bit row offsets: T * K overflows int32 at Mixtral sizes with long sequences.
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xt + ks[None, :] * stride_xk
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(e < E, K, 0)
    for k0 in range(0, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=col_mask[None, :], other=0.0)
        else:
            k_mask = k0 + ks < K
            a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_yt + cols[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_mm_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, offsets_ptr,
    K, N,
    stride_xt, stride_xk, stride_dyt, stride_dyn, stride_dwe, stride_dwk, stride_dwn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    # dw[e] = x[rows of e]^T @ dy[rows of e]: one (K, N) tile per program, reducing over the
    # group's rows BLOCK_M at a time. Programs of one group run together and share its rows.
    pid_kn = tl.program_id(0)
    e = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    ks = (pid_kn // num_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = (pid_kn % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = ks < K
    col_mask = cols < N
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offsets_ptr + e)

    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_M):
        rows = (t0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < end
        xt = tl.load(x_ptr + rows[None, :] * stride_xt + ks[:, None] * stride_xk,
                     mask=k_mask[:, None] & row_mask[None, :], other=0.0)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dyt + cols[None, :] * stride_dyn,
                     mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            dy = dy.to(tl.float32)
        acc = tl.dot(xt, dy, acc)

    dw_ptrs = dw_ptr + e.to(tl.int64) * stride_dwe + ks[:, None] * stride_dwk + cols[None, :] * stride_dwn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_e(E: int) -> int:
    # One slot per group plus the tail "group"; a power of two for tl.arange.
    return max(16, 1 << E.bit_length())


def grouped_mm_triton(x_TK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor, backend: str,
                      config: GemmConfig | None = None) -> torch.Tensor:
    """y_TN = x_TK @ w_EKN[group of row] with the Triton kernel; any strides. `config` overrides
    the shipped tile (bench/kernels.py --tune tries candidates through it)."""
    T, K = x_TK.shape
    E, _, N = w_EKN.shape
    cfg = config or forward_config(N, x_TK.dtype, backend == "interpret")
    y_TN = torch.empty(T, N, dtype=x_TK.dtype, device=x_TK.device)
    if T == 0 or N == 0:
        return y_TN
    # Each group wastes at most one partial tile, and the tail adds one more.
    num_m_tiles = _cdiv(T, cfg.BLOCK_M) + E + 1
    grid = (num_m_tiles * _cdiv(N, cfg.BLOCK_N),)
    with device_guard(x_TK):
        _grouped_mm_kernel[grid](
            x_TK, w_EKN, y_TN, offsets_E,
            T, K, N, E, num_m_tiles,
            *x_TK.stride(), *w_EKN.stride(), *y_TN.stride(),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
            BLOCK_E=_block_e(E), EVEN_K=K % cfg.BLOCK_K == 0, UPCAST=upcast(backend, x_TK.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return y_TN


def grouped_mm_wgrad_triton(x_TK: torch.Tensor, dy_TN: torch.Tensor, offsets_E: torch.Tensor, backend: str,
                            config: GemmConfig | None = None) -> torch.Tensor:
    """dw_EKN[e] = x_TK[rows of e]^T @ dy_TN[rows of e]; zeros for empty groups. `config`
    overrides the shipped tile."""
    K, N, E = x_TK.shape[1], dy_TN.shape[1], offsets_E.shape[0]
    cfg = config or wgrad_config(x_TK.dtype, backend == "interpret")
    dw_EKN = torch.empty(E, K, N, dtype=x_TK.dtype, device=x_TK.device)
    if dw_EKN.numel() == 0:
        return dw_EKN
    grid = (_cdiv(K, cfg.BLOCK_K) * _cdiv(N, cfg.BLOCK_N), E)
    with device_guard(x_TK):
        _grouped_mm_wgrad_kernel[grid](
            x_TK, dy_TN, dw_EKN, offsets_E,
            K, N,
            *x_TK.stride(), *dy_TN.stride(), *dw_EKN.stride(),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
            UPCAST=upcast(backend, x_TK.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return dw_EKN


def compile_specs():
    """Every shipped configuration, with arguments shaped like Mixtral-8x7B's experts, for
    compiling ahead of time against a GPU target (see moetron.kernels.aot)."""
    T, K, N, E = 32768, 4096, 14336, 8
    for dtype in (torch.bfloat16, torch.float32):
        names = ["fp32"] if dtype.itemsize == 4 else ["wide16", "square16"]
        for name in names:
            cfg = FORWARD_CONFIGS[name]
            args = dict(x_ptr=dtype, w_ptr=dtype, y_ptr=dtype, offsets_ptr=torch.int32, T=T, K=K, N=N, E=E,
                        NUM_M_TILES=_cdiv(T, cfg.BLOCK_M) + E + 1, stride_xt=K, stride_xk=1,
                        stride_we=K * N, stride_wk=N, stride_wn=1, stride_yt=N, stride_yn=1)
            consts = dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                          BLOCK_E=_block_e(E), EVEN_K=True, UPCAST=False)
            yield KernelSpec(f"grouped_mm[{name},{dtype}]", _grouped_mm_kernel, args, consts, cfg.num_warps, cfg.num_stages)
        cfg = wgrad_config(dtype, interpret=False)
        args = dict(x_ptr=dtype, dy_ptr=dtype, dw_ptr=dtype, offsets_ptr=torch.int32, K=K, N=N,
                    stride_xt=K, stride_xk=1, stride_dyt=N, stride_dyn=1, stride_dwe=K * N, stride_dwk=N, stride_dwn=1)
        consts = dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, UPCAST=False)
        yield KernelSpec(f"grouped_mm_wgrad[{dtype}]", _grouped_mm_wgrad_kernel, args, consts, cfg.num_warps, cfg.num_stages)

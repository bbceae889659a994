"""Grouped GEMM over ragged groups of rows: y[rows of e] = x[rows of e] @ w[e].

Legend: T rows (tokens sorted by expert), K input features, N output features, E groups.
`offsets_E[e]` is the cumulative end row of group e (int32), as `torch._grouped_mm` takes it.
Rows past `offsets_E[-1]` belong to no group and come out as zeros (their gradient too).

Layers: Triton kernels (grouped_mm_triton) → the ops `moetron::grouped_mm` and
`moetron::grouped_mm_wgrad` (custom ops with fake implementations, so torch.compile traces them,
and autograd formulas written with the same two ops, so they are differentiable twice) → the
function `grouped_mm` that the model calls. Each product names its pass — fwd (x @ w), dx
(dy @ w^T), dw (x^T @ dy) — so that "auto" can run each on the path measured faster for it.
"""

from __future__ import annotations

import torch

from moetron.kernels.backend import resolve_backend
from moetron.kernels.measured_backends import PASSES


def grouped_mm_reference(x_TK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Per-group loop in plain torch; the slow, obviously-right reference. Any float dtype."""
    # NOTE: host-device sync: the group boundaries are read on the host.
    ends = offsets_E.tolist()
    starts = [0] + ends[:-1]
    parts = [x_TK[s:e] @ w_EKN[g] for g, (s, e) in enumerate(zip(starts, ends))]
    parts.append(x_TK.new_zeros(x_TK.shape[0] - (ends[-1] if ends else 0), w_EKN.shape[-1]))
    return torch.cat(parts, dim=0)


def grouped_mm_wgrad_reference(x_TK: torch.Tensor, dy_TN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """dw_EKN[e] = x_TK[rows of e]^T @ dy_TN[rows of e], by a per-group loop."""
    # NOTE: host-device sync: the group boundaries are read on the host.
    ends = offsets_E.tolist()
    starts = [0] + ends[:-1]
    parts = [x_TK[s:e].T @ dy_TN[s:e] for s, e in zip(starts, ends)]
    if not parts:
        return x_TK.new_zeros(0, x_TK.shape[1], dy_TN.shape[1])
    return torch.stack(parts)


def _fits_torch_grouped_mm(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm takes fp32/bf16 operands whose non-unit strides and base addresses are
    multiples of 16 bytes, none of them 0 (an expanded gradient, as `y.sum().backward()` sends,
    is refused: "Invalid strides/sizes"); anything else goes through the reference loop."""
    for t in tensors:
        if t.dtype not in (torch.float32, torch.bfloat16) or t.dtype != tensors[0].dtype:
            return False
        if 0 in t.stride():
            return False
        if t.data_ptr() % 16 or any(s != 1 and (s * t.element_size()) % 16 for s in t.stride()):
            return False
    return True


# Row block the CPU path rounds group sizes up to for bf16/fp16 (see _cpu_windows).
CPU_ROW_BLOCK = 128


# Group sizes the CPU bf16/fp16 path is fed in multiples of, when groups average at least
# CPU_GROUP_MIN_ROWS rows (padding then costs ≤ ~3% more rows; see group_row_multiple).
CPU_GROUP_ROWS, CPU_GROUP_MIN_ROWS = 16, 256


def group_row_multiple(device: torch.device, dtype: torch.dtype, rows_per_group: float,
                       backend: str | None = None) -> int:
    """Rows each group's size is best rounded up to (by the dispatcher, with rows that count for
    nothing) for the multiply that will run on `device` in `dtype`, groups averaging
    `rows_per_group` rows.

    CPU bf16/fp16: torch._grouped_mm multiplies group by group, and oneDNN builds (JIT-compiles)
    a kernel for every new shape: a 512-row bf16 product took ~0.35 ms cached and ~0.6 ms more
    when its row count was new, so ragged sizes that change every step spend much of their time
    building kernels. Multiples of CPU_GROUP_ROWS keep a few shapes per projection, cached after
    the first steps, for ~8 padded rows per group — worth it only for large groups (a training
    step of the bench's model, 8 experts of ~512 rows, bf16: 544 → 519 ms; 64 experts of ~64
    rows: 875 → 941 ms, so small groups stay exact). 1 (exact groups) everywhere else: fp32 goes
    to the BLAS, which keeps no per-shape state, and Triton masks ragged tiles.
    """
    if resolve_backend(backend, device) == "torch" and device.type == "cpu" \
            and dtype in (torch.bfloat16, torch.float16) and rows_per_group >= CPU_GROUP_MIN_ROWS:
        return CPU_GROUP_ROWS
    return 1


def _cpu_row_block(dtype: torch.dtype) -> int:
    """bf16/fp16 matmuls go to oneDNN, which builds and caches a kernel per new shape: ragged
    group sizes make new shapes every step, so time goes to setup and memory grows by megabytes
    per step; rounded windows keep the set of shapes small. fp32 goes to the BLAS, which has no
    per-shape state: exact groups, no borrowed rows."""
    return CPU_ROW_BLOCK if dtype in (torch.bfloat16, torch.float16) else 1


def _cpu_windows(ends: list[int], num_rows: int, block: int):
    """For each non-empty group [s, e): a window [a, a + m) of rows that contains it, m being the
    group size rounded up to `block` (shifted back when it would run past the last row); the
    rows it borrows from neighbours are discarded by the caller."""
    s = 0
    for g, e in enumerate(ends):
        if e > s:
            m = min(-(-(e - s) // block) * block, num_rows)
            a = min(s, num_rows - m)
            yield g, s, e, a, m
        s = e


def _k_contiguous(w_EKN: torch.Tensor) -> torch.Tensor:
    """w_EKN with K innermost (each w[e] column-major), copied only when it is not already.

    Without native bf16 (AVX2 only: no AVX512-BF16, no AMX), a bf16 x @ w runs at
    ~1 GFLOP/s when w is row-major and 10-16 GFLOP/s when it is column-major (measured for
    T = 32..512, K, N = 256..1024; fp16 takes the same path, unmeasured), because only the latter
    walks both operands along K. The copy is E·K·N elements, small next to the products it speeds up."""
    return w_EKN if w_EKN.stride(1) == 1 else w_EKN.transpose(1, 2).contiguous().transpose(1, 2)


def _grouped_mm_cpu(x_TK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    # NOTE: host-device sync (a no-op on CPU) to read the group boundaries.
    ends = offsets_E.tolist()
    if x_TK.dtype in (torch.bfloat16, torch.float16):
        w_EKN = _k_contiguous(w_EKN)
    y_TN = x_TK.new_empty(x_TK.shape[0], w_EKN.shape[2])
    y_TN[ends[-1] if ends else 0 :] = 0  # rows past the last group belong to none
    for g, s, e, a, m in _cpu_windows(ends, x_TK.shape[0], _cpu_row_block(x_TK.dtype)):
        if (a, m) == (s, e - s):
            torch.mm(x_TK[s:e], w_EKN[g], out=y_TN[s:e])  # straight into place, no copy
        else:
            y_TN[s:e] = (x_TK[a : a + m] @ w_EKN[g])[s - a : e - a]
    return y_TN


def _grouped_mm_wgrad_cpu(x_TK: torch.Tensor, dy_TN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    # NOTE: host-device sync (a no-op on CPU) to read the group boundaries.
    ends = offsets_E.tolist()
    # Every non-empty group's slice is overwritten below; only empty groups need their zeros
    # (zero-filling all of it took 11% of an E=64 layer's forward + backward).
    dw_EKN = x_TK.new_empty(len(ends), x_TK.shape[1], dy_TN.shape[1])
    starts = [0] + ends[:-1]
    for g, (s, e) in enumerate(zip(starts, ends)):
        if e <= s:
            dw_EKN[g].zero_()
    for g, s, e, a, m in _cpu_windows(ends, x_TK.shape[0], _cpu_row_block(x_TK.dtype)):
        if (a, m) == (s, e - s):
            torch.mm(x_TK[s:e].T, dy_TN[s:e], out=dw_EKN[g])
            continue
        # Rows borrowed from neighbouring groups must not contribute: zero their gradient.
        dy_MN = dy_TN[a : a + m].clone()
        dy_MN[: s - a] = 0
        dy_MN[e - a :] = 0
        dw_EKN[g] = x_TK[a : a + m].T @ dy_MN
    return dw_EKN


def _cpu_loop(*tensors: torch.Tensor) -> bool:
    """CPU operands that torch._grouped_mm does not take (fp16, unaligned) go through the
    per-group loop. Where it takes them it was as fast or faster than the loop on 2 cores
    (T = 4096, K = 256, N = 512: fp32 E = 8 fwd 6.9 vs 7.8 ms, E = 64 10.0 vs 10.5; bf16 E = 64
    fwd 4.8 vs 15.0 ms, dW 6.2 vs 9.8), and it reads the weights as they are stored."""
    return tensors[0].device.type == "cpu" and tensors[0].dtype in (torch.float32, torch.bfloat16, torch.float16) \
        and not (hasattr(torch, "_grouped_mm") and _fits_torch_grouped_mm(*tensors))


def _grouped_mm_torch(x_TK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    # NOTE: host-device sync to read the number of grouped rows: torch._grouped_mm leaves rows
    # past the last offset uninitialized, so they are kept out of it.
    end = int(offsets_E[-1]) if offsets_E.numel() else 0
    if _cpu_loop(x_TK, w_EKN) or (x_TK.device.type == "cpu" and 0 < end < x_TK.shape[0]):
        # Rows past the last group (dropped routes): the loop writes each group in place, where
        # torch._grouped_mm's output would be copied into one with the zero rows (fp32 MoE layer
        # with capacity 1.0, forward + backward: 13% slower than exact rows with the copy, 5% with
        # the loop).
        return _grouped_mm_cpu(x_TK, w_EKN, offsets_E)
    if end == 0 or not _fits_torch_grouped_mm(x_TK, w_EKN):
        return grouped_mm_reference(x_TK, w_EKN, offsets_E)
    y_TN = torch._grouped_mm(x_TK[:end], w_EKN, offs=offsets_E.to(torch.int32))
    if end < x_TK.shape[0]:
        y_TN = torch.cat([y_TN, y_TN.new_zeros(x_TK.shape[0] - end, y_TN.shape[1])])
    return y_TN


def _grouped_mm_wgrad_torch(x_TK: torch.Tensor, dy_TN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    if _cpu_loop(x_TK.T, dy_TN):
        return _grouped_mm_wgrad_cpu(x_TK, dy_TN, offsets_E)
    # NOTE: host-device sync to read the number of grouped rows (see _grouped_mm_torch).
    end = int(offsets_E[-1]) if offsets_E.numel() else 0
    xt_KT = x_TK[:end].T
    if end == 0 or not _fits_torch_grouped_mm(xt_KT, dy_TN):
        return grouped_mm_wgrad_reference(x_TK, dy_TN, offsets_E)
    return torch._grouped_mm(xt_KT, dy_TN[:end], offs=offsets_E.to(torch.int32))


def _pass_backend(backend: str, pass_: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """The backend the product a @ b of one pass runs with: `backend` as given, or for "auto" the
    path measured faster for this pass on this device class (kernels/measured_backends.py). The
    torch rows measured torch._grouped_mm; operands it does not take (unaligned, expanded) would go
    to the per-group loop instead, so they stay on Triton."""
    if backend != "auto":
        return backend
    chosen = resolve_backend(backend, a.device, "grouped_mm", pass_, a.dtype)
    if chosen == "torch" and a.is_cuda and not _fits_torch_grouped_mm(a, b):
        return "triton"
    return chosen


@torch.library.custom_op("moetron::grouped_mm", mutates_args=())
def _grouped_mm_op(x_TK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor, backend: str,
                   pass_: str) -> torch.Tensor:
    backend = _pass_backend(backend, pass_, x_TK, w_EKN)
    if backend == "torch":
        return _grouped_mm_torch(x_TK, w_EKN, offsets_E)
    from moetron.kernels.grouped_mm_triton import grouped_mm_triton

    return grouped_mm_triton(x_TK, w_EKN, offsets_E, backend)


@_grouped_mm_op.register_fake
def _(x_TK, w_EKN, offsets_E, backend, pass_):
    return x_TK.new_empty(x_TK.shape[0], w_EKN.shape[2])


@torch.library.custom_op("moetron::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(x_TK: torch.Tensor, dy_TN: torch.Tensor, offsets_E: torch.Tensor, backend: str) -> torch.Tensor:
    backend = _pass_backend(backend, "dw", x_TK.T, dy_TN)
    if backend == "torch":
        return _grouped_mm_wgrad_torch(x_TK, dy_TN, offsets_E)
    from moetron.kernels.grouped_mm_triton import grouped_mm_wgrad_triton

    return grouped_mm_wgrad_triton(x_TK, dy_TN, offsets_E, backend)


@_grouped_mm_wgrad_op.register_fake
def _(x_TK, dy_TN, offsets_E, backend):
    return x_TK.new_empty(offsets_E.shape[0], x_TK.shape[1], dy_TN.shape[1])


def _setup_context(ctx, inputs, output):
    a, b, offsets_E, backend = inputs[:4]
    ctx.save_for_backward(a, b, offsets_E)
    ctx.backend = backend


def _grouped_mm_backward(ctx, dy_TN):
    # y = x @ w[e]:  dx = dy @ w[e]^T (the same op on w's transposed view), dw[e] = x^T @ dy.
    x_TK, w_EKN, offsets_E = ctx.saved_tensors
    dx_TK = dw_EKN = None
    if ctx.needs_input_grad[0]:
        dx_TK = _grouped_mm_op(dy_TN, w_EKN.transpose(1, 2), offsets_E, ctx.backend, "dx")
    if ctx.needs_input_grad[1]:
        dw_EKN = _grouped_mm_wgrad_op(x_TK, dy_TN, offsets_E, ctx.backend)
    return dx_TK, dw_EKN, None, None, None


def _grouped_mm_wgrad_backward(ctx, g_EKN):
    # dw[e] = x^T @ dy:  d x = dy @ g[e]^T, d dy = x @ g[e].
    x_TK, dy_TN, offsets_E = ctx.saved_tensors
    dx_TK = ddy_TN = None
    if ctx.needs_input_grad[0]:
        dx_TK = _grouped_mm_op(dy_TN, g_EKN.transpose(1, 2), offsets_E, ctx.backend, "dx")
    if ctx.needs_input_grad[1]:
        ddy_TN = _grouped_mm_op(x_TK, g_EKN, offsets_E, ctx.backend, "fwd")
    return dx_TK, ddy_TN, None, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_setup_context)
_grouped_mm_wgrad_op.register_autograd(_grouped_mm_wgrad_backward, setup_context=_setup_context)


def grouped_mm(
    x_TK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor, *, backend: str | None = None
) -> torch.Tensor:
    """y_TN = x_TK @ w_EKN[group of row]; differentiable in x and w (twice).

    Rows past the last offset belong to no group and come out as zeros. `backend`: None or
    "auto" picks, for the forward, dX and dW each, the path measured faster on this CUDA device
    (Triton where unmeasured; see kernels/measured_backends.py) and torch elsewhere; "interpret"
    runs the Triton kernels on CPU (tests).
    The Triton path takes fp32, fp16 and bf16 (fp32 accumulation); the torch path any float dtype.
    """
    if x_TK.dim() != 2 or w_EKN.dim() != 3 or offsets_E.dim() != 1:
        raise ValueError(
            f"grouped_mm: expected x_TK 2-D, w_EKN 3-D, offsets_E 1-D; got shapes "
            f"{tuple(x_TK.shape)}, {tuple(w_EKN.shape)}, {tuple(offsets_E.shape)}"
        )
    if x_TK.shape[1] != w_EKN.shape[1] or w_EKN.shape[0] != offsets_E.shape[0]:
        raise ValueError(
            f"grouped_mm: x_TK {tuple(x_TK.shape)}, w_EKN {tuple(w_EKN.shape)} and offsets_E "
            f"{tuple(offsets_E.shape)} disagree on K or E"
        )
    if x_TK.dtype != w_EKN.dtype:
        raise ValueError(f"grouped_mm: x_TK is {x_TK.dtype} but w_EKN is {w_EKN.dtype}")
    request = "auto" if backend is None else backend
    kernels = sorted({resolve_backend(request, x_TK.device, "grouped_mm", p, x_TK.dtype)
                      for p in PASSES["grouped_mm"]} - {"torch"})
    if kernels and x_TK.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"grouped_mm: backend={kernels[0]!r} takes fp32, fp16 or bf16, got {x_TK.dtype}")
    return _grouped_mm_op(x_TK, w_EKN, offsets_E.to(torch.int32), request, "fwd")

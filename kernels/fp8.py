"""FP8 training GEMMs from torchao (the optional [fp8] extra): where FP8 runs and what it needs.

Dense linears become torchao's `Float8Linear` (parallel/float8.py); the experts' grouped GEMM is
torchao's rowwise-scaled grouped GEMM, `fp8_grouped_mm` below. Both quantize inputs and weights
to float8_e4m3fn with dynamic per-row scales in forward and backward and accumulate in higher
precision; the master weights stay in fp32. They run on CUDA GPUs of compute capability 8.9 or newer
(Ada, Hopper and later), where `torch._scaled_mm` and `torch._scaled_grouped_mm` exist.
"""

from __future__ import annotations

import importlib.metadata

import torch

# torchao versions whose float8 training and rowwise grouped GEMM this module calls.
TORCHAO_MIN = (0, 16)
# Rows each expert's group is padded to: the scaled grouped GEMM takes groups of multiples of 16.
FP8_GROUP_ROWS = 16


def fp8_problem(device: torch.device) -> str | None:
    """Why FP8 training cannot run on `device` here (one clause naming what is missing), or None."""
    if device.type != "cuda":
        return f"FP8 GEMMs need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); this run is on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} has {major}.{minor}")
    try:
        version = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return "torchao is not installed (pip install 'moetron[fp8]')"
    found = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if found < TORCHAO_MIN:
        return f"torchao {version} is older than {'.'.join(map(str, TORCHAO_MIN))} (pip install 'moetron[fp8]')"
    try:  # a torchao built for another torch may fail here
        import torchao.float8  # noqa: F401
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means FP8 cannot run; say which
        return f"torchao {version} does not import with torch {torch.__version__} ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return None


def fp8_grouped_mm(x_TK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """y_TN = x_TK @ w_EKN[e] for each expert's rows, in FP8 with rowwise scales (torchao). Rows
    past the last group come out zero, as from the other grouped-GEMM paths."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    # The scaled grouped GEMM takes the right operand column-major per expert: strides (K·N, 1, K).
    w_col_EKN = w_EKN.mT.contiguous().mT

    def mm(x_PK: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return _to_fp8_rowwise_then_scaled_grouped_mm(x_PK, w_col_EKN, offsets, out_dtype=x_TK.dtype,
                                                      pad_token_groups_for_grouped_mm=False)

    return grouped_in_aligned_groups(mm, x_TK, offsets_E, FP8_GROUP_ROWS)


def grouped_in_aligned_groups(mm, x_TK: torch.Tensor, offsets_E: torch.Tensor, multiple: int) -> torch.Tensor:
    """mm(x_PK, offsets_P) (a grouped GEMM whose groups must hold multiples of `multiple` rows) on
    groups of any size: each group's rows are copied into one padded to the multiple, and its
    outputs copied back. The local dispatcher pads groups so already (no copy then); expert
    parallelism's received groups are exact. Rows past the last group come out zero."""
    # NOTE: host-device sync to read the group sizes (see grouped_mm._grouped_mm_torch).
    ends = offsets_E.tolist()
    counts = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).tolist()
    end = ends[-1] if ends else 0
    if all(c % multiple == 0 for c in counts):
        y_TN = mm(x_TK[:end], offsets_E.to(torch.int32))
    else:
        device = x_TK.device
        padded = [-(-c // multiple) * multiple for c in counts]
        counts_E, padded_E = torch.tensor(counts, device=device), torch.tensor(padded, device=device)
        # Each group moves from its start to its padded start; its rows keep their order.
        shift_E = (padded_E.cumsum(0) - padded_E) - (counts_E.cumsum(0) - counts_E)
        group_R = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_E)
        dest_R = torch.arange(end, device=device) + shift_E[group_R]
        x_PK = x_TK.new_zeros(sum(padded), x_TK.shape[1]).index_copy(0, dest_R, x_TK[:end])
        y_TN = mm(x_PK, padded_E.cumsum(0).to(torch.int32)).index_select(0, dest_R)
    if end < x_TK.shape[0]:
        y_TN = torch.cat([y_TN, y_TN.new_zeros(x_TK.shape[0] - end, y_TN.shape[1])])
    return y_TN

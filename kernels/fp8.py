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
    """y_TN = x_TK @ w_EKN[e] for each expert's rows, in FP8 with rowwise scales (torchao).
    Groups must hold multiples of FP8_GROUP_ROWS rows (the dispatcher pads them so); rows past
    the last group come out zero, as from the other grouped-GEMM paths."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    # NOTE: host-device sync to read the number of grouped rows (see grouped_mm._grouped_mm_torch).
    end = int(offsets_E[-1]) if offsets_E.numel() else 0
    # The scaled grouped GEMM takes the right operand column-major per expert: strides (K·N, 1, K).
    w_col_EKN = w_EKN.mT.contiguous().mT
    y_TN = _to_fp8_rowwise_then_scaled_grouped_mm(x_TK[:end], w_col_EKN, offsets_E.to(torch.int32),
                                                  out_dtype=x_TK.dtype, pad_token_groups_for_grouped_mm=False)
    if end < x_TK.shape[0]:
        y_TN = torch.cat([y_TN, y_TN.new_zeros(x_TK.shape[0] - end, y_TN.shape[1])])
    return y_TN

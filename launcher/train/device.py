"""Which device a command runs on, and whether it computes in bf16."""

from __future__ import annotations

import torch

from moetron.launcher.config import Config, ConfigError


def pick_device(want: str, no_cuda_error: str) -> torch.device:
    """`want` is auto, cpu or cuda; auto takes CUDA when one is visible. Asking for CUDA where none
    is visible raises ConfigError(no_cuda_error), which names the setting as the user wrote it."""
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(no_cuda_error)
    return torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")


def resolve_device(cfg: Config) -> torch.device:
    """The device of train.device."""
    return pick_device(cfg.train.device, "train.device = 'cuda': no CUDA device is visible (use auto or cpu)")


def use_bf16(cfg: Config, device: torch.device) -> bool:
    """bf16 autocast on CUDA, and on CPUs whose oneDNN has native bf16 matmuls (AVX512-BF16, AMX);
    under fp8 too, for what does not run in FP8."""
    if cfg.train.precision != "auto":
        return cfg.train.precision in ("bf16", "fp8")
    return device.type == "cuda" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_fp8(cfg: Config, device: torch.device) -> None:
    """Raise ConfigError (one line) where train.precision fp8 cannot run on `device`."""
    from moetron.kernels.fp8 import fp8_problem

    problem = fp8_problem(device) if cfg.train.precision == "fp8" else None
    if problem:
        raise ConfigError(f"train.precision = 'fp8': {problem}; use bf16 here")

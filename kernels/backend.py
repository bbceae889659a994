"""Which implementation an op runs: `triton` (compiled, CUDA), `interpret` (the same Triton kernels
run by Triton's CPU interpreter, for tests) or `torch` (plain torch, any device and dtype).

The choice is an explicit argument of every op, resolved here once per call; there is no global
switch to flip. `None` means: Triton on CUDA when it is importable, torch everywhere else.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

BACKENDS = ("triton", "interpret", "torch")


def triton_available() -> bool:
    """True when the `triton` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Turn the user's `backend` (None, "auto" or one of BACKENDS) into one of BACKENDS for
    tensors on `device`, or raise with the reason it cannot run there."""
    if backend in (None, "auto"):
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {BACKENDS} or None")
    if backend == "triton":
        if device.type != "cuda":
            raise ValueError(f"backend='triton' needs CUDA tensors, got device {device}")
        if not triton_available():
            raise RuntimeError("backend='triton' needs the triton package, which is not installed")
    if backend == "interpret":
        if device.type != "cpu":
            raise ValueError(f"backend='interpret' runs on CPU tensors, got device {device}")
        # Triton reads this variable once, when it is first imported; setting it later is too
        # late (tl.sum and friends then fail), so only check it here.
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "backend='interpret' needs TRITON_INTERPRET=1 in the environment before triton "
                "is imported (tests/conftest.py sets it when no GPU is present)"
            )
    return backend


def upcast(backend: str, dtype: torch.dtype) -> bool:
    """Whether kernels must load 16-bit inputs as fp32: the interpreter does bf16 arithmetic on
    raw bit patterns (silently wrong), and fp16 dots there would accumulate in fp16."""
    return backend == "interpret" and dtype.itemsize == 2


def device_guard(t: torch.Tensor):
    """Make `t`'s GPU the current one while launching, so kernels run where their data is."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()

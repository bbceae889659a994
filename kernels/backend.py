"""Which implementation an op runs: `triton` (compiled, CUDA), `interpret` (the same Triton kernels
run by Triton's CPU interpreter, for tests) or `torch` (plain torch, any device and dtype).

The choice is an explicit argument of every op, resolved here once per call; there is no global
switch to flip. `None` or "auto" means: torch off CUDA or without Triton; on CUDA, for each op and
pass (grouped GEMM forward, dX, dW; attention forward, backward), the path measured faster on that
device class (measured_backends.py), and Triton where nothing is recorded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re

import torch

from moetron.kernels.measured_backends import recorded_choice

BACKENDS = ("triton", "interpret", "torch")


def triton_available() -> bool:
    """True when the `triton` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def device_class(device: torch.device) -> str:
    """"cpu" (any device but CUDA: its type), or the model of a CUDA device (`model_of`)."""
    return model_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else device.type


def model_of(name: str) -> str:
    """A GPU's model from its name: the first word of letters then digits ("NVIDIA H100 80GB HBM3"
    → "H100", "NVIDIA GH200 480GB" → "GH200", "NVIDIA A100-SXM4-80GB" → "A100"), else the name."""
    return next((w for w in re.split(r"[\s-]+", name) if re.fullmatch(r"[A-Za-z]*\d+", w)), name)


def auto_backend(device_class: str, op: str, pass_: str, dtype: torch.dtype, *, triton: bool = True) -> str:
    """What "auto" runs for one pass of one op: torch off CUDA (device class "cpu") or without
    Triton; else the recorded choice (measured_backends.py), Triton where none is recorded.
    A pure function of its arguments."""
    if device_class == "cpu" or not triton:
        return "torch"
    return recorded_choice(device_class, op, pass_, dtype) or "triton"


def resolve_backend(backend: str | None, device: torch.device, op: str | None = None, pass_: str | None = None,
                    dtype: torch.dtype | None = None) -> str:
    """Turn the user's `backend` (None, "auto" or one of BACKENDS) into one of BACKENDS for
    tensors on `device`, or raise with the reason it cannot run there. "auto" on CUDA follows
    `auto_backend` for the `op`, `pass_` and `dtype` named; without them, Triton."""
    if backend in (None, "auto"):
        if device.type != "cuda" or not triton_available():
            return "torch"
        return auto_backend(device_class(device), op, pass_, dtype) if op is not None else "triton"
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

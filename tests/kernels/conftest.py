"""Fixtures for the kernel tests: where the Triton kernels run, fresh random inputs, and a
scale-aware comparison with the reference."""

import importlib.util
import os

import pytest
import torch

# Tolerances relative to the largest entry, for fp32 accumulation on a GPU (tf32 dots: 10-bit
# mantissas; attention gradients reached 2.1e-3 of their largest entry on an H200) and for
# 16-bit inputs and outputs.
TOLERANCE = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float64: 1e-10}


@pytest.fixture
def triton_target():
    """(backend, device) for the Triton kernels: compiled on a GPU, interpreted on CPU."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return "triton", torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it)")
    return "interpret", torch.device("cpu")


@pytest.fixture
def seed():
    """A fresh seed per test (torch's default generator starts from a fixed one), reported in
    failure messages so a failure can be replayed with torch.manual_seed."""
    return torch.seed()


@pytest.fixture
def close(seed):
    """close(actual, expected, dtype, what): max |actual - expected| <= tol(dtype) * max |expected|.
    Scale-aware, because attention gradients and long reductions span orders of magnitude."""

    def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
        assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
        assert torch.isfinite(actual).all(), f"{what}: non-finite values (seed {seed})"
        if actual.numel() == 0:
            return
        err = (actual - expected).abs().max().item()
        scale = expected.abs().max().item()
        tol = TOLERANCE[dtype]
        assert err <= tol * scale + 1e-12, f"{what}: max error {err:.3g} > {tol} x {scale:.3g} (seed {seed})"

    return check

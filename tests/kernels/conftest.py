"""Fixtures for the kernel tests: fresh random inputs and a scale-aware comparison with the
reference (where the Triton kernels run, `triton_target`, is tests/conftest.py's)."""

import pytest
import torch

# Tolerances relative to the largest entry of the reference, by where the result was computed.
# On a GPU fp32 dots run in tf32 (10-bit mantissas; attention gradients reached 2.1e-3 of their
# largest entry on an H200), and 16-bit kernels round their tiles (P in attention) on the way.
GPU_TOLERANCE = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float64: 1e-10}
# On the CPU (the Triton interpreter, torch's CPU kernels) fp32 products are exact: the error measured
# over every kernel test was at most 6.1e-7 of the largest entry, so 1e-5 leaves room for longer
# reductions and still fails a 1e-4 slip. 16-bit results are rounded more than once on the way:
# measured up to 0.95 eps for bf16 and 0.5 eps for fp16; allowed 2 eps (bf16 eps 2^-7, fp16 2^-10).
CPU_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2 * 2**-10, torch.bfloat16: 2 * 2**-7, torch.float64: 1e-10}


def tolerance(device: torch.device, dtype: torch.dtype) -> float:
    """Allowed max |actual - expected| / max |expected| for a result computed on `device` in `dtype`."""
    return (GPU_TOLERANCE if device.type == "cuda" else CPU_TOLERANCE)[dtype]


@pytest.fixture
def seed():
    """A fresh seed per test (torch's default generator starts from a fixed one), reported in
    failure messages so a failure can be replayed with torch.manual_seed."""
    return torch.seed()


@pytest.fixture
def close(seed):
    """close(actual, expected, dtype, what): max |actual - expected| <= tol * max |expected|, with tol
    from `tolerance(actual.device, dtype)`. Scale-aware, because attention gradients and long
    reductions span orders of magnitude."""

    def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
        assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        tol = tolerance(actual.device, dtype)
        actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
        assert torch.isfinite(actual).all(), f"{what}: non-finite values (seed {seed})"
        if actual.numel() == 0:
            return
        err = (actual - expected).abs().max().item()
        scale = expected.abs().max().item()
        assert err <= tol * scale + 1e-12, f"{what}: max error {err:.3g} > {tol:.3g} x {scale:.3g} (seed {seed})"

    return check


@pytest.fixture
def compiles_like_eager(close):
    """check(loss, q, k, v): torch.compile traces `loss` whole (aot_eager, fullgraph) and the
    gradients of q, k and v through it equal eager ones."""

    def check(loss, *qkv: torch.Tensor) -> None:
        compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
        a = [t.clone().requires_grad_() for t in qkv]
        b = [t.clone().requires_grad_() for t in qkv]
        compiled(*a).backward()
        loss(*b).backward()
        for name, x, y in zip("qkv", a, b):
            close(x.grad, y.grad, torch.float32, f"compiled d{name}")

    return check

"""The kernel tests' `close` is tight enough to catch a wrong kernel on the CPU: a result off by a
small factor in one expert group fails it, while the real kernel output passes. On a GPU (tf32
dots) it allows 5e-3 of the largest entry, which would let such a bug through on the CPU."""

import pytest
import torch

from moetron.kernels.grouped_mm import grouped_mm, grouped_mm_reference


def _grouped_output():
    """A ragged grouped GEMM on the CPU (fp32, torch backend) and its float64 reference; groups of
    0, 40, 7 and 25 rows, plus 5 unowned tail rows."""
    gen = torch.Generator().manual_seed(11)
    offsets_E = torch.tensor([0, 40, 47, 72], dtype=torch.int32)
    x_TK = torch.randn(77, 48, generator=gen)
    w_EKN = torch.randn(4, 48, 40, generator=gen) / 48**0.5
    y_TN = grouped_mm(x_TK, w_EKN, offsets_E, backend="torch")
    return y_TN, grouped_mm_reference(x_TK.double(), w_EKN.double(), offsets_E)


# 1.004: the slip the GPU tolerance (5e-3) lets through; 1e-4: still a bug, 10x the CPU tolerance.
@pytest.mark.parametrize("factor", [1.004, 1 + 1e-4])
def test_one_group_scaled_fails_on_the_cpu(factor, close):
    y_TN, y64_TN = _grouped_output()
    close(y_TN, y64_TN, torch.float32, "the real output")
    wrong_TN = y_TN.clone()
    wrong_TN[0:40] *= factor  # the 40-row group only
    with pytest.raises(AssertionError, match="one group scaled: max error"):
        close(wrong_TN, y64_TN, torch.float32, "one group scaled")


def test_bf16_slip_of_a_few_percent_fails_on_the_cpu(close):
    """bf16 is allowed 2 eps (2^-6) of the largest entry: a result rounded to bf16 passes, one off by
    3% in one group is a bug, not rounding."""
    y_TN, y64_TN = _grouped_output()
    wrong_TN = y_TN.bfloat16()
    close(wrong_TN, y64_TN, torch.bfloat16, "rounded to bf16")
    wrong_TN[0:40] *= 1.03
    with pytest.raises(AssertionError, match="max error"):
        close(wrong_TN, y64_TN, torch.bfloat16, "bf16 group scaled")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA tensor needs a GPU")
def test_a_cuda_result_gets_the_gpu_tolerance(close):
    y_TN, y64_TN = _grouped_output()
    tf32_like_TN = (y_TN * (1 + 2e-3)).cuda()  # the size of a tf32 rounding: accepted on a GPU only
    close(tf32_like_TN, y64_TN, torch.float32, "tf32-sized error on cuda")
    with pytest.raises(AssertionError):
        close(tf32_like_TN.cpu(), y64_TN, torch.float32, "tf32-sized error on cpu")

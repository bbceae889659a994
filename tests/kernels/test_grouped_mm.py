"""moetron.kernels.grouped_mm against the per-group loop reference, on fresh random ragged inputs.

Legend: T rows, K input features, N output features, E groups; offsets_E cumulative end rows.
Triton tests run compiled on a GPU or interpreted on CPU, each in its own process (a bad
pointer in an interpreted kernel corrupts memory instead of raising).
"""

import subprocess
import sys

import pytest
import torch

from moetron.kernels.grouped_mm import grouped_mm, grouped_mm_reference


def _tile(backend: str) -> int:
    # Sizes are drawn per tile so they cover two tiles plus a ragged edge: small tiles under the
    # interpreter, the shipped ones on a GPU.
    return 32 if backend == "interpret" else 128


def _ragged_sizes(E: int, tile: int) -> list[int]:
    """Group sizes with at least one empty group and one of two tiles plus an edge, shuffled."""
    sizes = torch.randint(0, tile + 8, (E,))
    sizes[0] = 0
    sizes[1] = int(torch.randint(2 * tile + 1, 3 * tile, ()))
    return sizes[torch.randperm(E)].tolist()


def _problem(E, tile, dtype, device, tail=True):
    sizes = _ragged_sizes(E, tile)
    T = sum(sizes) + (int(torch.randint(1, tile, ())) if tail else 0)
    K = int(torch.randint(2 * tile + 1, 3 * tile, ()))
    N = int(torch.randint(2 * tile + 1, 3 * tile, ()))
    offsets_E = torch.tensor(sizes).cumsum(0).to(device=device, dtype=torch.int32)
    x_TK = torch.randn(T, K, device=device, dtype=dtype)
    w_EKN = (torch.randn(E, K, N, device=device) / K**0.5).to(dtype)
    return x_TK, w_EKN, offsets_E


def _check_against_reference(x_TK, w_EKN, offsets_E, backend, close, what):
    x = x_TK.detach().clone().requires_grad_()
    w = w_EKN.detach().clone().requires_grad_()
    y = grouped_mm(x, w, offsets_E, backend=backend)
    dy = torch.randn_like(y)
    y.backward(dy)

    x64 = x_TK.detach().double().requires_grad_()
    w64 = w_EKN.detach().double().requires_grad_()
    y64 = grouped_mm_reference(x64, w64, offsets_E)
    y64.backward(dy.double())

    assert y.dtype == x_TK.dtype and x.grad.dtype == x_TK.dtype and w.grad.dtype == w_EKN.dtype
    close(y, y64, x_TK.dtype, f"{what} y")
    close(x.grad, x64.grad, x_TK.dtype, f"{what} dx")
    close(w.grad, w64.grad, x_TK.dtype, f"{what} dw")
    end = int(offsets_E[-1]) if offsets_E.numel() else 0
    assert not y[end:].any() and not x.grad[end:].any(), f"{what}: rows past the last group must be zero"


@pytest.mark.forked
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_triton_matches_reference(dtype, triton_target, close):
    backend, device = triton_target
    x_TK, w_EKN, offsets_E = _problem(5, _tile(backend), dtype, device)
    _check_against_reference(x_TK, w_EKN, offsets_E, backend, close, f"{backend} {dtype}")


@pytest.mark.forked
def test_triton_edge_layouts(triton_target, close):
    """No tail rows; all rows in the tail (every group empty); a non-contiguous x and a w that is
    the transposed view of a (E, N, K) tensor, as the backward pass produces."""
    backend, device = triton_target
    tile = _tile(backend)
    x_TK, w_EKN, offsets_E = _problem(3, tile, torch.float32, device, tail=False)
    _check_against_reference(x_TK, w_EKN, offsets_E, backend, close, "no tail")

    _check_against_reference(x_TK, w_EKN, torch.zeros_like(offsets_E), backend, close, "all empty")

    T, K = x_TK.shape
    wide_TK = torch.randn(T, K + 8, device=device)
    w_ENK = torch.randn(w_EKN.shape[0], w_EKN.shape[2], K, device=device) / K**0.5
    _check_against_reference(wide_TK[:, 3 : 3 + K], w_ENK.transpose(1, 2), offsets_E, backend, close, "strided")


@pytest.mark.parametrize(
    "dtype,aligned",
    [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False), (torch.float16, True)],
)
def test_torch_backend_matches_reference(dtype, aligned, close):
    # Aligned fp32/bf16 shapes go through torch._grouped_mm, the others through the loop.
    x_TK, w_EKN, offsets_E = _problem(4, 16, dtype, torch.device("cpu"))
    if aligned:
        x_TK, w_EKN = x_TK[:, :32].contiguous(), w_EKN[:, :32, :48].contiguous()
    _check_against_reference(x_TK, w_EKN, offsets_E, "torch", close, f"torch {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expanded_gradient(dtype, close):
    """`grouped_mm(...).sum().backward()` hands the backward a gradient of stride 0, which
    torch._grouped_mm refuses; it must still give the reference's gradients."""
    x_TK, w_EKN, offsets_E = _problem(4, 16, dtype, torch.device("cpu"))
    x_TK, w_EKN = x_TK[:, :32].contiguous().requires_grad_(), w_EKN[:, :32, :48].contiguous().requires_grad_()
    grouped_mm(x_TK, w_EKN, offsets_E).sum().backward()
    x64, w64 = x_TK.detach().double().requires_grad_(), w_EKN.detach().double().requires_grad_()
    grouped_mm_reference(x64, w64, offsets_E).sum().backward()
    close(x_TK.grad, x64.grad, dtype, "dx")
    close(w_EKN.grad, w64.grad, dtype, "dw")


def test_float64_gradcheck_twice():
    """The model's gradient checks run in float64 on CPU, and the backward is itself built from
    the two ops, so second derivatives must be right too."""
    offsets_E = torch.tensor([2, 2, 5], dtype=torch.int32)
    x_TK = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    w_EKN = torch.randn(3, 3, 4, dtype=torch.float64, requires_grad=True)
    fn = lambda x, w: grouped_mm(x, w, offsets_E)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x_TK, w_EKN))
    assert torch.autograd.gradgradcheck(fn, (x_TK, w_EKN))


def test_traced_by_torch_compile(close):
    x_TK, w_EKN, offsets_E = _problem(4, 16, torch.float32, torch.device("cpu"))

    def loss(x, w):
        return grouped_mm(x, w, offsets_E).square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    x1, w1 = x_TK.clone().requires_grad_(), w_EKN.clone().requires_grad_()
    x2, w2 = x_TK.clone().requires_grad_(), w_EKN.clone().requires_grad_()
    compiled(x1, w1).backward()
    loss(x2, w2).backward()
    close(x1.grad, x2.grad, torch.float32, "compiled dx")
    close(w1.grad, w2.grad, torch.float32, "compiled dw")


def test_checks_arguments():
    x_TK, w_EKN = torch.randn(4, 3), torch.randn(2, 3, 5)
    offsets_E = torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="disagree"):
        grouped_mm(x_TK, torch.randn(2, 4, 5), offsets_E)
    with pytest.raises(ValueError, match="bfloat16"):
        grouped_mm(x_TK, w_EKN.bfloat16(), offsets_E)
    with pytest.raises(ValueError, match="CUDA"):
        grouped_mm(x_TK, w_EKN, offsets_E, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        grouped_mm(x_TK, w_EKN, offsets_E, backend="cuda")


def test_import_and_torch_path_without_triton():
    """Nothing imports triton until a Triton backend runs: the package works where it is absent."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from moetron.kernels.flash_attention import flash_attention\n"
        "from moetron.kernels.grouped_mm import grouped_mm\n"
        "y = grouped_mm(torch.randn(5, 3), torch.randn(2, 3, 4), torch.tensor([2, 4], dtype=torch.int32))\n"
        "o = flash_attention(torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8))\n"
        "assert y.shape == (5, 4) and o.shape == (1, 2, 5, 8)\n"
        "assert 'moetron.kernels.grouped_mm_triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_path_with_groups_larger_than_its_row_block(dtype, close):
    """The CPU path multiplies fp32 groups exactly, in place, and bf16/fp16 groups in row windows
    rounded to CPU_ROW_BLOCK whose borrowed rows it discards; groups of 0, 1, block±1 and several
    blocks, plus unowned tail rows, must all come out exact either way."""
    from moetron.kernels.grouped_mm import CPU_ROW_BLOCK as B

    sizes = [0, B + 2, B - 1, 1, 3 * B + 5, 0, 7]
    offsets_E = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    x_TK = torch.randn(int(offsets_E[-1]) + 33, 24, dtype=dtype, requires_grad=True)
    w_EKN = torch.randn(len(sizes), 24, 40, dtype=dtype, requires_grad=True)
    dy_TN = torch.randn(x_TK.shape[0], 40, dtype=dtype)
    y = grouped_mm(x_TK, w_EKN, offsets_E, backend="torch")
    dx, dw = torch.autograd.grad(y, (x_TK, w_EKN), dy_TN)
    x64, w64 = x_TK.detach().double().requires_grad_(), w_EKN.detach().double().requires_grad_()
    y64 = grouped_mm_reference(x64, w64, offsets_E)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy_TN.double())
    close(y, y64, dtype, "cpu y")
    close(dx, dx64, dtype, "cpu dx")
    close(dw, dw64, dtype, "cpu dw")
    assert torch.all(y[int(offsets_E[-1]) :] == 0)

"""`kernel.backend: auto`: per device class, op and pass, the path a recorded measurement found
faster, checked against the measurement itself (the H200 report in docs/), and on CPU plain torch
as before, with the same numbers as asking for torch."""

import math
import re
from pathlib import Path

import pytest
import torch

from moetron.kernels import measured_backends
from moetron.kernels.backend import auto_backend, model_of, resolve_backend
from moetron.kernels.flash_attention import flash_attention
from moetron.kernels.grouped_mm import grouped_mm
from moetron.kernels.measured_backends import MEASURED, PASSES, faster

H200_REPORT = Path(__file__).resolve().parents[2] / "docs" / "gpu-check-h200-2026-12-04.md"
BF16 = torch.bfloat16


def report_ratios(path: Path) -> dict[str, list[float]]:
    """pass → the "× grouped_mm" column (torch._grouped_mm time / Triton time) of the report's
    grouped_mm rows, in the report's order of shapes."""
    out: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == "grouped_mm":
            out.setdefault(cells[2], []).append(float(cells[8]))
    return out


def test_the_h200_rows_record_the_h200_report():
    ratios = report_ratios(H200_REPORT)
    assert sorted(ratios) == ["dw", "dx", "fwd"] and all(len(r) == 4 for r in ratios.values())
    for pass_, measured in ratios.items():
        (row,) = [r for r in MEASURED if (r.device_class, r.op, r.pass_) == ("H200", "grouped_mm", pass_)]
        assert list(row.ratios) == measured and row.dtype == BF16
        # Hand check: torch._grouped_mm is faster on the geometric mean for all three passes
        # (fwd 0.98, dx 0.82, dw 0.74), so each is torch.
        assert math.prod(measured) < 1 and row.choice == "torch"


def test_every_recorded_choice_is_the_faster_path_of_its_ratios():
    for row in MEASURED:
        if row.ratios:
            assert row.choice == ("triton" if math.prod(row.ratios) >= 1 else "torch") == faster(row.ratios), row
        else:  # nothing compared the op's two paths there: the choice before measurements
            assert row.choice == "triton", row
        assert row.source
    assert faster((1.2, 0.9)) == "triton" and faster((0.8, 1.1)) == "torch"
    keys = [(r.device_class, r.op, r.pass_, r.dtype) for r in MEASURED]
    assert len(keys) == len(set(keys))
    for device in {r.device_class for r in MEASURED}:
        assert {(r.op, r.pass_) for r in MEASURED if r.device_class == device} == \
               {(op, p) for op, passes in PASSES.items() for p in passes}


def test_the_table_in_the_module_docstring_shows_the_rows():
    shown = set()
    for line in measured_backends.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and re.fullmatch(r"[A-Z]+\d+", cells[0]):
            shown |= {(cells[0], cells[1], p, cells[4]) for p in cells[2].split(", ")}
    assert shown == {(r.device_class, r.op, r.pass_, r.choice) for r in MEASURED}


@pytest.mark.parametrize(("device", "op", "pass_", "dtype", "expected"), [
    ("H200", "grouped_mm", "fwd", BF16, "torch"),
    ("H200", "grouped_mm", "dx", BF16, "torch"),
    ("H200", "grouped_mm", "dw", BF16, "torch"),
    ("H200", "attention", "fwd", BF16, "triton"),
    ("H200", "attention", "bwd", BF16, "triton"),
    ("H200", "grouped_mm", "dx", torch.float16, "triton"),  # measured in bf16 only
    ("H100", "grouped_mm", "dw", BF16, "triton"),  # no measurement on an H100
    ("A100", "grouped_mm", "dx", BF16, "triton"),  # no row at all: Triton, as before
    ("cpu", "grouped_mm", "fwd", BF16, "torch"),
    ("cpu", "attention", "bwd", torch.float32, "torch"),
])
def test_auto_is_a_pure_function_of_device_class_op_and_pass(device, op, pass_, dtype, expected):
    assert auto_backend(device, op, pass_, dtype) == expected
    assert auto_backend(device, op, pass_, dtype, triton=False) == "torch"


def test_gpu_names_give_their_model():
    assert [model_of(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA GH200 480GB",
                                  "NVIDIA A100-SXM4-80GB")] == ["H200", "H100", "H100", "GH200", "A100"]


def test_auto_on_cpu_resolves_to_torch_as_before_and_explicit_choices_are_checked():
    cpu = torch.device("cpu")
    assert resolve_backend(None, cpu) == resolve_backend("auto", cpu) == "torch"
    for op, passes in PASSES.items():
        assert {resolve_backend("auto", cpu, op, p, BF16) for p in passes} == {"torch"}
    assert resolve_backend("torch", cpu, "grouped_mm", "dx", BF16) == "torch"
    with pytest.raises(ValueError, match="backend='cuda-magic': must be one of"):
        resolve_backend("cuda-magic", cpu, "grouped_mm", "fwd", BF16)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        resolve_backend("triton", cpu, "attention", "bwd", BF16)


def test_auto_on_cpu_computes_what_torch_computes():
    """Forward and every gradient of both ops under auto are torch's, bit for bit."""
    torch.manual_seed(0)
    x, w = torch.randn(40, 16), torch.randn(3, 16, 24)
    offsets = torch.tensor([10, 10, 33], dtype=torch.int32)  # an empty group, 7 rows in none
    q, k, v = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    results = {}
    for backend in (None, "auto", "torch"):
        xs, ws, qs, ks, vs = (t.clone().requires_grad_() for t in (x, w, q, k, v))
        y = grouped_mm(xs, ws, offsets, backend=backend)
        o = flash_attention(qs, ks, vs, backend=backend)
        (y.square().sum() + o.square().sum()).backward()
        results[backend] = [y, o, xs.grad, ws.grad, qs.grad, ks.grad, vs.grad]
    for backend in (None, "auto"):
        assert all(torch.equal(a, b) for a, b in zip(results[backend], results["torch"]))

"""What `kernel.backend: auto` runs on CUDA, per device class, op and pass: the path measured faster.

Each row names the path chosen and the measurement that chose it. `ratios` are, per measured
shape, the time of the op's torch path over the time of its Triton kernel (above 1: Triton is
faster), all from one run; a row chooses Triton when their geometric mean is at least 1, torch
otherwise. A row without ratios records that no measurement compares the two paths there, and
keeps Triton, the choice before any measurement. A device class, op or dtype without a row runs
Triton too (see `kernels.backend.auto_backend`); a GPU run that measures one adds or corrects a row.

Ops and passes: grouped_mm fwd (y = x @ w[e]), dx (dy @ w[e]^T), dw (x^T @ dy per group);
attention fwd, bwd. The torch path of grouped_mm is `torch._grouped_mm` (bf16/fp32 operands it
takes); that of attention is the eager reference, which materializes every score.

| device | op | pass | dtype | chosen | torch time / Triton time, per shape | source |
| --- | --- | --- | --- | --- | --- | --- |
| H200 | grouped_mm | fwd | bf16 | torch | 1.04 0.84 1.11 0.94 (geomean 0.98) | H200_2026_12_04 |
| H200 | grouped_mm | dx | bf16 | torch | 0.93 0.73 0.97 0.70 (0.82) | H200_2026_12_04 |
| H200 | grouped_mm | dw | bf16 | torch | 0.60 0.81 0.78 0.80 (0.74) | H200_2026_12_04 |
| H200 | attention | fwd | bf16 | triton | unmeasured against this op's torch path | H200_2026_12_04 |
| H200 | attention | bwd | bf16 | triton | unmeasured against this op's torch path | H200_2026_12_04 |
| H100 | grouped_mm | fwd, dx, dw | bf16 | triton | no measurement on this class | — |
| H100 | attention | fwd, bwd | bf16 | triton | no measurement on this class | — |
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# bench/gpu_check.sh (its kernels section, bench/kernel_speed.py) on one H200, 2026-12-04, torch
# 2.11, Triton 3.6, bf16: docs/gpu-check-h200-2026-12-04.md. Shapes, in order: Mixtral 8x7B up
# (8 experts, 4096 → 14336) and down, DeepSeek-style 64 experts up (2048 → 1408) and down; 16k
# tokens, top-2 / top-6. Its Triton tiles were the ones before that run's tuning: the tiles it
# found (now shipped) gained 1.00-1.13x (fwd, dx) and 1.19-1.37x (dw) by the tuner's own timing,
# which was not repeated against torch._grouped_mm, so the forward's 0.98 may turn over on a rerun.
H200_2026_12_04 = "bench/gpu_check.sh kernels, H200, 2026-12-04 (docs/gpu-check-h200-2026-12-04.md)"
# Attention was timed against SDPA's flash backend (fwd 1.28-1.44x, bwd 0.42-0.47x; with the tiles
# tuned in the same run the backward reached 1.13-1.18x), not against this op's torch path, the
# eager reference: SDPA-flash is no path of this op, so these rows keep Triton.
SDPA_ONLY = H200_2026_12_04 + "; attention timed against SDPA-flash only"
UNMEASURED = "no measurement on this device class: keeps Triton"


@dataclass(frozen=True)
class Measured:
    device_class: str  # as `device_class` names it: "H200", "H100", ...
    op: str  # "grouped_mm" | "attention"
    pass_: str  # grouped_mm: "fwd" | "dx" | "dw"; attention: "fwd" | "bwd"
    dtype: torch.dtype  # the operands' dtype the measurement used
    choice: str  # "triton" | "torch"
    ratios: tuple[float, ...]  # torch time / Triton time per measured shape; () = not compared
    source: str


PASSES = {"grouped_mm": ("fwd", "dx", "dw"), "attention": ("fwd", "bwd")}

MEASURED: tuple[Measured, ...] = (
    Measured("H200", "grouped_mm", "fwd", torch.bfloat16, "torch", (1.04, 0.84, 1.11, 0.94), H200_2026_12_04),
    Measured("H200", "grouped_mm", "dx", torch.bfloat16, "torch", (0.93, 0.73, 0.97, 0.70), H200_2026_12_04),
    Measured("H200", "grouped_mm", "dw", torch.bfloat16, "torch", (0.60, 0.81, 0.78, 0.80), H200_2026_12_04),
    Measured("H200", "attention", "fwd", torch.bfloat16, "triton", (), SDPA_ONLY),
    Measured("H200", "attention", "bwd", torch.bfloat16, "triton", (), SDPA_ONLY),
    *(Measured("H100", op, p, torch.bfloat16, "triton", (), UNMEASURED) for op, ps in PASSES.items() for p in ps),
)


def faster(ratios: tuple[float, ...]) -> str:
    """The path a row's ratios choose: Triton unless torch is faster on the geometric mean."""
    if not ratios:
        return "triton"
    return "triton" if math.fsum(math.log(r) for r in ratios) >= 0 else "torch"


def recorded_choice(device_class: str, op: str, pass_: str, dtype: torch.dtype) -> str | None:
    """The recorded path for (device class, op, pass, dtype), or None where nothing is recorded."""
    for row in MEASURED:
        if (row.device_class, row.op, row.pass_, row.dtype) == (device_class, op, pass_, dtype):
            return row.choice
    return None

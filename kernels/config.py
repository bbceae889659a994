"""The kernel section: which implementation the fused ops use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What every config section's `problems()` returns, one per broken rule: (key, value, rule). Kept
# here, in the section every other one may import (kernels → model → parallel → launcher).
Problem = tuple[str, object, str]


@dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """"auto": on CUDA, per op and pass, the path measured faster on the device's class
    (kernels/measured_backends.py; Triton where unmeasured), plain torch elsewhere; "triton" and
    "torch" force one path everywhere; "interpret": Triton's CPU interpreter (tests)."""

    backend: Literal["auto", "triton", "torch", "interpret"] = "auto"

    def problems(self) -> list[Problem]:
        return []

"""The kernel section: which implementation the fused ops use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Problem = tuple[str, object, str]


@dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """"auto": Triton on CUDA, plain torch elsewhere; "interpret": Triton's CPU interpreter (tests)."""

    backend: Literal["auto", "triton", "torch", "interpret"] = "auto"

    def problems(self) -> list[Problem]:
        return []

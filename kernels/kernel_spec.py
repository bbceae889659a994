"""`KernelSpec`: one launch configuration of a Triton kernel, with arguments shaped like a real call.

Each Triton module lists its shipped configurations as KernelSpecs; kernels/aot.py compiles them
for a GPU target on a machine without one. The record lives here, apart from both, so that the
kernel modules need not import the compiler driver that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KernelSpec:
    name: str
    kernel: Any  # a triton.JITFunction
    args: dict  # runtime argument -> torch.dtype (a pointer to it), int or float, as in a real call
    constexprs: dict
    num_warps: int
    num_stages: int

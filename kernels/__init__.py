"""Fused ops for MoE training: grouped GEMM and flash attention.

Each op is kernel (Triton) → op (`torch.library.custom_op`) → used by `moetron.model`, with a
plain-torch reference beside it. Nothing is compiled or launched at import time.
"""

from moetron.kernels.grouped_mm import grouped_mm, grouped_mm_reference

__all__ = ["grouped_mm", "grouped_mm_reference"]

"""Fused ops for MoE training: grouped GEMM and flash attention.

Each op is kernel (Triton) → op (`torch.library.custom_op`) → used by `moetron.model`, with a
plain-torch reference beside it. Nothing is compiled or launched at import time, and triton is
imported only when a Triton backend runs.
"""

from moetron.kernels.flash_attention import flash_attention, flash_attention_reference
from moetron.kernels.grouped_mm import grouped_mm, grouped_mm_reference

__all__ = ["flash_attention", "flash_attention_reference", "grouped_mm", "grouped_mm_reference"]

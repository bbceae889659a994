"""How throughput and MFU read on a console: one format each, wherever moetron prints them.

Tokens/s is a whole number with thousands separators and its unit (`9,768 tok/s`); MFU is a
percentage with one decimal (`26.0%`); any other measured number has three significant digits and
no exponent (`1,872` GFLOP/s, `24.5`, `0.0123`). Only what people read goes through here: metrics.jsonl and
TensorBoard keep the raw numbers (tokens/s as a float, MFU as a fraction of the peak).
"""

from __future__ import annotations

import math


def tokens_per_s(rate: float) -> str:
    """9768.4 → '9,768 tok/s'."""
    return f"{rate:,.0f} tok/s"


def mfu(fraction: float) -> str:
    """0.26 → '26.0%' (MFU is computed and stored as a fraction of the device's peak)."""
    return f"{fraction:.1%}"


def significant(value: float, digits: int = 3) -> str:
    """1872.4 → '1,872', 24.51 → '24.5', 0.5 → '0.5', 1.2345e-5 → '0.0000123': Python's `:.3g`, except
    where that would print an exponent (1.87e+03): a whole number then, or the decimals it needs."""
    text = f"{value:.{digits}g}"
    if "e" not in text:
        return text
    if abs(value) >= 1:
        return f"{value:,.0f}"
    return f"{value:.{digits - 1 - math.floor(math.log10(abs(value)))}f}"


def gflops_by_dtype(rates: dict[str, float]) -> str:
    """{"torch.bfloat16": 1.87e12, "torch.float32": 1.83e11} (FLOP/s) → 'bfloat16 1,870 GFLOP/s, float32 183 GFLOP/s'."""
    return ", ".join(f"{d.removeprefix('torch.')} {significant(flops / 1e9)} GFLOP/s" for d, flops in rates.items())

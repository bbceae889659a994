"""How throughput and MFU read on a console: one format each, wherever moetron prints them.

Tokens/s is a whole number with thousands separators and its unit (`9,768 tok/s`); MFU is a
percentage with one decimal (`26.0%`). Only what people read goes through here: metrics.jsonl and
TensorBoard keep the raw numbers (tokens/s as a float, MFU as a fraction of the peak).
"""

from __future__ import annotations


def tokens_per_s(rate: float) -> str:
    """9768.4 → '9,768 tok/s'."""
    return f"{rate:,.0f} tok/s"


def mfu(fraction: float) -> str:
    """0.26 → '26.0%' (MFU is computed and stored as a fraction of the device's peak)."""
    return f"{fraction:.1%}"

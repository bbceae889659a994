"""Small building blocks shared by attention and FFNs: norms and the dense feed-forward network.

Legend: B batch, S sequence, D model dim, F FFN hidden dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def build_norm(kind: str, d_model: int, eps: float) -> nn.Module:
    """RMSNorm (Zhang & Sennrich 2019) or LayerNorm (Ba et al. 2016), both with a learned gain."""
    if kind == "rmsnorm":
        return nn.RMSNorm(d_model, eps=eps)
    return nn.LayerNorm(d_model, eps=eps)


def activate(kind: str, gate: torch.Tensor, up: torch.Tensor | None, *, limit: float = 0.0, alpha: float = 1.0,
             up_offset: float = 0.0) -> torch.Tensor:
    """SwiGLU: silu(gate) * up (Shazeer 2020); ReLU and GeLU take no `up` projection.

    GPT-OSS's clamped SwiGLU (MoEConfig.swiglu_*): with `limit` > 0 the gate is clamped to at most
    `limit` and up to ±limit, then gate · sigmoid(alpha · gate) · (up + up_offset); the defaults
    (0, 1, 0) are plain SwiGLU."""
    if kind == "swiglu":
        if limit == 0.0 and alpha == 1.0 and up_offset == 0.0:
            return F.silu(gate) * up
        if limit > 0.0:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return gate * torch.sigmoid(alpha * gate) * (up + up_offset)
    if kind == "gelu":
        return F.gelu(gate)
    return F.relu(gate)


class FeedForward(nn.Module):
    """Position-wise FFN: D → F → D, with SwiGLU's extra gate projection when asked for."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool = False, dropout: float = 0.0):
        super().__init__()
        self.activation = activation
        self.w_gate = nn.Linear(d_model, d_ff, bias=bias)
        self.w_up = nn.Linear(d_model, d_ff, bias=bias) if activation == "swiglu" else None
        self.w_down = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        up = self.w_up(x_BSD) if self.w_up is not None else None
        return self.dropout(self.w_down(activate(self.activation, self.w_gate(x_BSD), up)))

    def init_weights(self, std: float, out_std: float) -> None:
        for lin, s in ((self.w_gate, std), (self.w_up, std), (self.w_down, out_std)):
            if lin is not None:
                nn.init.normal_(lin.weight, std=s)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)

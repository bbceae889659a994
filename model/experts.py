"""Experts: E independent FFNs applied to ragged groups of tokens, in one grouped GEMM per projection.

Legend: A routed rows sorted by expert, D model dim, F expert hidden dim, E experts held here.
`offsets_E[e]` is the end row of expert e's group; rows past `offsets_E[-1]` are not computed.
"""

from __future__ import annotations

import torch
from torch import nn

from moetron.kernels.grouped_mm import group_row_multiple, grouped_mm
from moetron.model.layers import activate


class GroupedExperts(nn.Module):
    """E FFNs D → F → D stacked into 3-D weights, so expert parallelism can shard dim 0."""

    def __init__(self, num_experts: int, d_model: int, d_ff: int, activation: str, impl: str = "grouped"):
        super().__init__()
        self.activation, self.impl = activation, impl
        # Which grouped-GEMM implementation runs (see moetron.kernels.backend); None: automatic.
        self.kernel_backend: str | None = None
        # Rows the dispatcher pads each expert's group to; None: what the multiply prefers.
        self.row_multiple: int | None = None
        self.w_gate_EDF = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w_up_EDF = nn.Parameter(torch.empty(num_experts, d_model, d_ff)) if activation == "swiglu" else None
        self.w_down_EFD = nn.Parameter(torch.empty(num_experts, d_ff, d_model))

    def forward(self, x_AD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        weights = [w for w in (self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD) if w is not None]
        if torch.is_autocast_enabled(x_AD.device.type):
            # Grouped GEMM has no autocast rule; cast here so it runs in the autocast dtype too.
            dtype = torch.get_autocast_dtype(x_AD.device.type)
            x_AD, weights = x_AD.to(dtype), [w.to(dtype) for w in weights]
        if self.impl == "grouped":
            def mm(x, w, offsets):
                return grouped_mm(x, w, offsets, backend=self.kernel_backend)
        else:
            mm = _loop_mm
        gate_AF = mm(x_AD, weights[0], offsets_E)
        up_AF = mm(x_AD, weights[1], offsets_E) if self.w_up_EDF is not None else None
        return mm(activate(self.activation, gate_AF, up_AF), weights[-1], offsets_E)

    def group_row_multiple(self, x_TD: torch.Tensor, rows_per_group: float) -> int:
        """Rows each expert's group is best padded to for the multiply that will run on x_TD (its
        device, its dtype under autocast) with groups of `rows_per_group` rows on average (see
        kernels.grouped_mm.group_row_multiple). `row_multiple` set on the module overrides it."""
        if self.row_multiple is not None:
            return self.row_multiple
        if self.impl != "grouped":
            return 1
        device = x_TD.device
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else x_TD.dtype
        return group_row_multiple(device, dtype, rows_per_group, self.kernel_backend)

    def init_weights(self, std: float, out_std: float) -> None:
        for w, s in ((self.w_gate_EDF, std), (self.w_up_EDF, std), (self.w_down_EFD, out_std)):
            if w is not None:
                nn.init.normal_(w, std=s)


def _loop_mm(x_AD: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """One matmul per expert: the reference the grouped path is checked against."""
    # NOTE: host-device sync to read the group boundaries.
    ends = offsets_E.tolist()
    out = x_AD.new_zeros(x_AD.shape[0], w_EDF.shape[-1])
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = x_AD[start:end] @ w_EDF[e]
        start = end
    return out

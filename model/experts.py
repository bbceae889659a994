"""Experts: E independent FFNs applied to ragged groups of tokens, in one grouped GEMM per projection.

Legend: A routed rows sorted by expert, D model dim, F expert hidden dim, E experts held here.
`offsets_E[e]` is the end row of expert e's group; rows past `offsets_E[-1]` are not computed.

With `bias` (GPT-OSS) each projection adds its expert's bias to the rows of that expert's group,
b_gate_EF and b_up_EF (E, F), b_down_ED (E, D), before the combine weight multiplies the row.
"""

from __future__ import annotations

import torch
from torch import nn

from moetron.kernels.fp8 import fp8_grouped_mm
from moetron.kernels.grouped_mm import group_row_multiple, grouped_mm
from moetron.model.layers import activate


class GroupedExperts(nn.Module):
    """E FFNs D → F → D stacked into 3-D weights (and 2-D biases), so expert parallelism can shard dim 0.

    `swiglu`: (limit, alpha, up_offset) of the clamped SwiGLU (`layers.activate`); (0, 1, 0) is plain.
    """

    def __init__(self, num_experts: int, d_model: int, d_ff: int, activation: str, impl: str = "grouped", *,
                 bias: bool = False, swiglu: tuple[float, float, float] = (0.0, 1.0, 0.0)):
        super().__init__()
        self.activation, self.impl, self.swiglu = activation, impl, swiglu
        # Which grouped-GEMM implementation runs (see moetron.kernels.backend); None: automatic.
        self.kernel_backend: str | None = None
        # Rows the dispatcher pads each expert's group to; None: what the multiply prefers.
        self.row_multiple: int | None = None
        # FP8 grouped GEMMs (train.precision fp8, set by parallel/float8.py; kernels/fp8.py).
        self.fp8 = False
        self.w_gate_EDF = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w_up_EDF = nn.Parameter(torch.empty(num_experts, d_model, d_ff)) if activation == "swiglu" else None
        self.w_down_EFD = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        # Biases, one row per expert: named b_* so that the optimizer, which judges by name, does not decay them.
        self.b_gate_EF = nn.Parameter(torch.empty(num_experts, d_ff)) if bias else None
        self.b_up_EF = nn.Parameter(torch.empty(num_experts, d_ff)) if bias and self.w_up_EDF is not None else None
        self.b_down_ED = nn.Parameter(torch.empty(num_experts, d_model)) if bias else None

    def forward(self, x_AD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        weights = [w for w in (self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD) if w is not None]
        biases = [b for b in (self.b_gate_EF, self.b_up_EF, self.b_down_ED) if b is not None]
        if torch.is_autocast_enabled(x_AD.device.type):
            # Grouped GEMM has no autocast rule; cast here so it runs in the autocast dtype too.
            dtype = torch.get_autocast_dtype(x_AD.device.type)
            x_AD, weights, biases = x_AD.to(dtype), [w.to(dtype) for w in weights], [b.to(dtype) for b in biases]
        if self.fp8:
            mm = fp8_grouped_mm
        elif self.impl == "grouped":
            def mm(x, w, offsets):
                return grouped_mm(x, w, offsets, backend=self.kernel_backend)
        else:
            mm = _loop_mm
        expert_A = row_experts(offsets_E, x_AD.shape[0]) if biases else None

        def project(x_AX: torch.Tensor, i: int) -> torch.Tensor:
            y_AY = mm(x_AX, weights[i], offsets_E)
            return y_AY if expert_A is None else y_AY + expert_rows(biases[i], expert_A)

        gate_AF = project(x_AD, 0)
        up_AF = project(x_AD, 1) if self.w_up_EDF is not None else None
        limit, alpha, up_offset = self.swiglu
        return project(activate(self.activation, gate_AF, up_AF, limit=limit, alpha=alpha, up_offset=up_offset), -1)

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
        for b in (self.b_gate_EF, self.b_up_EF, self.b_down_ED):
            if b is not None:
                nn.init.zeros_(b)


def row_experts(offsets_E: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert of each of `rows` rows grouped by `offsets_E` (group ends) → int64 (A,); rows
    past the last group get E. A search, not a repeat by counts: no host-device sync."""
    rows_A = torch.arange(rows, device=offsets_E.device, dtype=offsets_E.dtype)
    return torch.searchsorted(offsets_E, rows_A, right=True)


def expert_rows(b_EX: torch.Tensor, expert_A: torch.Tensor) -> torch.Tensor:
    """Each row's expert's bias → (A, X); rows past the last group (expert E) get 0, so they stay
    the zeros the grouped multiply leaves there."""
    return torch.cat([b_EX, b_EX.new_zeros(1, b_EX.shape[1])]).index_select(0, expert_A)


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

"""Grouped GEMM over ragged groups of rows: y[rows of e] = x[rows of e] @ w[e].

Legend: T rows (tokens sorted by expert), K input features, N output features, E groups.
`offsets_E[e]` is the cumulative end row of group e (int32), as `torch._grouped_mm` takes it.
"""

from __future__ import annotations

import torch


def grouped_mm_reference(x_TK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Per-group loop in plain torch; the slow, obviously-right reference. Any float dtype."""
    # NOTE: host-device sync: the group boundaries are read on the host.
    ends = offsets_E.tolist()
    starts = [0] + ends[:-1]
    parts = [x_TK[s:e] @ w_EKN[g] for g, (s, e) in enumerate(zip(starts, ends))]
    parts.append(x_TK.new_zeros(x_TK.shape[0] - (ends[-1] if ends else 0), w_EKN.shape[-1]))
    return torch.cat(parts, dim=0)


def grouped_mm(x_TK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """y_TN = x_TK @ w_EKN[group of row]; differentiable in x and w. Rows past the last
    offset belong to no group and come out as zeros."""
    if x_TK.dtype in (torch.float32, torch.bfloat16) and x_TK.dtype == w_EKN.dtype:
        # torch._grouped_mm leaves rows past the last offset uninitialized; keep them out.
        # NOTE: host-device sync to read the number of grouped rows.
        end = int(offsets_E[-1]) if offsets_E.numel() else 0
        y = torch._grouped_mm(x_TK[:end], w_EKN, offs=offsets_E.to(torch.int32))
        if end < x_TK.shape[0]:
            y = torch.cat([y, y.new_zeros(x_TK.shape[0] - end, y.shape[1])])
        return y
    return grouped_mm_reference(x_TK, w_EKN, offsets_E)

"""Documents packed into one sequence: where each begins, and positions that restart with each.

Legend: B batch, S positions.

A packed training window holds several documents, each closed by the end-of-document token (as
Megatron's corpora and `moetron data prepare` write them), so a document begins right after each
such token. `document_starts` turns the token ids into the position where each token's document
begins — per position, the sequence-start offsets of varlen flash attention — which is what the
attention mask needs (key j is visible to query i iff start(i) <= j <= i) and what positions that
restart per document subtract (Megatron's `--reset-attention-mask` and `--reset-position-ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def document_starts(ids_BS: torch.Tensor, eod_id: int) -> torch.Tensor:
    """For every position, the position of the first token of its document → int64 (B, S).

    A document begins at 0 and right after every `eod_id`; an end-of-document token belongs to
    the document it closes.
    """
    B, S = ids_BS.shape
    begins_BS = torch.zeros(B, S, dtype=torch.bool, device=ids_BS.device)
    begins_BS[:, 1:] = ids_BS[:, :-1] == eod_id
    at_S = torch.arange(S, device=ids_BS.device)
    return torch.where(begins_BS, at_S, 0).cummax(dim=1).values


def document_positions(doc_start_BS: torch.Tensor) -> torch.Tensor:
    """Positions counted from each token's document start → int64 (B, S)."""
    return torch.arange(doc_start_BS.shape[1], device=doc_start_BS.device) - doc_start_BS


@dataclass(frozen=True)
class Packing:
    """How a run's windows hold documents: each closed by `eod_id`; positions restart per
    document when `reset_positions` (else they run on across the window)."""

    eod_id: int
    reset_positions: bool = False

    def model_inputs(self, ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(doc_start_BS, positions_BS) for the Decoder; positions are given either way, so that a
        pipeline stage always receives the same tensors."""
        doc_start_BS = document_starts(ids_BS, self.eod_id)
        if self.reset_positions:
            return doc_start_BS, document_positions(doc_start_BS)
        return doc_start_BS, torch.arange(ids_BS.shape[1], device=ids_BS.device).repeat(ids_BS.shape[0], 1)

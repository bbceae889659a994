"""Masked-language-model batches (BERT, Devlin et al. 2019): which positions are scored, and how
their inputs are corrupted.

Legend: B sequences, S positions.

Of every window's S positions `rate` (15%) are chosen, at least one per sequence; a chosen
position's input becomes the mask token (80%), a random token of the tokenizer's vocabulary (10%)
or stays (10%), and only chosen positions carry a target: the others hold -100, which
cross entropy ignores. The mask token is the first id past the tokenizer's vocabulary, so
model.vocab_size must leave room for it.

The draws depend on the seed, the step and the row's place in the global batch only — not on the
layout — so every data-parallel rank corrupts its own rows as one process would, and a resumed run
corrupts a step exactly as the uninterrupted run did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetron.parallel.token_mean import IGNORE_INDEX as IGNORE


@dataclass(frozen=True)
class MaskedLM:
    """BERT's corruption of windows drawn from a tokenizer of `vocab` ids."""

    vocab: int
    seed: int
    rate: float = 0.15

    @property
    def mask_id(self) -> int:
        return self.vocab

    def pairs(self, windows_BS1: torch.Tensor, draw: int, rows: slice | None = None,
              batch: int | None = None) -> torch.Tensor:
        """Windows (B, S + 1) of token ids → (B, 2, S): corrupted inputs and targets (-100 where
        not scored). `draw` numbers the batch (the step; validation batches count down from -1);
        `rows` of a global batch of `batch` sequences are these B (None: B is the whole batch)."""
        ids_BS = windows_BS1[:, :-1]
        B, S = ids_BS.shape
        rows = rows if rows is not None else slice(0, B)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + draw)
        n = batch if batch is not None else B
        chosen_p, action_p = torch.rand(n, S, generator=g), torch.rand(n, S, generator=g)
        random_ids = torch.randint(0, self.vocab, (n, S), generator=g)
        chosen_p, action_p, random_ids = chosen_p[rows], action_p[rows], random_ids[rows]
        chosen_BS = chosen_p < self.rate
        # At least one scored position per sequence, as BERT's pretraining data has (max(1, ·)).
        chosen_BS[torch.arange(B), chosen_p.argmin(dim=1)] = True
        inputs_BS = ids_BS.clone()
        masked_BS = chosen_BS & (action_p < 0.8)
        replaced_BS = chosen_BS & (action_p >= 0.8) & (action_p < 0.9)
        inputs_BS[masked_BS] = self.mask_id
        inputs_BS[replaced_BS] = random_ids.to(ids_BS.device)[replaced_BS]
        targets_BS = torch.where(chosen_BS.to(ids_BS.device), ids_BS, IGNORE)
        return torch.stack([inputs_BS, targets_BS], dim=1)

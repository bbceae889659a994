"""A weighted blend of corpora, drawn the way Megatron's BlendedDataset draws it, and resumable.

Sample i of the global order (i = 0, 1, …) comes from the source with the largest deficit
w_s · max(i, 1) − c_s, where the weights w are normalized to sum to 1, c_s counts the samples
source s has given so far, and a tie goes to the first source: megatron-core's
`build_blending_indices` (megatron/core/datasets/helpers.cpp). After n samples every source has
given within one sample of w_s · n. Within a source, windows come in its own seeded order
(`WindowSampler`, one stream per source), epoch after epoch, so a small source repeats sooner.

The state is each source's position, and the counts c_s are those positions: a resumed run draws
exactly what the uninterrupted one draws. A blend whose weights changed between a stop and its
resume goes on from the counts reached (a curriculum), matching the new weights from then on.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from moetron.launcher.config import ConfigError
from moetron.launcher.data.corpus import (
    VALIDATION_SEED,
    Source,
    WindowSampler,
    fixed_batches,
    read_windows,
)


class BlendSampler:
    """Windows of seq_len + 1 tokens from several sources, `(name, weight, token arrays)` each.
    Reads only a rank's rows and spans of each batch, as `WindowSampler.next_batch` does; a lone
    source draws exactly what a `WindowSampler` with the same seed draws."""

    def __init__(self, sources: list[tuple[str, float, list[np.ndarray]]], seq_len: int, seed: int):
        self.names = [name for name, _, _ in sources]
        weights = np.asarray([w for _, w, _ in sources], dtype=np.float64)
        self.weights = weights / weights.sum()  # as Megatron's normalize()
        self.samplers = [WindowSampler(arrays, seq_len, seed, stream=k) for k, (_, _, arrays) in enumerate(sources)]
        self.seq_len = seq_len

    @property
    def num_windows(self) -> int:
        return sum(s.num_windows for s in self.samplers)

    @property
    def tokens_read(self) -> int:
        return sum(s.tokens_read for s in self.samplers)

    def counts(self) -> np.ndarray:
        """(sources,) samples each source has given."""
        return np.asarray([s.drawn for s in self.samplers], dtype=np.int64)

    def next_sources(self, n: int) -> list[int]:
        """The sources of the next n samples (the state does not move)."""
        counts, out = self.counts(), []
        for _ in range(n):
            deficit = self.weights * float(max(int(counts.sum()), 1)) - counts
            k = int(np.argmax(deficit))  # the first of equal deficits, as helpers.cpp's strict >
            counts[k] += 1
            out.append(k)
        return out

    def next_batch(self, n: int, rows: slice | None = None,
                   spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """The next n windows of the blend's global order, of which only `rows` (and of each only
        the token `spans`) are read. → (rows, seq_len + 1) int64, or (rows, len(spans), width)."""
        picks = [(k, self.samplers[k].next_windows(1)[0]) for k in self.next_sources(n)]
        chosen = picks[rows if rows is not None else slice(None)]
        return read_windows([(self.samplers[k], w) for k, w in chosen], self.seq_len, spans)

    def tokens_by_source(self) -> dict[str, int]:
        """Training tokens (seq_len per sample) each source has given, over every rank."""
        return {name: int(c) * self.seq_len for name, c in zip(self.names, self.counts())}

    def state_dict(self) -> dict:
        return {"sources": {name: s.state_dict() for name, s in zip(self.names, self.samplers)}}

    def load_state_dict(self, state: dict) -> None:
        if "sources" not in state:  # a lone corpus's position, saved before blends
            state = {"sources": {self.names[0]: state}} if len(self.names) == 1 else state
        saved = list(state.get("sources", {}))
        if saved != self.names:
            raise ConfigError(f"the checkpoint's data position is for the sources {saved}, this run's data are "
                              f"{self.names}; resume with the same sources (weights may change), or start a new "
                              f"run with train.name=<new name>")
        for name, sampler in zip(self.names, self.samplers):
            sampler.load_state_dict(state["sources"][name])


def blend_sampler(sources: list[Source], split: str, seq_len: int, seed: int) -> BlendSampler:
    """A sampler of the `split` ("train" or "val") of every source, at its weight."""
    return BlendSampler([(s.name, s.weight, getattr(s, split)) for s in sources], seq_len, seed)


def blend_validation_batches(sources: list[Source], seq_len: int, batch: int, n_batches: int, *,
                             rows: Callable[[int], slice] | None = None,
                             spans: list[tuple[int, int]] | None = None) -> list[torch.Tensor]:
    """A fixed set of validation windows drawn from each source's held-out split at the blend's
    weights (one source: exactly `validation_batches`); the same at every evaluation."""
    sampler = blend_sampler(sources, "val", seq_len, VALIDATION_SEED)
    return fixed_batches(sampler, batch, n_batches, rows, spans)

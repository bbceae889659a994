"""Validation loss by evaluation length and by position: how far past its training length a
model's position encoding carries it. Used by `moetron eval` and bench/positions.py.

Legend: B windows in a batch, S evaluation length, V vocabulary, P position buckets.

Every length is scored on the same tokens. `spans` evenly spaced stretches of longest-length + 1
tokens are taken from the validation split; a length S cuts each into windows of S + 1 (inputs and
shifted targets). So when the lengths divide the longest, each target token is predicted at every
length, only from a different amount of context at a different position: the losses differ by
what the encoding does with length, not by which text was drawn.

Losses are also reported per position bucket — [0, 64), [64, 128), [128, 256), … octaves — which
shows where a model degrades: past its training length, or everywhere at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from moetron.model.config import ModelConfig
from moetron.model.transformer import Decoder

FIRST_BUCKET = 64


@dataclass(frozen=True)
class LengthLoss:
    """Mean next-token loss (nats per token) at one evaluation length, overall and per bucket."""

    seq_len: int
    loss: float
    tokens: int
    # (first position, end position, mean loss) per octave bucket of positions.
    buckets: list[tuple[int, int, float]]

    def to_dict(self) -> dict:
        return {"seq_len": self.seq_len, "loss": self.loss, "tokens": self.tokens,
                "buckets": [{"start": a, "end": b, "loss": loss} for a, b, loss in self.buckets]}


def length_problems(cfg: ModelConfig, lengths: list[int]) -> list[str]:
    """Why a length cannot run with this model's position encoding (empty: all can).

    Learned positions stop at their table (max_seq_len rows). The other encodings are computed for
    any position (T5's buckets saturate at max_distance), so they run at any length and only
    the loss tells how well.
    """
    out = [f"--seq-len {s}: must be >= 2" for s in lengths if s < 2]
    if cfg.position == "learned":
        out += [f"--seq-len {s}: position 'learned' has a table of max_seq_len = {cfg.max_seq_len} positions "
                f"and cannot run past it" for s in lengths if s > cfg.max_seq_len]
    return out


def position_buckets(seq_len: int) -> list[tuple[int, int]]:
    """[0, 64), [64, 128), [128, 256), … cut at seq_len."""
    edges = [0, FIRST_BUCKET]
    while edges[-1] < seq_len:
        edges.append(edges[-1] * 2)
    edges = [e for e in edges if e < seq_len] + [seq_len]
    return list(zip(edges[:-1], edges[1:]))


def eval_spans(val_shards: list[np.ndarray], span_len: int, spans: int) -> list[np.ndarray]:
    """`spans` stretches of `span_len` tokens, evenly spaced over the validation split, each inside
    one shard. Fewer when the split is too short to hold them apart."""
    starts = [max(len(s) - span_len + 1, 0) for s in val_shards]  # where a span may begin, per shard
    if not any(starts):
        raise ValueError(f"the validation split holds no stretch of {span_len} tokens "
                         f"(its longest shard has {max((len(s) for s in val_shards), default=0)})")
    spans = max(1, min(spans, sum(len(s) // span_len for s in val_shards)))
    out = []
    for i in range(spans):
        at = i * sum(starts) // spans  # an offset into the shards' start ranges laid end to end
        for shard, n in zip(val_shards, starts):
            if at < n:
                out.append(np.asarray(shard[at : at + span_len], dtype=np.int64))
                break
            at -= n
    return out


@torch.no_grad()
def loss_per_position(model: Decoder, windows_BS1: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Summed next-token loss at each position over the windows → (S,), float64.

    `vocab_size` (the tokenizer's) masks padded ids past it, as generation does.
    """
    logits_BSV = model(windows_BS1[:, :-1]).logits_BSV.float()
    if vocab_size is not None and vocab_size < logits_BSV.shape[-1]:
        logits_BSV = logits_BSV[..., :vocab_size]
    ce_BS = F.cross_entropy(logits_BSV.transpose(1, 2), windows_BS1[:, 1:], reduction="none")
    return ce_BS.double().sum(dim=0)


def evaluate_lengths(model: Decoder, val_shards: list[np.ndarray], lengths: list[int], *, tokens: int,
                     batch_tokens: int = 8192, vocab_size: int | None = None, device=None,
                     longest: int | None = None, on_plan=None) -> list[LengthLoss]:
    """Validation loss at each of `lengths` on the same ~`tokens` target tokens (module docstring).

    Windows are batched `batch_tokens` tokens at a time (at least one window): the scores of one
    batch are B × H × S × S, which bounds memory at long lengths. `longest` (default: the longest
    of `lengths`) is the length the spans are cut for: a sweep run a few lengths at a time (one
    model setting per length) passes its overall longest, so every piece scores the same tokens.
    `on_plan(total)` → advance(n), if given, hears the target tokens to score and each batch's.
    """
    for problem in length_problems(model.cfg, lengths):
        raise ValueError(problem)
    device = device or model.embed.weight.device
    longest = max(lengths) if longest is None else longest
    if longest < max(lengths):
        raise ValueError(f"longest ({longest}) must be >= every length ({max(lengths)})")
    spans = eval_spans(val_shards, longest + 1, max(1, math.ceil(tokens / longest)))
    model.eval()
    out = []
    advance = on_plan(sum(len(spans) * (longest // S) * S for S in lengths)) if on_plan else lambda n: None
    for S in lengths:
        windows = [span[i * S : i * S + S + 1] for span in spans for i in range(longest // S)]
        per_batch = max(1, batch_tokens // S)
        sum_S = torch.zeros(S, dtype=torch.float64)
        for i in range(0, len(windows), per_batch):
            batch_BS1 = torch.from_numpy(np.stack(windows[i : i + per_batch])).to(device)
            sum_S += loss_per_position(model, batch_BS1, vocab_size).cpu()
            advance(batch_BS1.shape[0] * S)
        mean_S = sum_S / len(windows)
        buckets = [(a, b, float(mean_S[a:b].mean())) for a, b in position_buckets(S)]
        out.append(LengthLoss(S, float(mean_S.mean()), len(windows) * S, buckets))
    return out

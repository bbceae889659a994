"""Documents in, a Megatron indexed corpus out: what `moetron data prepare` writes.

Each document is tokenized, closed by the tokenizer's end-of-text id, and written as one sequence
(one document) of PREFIX.bin as it comes; the held-out documents (`is_validation`) are kept aside
and written last, so the corpus's last documents are its validation split, and PREFIX.json
records how many. A failure on the way leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetron.launcher.data.corpus import is_validation, sidecar_for
from moetron.launcher.data.indexed import IndexedWriter, token_dtype
from moetron.launcher.data.tokenizer import Tokenizer


@dataclass
class Written:
    """What a prepare wrote: PREFIX.idx, documents and tokens per split, the largest id."""

    index: Path
    documents: dict[str, int]
    tokens: dict[str, int]
    max_id: int


def write_corpus(prefix: str | Path, docs: Iterable[tuple[str, str]], tok: Tokenizer, val_fraction: float,
                 advance: Callable[[int], None] = lambda chars: None) -> Written:
    """Tokenize (name, text) documents into PREFIX.bin/.idx/.json; `advance(chars)` after each."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    writer = IndexedWriter(prefix, token_dtype(tok.vocab_size))
    eos = np.array([tok.eos_id])
    held_out: list[np.ndarray] = []  # a small share of the corpus, written after the rest
    tokens = {"train": 0, "val": 0}
    try:
        for name, text in docs:
            ids = np.concatenate([tok.encode_array(text), eos])
            if is_validation(name, val_fraction):
                held_out.append(ids.astype(writer.dtype))
            else:
                writer.add(ids)
            advance(len(text))
        tokens["train"] = sum(writer.lengths)
        for ids in held_out:
            writer.add(ids)
        tokens["val"] = sum(writer.lengths) - tokens["train"]
        documents = {"train": len(writer.lengths) - len(held_out), "val": len(held_out)}
        index = writer.finish(sidecar_for(tok, prefix, documents, writer.max_id))
    except BaseException:
        writer.abort()
        raise
    return Written(index, documents, tokens, writer.max_id)

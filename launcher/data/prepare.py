"""Documents in, a Megatron indexed corpus out: what `moetron data prepare` writes.

Each document is tokenized (by worker processes: encode_pool.py), closed by the tokenizer's
end-of-text id, and written as one sequence (one document) of PREFIX.bin in the order it came;
the held-out documents (`is_validation`) are kept aside and written last, so the corpus's last
documents are its validation split, and PREFIX.json records how many. The writer stays in this
process. A failure on the way leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetron.launcher.data.corpus import is_validation, sidecar_for
from moetron.launcher.data.encode_pool import encode_in_order
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
                 advance: Callable[[int], None] = lambda documents: None, workers: int = 1) -> Written:
    """Tokenize (name, text) documents with `workers` processes into PREFIX.bin/.idx/.json, the
    same bytes whatever their number; `advance(1)` after each document written or held out."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    writer = IndexedWriter(prefix, token_dtype(tok.vocab_size))
    held_out: list[np.ndarray] = []  # a small share of the corpus, written after the rest
    tokens = {"train": 0, "val": 0}
    try:
        for name, ids in encode_in_order(docs, tok, writer.dtype, workers):
            if is_validation(name, val_fraction):
                held_out.append(ids.copy())  # a copy: the view would keep its whole chunk alive
            else:
                writer.add(ids)
            advance(1)
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

"""Megatron's indexed token format (`PREFIX.bin` + `PREFIX.idx`), read in place and written.

The layout megatron-core's `IndexedDatasetBuilder` writes (megatron/core/datasets/indexed_dataset.py):
  PREFIX.bin   the token ids of every sequence, back to back, in the dtype the index names
  PREFIX.idx   b"MMIDIDX\\x00\\x00", version <Q = 1, dtype code <B, S <Q sequences, D <Q document
               boundaries, then int32 lengths[S], int64 byte pointers[S] into .bin, and int64
               document_indices[D]: 0, then the sequence index ending each document
               (a multimodal index appends int8 modes[S], which are not read here)
Everything is little-endian. A document is one or more sequences; `moetron data prepare` writes
one sequence per document, each closed by the tokenizer's end-of-text id (Megatron's --append-eod).

`moetron data prepare` also leaves `PREFIX.json` beside them (Megatron ignores it): the tokenizer,
how many trailing documents it held out for validation, and the largest token id written.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetron.launcher.config import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, S, D
# Megatron's DType codes (indexed_dataset.DType).
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
CODES = {np.dtype(t): code for code, t in DTYPES.items()}
SIDECAR_FORMAT = "moetron.indexed"


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype Megatron's preprocess_data.py picks for a vocabulary (DType.optimal_dtype)."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


@dataclass
class IndexedTokens:
    """One prefix, memory-mapped: `tokens` (T,) is the whole .bin; `doc_starts` (D + 1,) the
    token offset where each document begins, then T."""

    prefix: str
    tokens: np.ndarray
    doc_starts: np.ndarray

    @property
    def documents(self) -> int:
        return len(self.doc_starts) - 1

    def split(self, val_documents: int) -> tuple[np.ndarray, np.ndarray]:
        """(train, validation) token arrays, views of the .bin: the last `val_documents` documents
        are validation, as Megatron's split keeps its later documents for validation."""
        cut = int(self.doc_starts[self.documents - val_documents])
        return self.tokens[:cut], self.tokens[cut:]


def read_indexed(prefix: str) -> IndexedTokens:
    """Open PREFIX.idx and PREFIX.bin without copying; ConfigError/FileNotFoundError (one line)
    when either is missing, of another format or version, or they do not agree."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for path in (idx, bin_):
        if not path.is_file():
            raise FileNotFoundError(f"{prefix}: {path} missing (a Megatron indexed corpus is PREFIX.idx + "
                                    f"PREFIX.bin; write one with `moetron data prepare`)")
    with idx.open("rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:len(MAGIC)] != MAGIC:
        raise ConfigError(f"{idx}: not a Megatron index (it must start with {MAGIC!r})")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[len(MAGIC):])
    if version != VERSION:
        raise ConfigError(f"{idx}: index version {version}; only version {VERSION} (megatron-core's) is read")
    if code not in DTYPES:
        raise ConfigError(f"{idx}: unknown dtype code {code}; Megatron's codes are "
                          + ", ".join(f"{c} {np.dtype(t).name}" for c, t in DTYPES.items()))
    dtype = np.dtype(DTYPES[code]).newbyteorder("<")
    needed = HEADER_BYTES + sequences * 12 + documents * 8
    if idx.stat().st_size < needed or documents < 1:
        raise ConfigError(f"{idx}: cut short ({idx.stat().st_size} bytes; its header needs {needed})")
    raw = np.memmap(idx, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(raw, "<i4", sequences, HEADER_BYTES)
    pointers = np.frombuffer(raw, "<i8", sequences, HEADER_BYTES + 4 * sequences)
    doc_index = np.frombuffer(raw, "<i8", documents, HEADER_BYTES + 12 * sequences)
    total = int(lengths.sum(dtype=np.int64))
    if bin_.stat().st_size != total * dtype.itemsize:
        raise ConfigError(f"{bin_}: {bin_.stat().st_size} bytes, but {idx} describes {total} tokens of "
                          f"{dtype.name} ({total * dtype.itemsize} bytes); the pair was not written together")
    starts = np.append(pointers // dtype.itemsize, total)
    tokens = np.memmap(bin_, dtype=dtype, mode="r", shape=(total,)) if total else np.zeros(0, dtype)
    return IndexedTokens(prefix, tokens, starts[doc_index])


def read_sidecar(prefix: str) -> dict | None:
    """What `moetron data prepare` recorded beside PREFIX.idx, or None for another writer's corpus."""
    path = Path(prefix + ".json")
    if not path.is_file():
        return None
    header = json.loads(path.read_text())
    if header.get("format") == "moetron.tokens":
        raise ConfigError(f"{path}: token shards of an older `moetron data prepare`; run it again to write "
                          f"the Megatron indexed format (PREFIX.bin + PREFIX.idx)")
    return header if header.get("format") == SIDECAR_FORMAT else None


class IndexedWriter:
    """Writes PREFIX.bin as documents arrive, then PREFIX.idx, byte for byte what megatron-core's
    IndexedDatasetBuilder writes for the same documents (one sequence each). Files are written
    under temporary names and renamed on `finish`, the index last: a prefix with an index is whole."""

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.lengths: list[int] = []
        self.max_id = -1
        self._bin = open(self._tmp(".bin"), "wb")

    def _tmp(self, suffix: str) -> Path:
        return self.prefix.with_name(self.prefix.name + suffix + ".tmp")

    def add(self, ids: np.ndarray) -> None:
        """One document's token ids (already closed by end-of-text, if wanted)."""
        ids = np.asarray(ids)
        if ids.size:
            self.max_id = max(self.max_id, int(ids.max()))
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes())
        self.lengths.append(int(ids.size))

    def finish(self, sidecar: dict | None = None) -> Path:
        """Close the .bin, write the .idx (and PREFIX.json), and put them in place; → PREFIX.idx."""
        self._bin.close()
        lengths = np.asarray(self.lengths, dtype="<i4")
        pointers = (np.cumsum(lengths, dtype="<i8") - lengths) * self.dtype.itemsize
        with open(self._tmp(".idx"), "wb") as f:
            f.write(MAGIC + struct.pack("<QB", VERSION, CODES[np.dtype(self.dtype.type)]))
            f.write(struct.pack("<QQ", len(lengths), len(lengths) + 1))
            f.write(lengths.tobytes() + pointers.astype("<i8").tobytes())
            f.write(np.arange(len(lengths) + 1, dtype="<i8").tobytes())
        os.replace(self._tmp(".bin"), self.prefix.with_name(self.prefix.name + ".bin"))
        if sidecar is not None:
            path = self.prefix.with_name(self.prefix.name + ".json")
            path.write_text(json.dumps({"format": SIDECAR_FORMAT, "version": 1, **sidecar}, indent=1))
        idx = self.prefix.with_name(self.prefix.name + ".idx")
        os.replace(self._tmp(".idx"), idx)
        return idx

    def abort(self) -> None:
        """Remove what was written (a failed prepare leaves nothing behind)."""
        self._bin.close()
        for suffix in (".bin", ".idx"):
            self._tmp(suffix).unlink(missing_ok=True)

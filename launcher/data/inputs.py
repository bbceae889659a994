"""What `moetron data prepare` reads: each input is a source of (name, text) documents.

The kind of an input is told by what is on disk:
  a text file          one document, named by its path
  PATH.jsonl           one document per non-blank line (field `text_key`), named PATH:LINE (from 0)
  PATH.parquet         one document per row (column `text_key`), named PATH:ROW; read a batch of
                       rows at a time with pyarrow, never the whole file
  a save_to_disk folder  a `datasets` Dataset (dataset_info.json, state.json): one document per row,
                       PATH:ROW; a DatasetDict (dataset_dict.json): the rows of its splits (or of
                       `split`), named PATH/SPLIT:ROW, the names the split's own folder gives
  stdlib               the Python standard library's source (corpus.stdlib_documents)

A document's name picks its split (corpus.is_validation), so a name depends only on the input and
the document's place in it. Every input can be read twice: `names()` (rows counted, no text
decoded where the format knows its row count) lets the split be checked before anything is
written, `documents()` streams the texts. What can be seen before the texts are read (a missing
column, a kind no reader takes, a reader's package missing) is refused by `open_input` in one line.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from moetron.launcher.config import ConfigError
from moetron.launcher.data.corpus import stdlib_documents

KINDS = "inputs are text files, .jsonl, .parquet, or a folder written by `datasets`' save_to_disk"
DATASET_MARKERS = ("dataset_dict.json", "dataset_info.json", "state.json")
COMPRESSED = {".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip", ".tar", ".7z"}
BATCH_ROWS = 1024  # rows decoded at a time from parquet and Arrow: memory stays flat per file
SNIFF_BYTES = 8192


class Input(Protocol):
    def names(self) -> Iterator[str]: ...

    def documents(self) -> Iterator[tuple[str, str]]: ...


def open_input(item: str, text_key: str = "text", split: str | None = None) -> Input:
    """The input `item` names, its kind told by what is on disk; FileNotFoundError or ConfigError
    (one line: the problem and what would be right) when it cannot be read."""
    if item == "stdlib":
        return Stdlib()
    path = Path(item)
    if path.is_dir():
        if not any((path / marker).is_file() for marker in DATASET_MARKERS):
            raise ConfigError(f"input {path}: a folder, but not one save_to_disk wrote (none of "
                              f"{', '.join(DATASET_MARKERS)} in it); {KINDS}")
        return SavedDataset(path, text_key, split)
    if not path.is_file():
        raise FileNotFoundError(f"input {item}: no such file or folder")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return JsonLines(path, text_key)
    if suffix == ".parquet":
        return ParquetFile(path, text_key)
    if suffix in COMPRESSED:
        raise ConfigError(f"input {path}: compressed ({suffix}); decompress it first: {KINDS}")
    with path.open("rb") as f:
        if b"\0" in f.read(SNIFF_BYTES):
            raise ConfigError(f"input {path}: binary, not text (a NUL byte in its first {SNIFF_BYTES // 1024} KiB); "
                              f"{KINDS}")
    return TextFile(path)


class Stdlib:
    def names(self) -> Iterator[str]:
        return (name for name, _ in stdlib_documents())

    def documents(self) -> Iterator[tuple[str, str]]:
        return stdlib_documents()


class TextFile:
    def __init__(self, path: Path):
        self.path = path

    def names(self) -> Iterator[str]:
        yield str(self.path)

    def documents(self) -> Iterator[tuple[str, str]]:
        yield str(self.path), self.path.read_text(encoding="utf-8", errors="replace")


class JsonLines:
    def __init__(self, path: Path, text_key: str):
        self.path, self.text_key = path, text_key

    def names(self) -> Iterator[str]:
        with self.path.open(encoding="utf-8", errors="replace") as f:
            yield from (f"{self.path}:{i}" for i, line in enumerate(f) if line.strip())

    def documents(self) -> Iterator[tuple[str, str]]:
        with self.path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict) or not isinstance(record.get(self.text_key), str):
                        raise ConfigError(f"{self.path}:{i + 1}: no text field {self.text_key!r} (choose the "
                                          f"field with --json-key)")
                    yield f"{self.path}:{i}", record[self.text_key]


class ParquetFile:
    """Rows of a parquet file, BATCH_ROWS at a time, only the text column decoded."""

    def __init__(self, path: Path, text_key: str):
        self.path, self.text_key = path, text_key
        schema = self._open().schema_arrow
        if text_key not in schema.names:
            raise ConfigError(f"input {path}: no column {text_key!r} (its columns: {', '.join(schema.names)}); "
                              f"choose the text column with --text-key")
        kind = schema.field(text_key).type
        if not _is_arrow_text(kind):
            raise ConfigError(f"input {path}: column {text_key!r} holds {kind}, not text; choose a text column "
                              f"with --text-key (its text columns: {_listed(_arrow_text_columns(schema))})")

    def _open(self):
        pq = _reader_module("pyarrow.parquet", "pyarrow", self.path)
        try:
            return pq.ParquetFile(self.path)
        except Exception as e:  # pyarrow.ArrowInvalid and kin: not a parquet file, or a damaged one
            raise ConfigError(f"input {self.path}: not a readable parquet file ({str(e).splitlines()[0]})") from e

    def names(self) -> Iterator[str]:
        return (f"{self.path}:{row}" for row in range(self._open().metadata.num_rows))

    def documents(self) -> Iterator[tuple[str, str]]:
        batches = self._open().iter_batches(batch_size=BATCH_ROWS, columns=[self.text_key])
        texts = (text for batch in batches for text in batch.column(0).to_pylist())
        return _named_rows(str(self.path), texts, self.text_key)


class SavedDataset:
    """Rows of a `datasets` Dataset, or of the splits of a DatasetDict, saved by save_to_disk;
    memory-mapped Arrow files read BATCH_ROWS rows at a time."""

    def __init__(self, path: Path, text_key: str, split: str | None):
        datasets = _reader_module("datasets", "datasets", path)
        self.text_key = text_key
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split is not None and split not in loaded:
                raise ConfigError(f"input {path}: no split {split!r} (its splits: {_listed(loaded)}); choose one "
                                  f"with --split, or leave it out to take them all")
            self.parts = [(path / s, loaded[s]) for s in ([split] if split is not None else list(loaded))]
        else:
            self.parts = [(path, loaded)]
        for where, dataset in self.parts:
            features = dataset.features
            if text_key not in features:
                raise ConfigError(f"input {where}: no column {text_key!r} (its columns: {_listed(features)}); "
                                  f"choose the text column with --text-key")
            if getattr(features[text_key], "dtype", None) not in ("string", "large_string"):
                text = [name for name, f in features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
                raise ConfigError(f"input {where}: column {text_key!r} holds {features[text_key]}, not text; choose "
                                  f"a text column with --text-key (its text columns: {_listed(text)})")

    def names(self) -> Iterator[str]:
        return (f"{where}:{row}" for where, dataset in self.parts for row in range(dataset.num_rows))

    def documents(self) -> Iterator[tuple[str, str]]:
        for where, dataset in self.parts:
            batches = dataset.select_columns([self.text_key]).iter(batch_size=BATCH_ROWS)
            yield from _named_rows(str(where), (text for batch in batches for text in batch[self.text_key]),
                                   self.text_key)


def _named_rows(where: str, texts: Iterator[str | None], text_key: str) -> Iterator[tuple[str, str]]:
    """(WHERE:ROW, text) of a table's rows; a null refused (its row is named, as names() counted it)."""
    for row, text in enumerate(texts):
        if text is None:
            raise ConfigError(f"{where}:{row}: column {text_key!r} is null in this row; drop such rows or choose "
                              f"another column with --text-key")
        yield f"{where}:{row}", text


def _reader_module(module: str, package: str, path: Path):
    """`module`, or one line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"input {path}: reading it needs {package}, which is not installed: "
                          f"pip install 'moetron[data]'") from e


def _is_arrow_text(kind) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    is_view = getattr(pa.types, "is_string_view", lambda kind: False)  # pyarrow >= 16
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)


def _arrow_text_columns(schema) -> list[str]:
    return [field.name for field in schema if _is_arrow_text(field.type)]


def _listed(names) -> str:
    return ", ".join(names) or "none"

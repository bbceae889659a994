"""Text in, token windows out: the embedded corpus, token shards on disk, and a resumable sampler.

Token shards (written by `moetron data prepare … --out PREFIX`):
  PREFIX.json              header: {"format": "moetron.tokens", "version": 1, "dtype": "uint16"|"uint32",
                           "vocab_size", "eos_id", "tokenizer": {...}, "splits": {"train": [{"file", "tokens",
                           "documents"}], "val": [...]}}
  PREFIX.train-00000.bin   little-endian token ids, each document followed by eos_id; likewise .val-*.bin
A document goes to validation when crc32(its name) falls in the lowest `val_fraction` of the range,
so the split never changes with the order or number of inputs.
"""

from __future__ import annotations

import json
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from moetron.launcher.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_spec

TEST_FOLDERS = {"test", "tests", "idle_test"}
THIRD_PARTY_FOLDERS = {"site-packages", "dist-packages"}


def stdlib_documents() -> Iterator[tuple[str, str]]:
    """(name, text) of every .py file of the running interpreter's standard library, test folders
    and third-party packages excluded, in sorted order: real text on every machine, no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for rel in sorted(_stdlib_sources(root), key=lambda r: r.parts):
        try:
            text = (root / rel).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:  # removed since the walk (e.g. by a pip running beside us)
            continue
        yield str(rel), text


def _stdlib_sources(root: Path) -> Iterator[Path]:
    """.py files under `root`, relative to it, never entering site-packages or test folders:
    with torch and transformers installed, site-packages is most of the tree."""
    for folder, subfolders, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        subfolders[:] = [d for d in subfolders if d not in TEST_FOLDERS
                         and not (rel == Path(".") and d in THIRD_PARTY_FOLDERS)]
        yield from (rel / f for f in files if f.endswith(".py"))


def is_validation(name: str, val_fraction: float) -> bool:
    return zlib.crc32(name.encode()) < val_fraction * 2**32


def tokenize_split(docs: Iterable[tuple[str, str]], tok: Tokenizer, val_fraction: float) -> dict[str, np.ndarray]:
    """Concatenate documents (each closed by eos) into one token array per split."""
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for name, text in docs:
        split = parts["val" if is_validation(name, val_fraction) else "train"]
        split += [tok.encode_array(text).astype(dtype), np.array([tok.eos_id], dtype=dtype)]
    return {k: np.concatenate(v) if v else np.zeros(0, dtype) for k, v in parts.items()}


def read_documents(paths: Iterable[str | Path], text_key: str = "text") -> Iterator[tuple[str, str]]:
    """Documents of text files (one per file) and jsonl files (one per line, field `text_key`)."""
    for p in paths:
        p = Path(p)
        if p.suffix == ".jsonl":
            with p.open(encoding="utf-8") as f:
                for i, line in enumerate(f):
                    if line.strip():
                        yield f"{p}:{i}", json.loads(line)[text_key]
        else:
            yield str(p), p.read_text(encoding="utf-8", errors="replace")


def write_shards(prefix: str | Path, splits: dict[str, np.ndarray], tok: Tokenizer, *,
                 shard_tokens: int = 1 << 28, documents: dict[str, int] | None = None) -> Path:
    """Write token shards and the header describing them; the header is written last, so a
    prefix with a header is always complete."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    header = {"format": "moetron.tokens", "version": 1, "dtype": np.dtype(splits["train"].dtype).name,
              "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "tokenizer": tokenizer_spec(tok, prefix.parent), "splits": {}}
    for split, tokens in splits.items():
        entries = []
        for i, start in enumerate(range(0, max(len(tokens), 1), shard_tokens)):
            chunk = tokens[start : start + shard_tokens]
            name = f"{prefix.name}.{split}-{i:05d}.bin"
            chunk.astype(chunk.dtype.newbyteorder("<"), copy=False).tofile(prefix.parent / name)
            entries.append({"file": name, "tokens": int(len(chunk))})
        header["splits"][split] = entries
        header.setdefault("documents", {})[split] = (documents or {}).get(split)
    header_path = prefix.with_name(prefix.name + ".json")
    tmp = header_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(header, indent=1))
    tmp.replace(header_path)
    return header_path


@dataclass
class TokenData:
    """Both splits as lists of (memory-mapped) token arrays, and the tokenizer that made them."""

    train: list[np.ndarray]
    val: list[np.ndarray]
    tokenizer: Tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def load_token_data(source: str, tokenizer: str = "byte", val_fraction: float = 0.02) -> TokenData:
    """"stdlib" tokenizes the embedded corpus in memory; anything else is a shard PREFIX."""
    if source == "stdlib":
        tok = load_tokenizer(tokenizer)
        splits = tokenize_split(stdlib_documents(), tok, val_fraction)
        return TokenData([splits["train"]], [splits["val"]], tok)
    header_path = Path(source + ".json")
    if not header_path.is_file():
        raise FileNotFoundError(f"data.source {source!r}: neither 'stdlib' nor a token-shard prefix "
                                f"({header_path} missing; write one with `moetron data prepare`)")
    header = json.loads(header_path.read_text())
    if header.get("format") != "moetron.tokens":
        raise ValueError(f"{header_path}: not a moetron token-shard header")
    dtype = np.dtype(header["dtype"]).newbyteorder("<")

    def open_split(split: str) -> list[np.ndarray]:
        return [np.memmap(header_path.parent / e["file"], dtype=dtype, mode="r", shape=(e["tokens"],))
                for e in header["splits"][split] if e["tokens"]]

    return TokenData(open_split("train"), open_split("val"), load_tokenizer(header["tokenizer"], header_path.parent))


class WindowSampler:
    """Hands out windows of `seq_len + 1` tokens (inputs and shifted targets) in a seeded random
    order, epoch after epoch. Its whole state is (epoch, index): saved with a checkpoint and
    restored, it continues with exactly the windows an uninterrupted run would have seen.

    Every rank walks the same global order, but reads only its part of each batch (`next_batch`'s
    rows and spans), so reading, host memory and the copy to the device shrink with the layout
    while the state, and so a resume under any other layout, stays that of the global batch.
    `tokens_read` counts the tokens this sampler has gathered from the shards.
    """

    def __init__(self, shards: list[np.ndarray], seq_len: int, seed: int):
        self.shards, self.seq_len, self.seed = shards, seq_len, seed
        # Windows start every seq_len tokens and never cross a shard boundary.
        self.per_shard = [max((len(s) - 1) // seq_len, 0) for s in shards]
        self.first = np.cumsum([0] + self.per_shard)
        self.num_windows = int(self.first[-1])
        if self.num_windows == 0:
            raise ValueError(f"not enough tokens for one window of {seq_len + 1}")
        self.epoch, self.index = 0, 0
        self.tokens_read = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def _locate(self, w: int) -> tuple[np.ndarray, int]:
        """The shard holding window w and the window's first token in it."""
        shard = int(np.searchsorted(self.first, w, side="right") - 1)
        return self.shards[shard], (w - int(self.first[shard])) * self.seq_len

    def window(self, w: int) -> np.ndarray:
        shard, start = self._locate(w)
        self.tokens_read += self.seq_len + 1
        return np.asarray(shard[start : start + self.seq_len + 1], dtype=np.int64)

    def next_windows(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.index == self.num_windows:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(int(self._order[self.index]))
            self.index += 1
        return out

    def next_batch(self, n: int, rows: slice | None = None,
                   spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """The next n windows of the global order, of which only `rows` are read (a data-parallel
        rank's slice of the batch; all of them by default) and of each only the token `spans`
        ((start, stop) offsets into its seq_len + 1 tokens: a context-parallel rank's chunks;
        the whole window by default). The state moves past all n windows whatever is read.

        → (rows, seq_len + 1) int64, or with spans (rows, len(spans), stop − start): equal to
        `next_batch(n)[rows]` cut at the spans.
        """
        windows = self.next_windows(n)[rows if rows is not None else slice(None)]
        pieces = spans if spans is not None else [(0, self.seq_len + 1)]
        widths = {stop - start for start, stop in pieces}
        if len(widths) != 1 or not all(0 <= a < b <= self.seq_len + 1 for a, b in pieces):
            raise ValueError(f"spans {spans}: need pieces of one width within a window's {self.seq_len + 1} tokens")
        # Filled in place: the batch is the only copy of the tokens held here (no list to stack).
        out_RPL = np.empty((len(windows), len(pieces), widths.pop()), dtype=np.int64)
        for i, w in enumerate(windows):
            shard, start = self._locate(w)
            for j, (a, b) in enumerate(pieces):
                out_RPL[i, j] = shard[start + a : start + b]
        self.tokens_read += out_RPL.size
        return torch.from_numpy(out_RPL if spans is not None else out_RPL[:, 0])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if (state["seed"], state["seq_len"]) != (self.seed, self.seq_len):
            raise ValueError(f"sampler state is for seed {state['seed']}, seq_len {state['seq_len']}; "
                             f"this run has seed {self.seed}, seq_len {self.seq_len}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


def validation_batches(shards: list[np.ndarray], seq_len: int, batch: int, n_batches: int, *,
                       rows: Callable[[int], slice] | None = None,
                       spans: list[tuple[int, int]] | None = None) -> list[torch.Tensor]:
    """A fixed set of validation windows, the same at every evaluation (seeded, not advancing).
    rows(size) and spans pick the part of each batch this rank reads, as in `WindowSampler.next_batch`."""
    sampler = WindowSampler(shards, seq_len, seed=12345)
    n = min(batch * n_batches, sampler.num_windows)
    sizes = [min(batch, n - i) for i in range(0, n, batch)]
    return [sampler.next_batch(size, rows(size) if rows else None, spans) for size in sizes]


def window_shortage(split: str, lengths: list[int], seq_len: int) -> str | None:
    """Why a split's token shards (their lengths) hold no window of seq_len + 1 tokens, the unit
    `WindowSampler` hands out (a window never crosses a shard's end), as one phrase with the
    numbers and the way out; None when they hold one."""
    longest = max(lengths, default=0)
    if longest >= seq_len + 1:
        return None
    shards = f" (the longest of its {len(lengths)} shards {longest:,})" if len(lengths) > 1 else ""
    needed = f"one window of train.seq_len + 1 = {seq_len + 1:,} tokens is needed"
    fix = f"train.seq_len={longest - 1} or less, or prepare more text" if longest > 1 else "prepare more text"
    more = " (or a larger --val-fraction)" if split == "validation" else ""
    return f"the {split} split holds {sum(lengths):,} tokens{shards}; {needed}: use {fix}{more}"

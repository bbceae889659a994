"""Text in, token windows out: the embedded corpus, Megatron indexed corpora on disk
(launcher/data/indexed.py), and a resumable sampler of one corpus (a blend of several: blend.py).

`moetron data prepare` sends a document to validation when crc32(its name) falls in the lowest
`val_fraction` of the range, so the split never changes with the order or number of inputs; it
writes the training documents first and the held-out ones last, and records how many it held
out. A corpus from another writer holds out its last documents (Megatron's train/valid order).
"""

from __future__ import annotations

import json
import os
import sysconfig
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moetron.launcher.config import ConfigError
from moetron.launcher.data.indexed import IndexedWriter, read_indexed, read_sidecar, token_dtype
from moetron.launcher.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_spec

VALIDATION_SEED = 12345
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


def write_shards(prefix: str | Path, splits: dict[str, np.ndarray], tok: Tokenizer) -> Path:
    """Write whole split arrays as a Megatron indexed corpus (launcher/data/indexed.py): the train
    tokens as one document, then the validation tokens as the one held-out document. → PREFIX.idx"""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    writer = IndexedWriter(prefix, token_dtype(tok.vocab_size))
    for split in ("train", "val"):
        writer.add(splits[split])
    return writer.finish(sidecar_for(tok, prefix, {"train": 1, "val": 1}, writer.max_id))


def sidecar_for(tok: Tokenizer, prefix: Path, documents: dict[str, int], max_id: int) -> dict:
    """What PREFIX.json records beside an indexed corpus `moetron data prepare` wrote."""
    return {"tokenizer": tokenizer_spec(tok, prefix.parent), "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "documents": documents, "max_token_id": max_id}


@dataclass
class Source:
    """One corpus of a run: its splits as lists of (memory-mapped) token arrays, its blend weight,
    and the largest token id its writer recorded (None when unknown)."""

    name: str
    prefix: str
    weight: float
    train: list[np.ndarray]
    val: list[np.ndarray]
    max_id: int | None = None


@dataclass
class TokenData:
    """A run's sources (one, or a blend's) and the tokenizer that made them."""

    sources: list[Source]
    tokenizer: Tokenizer

    @property
    def train(self) -> list[np.ndarray]:
        return [a for s in self.sources for a in s.train]

    @property
    def val(self) -> list[np.ndarray]:
        return [a for s in self.sources for a in s.val]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def load_token_data(source: str, tokenizer: str = "byte", val_fraction: float = 0.02,
                    blend: list[tuple[float, str]] | None = None) -> TokenData:
    """"stdlib" tokenizes the embedded corpus in memory; anything else is the PREFIX of a Megatron
    indexed corpus, or `blend` names several as (weight, PREFIX). A prefix `moetron data prepare`
    wrote carries its tokenizer and split (PREFIX.json); another writer's takes `tokenizer` and
    holds out its last `val_fraction` of documents."""
    if blend is None and source == "stdlib":
        tok = load_tokenizer(tokenizer)
        splits = tokenize_split(stdlib_documents(), tok, val_fraction)
        return TokenData([Source("stdlib", "stdlib", 1.0, [splits["train"]], [splits["val"]])], tok)
    pairs = blend if blend is not None else [(1.0, source)]
    loaded = [_load_prefix(prefix, weight, val_fraction) for weight, prefix in pairs]
    specs = {json.dumps(spec, sort_keys=True): (spec, prefix) for (_, spec), (_, prefix) in zip(loaded, pairs) if spec}
    if len(specs) > 1:
        (a, pa), (b, pb) = list(specs.values())[:2]
        raise ConfigError(f"data.blend: {pa} and {pb} were tokenized differently ({a} vs {b}); a blend needs "
                          f"one tokenizer")
    if specs:
        spec, prefix = next(iter(specs.values()))
        tok = load_tokenizer(spec, Path(prefix).parent)
    else:
        tok = load_tokenizer(tokenizer)
    return TokenData([s for s, _ in loaded], tok)


def _load_prefix(prefix: str, weight: float, val_fraction: float) -> tuple[Source, dict | None]:
    """One indexed corpus as a Source, and the tokenizer its sidecar names (None without one)."""
    sidecar = read_sidecar(prefix)
    corpus = read_indexed(prefix)
    if sidecar is not None:
        held_out = int(sidecar["documents"]["val"])
    else:
        held_out = max(1, round(corpus.documents * val_fraction))
        if corpus.documents < 2:
            raise ConfigError(f"{prefix}: {corpus.documents} document(s); a validation split held out by "
                              f"documents needs at least 2")
    train, val = corpus.split(min(held_out, corpus.documents))
    max_id = sidecar.get("max_token_id") if sidecar else None
    return Source(Path(prefix).name, prefix, weight, [train], [val], max_id), (sidecar or {}).get("tokenizer")


class WindowSampler:
    """Hands out windows of `seq_len + 1` tokens (inputs and shifted targets) in a seeded random
    order, epoch after epoch. Its whole state is (epoch, index): saved with a checkpoint and
    restored, it continues with exactly the windows an uninterrupted run would have seen.

    Every rank walks the same global order, but reads only its part of each batch (`next_batch`'s
    rows and spans), so reading, host memory and the copy to the device shrink with the layout
    while the state, and so a resume under any other layout, stays that of the global batch.
    `tokens_read` counts the tokens this sampler has gathered from the shards.
    """

    def __init__(self, shards: list[np.ndarray], seq_len: int, seed: int, stream: int = 0):
        # `stream` tells apart the orders of a blend's sources under one seed; 0 is a lone corpus's.
        self.shards, self.seq_len, self.seed, self.stream = shards, seq_len, seed, stream
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
        key = [self.seed, epoch] if self.stream == 0 else [self.seed, epoch, self.stream]
        return np.random.default_rng(key).permutation(self.num_windows)

    @property
    def drawn(self) -> int:
        """Windows handed out so far, over all epochs."""
        return self.epoch * self.num_windows + self.index

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
        return read_windows([(self, w) for w in windows], self.seq_len, spans)

    def read_into(self, out_PL: np.ndarray, w: int, pieces: list[tuple[int, int]]) -> None:
        """Copy the `pieces` of window w into out_PL (len(pieces), width)."""
        shard, start = self._locate(w)
        for j, (a, b) in enumerate(pieces):
            out_PL[j] = shard[start + a : start + b]
        self.tokens_read += out_PL.size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if (state["seed"], state["seq_len"]) != (self.seed, self.seq_len):
            raise ValueError(f"sampler state is for seed {state['seed']}, seq_len {state['seq_len']}; "
                             f"this run has seed {self.seed}, seq_len {self.seq_len}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


def window_pieces(spans: list[tuple[int, int]] | None, seq_len: int) -> tuple[list[tuple[int, int]], int]:
    """The (start, stop) pieces of a window of seq_len + 1 tokens to read (the whole window when
    `spans` is None) and their common width."""
    pieces = spans if spans is not None else [(0, seq_len + 1)]
    widths = {stop - start for start, stop in pieces}
    if len(widths) != 1 or not all(0 <= a < b <= seq_len + 1 for a, b in pieces):
        raise ValueError(f"spans {spans}: need pieces of one width within a window's {seq_len + 1} tokens")
    return pieces, widths.pop()


def read_windows(picks: list[tuple[WindowSampler, int]], seq_len: int,
                 spans: list[tuple[int, int]] | None) -> torch.Tensor:
    """Window w of its sampler's corpus for each (sampler, w) of `picks`, cut at `spans`.
    → (len(picks), seq_len + 1) int64, or (len(picks), len(spans), width)."""
    pieces, width = window_pieces(spans, seq_len)
    # Filled in place: the batch is the only copy of the tokens held here (no list to stack).
    out_RPL = np.empty((len(picks), len(pieces), width), dtype=np.int64)
    for i, (sampler, w) in enumerate(picks):
        sampler.read_into(out_RPL[i], w, pieces)
    return torch.from_numpy(out_RPL if spans is not None else out_RPL[:, 0])


def validation_batches(shards: list[np.ndarray], seq_len: int, batch: int, n_batches: int, *,
                       rows: Callable[[int], slice] | None = None,
                       spans: list[tuple[int, int]] | None = None) -> list[torch.Tensor]:
    """A fixed set of validation windows, the same at every evaluation (seeded, not advancing).
    rows(size) and spans pick the part of each batch this rank reads, as in `WindowSampler.next_batch`."""
    return fixed_batches(WindowSampler(shards, seq_len, seed=VALIDATION_SEED), batch, n_batches, rows, spans)


def fixed_batches(sampler, batch: int, n_batches: int, rows: Callable[[int], slice] | None,
                  spans: list[tuple[int, int]] | None) -> list[torch.Tensor]:
    """The first n_batches batches of a fresh `sampler` (at most one epoch of its windows)."""
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

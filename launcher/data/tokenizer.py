"""Tokenizers: bytes by default, or a Hugging Face `tokenizers` BPE (trained here or the user's)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and 256 as end-of-document. Loss per token is then nats per byte."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer.json; its end-of-text token is the first of </s>, <|endoftext|>, <eos>."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        self.path = Path(path)
        self.name = str(self.path)
        self._tok = _Tok.from_file(str(self.path))
        self.vocab_size = self._tok.get_vocab_size()
        vocab = self._tok.get_vocab()
        eos = next((t for t in ("</s>", "<|endoftext|>", "<eos>") if t in vocab), None)
        if eos is None:
            raise ValueError(f"{path}: no end-of-text token (one of </s>, <|endoftext|>, <eos>)")
        self.eos_id = vocab[eos]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str | Path) -> HFTokenizer:
    """Train a byte-level BPE on `texts` and save it as tokenizer.json."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out_path))
    return HFTokenizer(out_path)


def load_tokenizer(spec: str | dict, base: Path | None = None) -> Tokenizer:
    """"byte", a tokenizer.json path, or the `tokenizer` entry of a token-shard header; a relative
    path in a header is relative to the header's folder (`base`)."""
    if isinstance(spec, dict):
        spec = spec["path"] if spec.get("kind") == "tokenizers" else spec.get("kind", "byte")
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec) if base is None else base / spec
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {spec!r}: not 'byte' and no such tokenizer.json")
    return HFTokenizer(path)


def tokenizer_spec(tok: Tokenizer, relative_to: Path) -> dict:
    """What a token-shard header in the folder `relative_to` records to reload `tok`. The path is
    relative to that folder, so shards copied elsewhere together with their tokenizer still find it."""
    if isinstance(tok, ByteTokenizer):
        return {"kind": "byte"}
    return {"kind": "tokenizers", "path": os.path.relpath(Path(tok.name).resolve(), Path(relative_to).resolve())}


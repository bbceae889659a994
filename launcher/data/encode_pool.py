"""Tokenizing documents in worker processes, in their order: what lets `moetron data prepare` use
every core while its one writer stays in the main process.

Documents go to the workers in chunks (CHUNK_DOCUMENTS documents or CHUNK_CHARS characters,
whichever comes first) and come back in the order they were sent, so the corpus is byte for byte
the same whatever the number of workers. At most IN_FLIGHT chunks per worker are out at a time:
reading stays ahead of the workers without holding the corpus in memory (`Pool.imap` would read its
whole input ahead). Input that fits one chunk is tokenized in the main process: starting workers
would cost more than it saves.

Workers are spawned, not forked: the parent has torch loaded and, on a terminal, the progress bar's
thread running; a fresh interpreter imports numpy and the tokenizer (and the parent's main module,
which for `moetron` imports nothing more), and loads the tokenizer once by name (`Tokenizer.name`:
"byte" or a tokenizer.json, what `load_tokenizer` takes).
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from moetron.launcher.data.tokenizer import Tokenizer, load_tokenizer

CHUNK_DOCUMENTS = 256
CHUNK_CHARS = 1 << 20
IN_FLIGHT = 2


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity, which Slurm and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def encode_in_order(docs: Iterable[tuple[str, str]], tok: Tokenizer, dtype: np.dtype,
                    workers: int) -> Iterator[tuple[str, np.ndarray]]:
    """(name, token ids closed by tok.eos_id, as `dtype`) of each document, in the order given,
    tokenized by `workers` processes (1: in this one). An id is a view into its chunk's array."""
    chunks = _chunks(docs)
    head = list(itertools.islice(chunks, 2))
    if workers <= 1 or len(head) < 2:
        for names, texts in itertools.chain(head, chunks):
            yield from zip(names, _split(encode_texts(tok, texts, dtype)))
        return
    # A worker that dies (killed for memory, or unable to start) fails the prepare with
    # BrokenProcessPool instead of leaving it waiting, as multiprocessing.Pool would.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        pending: deque = deque()
        for names, texts in itertools.chain(head, chunks):
            pending.append((names, pool.submit(_encode_in_worker, tok.name, texts, dtype)))
            if len(pending) >= IN_FLIGHT * workers:
                names, future = pending.popleft()
                yield from zip(names, _split(future.result()))
        while pending:
            names, future = pending.popleft()
            yield from zip(names, _split(future.result()))
    finally:
        pool.shutdown(cancel_futures=True)


def encode_texts(tok: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Each text's ids and end-of-text, all in one array (one object to send back), and their lengths."""
    eos = np.array([tok.eos_id], dtype=dtype)
    pieces = [piece for text in texts for piece in (tok.encode_array(text).astype(dtype, copy=False), eos)]
    lengths = np.array([len(piece) + 1 for piece in pieces[::2]], dtype=np.int64)
    return np.concatenate(pieces), lengths


def _encode_in_worker(tokenizer: str, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    return encode_texts(_worker_tokenizer(tokenizer), texts, dtype)


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(name: str) -> Tokenizer:
    """A worker's tokenizer: loaded with its first chunk, kept for the rest."""
    return load_tokenizer(name)


def _chunks(docs: Iterable[tuple[str, str]]) -> Iterator[tuple[list[str], list[str]]]:
    """(names, texts) of consecutive documents, CHUNK_DOCUMENTS or CHUNK_CHARS at most (a longer
    document alone)."""
    names: list[str] = []
    texts: list[str] = []
    chars = 0
    for name, text in docs:
        if names and (len(names) == CHUNK_DOCUMENTS or chars + len(text) > CHUNK_CHARS):
            yield names, texts
            names, texts, chars = [], [], 0
        names.append(name)
        texts.append(text)
        chars += len(text)
    if names:
        yield names, texts


def _split(encoded: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray]:
    flat, lengths = encoded
    return np.split(flat, np.cumsum(lengths)[:-1])

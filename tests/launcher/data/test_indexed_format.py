"""Megatron's indexed format: what megatron-core's own IndexedDatasetBuilder writes is read here
in every dtype it writes, in place; what `moetron data prepare` writes is byte for byte what that
builder writes for the same documents, and megatron-core's IndexedDataset reads it back."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from moetron.launcher.cli.main import main
from moetron.launcher.data.corpus import is_validation, load_token_data
from moetron.launcher.data.indexed import DTYPES, read_indexed


def megatron_indexed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def test_every_dtype_megatron_writes_is_read_in_place(tmp_path):
    """Documents of one and of several sequences (add_item + end_document), an empty sequence,
    and ids at each dtype's extremes, in all eight of Megatron's dtype codes."""
    import torch

    m = megatron_indexed()
    rng = np.random.default_rng(0)
    for code, dtype in DTYPES.items():
        info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None
        hi = min(info.max, 60_000) if info else 60_000
        lo = max(info.min, -5) if info else -5
        docs = [[rng.integers(lo, hi, size=n).astype(dtype) for n in lengths]
                for lengths in ([7], [3, 0, 5], [1], [11, 2])]
        docs[0][0][:2] = [hi, lo]
        prefix = str(tmp_path / f"c{code}")
        builder = m.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for doc in docs:
            for seq in doc:
                builder.add_item(torch.from_numpy(seq))
            builder.end_document()
        builder.finalize(prefix + ".idx")
        assert Path(prefix + ".idx").read_bytes()[17] == code  # the header's dtype code

        corpus = read_indexed(prefix)
        assert isinstance(corpus.tokens, np.memmap) and corpus.tokens.dtype == np.dtype(dtype)
        whole = [np.concatenate(doc) for doc in docs]
        assert np.array_equal(corpus.tokens, np.concatenate(whole))
        assert corpus.documents == 4
        for d, doc in enumerate(whole):
            assert np.array_equal(corpus.tokens[corpus.doc_starts[d]:corpus.doc_starts[d + 1]], doc)
        train, val = corpus.split(1)  # the last document held out, as Megatron's train/valid order
        assert np.array_equal(val, whole[-1]) and np.array_equal(train, np.concatenate(whole[:-1]))


def test_prepare_writes_what_megatron_writes_and_megatron_reads_it(tmp_path, monkeypatch):
    m = megatron_indexed()
    monkeypatch.chdir(tmp_path)
    texts = [f"record {i} ünïcode " * (1 + i % 5) for i in range(120)]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"body": t, "text": 0}) for t in texts))
    assert main(["data", "prepare", "in.jsonl", "--out", "out/ours", "--json-key", "body",
                 "--val-fraction", "0.1"]) == 0
    # The same documents through megatron-core's builder: training documents, then held-out ones,
    # each closed by the byte tokenizer's end-of-text 256, in Megatron's dtype for 257 ids.
    names = [f"in.jsonl:{i}" for i in range(len(texts))]
    order = [i for i in range(len(texts)) if not is_validation(names[i], 0.1)]
    held = [i for i in range(len(texts)) if is_validation(names[i], 0.1)]
    assert 0 < len(held) < 30
    builder = m.IndexedDatasetBuilder("theirs.bin", dtype=np.uint16)
    docs = [np.append(np.frombuffer(texts[i].encode(), np.uint8), 256) for i in order + held]
    for doc in docs:
        builder.add_document(doc.astype(np.int64), [len(doc)])
    builder.finalize("theirs.idx")
    for ext in (".bin", ".idx"):
        assert (tmp_path / "out" / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()

    dataset = m.IndexedDataset("out/ours")
    assert len(dataset) == len(texts)
    assert all(np.array_equal(dataset.get(d), doc) for d, doc in enumerate(docs))
    # PREFIX.json says how many trailing documents are validation; training reads them apart.
    data = load_token_data("out/ours")
    assert json.loads((tmp_path / "out" / "ours.json").read_text())["documents"] == {"train": len(order),
                                                                                   "val": len(held)}
    assert np.array_equal(data.val[0], np.concatenate(docs[len(order):]))
    assert np.array_equal(data.train[0], np.concatenate(docs[:len(order)]))


def test_a_corpus_from_another_writer_holds_out_its_last_documents(tmp_path):
    """No PREFIX.json: data.tokenizer names the tokenizer and the last val_fraction of documents
    (at least one) are validation."""
    from moetron.launcher.data.indexed import IndexedWriter

    writer = IndexedWriter(tmp_path / "c", np.uint16)
    docs = [np.full(10 + d, d, np.uint16) for d in range(20)]
    for doc in docs:
        writer.add(doc)
    writer.finish()
    data = load_token_data(str(tmp_path / "c"), val_fraction=0.1)
    assert np.array_equal(data.val[0], np.concatenate(docs[18:]))
    assert np.array_equal(data.train[0], np.concatenate(docs[:18]))
    assert data.tokenizer.name == "byte" and data.sources[0].max_id is None


"""`moetron data prepare` on parquet files and `datasets` folders, with worker processes, and what
it refuses. The tokens are read back with megatron-core's own IndexedDataset (the oracle), each
document found by its name: a document's split follows its name, so the row order is rebuilt from
the names the input gives (PATH:ROW, PATH/SPLIT:ROW for a DatasetDict's split)."""

import json
import sys
import warnings

import numpy as np
import pytest

from moetron.launcher.cli.main import main
from moetron.launcher.data.corpus import is_validation
from moetron.launcher.data.encode_pool import CHUNK_DOCUMENTS

TEXTS = [f"record {i} ünïcode " * (1 + i % 5) for i in range(120)]
VAL = 0.1


def megatron_indexed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def by_name(prefix: str, names: list[str]) -> dict[str, np.ndarray]:
    """Each document of the corpus at `prefix`, read by megatron-core, under the name it was given:
    prepare writes the training documents in input order, then the held-out ones."""
    dataset = megatron_indexed().IndexedDataset(prefix)
    order = [n for n in names if not is_validation(n, VAL)] + [n for n in names if is_validation(n, VAL)]
    assert len(dataset) == len(order)
    # Copies: megatron-core unmaps its files when the dataset goes, and its arrays are views of them.
    return {name: np.array(dataset.get(d)) for d, name in enumerate(order)}


def expected(texts: list[str]) -> list[np.ndarray]:
    """The byte tokenizer's ids, closed by end-of-text 256."""
    return [np.append(np.frombuffer(t.encode(), np.uint8), 256) for t in texts]


def prepare(*args: str) -> int:
    return main(["data", "prepare", *args, "--val-fraction", str(VAL), "--workers", "1"])


def test_parquet_gives_the_tokens_of_the_same_jsonl(tmp_path, monkeypatch):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in TEXTS))
    # Several row groups, and a column beside the text that is never read.
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "body": TEXTS}), "in.parquet", row_group_size=50)
    for name in ("in.jsonl", "in.parquet"):
        assert prepare(name, "--out", f"out/{name}", "--text-key", "body") == 0
    jsonl, parquet = (by_name(f"out/{name}", [f"{name}:{i}" for i in range(len(TEXTS))])
                      for name in ("in.jsonl", "in.parquet"))
    for i, want in enumerate(expected(TEXTS)):
        assert np.array_equal(parquet[f"in.parquet:{i}"], jsonl[f"in.jsonl:{i}"])
        assert np.array_equal(parquet[f"in.parquet:{i}"], want)
    header = json.loads((tmp_path / "out" / "in.parquet.json").read_text())
    held = sum(is_validation(f"in.parquet:{i}", VAL) for i in range(len(TEXTS)))
    assert header["documents"] == {"train": len(TEXTS) - held, "val": held} and 0 < held


def test_saved_datasets_give_the_tokens_of_their_rows(tmp_path, monkeypatch):
    """A Dataset folder, a DatasetDict folder (all splits, one --split) and that split's own folder:
    every row's tokens, a split's rows named alike either way."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.chdir(tmp_path)
    datasets.Dataset.from_dict({"text": TEXTS, "n": list(range(len(TEXTS)))}).save_to_disk("ds")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:80]}),
                          "test": datasets.Dataset.from_dict({"text": TEXTS[80:]})}).save_to_disk("dd")
    want = expected(TEXTS)

    assert prepare("ds", "--out", "out/ds") == 0
    docs = by_name("out/ds", [f"ds:{i}" for i in range(len(TEXTS))])
    assert all(np.array_equal(docs[f"ds:{i}"], want[i]) for i in range(len(TEXTS)))

    assert prepare("dd", "--out", "out/dd") == 0
    names = [f"dd/train:{i}" for i in range(80)] + [f"dd/test:{i}" for i in range(len(TEXTS) - 80)]
    docs = by_name("out/dd", names)
    assert all(np.array_equal(docs[name], want[i]) for i, name in enumerate(names))

    for args in (["dd", "--split", "test"], ["dd/test"]):
        assert prepare(*args, "--out", "out/test") == 0
        docs = by_name("out/test", names[80:])
        assert all(np.array_equal(docs[name], want[80 + i]) for i, name in enumerate(names[80:]))


def test_any_number_of_workers_writes_the_same_bytes(tmp_path, monkeypatch):
    """More documents than three chunks, so two workers share them, with a BPE tokenizer.json that
    each worker loads by name; the same .bin, .idx and .json as one process."""
    from moetron.launcher.data.tokenizer import train_bpe

    monkeypatch.chdir(tmp_path)
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # ünï\n" * (1 + i % 4)
             for i in range(3 * CHUNK_DOCUMENTS + 9)]
    (tmp_path / "code.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    train_bpe(texts[:50], 300, tmp_path / "tok.json")
    for workers in ("1", "2"):
        assert main(["data", "prepare", "code.jsonl", "--out", f"out/w{workers}", "--tokenizer", "tok.json",
                     "--workers", workers]) == 0
    for ext in (".bin", ".idx", ".json"):
        assert (tmp_path / "out" / f"w1{ext}").read_bytes() == (tmp_path / "out" / f"w2{ext}").read_bytes()


def refused(capsys, tmp_path, *args: str) -> str:
    """The one line a refused prepare prints; it exits 2 and leaves nothing at its --out."""
    capsys.readouterr()
    assert main(["data", "prepare", *args, "--out", str(tmp_path / "out" / "deep" / "c"), "--workers", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    return err


def test_bad_parquet_inputs_are_refused_in_one_line(tmp_path, capsys, monkeypatch):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [1, 2], "content": ["a", "b"]}), path)
    assert "no column 'text' (its columns: id, content); choose the text column with --text-key" in refused(
        capsys, tmp_path, str(path))
    assert "column 'id' holds int64, not text; choose a text column with --text-key (its text columns: content)" in \
        refused(capsys, tmp_path, str(path), "--text-key", "id")
    # A null met halfway: what was written so far is removed, the folders made for it too.
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(2000)] + [None]}), nulls, row_group_size=300)
    assert f"{nulls}:2000: column 'text' is null in this row" in refused(capsys, tmp_path, str(nulls))
    (tmp_path / "fake.parquet").write_text("not parquet")
    assert "fake.parquet: not a readable parquet file (" in refused(capsys, tmp_path, str(tmp_path / "fake.parquet"))
    # Without pyarrow installed, the extra that brings it.
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert "reading it needs pyarrow, which is not installed: pip install 'moetron[data]'" in refused(
        capsys, tmp_path, str(path))


def test_bad_datasets_folders_are_refused_in_one_line(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"content": ["a", "b"]}).save_to_disk(tmp_path / "ds")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(tmp_path / "dd")
    assert "ds: no column 'text' (its columns: content); choose the text column with --text-key" in refused(
        capsys, tmp_path, str(tmp_path / "ds"))
    assert "dd: no split 'valid' (its splits: train); choose one with --split" in refused(
        capsys, tmp_path, str(tmp_path / "dd"), "--split", "valid")


def test_inputs_no_reader_takes_are_refused_in_one_line(tmp_path, capsys):
    kinds = "inputs are text files, .jsonl, .parquet, or a folder written by `datasets`' save_to_disk"
    (tmp_path / "folder").mkdir()
    assert f"folder: a folder, but not one save_to_disk wrote (none of dataset_dict.json, dataset_info.json, " \
           f"state.json in it); {kinds}" in refused(capsys, tmp_path, str(tmp_path / "folder"))
    (tmp_path / "x.bin").write_bytes(b"text\0more")
    assert f"x.bin: binary, not text (a NUL byte in its first 8 KiB); {kinds}" in refused(
        capsys, tmp_path, str(tmp_path / "x.bin"))
    (tmp_path / "x.jsonl.gz").write_bytes(b"\x1f\x8b")
    assert f"x.jsonl.gz: compressed (.gz); decompress it first: {kinds}" in refused(
        capsys, tmp_path, str(tmp_path / "x.jsonl.gz"))
    assert "nope: no such file or folder" in refused(capsys, tmp_path, str(tmp_path / "nope"))
    # A bad record met halfway through a .jsonl: nothing left, as for a refusal before reading.
    (tmp_path / "late.jsonl").write_text("\n".join([json.dumps({"text": f"r{i}"}) for i in range(600)] + ["{}"]))
    assert "late.jsonl:601: no text field 'text'" in refused(capsys, tmp_path, str(tmp_path / "late.jsonl"))

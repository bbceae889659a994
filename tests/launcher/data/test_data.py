"""Corpus, split, token shards and the resumable sampler."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

from moetron.launcher.data.corpus import (
    WindowSampler,
    is_validation,
    load_token_data,
    stdlib_documents,
    tokenize_split,
    validation_batches,
)
from moetron.launcher.data.tokenizer import ByteTokenizer, load_tokenizer


def test_stdlib_corpus_is_the_interpreters_source_without_tests():
    root = Path(sysconfig.get_paths()["stdlib"])
    names = [name for name, _ in stdlib_documents()]
    assert "os.py" in names and "json/decoder.py" in names
    assert not [n for n in names if "/test/" in f"/{n}" or "/tests/" in f"/{n}" or "idle_test" in n]
    expected = sum(1 for p in root.rglob("*.py")
                   if not {"test", "tests", "idle_test"} & set(p.relative_to(root).parts[:-1])
                   and p.relative_to(root).parts[0] not in ("site-packages", "dist-packages"))
    assert len(names) == expected
    assert names == sorted(names)


def test_the_corpus_walk_skips_third_party_and_test_folders(tmp_path):
    from moetron.launcher.data.corpus import _stdlib_sources

    for rel in ("os.py", "json/decoder.py", "site-packages/torch/x.py", "dist-packages/y.py", "test/t.py",
                "idlelib/idle_test/t.py", "json/tests/t.py", "lib2to3/site-packages.py", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    found = sorted(str(p) for p in _stdlib_sources(tmp_path))
    assert found == ["json/decoder.py", "lib2to3/site-packages.py", "os.py"]


def test_split_is_deterministic_and_disjoint():
    docs = [(f"doc{i}", f"text {i} " * 10) for i in range(400)]
    tok = ByteTokenizer()
    a = tokenize_split(docs, tok, 0.1)
    b = tokenize_split(list(reversed(docs))[::-1], tok, 0.1)
    assert np.array_equal(a["train"], b["train"]) and np.array_equal(a["val"], b["val"])
    val_docs = [name for name, _ in docs if is_validation(name, 0.1)]
    assert 10 < len(val_docs) < 80  # ~10% of 400
    # every document ends with eos, so the number of eos tokens counts the documents
    assert (a["val"] == tok.eos_id).sum() == len(val_docs)
    assert (a["train"] == tok.eos_id).sum() == 400 - len(val_docs)


def test_sampler_state_restores_the_exact_sequence():
    shards = [np.arange(1000, dtype=np.uint16), np.arange(5000, 5700, dtype=np.uint16)]
    a = WindowSampler(shards, seq_len=16, seed=3)
    a.next_batch(50)
    state = a.state_dict()
    expected = a.next_batch(200)  # crosses an epoch boundary (104 windows per epoch)
    b = WindowSampler(shards, seq_len=16, seed=3)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert np.array_equal(b.next_batch(200).numpy(), expected.numpy())


def test_every_epoch_draws_each_window_once_in_a_new_order():
    """Each epoch is a permutation of all windows, reshuffled per epoch (as Megatron's GPT dataset
    shuffles each epoch's sample index): repeating one order would replay the same batches."""
    shards = [np.arange(1000, dtype=np.uint16), np.arange(5000, 5700, dtype=np.uint16)]
    s = WindowSampler(shards, seq_len=16, seed=3)
    epochs = [s.next_windows(s.num_windows) for _ in range(3)]
    assert all(sorted(e) == list(range(s.num_windows)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert epochs[0] != WindowSampler(shards, seq_len=16, seed=4).next_windows(s.num_windows)  # the seed counts


def test_windows_are_contiguous_and_never_cross_shards():
    shards = [np.arange(100, dtype=np.uint16), np.arange(1000, 1100, dtype=np.uint16)]
    s = WindowSampler(shards, seq_len=9, seed=0)
    batch = s.next_batch(s.num_windows).numpy()
    assert np.all(np.diff(batch, axis=1) == 1)
    # (100 - 1) // 9 = 11 windows of 10 tokens per shard; the last one ends exactly at the shard's end
    assert sorted(batch[:, 0].tolist()) == [9 * i for i in range(11)] + [1000 + 9 * i for i in range(11)]


def test_validation_batches_are_fixed():
    shards = [np.arange(10_000, dtype=np.uint16)]
    a = validation_batches(shards, 32, 4, 3)
    b = validation_batches(shards, 32, 4, 3)
    assert len(a) == 3 and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_prepare_writes_a_memory_mapped_indexed_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"record {i} ünïcode"}) for i in range(300)))
    out = tmp_path / "out" / "corpus"
    # Named relative to the folder, the documents split the same on every machine (3 held out).
    proc = subprocess.run([sys.executable, "-m", "moetron", "data", "prepare", "a.txt", "b.jsonl", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    header = json.loads(out.with_name("corpus.json").read_text())
    assert header["format"] == "moetron.indexed" and header["documents"] == {"train": 298, "val": 3}
    assert header["max_token_id"] == 256  # end-of-text; the text's bytes are all below it
    assert out.with_name("corpus.idx").read_bytes()[17] == 8  # Megatron's code for uint16
    data = load_token_data(str(out))
    assert all(isinstance(a, np.memmap) for a in [*data.train, *data.val])
    tokens = np.concatenate([*data.train, *data.val])
    tok = ByteTokenizer()
    expected = len(("hello world\n" * 50).encode()) + sum(len(f"record {i} ünïcode".encode()) for i in range(300)) + 301
    assert len(tokens) == expected
    assert tok.decode(data.train[0][:200]).count("record") + tok.decode(data.val[0][:200]).count("record") > 0


def test_prepare_with_a_trained_bpe_and_reusing_its_tokenizer_json(tmp_path):
    text = "def function(argument):\n    return argument + 1\n" * 200
    # 40 documents, half held out: both splits get some (a lone document would leave one empty).
    (tmp_path / "code.jsonl").write_text("\n".join(json.dumps({"text": text[i * len(text) // 40:(i + 1) * len(text) // 40]})
                                                   for i in range(40)))
    out = tmp_path / "bpe"
    run = lambda *a: subprocess.run([sys.executable, "-m", "moetron", "data", "prepare", *a,  # noqa: E731
                                     "--val-fraction", "0.5"], capture_output=True, text=True)
    proc = run(str(tmp_path / "code.jsonl"), "--out", str(out), "--tokenizer", "bpe", "--vocab-size", "300")
    assert proc.returncode == 0, proc.stderr
    tok_json = tmp_path / "bpe.tokenizer.json"
    tok = load_tokenizer(str(tok_json))
    assert tok.decode(tok.encode(text[:100])) == text[:100]
    data = load_token_data(str(out))
    assert len(np.concatenate([*data.train, *data.val])) < len(text) / 2  # BPE compresses repeated code
    proc = run(str(tmp_path / "code.jsonl"), "--out", str(tmp_path / "again"), "--tokenizer", str(tok_json))
    assert proc.returncode == 0, proc.stderr
    again = load_token_data(str(tmp_path / "again"))
    assert np.array_equal(np.concatenate(again.train + again.val), np.concatenate(data.train + data.val))

    # Shards and their tokenizer copied to another machine's file system still load: the header
    # names the tokenizer relative to itself.
    header = json.loads((tmp_path / "bpe.json").read_text())
    assert header["tokenizer"]["path"] == "bpe.tokenizer.json"
    moved = tmp_path / "cluster" / "corpora"
    moved.mkdir(parents=True)
    for f in tmp_path.glob("bpe.*"):
        f.rename(moved / f.name)
    copied = load_token_data(str(moved / "bpe"))
    assert np.array_equal(np.concatenate(copied.train + copied.val), np.concatenate(data.train + data.val))
    assert copied.tokenizer.decode(copied.tokenizer.encode(text[:100])) == text[:100]


def test_prepare_refuses_missing_input(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moetron", "data", "prepare", "nope.txt", "--out", str(tmp_path / "x")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "nope.txt: no such file" in proc.stderr


def test_prepare_refuses_documents_that_cannot_make_both_splits_and_writes_nothing(tmp_path):
    """A document goes whole to one split by a hash of its name: one document leaves a split empty,
    which no run can use. Refused before anything is written (a trained BPE included)."""
    (tmp_path / "one.txt").write_text("hello world\n" * 100)
    for extra, side, fix in ((["--val-fraction", "1e-9"], "training, none to validation", "a larger"),
                             (["--val-fraction", "0.999999"], "validation, none to training", "a smaller")):
        proc = subprocess.run([sys.executable, "-m", "moetron", "data", "prepare", str(tmp_path / "one.txt"),
                               "--out", str(tmp_path / "out" / "c"), "--tokenizer", "bpe", *extra],
                              capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and f"the only document went to {side}" in proc.stderr
        assert f"or {fix} --val-fraction" in proc.stderr
        assert not (tmp_path / "out").exists()


def test_prepare_warns_of_a_split_shorter_than_a_default_window(tmp_path, capsys, monkeypatch):
    """Both splits written, and a split under 257 tokens (train.seq_len 256 + 1) named with its
    size and the longest seq_len it can feed, which then trains (tests/launcher/train/test_startup.py)."""
    from moetron.launcher.cli.main import main

    monkeypatch.chdir(tmp_path)  # documents are named by their path: "notes.jsonl:55" is held out
    (tmp_path / "notes.jsonl").write_text("\n".join(json.dumps({"text": f"note {i}"}) for i in range(60)))
    assert main(["data", "prepare", "notes.jsonl", "--out", "notes"]) == 0
    out, err = capsys.readouterr()
    data = load_token_data(str(tmp_path / "notes"))
    train_tokens, val_tokens = sum(map(len, data.train)), sum(map(len, data.val))
    assert out.startswith(f"60 documents → {train_tokens:,} train and {val_tokens:,} validation tokens")
    assert 0 < val_tokens < 257 and 0 < train_tokens < 257 * 3
    expected = [f"warning: at train.seq_len = 256 (the default), the {split} split holds {n} tokens; one window "
                f"of train.seq_len + 1 = 257 tokens is needed: use train.seq_len={n - 1} or less, or prepare "
                f"more text{more}" for split, n, more in (("train", train_tokens, ""),
                                                            ("validation", val_tokens, " (or a larger --val-fraction)"))
                if n < 257]
    assert err.splitlines() == expected and expected

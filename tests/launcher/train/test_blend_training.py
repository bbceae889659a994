"""Training on a blend of indexed corpora: records carry each source's tokens, a stopped and
resumed run draws exactly what an uninterrupted one draws, and bad corpora or blends are refused
by the real CLI in one line, status 2, with no run folder."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moetron.launcher.checkpoint.weights import load_model, resolve_checkpoint
from moetron.launcher.cli.main import main
from moetron.launcher.config import ConfigError, load_config
from moetron.launcher.data.corpus import load_token_data, write_shards
from moetron.launcher.data.indexed import IndexedWriter
from moetron.launcher.data.tokenizer import ByteTokenizer
from moetron.launcher.train.length_eval import evaluate_lengths
from moetron.launcher.train.trainer import train

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=32", "model.moe.num_experts=4", "train.seq_len=32", "train.batch_size=4",
         "train.log_every=1", "train.eval_every=3", "train.eval_batches=1", "train.warmup_steps=1",
         "train.threads=1", "train.peak_tflops=1", "train.checkpoint.every=0", "train.precision=fp32"]


def corpus(folder: Path, name: str, text: bytes) -> str:
    ids = np.frombuffer(text * (3000 // len(text) + 1), dtype=np.uint8).astype(np.uint16)
    prefix = folder / name
    write_shards(prefix, {"train": ids[:2500], "val": ids[2500:3000]}, ByteTokenizer())
    return str(prefix)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_blended_run_records_each_source_and_resumes_bit_exactly(tmp_path):
    code = corpus(tmp_path / "a", "code", b"def f(x):\n    return x + 1\n")
    prose = corpus(tmp_path / "b", "prose", b"The quick brown fox jumps over the lazy dog. ")
    blend = f"data.blend=[0.75, {code}, 0.25, {prose}]"
    straight = records(train(load_config(TINY, [*SMALL, blend, f"train.run_dir={tmp_path}", "train.steps=6",
                                                "train.name=straight"]), console=lambda *_: None))
    cfg = load_config(TINY, [*SMALL, blend, f"train.run_dir={tmp_path}", "train.steps=6", "train.name=split"])
    train(cfg, exit_after=3, console=lambda *_: None)
    resumed = records(train(cfg, console=lambda *_: None))
    keys = ("step", "loss", "lr", "tokens", "grad_norm", "aux_loss", "val_loss", "tokens/code", "tokens/prose")
    assert [{k: r.get(k) for k in keys} for r in straight] == [{k: r.get(k) for k in keys} for r in resumed]
    assert len(straight) == 6
    for r in straight:
        # 4 samples a step, 32 tokens each: 3 : 1 within one sample of the 0.75 : 0.25 share.
        assert r["tokens/code"] + r["tokens/prose"] == r["tokens"]
        assert abs(r["tokens/code"] - 0.75 * r["tokens"]) <= 32
    assert straight[-1]["tokens/code"] == 18 * 32 and straight[-1]["tokens/prose"] == 6 * 32


def test_eval_of_a_blended_run_scores_the_blends_held_out_tokens(tmp_path, capsys):
    code = corpus(tmp_path / "a", "code", b"def f(x):\n    return x + 1\n")
    prose = corpus(tmp_path / "b", "prose", b"The quick brown fox jumps over the lazy dog. ")
    overrides = [*SMALL, f"data.blend=[0.5, {code}, 0.5, {prose}]", f"train.run_dir={tmp_path}", "train.steps=2"]
    run = train(load_config(TINY, overrides), console=lambda *_: None)
    capsys.readouterr()
    assert main(["eval", str(run), "--seq-len", "32", "--tokens", "256", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)["results"][0]["loss"]
    cfg, model = load_model(resolve_checkpoint(str(run)), device=torch.device("cpu"))
    blend, stdlib = load_token_data("stdlib", "byte", 0.02, [(0.5, code), (0.5, prose)]), load_token_data("stdlib")
    expected, other = (evaluate_lengths(model, d.val, [32], tokens=256, vocab_size=d.vocab_size)[0].loss
                       for d in (blend, stdlib))
    assert scored == expected and abs(scored - other) > 1e-3


def corrupt_index(prefix: str, offset: int, raw: bytes) -> str:
    idx = Path(prefix + ".idx")
    data = bytearray(idx.read_bytes())
    data[offset:offset + len(raw)] = raw
    idx.write_bytes(bytes(data))
    return prefix


def test_bad_corpora_and_blends_are_refused_in_one_line(tmp_path, capsys):
    good = corpus(tmp_path, "good", b"hello world ")
    no_idx = corpus(tmp_path, "noidx", b"abc ")
    Path(no_idx + ".idx").unlink()
    no_bin = corpus(tmp_path, "nobin", b"abc ")
    Path(no_bin + ".bin").unlink()
    v2 = corrupt_index(corpus(tmp_path, "v2", b"abc "), 9, struct.pack("<Q", 2))
    code9 = corrupt_index(corpus(tmp_path, "code9", b"abc "), 17, bytes([9]))
    big = IndexedWriter(tmp_path / "big", np.int32)  # another writer's corpus, ids of a 50k vocabulary
    for d in range(4):
        big.add(np.arange(d * 300, d * 300 + 200, dtype=np.int32) % 50_000 + 40_000)
    big.finish()
    recorded = corpus(tmp_path, "recorded", b"abc ")  # PREFIX.json says an id above the model's rows
    sidecar = json.loads(Path(recorded + ".json").read_text())
    Path(recorded + ".json").write_text(json.dumps({**sidecar, "max_token_id": 400}))
    cases = {
        f"data.source={no_idx}": f"{no_idx}: {no_idx}.idx missing",
        f"data.source={no_bin}": f"{no_bin}: {no_bin}.bin missing",
        f"data.source={v2}": f"{v2}.idx: index version 2; only version 1 (megatron-core's) is read",
        f"data.source={code9}": f"{code9}.idx: unknown dtype code 9; Megatron's codes are 1 uint8,",
        f"data.blend=[-0.5, {good}, 1, {v2}]": "weight -0.5 of " + good + ": every weight must be > 0",
        f"data.blend=[0, {good}, 1, {v2}]": "weight 0 of " + good + ": every weight must be > 0",
        f"data.blend=[{good}, 0.5]": "must alternate weight and prefix, as [0.7, data/a, 0.3, data/b]",
        f"data.blend=[1, {good}, 1, {tmp_path}/big]": (f"data.blend source '{tmp_path}/big': token id 40799 among "
                                                       f"the first 600 tokens of its train split is outside "
                                                       f"model.vocab_size = 320"),
        f"data.source={recorded}": ("holds token id 400 (the largest `moetron data prepare` wrote); "
                                    "model.vocab_size = 320 must be above it"),
    }
    runs = tmp_path / "runs"
    for override, needle in cases.items():
        capsys.readouterr()
        code = main(["train", str(TINY), *SMALL, f"train.run_dir={runs}", override, "train.steps=1"])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and err.count("\n") == 1 and needle in err, (override, err)
        assert not runs.exists()
    # And once through a real process, as a user meets it.
    proc = subprocess.run([sys.executable, "-m", "moetron", "train", str(TINY), *SMALL, f"train.run_dir={runs}",
                           f"data.blend=[0.5, {good}, 0.5, {no_idx}]"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"moetron train: {no_idx}: {no_idx}.idx missing (a Megatron indexed corpus is " \
                          f"PREFIX.idx + PREFIX.bin; write one with `moetron data prepare`)\n"
    assert not runs.exists()


def test_document_mask_keeps_a_corpus_documents_apart(tmp_path):
    """data.document_mask reaches the model: windows of short documents (each closed by the byte
    tokenizer's end-of-text id, 256) train to another first loss than the same windows unmasked,
    and reset_positions without the mask is refused in one line."""
    docs = [np.frombuffer(t, dtype=np.uint8).astype(np.uint16) for t in (b"ab cd", b"x = 1\n", b"The fox. ")]
    ids = np.concatenate([np.append(d, ByteTokenizer().eos_id) for d in docs * 200]).astype(np.uint16)
    prefix = tmp_path / "docs"
    write_shards(prefix, {"train": ids[:3000], "val": ids[3000:]}, ByteTokenizer())
    base = [*SMALL, f"data.source={prefix}", f"train.run_dir={tmp_path}", "train.steps=1"]
    first = {}
    for name, mask in (("plain", []), ("masked", ["data.document_mask=true", "data.reset_positions=true"])):
        run = train(load_config(TINY, [*base, f"train.name={name}", *mask]), console=lambda *_: None)
        first[name] = records(run)[0]["loss"]
    assert abs(first["plain"] - first["masked"]) > 1e-3
    with pytest.raises(ConfigError, match=r"^data\.reset_positions = True: needs data\.document_mask: true [^\n]*$"):
        load_config(TINY, [*base, "data.reset_positions=true"])

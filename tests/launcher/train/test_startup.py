"""What `moetron train` checks before it writes anything, and what it says about how a run starts:
a corpus too small for one window, a missing data prefix, a finished run asked for fewer steps, a
warmup longer than the schedule, config.yaml after a resumed run raised train.steps."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from moetron.launcher.cli.main import main
from moetron.launcher.config import load_config
from moetron.launcher.data.corpus import load_token_data, write_shards
from moetron.launcher.data.tokenizer import ByteTokenizer
from moetron.launcher.train.trainer import train

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
# seq_len 32: a window is 33 tokens. peak_tflops set: no CPU peak measurement.
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=32", "model.moe.num_experts=4", "train.seq_len=32", "train.batch_size=2",
         "train.log_every=1", "train.eval_every=100", "train.eval_batches=1", "train.warmup_steps=1",
         "train.threads=1", "train.peak_tflops=1", "train.checkpoint.every=0"]


def corpus(folder: Path, train_tokens: int, val_tokens: int) -> str:
    """Token shards of byte text with the given split sizes; returns their prefix."""
    ids = np.frombuffer(b"def f(x):\n    return x + 1\n" * (1 + (train_tokens + val_tokens) // 26), dtype=np.uint8)
    ids = ids.astype(np.uint16)
    prefix = folder / f"corpus-{train_tokens}-{val_tokens}"
    write_shards(prefix, {"train": ids[:train_tokens], "val": ids[:val_tokens]}, ByteTokenizer())
    return str(prefix)


def moetron_train(capsys, runs: Path, *overrides: str, resume: str = "auto") -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["train", str(TINY), *SMALL, f"train.run_dir={runs}", *overrides, "--resume", resume])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_corpus_too_small_for_one_window_is_refused_in_one_line(tmp_path, capsys):
    """Each split must hold one window of train.seq_len + 1 tokens (33 here): a 20-token split is
    refused with its size, the need and the way out; nothing is written."""
    runs = tmp_path / "runs"
    for train_tokens, val_tokens, split in ((20, 500, "train"), (500, 20, "validation")):
        code, out, err = moetron_train(capsys, runs, f"data.source={corpus(tmp_path, train_tokens, val_tokens)}",
                                       "train.name=small", "train.steps=2")
        assert code == 2 and out == ""
        assert err == (f"moetron train: data.source = '{tmp_path}/corpus-{train_tokens}-{val_tokens}': the {split} "
                       f"split holds 20 tokens; one window of train.seq_len + 1 = 33 tokens is needed: use "
                       f"train.seq_len=19 or less, or prepare more text"
                       f"{' (or a larger --val-fraction)' if split == 'validation' else ''}\n")
        assert not runs.exists()
    # A split of exactly one window trains.
    code, _, err = moetron_train(capsys, runs, f"data.source={corpus(tmp_path, 33, 33)}", "train.name=exact",
                                 "train.steps=1")
    assert code == 0, err


def test_a_refused_start_leaves_no_folder_and_the_name_stays_free_for_resume_none(tmp_path, capsys):
    runs = tmp_path / "runs"
    refusals = {
        "a missing prefix": (f"data.source={tmp_path}/nope", f"{tmp_path}/nope.idx missing"),
        "a corpus too small": (f"data.source={corpus(tmp_path, 10, 10)}", "the train split holds 10 tokens"),
        "a tokenizer larger than the model": ("model.vocab_size=64", "must be >= the tokenizer's vocabulary (257"),
    }
    for source, needle in refusals.values():
        code, out, err = moetron_train(capsys, runs, source, "train.name=again", "train.steps=2", resume="none")
        assert code == 2 and out == "" and err.count("\n") == 1 and needle in err, err
        assert not (runs / "again").exists()
    code, _, err = moetron_train(capsys, runs, f"data.source={corpus(tmp_path, 2000, 300)}", "train.name=again",
                                 "train.steps=2", resume="none")
    assert code == 0, err
    assert [json.loads(line)["step"] for line in (runs / "again" / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_the_first_hour_story_in_a_real_process(tmp_path):
    """`moetron data prepare` warns of a validation split shorter than a default window and says
    how long it is; `moetron train` at the default seq_len then refuses in one line, status 2,
    no traceback and no run folder."""
    (tmp_path / "notes.jsonl").write_text("\n".join(json.dumps({"text": f"note {i}: " + "x" * 40}) for i in range(60)))
    prep = subprocess.run([sys.executable, "-m", "moetron", "data", "prepare", "notes.jsonl", "--out", "data/notes"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert prep.returncode == 0, prep.stderr
    val = sum(map(len, load_token_data(str(tmp_path / "data" / "notes")).val))
    assert 0 < val < 257
    assert prep.stderr == (f"warning: at train.seq_len = 256 (the default), the validation split holds {val} tokens; "
                           f"one window of train.seq_len + 1 = 257 tokens is needed: use train.seq_len={val - 1} or "
                           f"less, or prepare more text (or a larger --val-fraction)\n")
    proc = subprocess.run([sys.executable, "-m", "moetron", "train", str(TINY), "data.source=data/notes",
                           "train.name=notes"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr == (f"moetron train: data.source = 'data/notes': the validation split holds {val} tokens; "
                           f"one window of train.seq_len + 1 = 257 tokens is needed: use train.seq_len={val - 1} or "
                           f"less, or prepare more text (or a larger --val-fraction)\n")
    assert not (tmp_path / "runs").exists()


def test_a_finished_run_asked_for_fewer_steps_says_its_real_step(tmp_path, capsys):
    runs = tmp_path / "runs"
    data = f"data.source={corpus(tmp_path, 2000, 300)}"
    assert moetron_train(capsys, runs, data, "train.name=done", "train.steps=3")[0] == 0
    before = {p: p.read_bytes() for p in (runs / "done").rglob("*") if p.is_file()}
    code, out, err = moetron_train(capsys, runs, data, "train.name=done", "train.steps=2")
    ckpt = runs / "done" / "checkpoints" / "step-00000003"
    assert code == 2 and out == ""
    assert err == (f"moetron train: {runs}/done is at step 3 ({ckpt}), past train.steps = 2; to train it further "
                   f"set train.steps above 3, or start a new run with train.name=<new name> --resume none\n")
    # Asked for exactly what it did (a job requeued after its last step): status 0, the real step.
    code, out, err = moetron_train(capsys, runs, data, "train.name=done", "train.steps=3")
    assert code == 0 and out.startswith(f"{runs}/done already finished: {ckpt} is at step 3 = train.steps;")
    assert {p: p.read_bytes() for p in (runs / "done").rglob("*") if p.is_file()} == before


def test_a_warmup_longer_than_the_schedule_is_said_and_trained_as_configured(tmp_path):
    lines: list[str] = []
    cfg = load_config(TINY, [*SMALL, f"train.run_dir={tmp_path}", f"data.source={corpus(tmp_path, 2000, 300)}",
                             "train.name=warm", "train.steps=3", "train.warmup_steps=4", "train.lr=1e-3"])
    run = train(cfg, console=lines.append)
    said = [line for line in lines if "warmup" in line]
    assert said == [("warning: train.warmup_steps = 4 is longer than the learning-rate schedule (3 steps): the "
                     "learning rate reaches only 75% of train.lr = 0.001, at the last step; set "
                     "train.warmup_steps to at most 3")]
    lrs = [json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lrs == [1e-3 * 1 / 4, 1e-3 * 2 / 4, 1e-3 * 3 / 4]  # 75% at the last step, as said
    quiet: list[str] = []
    train(load_config(TINY, [*SMALL, f"train.run_dir={tmp_path}", f"data.source={corpus(tmp_path, 2000, 300)}",
                             "train.name=fine", "train.steps=3", "train.warmup_steps=3"]), console=quiet.append)
    assert not [line for line in quiet if "warmup" in line]


def test_config_yaml_follows_a_resumed_run_that_raised_its_steps(tmp_path):
    data = f"data.source={corpus(tmp_path, 2000, 300)}"
    first = load_config(TINY, [*SMALL, f"train.run_dir={tmp_path}", data, "train.name=grow", "train.steps=2"])
    run = train(first, console=lambda *_: None)
    assert yaml.safe_load((run / "config.yaml").read_text()) == first.to_dict()
    longer = load_config(TINY, [*SMALL, f"train.run_dir={tmp_path}", data, "train.name=grow", "train.steps=4"])
    train(longer, console=lambda *_: None)
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 4
    assert yaml.safe_load((run / "config.yaml").read_text()) == longer.to_dict()
    # No stray files: layouts.jsonl holds one line per start (launcher/train/layout_log.py).
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "layouts.jsonl", "metrics.jsonl",
                                                     "tensorboard"]
    assert [json.loads(line)["step"] for line in (run / "layouts.jsonl").read_text().splitlines()] == [0, 2]

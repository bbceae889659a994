"""Run folders and their checkpoints through the trainer and the CLI: a kill -9 mid-write, async
saves, damaged and foreign checkpoints, export."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moetron.launcher.checkpoint.store import consolidated_model_state, load_checkpoint
from moetron.launcher.cli.main import main
from moetron.launcher.config import load_config
from moetron.launcher.train.trainer import train
from moetron.model.transformer import build_model

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "model.moe.d_expert=64", "train.seq_len=32", "train.batch_size=4", "train.log_every=1",
         "train.eval_every=5", "train.eval_batches=2", "train.warmup_steps=2", "train.threads=1",
         "train.precision=fp32", "train.steps=20", "train.checkpoint.every=5"]
KEYS = ("step", "loss", "lr", "tokens", "grad_norm", "val_loss")
# `moetron ARGS` in a process whose save of step 10 stops for an hour once its shards are written.
STALLED_CLI = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent / 'checkpoint')!r}); "
               "from crash_harness import stall_saves; stall_saves('10'); "
               "from moetron.launcher.cli.main import main; sys.exit(main(sys.argv[1:]))")


def small(run_dir, *extra):
    return load_config(TINY, [*SMALL, f"train.run_dir={run_dir}", *extra])


def losses(run_path: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()]
    return [{k: r.get(k) for k in KEYS} for r in recs]


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "moetron", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """20 steps, never interrupted, checkpoints every 5 steps."""
    run_dir = tmp_path_factory.mktemp("runs")
    return train(small(run_dir, "train.name=straight"), console=lambda *_: None)


def test_kill_9_during_a_checkpoint_write_resumes_from_the_previous_one(tmp_run_dir, straight):
    args = ["train", TINY, *SMALL, f"train.run_dir={tmp_run_dir}", "train.name=killed"]
    proc = subprocess.Popen([sys.executable, "-c", STALLED_CLI, *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    ckpts = tmp_run_dir / "killed" / "checkpoints"
    written = ckpts / ".tmp-step-00000010" / "manifest.json.rank0"  # shards on disk, not yet renamed
    deadline = time.time() + 180
    while time.time() < deadline and not written.is_file() and proc.poll() is None:
        time.sleep(0.1)
    assert written.is_file(), proc.stderr.read() if proc.poll() is not None else "no checkpoint write seen"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert (ckpts / "latest").read_text().strip() == "step-00000005"

    resumed = train(small(tmp_run_dir, "train.name=killed"), console=lambda *_: None)
    assert losses(resumed) == losses(straight)
    assert not list(ckpts.glob(".tmp-*"))
    assert (ckpts / "latest").read_text().strip() == "step-00000020"


def test_async_checkpoints_train_and_save_like_sync(tmp_run_dir, straight):
    run = train(small(tmp_run_dir, "train.name=async", "train.checkpoint.async=true"), console=lambda *_: None)
    assert losses(run) == losses(straight)
    names = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert names == sorted(p.name for p in (straight / "checkpoints").glob("step-*"))
    for name in names:
        a = consolidated_model_state(run / "checkpoints" / name)
        b = consolidated_model_state(straight / "checkpoints" / name)
        assert all(torch.equal(a[k], b[k]) for k in b), name


def _copy_run(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def _damage(shard: Path, how: str) -> None:
    """Cut a shard short (seen by its size before the resume is chosen) or flip one of its bytes
    (seen by its hash while it loads)."""
    data = bytearray(shard.read_bytes())
    if how == "truncated":
        shard.write_bytes(bytes(data[:1000]))
    else:
        data[len(data) // 3] ^= 0x55
        shard.write_bytes(bytes(data))


def scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


@pytest.mark.parametrize("how", ["truncated", "corrupt"])
def test_auto_resume_sets_a_damaged_checkpoint_aside_and_goes_on_from_the_previous(tmp_run_dir, straight, how):
    """A requeued job must not die on a damaged newest checkpoint: --resume auto sets it aside
    (renamed, every byte kept), resumes step 15 with the uninterrupted run's numbers, and says so
    on the console, in metrics.jsonl and in TensorBoard. A cut shard is seen by its size before the
    resume is chosen, a flipped byte by its hash while the checkpoint loads."""
    run = _copy_run(straight, tmp_run_dir / "straight")
    ckpts = run / "checkpoints"
    shard = next((ckpts / "step-00000020").glob("*.distcp"))
    _damage(shard, how)
    damaged = shard.read_bytes()
    lines = []
    train(small(tmp_run_dir, "train.name=straight", "train.steps=25"), console=lines.append)
    aside = ckpts / "damaged-step-00000020"
    warning = [line for line in lines if line.startswith("WARNING")]
    assert len(warning) == 1
    assert warning[0].startswith(f"WARNING: checkpoint {ckpts / 'step-00000020'} is damaged ({shard}: "
                                 f"{'truncated or overwritten: 1000 bytes' if how == 'truncated' else 'corrupt'}")
    assert warning[0].endswith(f"); set aside as {aside}; resumed from {ckpts / 'step-00000015'} at step 15 instead")
    assert (aside / shard.name).read_bytes() == damaged and (aside / "COMPLETE").is_file()
    assert (ckpts / "latest").read_text().strip() == "step-00000025"
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    noted = [r for r in recs if "damaged_checkpoints" in r]
    assert noted == [{"step": 15, "damaged_checkpoints": 1, "resumed_from": str(ckpts / "step-00000015"),
                      "set_aside": [str(aside)]}]
    # The schedule keeps its 20 steps: steps 16-20 are the uninterrupted run's, bit for bit.
    assert [{k: r.get(k) for k in KEYS} for r in recs if r not in noted and r["step"] <= 20] == losses(straight)
    assert scalars(run, "damaged_checkpoints") == [(15, 1.0)]
    # Set aside, it is never picked up again: a rerun finds the run finished.
    assert train(small(tmp_run_dir, "train.name=straight", "train.steps=25"), console=lines.append) == run
    assert lines[-1].startswith(f"{run} already finished: {ckpts / 'step-00000025'} is at step 25")


@pytest.mark.parametrize("how", ["truncated", "corrupt"])
def test_an_explicit_resume_of_a_damaged_checkpoint_is_refused_in_one_line(tmp_run_dir, straight, how, capsys):
    run = _copy_run(straight, tmp_run_dir / "straight")
    shard = next((run / "checkpoints" / "step-00000020").glob("*.distcp"))
    _damage(shard, how)
    before = sorted(str(p) for p in tmp_run_dir.rglob("*"))
    code = main(["train", str(TINY), *SMALL, f"train.run_dir={tmp_run_dir}", "train.name=again", "train.steps=25",
                 "--resume", str(run / "checkpoints" / "step-00000020")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(shard) in err
    assert ("truncated" if how == "truncated" else "corrupt") in err
    assert str(run / "checkpoints" / "step-00000015") in err
    assert sorted(str(p) for p in tmp_run_dir.rglob("*")) == before  # nothing written, nothing moved


def test_when_every_checkpoint_is_damaged_auto_resume_refuses_and_moves_nothing(tmp_run_dir, straight):
    from moetron.launcher.run_dir import RunError, open_run_dir

    run = _copy_run(straight, tmp_run_dir / "straight")
    for ckpt in (run / "checkpoints").glob("step-*"):
        (ckpt / "state.json").write_text((ckpt / "state.json").read_text()[:50])
    before = _tree(run)
    with pytest.raises(RunError, match=r"no intact checkpoint to resume from; the newest, .*step-00000020, is "
                                       r"damaged: .*state.json: truncated or overwritten.*the 1 older one is damaged too"):
        open_run_dir(small(tmp_run_dir, "train.name=straight"))
    assert _tree(run) == before


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_other_model_names_config_key_and_tensors(tmp_run_dir, straight):
    _copy_run(straight, tmp_run_dir / "straight")
    proc = cli("train", TINY, *SMALL, f"train.run_dir={tmp_run_dir}", "train.name=straight", "model.d_model=96")
    assert proc.returncode == 2
    assert "another model: model.d_model was 64, now 96 (tensors: " in proc.stderr
    assert "embed.weight is [320, 64] there, [320, 96] here" in proc.stderr, proc.stderr


def test_export_writes_the_live_model(tmp_path, straight):
    from safetensors.torch import load_file

    out = tmp_path / "export" / "model.safetensors"
    proc = cli("export", straight, "--out", out)
    assert proc.returncode == 0, proc.stderr
    exported = load_file(str(out))
    cfg = small(tmp_path, "train.name=straight")
    torch.manual_seed(123)
    live = build_model(cfg.model)
    load_checkpoint(straight / "checkpoints" / "step-00000020", live, None)
    sd = live.state_dict()
    assert exported.keys() == sd.keys() and all(torch.equal(exported[k], sd[k]) for k in sd)
    config = json.loads((tmp_path / "export" / "model.config.json").read_text())
    assert config["model"]["d_model"] == 64 and config["step"] == 20
    again = cli("export", straight, "--out", out)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_same_run_stopped_before_its_first_checkpoint_starts_again(tmp_run_dir):
    # A job preempted or requeued while starting leaves config.yaml (and maybe metrics) but no
    # checkpoint; its next attempt, with the same config, starts afresh instead of being refused.
    from moetron.launcher.run_dir import RunError, open_run_dir

    cfg = small(tmp_run_dir, "train.name=early")
    first = open_run_dir(cfg)
    (first.path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    again = open_run_dir(cfg)
    assert again.resume_from is None and (first.path / "metrics.jsonl").read_text() == ""
    with pytest.raises(RunError, match="no complete checkpoint"):
        open_run_dir(small(tmp_run_dir, "train.name=early", "train.lr=1e-3"))

"""The single-process trainer end to end: metrics, determinism, resume, refusals, clean stops."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moetron.launcher.config import load_config
from moetron.launcher.run_dir import RunError
from moetron.launcher.train.trainer import train

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "model.moe.d_expert=64", "train.seq_len=32", "train.batch_size=4", "train.log_every=2",
         "train.eval_every=5", "train.eval_batches=2", "train.warmup_steps=2", "train.threads=1"]


def small(run_dir, *extra):
    return load_config(TINY, [*SMALL, f"train.run_dir={run_dir}", *extra])


def records(run_path: Path) -> list[dict]:
    return [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()]


def straight_and_resumed(run_dir, overrides, exit_after: int) -> tuple[list[dict], list[dict]]:
    """The records of a run trained straight through ("straight") and of the same run stopped after
    `exit_after` steps and resumed ("split")."""
    straight = records(train(small(run_dir, *overrides, "train.name=straight"), console=lambda *_: None))
    cfg = small(run_dir, *overrides, "train.name=split")
    train(cfg, exit_after=exit_after, console=lambda *_: None)
    return straight, records(train(cfg, console=lambda *_: None))


def test_training_writes_metrics_and_learns(tmp_run_dir):
    run = train(small(tmp_run_dir, "train.steps=30", "train.name=learn"), console=lambda *_: None)
    recs = records(run)
    assert [r["step"] for r in recs] == sorted(set(range(2, 31, 2)) | set(range(5, 31, 5)))
    assert {"step", "loss", "lr", "tokens", "grad_norm", "tokens_per_s"} <= set(recs[0])
    assert recs[-1]["tokens"] == 30 * 4 * 32
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    # An untrained model predicts ~uniformly over 320 ids (ln 320 = 5.77 nats); 30 steps learn byte statistics.
    assert recs[0]["loss"] > 5.0
    assert len(val) == 6 and val[-1] < val[0] and val[-1] < 4.5
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "latest").is_file()
    assert any((run / "tensorboard").iterdir())


def test_same_seed_same_losses_bit_for_bit(tmp_run_dir):
    a = records(train(small(tmp_run_dir, "train.steps=8", "train.name=a"), console=lambda *_: None))
    b = records(train(small(tmp_run_dir, "train.steps=8", "train.name=b"), console=lambda *_: None))
    c = records(train(small(tmp_run_dir, "train.steps=8", "train.name=c", "train.seed=1"), console=lambda *_: None))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["loss"] for r in a] != [r["loss"] for r in c]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_bit_exact(tmp_run_dir, precision):
    """10 steps + resume + 10 steps equals 20 steps straight, every logged number of every step."""
    straight, resumed = straight_and_resumed(tmp_run_dir, ("train.steps=20", f"train.precision={precision}"), 10)
    keys = ("step", "loss", "lr", "tokens", "grad_norm", "val_loss")
    assert [{k: r.get(k) for k in keys} for r in straight] == [{k: r.get(k) for k in keys} for r in resumed]


def test_resume_with_dropout_and_router_jitter_is_bit_exact(tmp_run_dir):
    """With dropout and router jitter every step draws random numbers: the resumed run matches
    only if the checkpoint restored the generators' states, not just the weights and sampler."""
    noisy = ("train.steps=12", "train.precision=fp32", "model.dropout=0.1", "model.moe.jitter=0.1")
    straight, resumed = straight_and_resumed(tmp_run_dir, noisy, 6)
    assert [(r["step"], r["loss"], r.get("grad_norm")) for r in straight] == \
           [(r["step"], r["loss"], r.get("grad_norm")) for r in resumed]


def test_grad_accumulation_matches_one_big_batch(tmp_run_dir):
    acc = records(train(small(tmp_run_dir, "train.steps=4", "train.name=acc", "train.precision=fp32",
                              "train.grad_accum=2", "model.moe.aux_loss_coef=0"), console=lambda *_: None))
    ref = records(train(small(tmp_run_dir, "train.steps=4", "train.name=ref", "train.precision=fp32",
                              "model.moe.aux_loss_coef=0"), console=lambda *_: None))
    # Mean of micro-batch losses equals the full-batch loss (equal micro-batch sizes); without
    # aux loss (which is per micro-batch) the updates agree up to summation order.
    for a, r in zip(acc, ref):
        assert a["loss"] == pytest.approx(r["loss"], rel=1e-4)


def test_existing_run_is_never_clobbered(tmp_run_dir):
    cfg = small(tmp_run_dir, "train.steps=2", "train.name=keep")
    run = train(cfg, console=lambda *_: None)
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(RunError, match="already holds a run"):
        train(cfg, resume="none", console=lambda *_: None)
    with pytest.raises(RunError, match="another model: model.d_model was 64, now 96"):
        train(small(tmp_run_dir, "train.steps=4", "train.name=keep", "model.d_model=96"), console=lambda *_: None)
    assert (run / "metrics.jsonl").read_text() == before
    # a folder with a run but no checkpoint is refused under auto as well
    (tmp_run_dir / "bare").mkdir()
    (tmp_run_dir / "bare" / "metrics.jsonl").write_text("")
    with pytest.raises(RunError, match="no complete checkpoint"):
        train(small(tmp_run_dir, "train.steps=2", "train.name=bare"), console=lambda *_: None)


def test_ctrl_c_stops_cleanly_with_a_checkpoint(tmp_run_dir):
    args = [sys.executable, "-m", "moetron", "train", str(TINY), *SMALL, f"train.run_dir={tmp_run_dir}",
            "train.name=intr", "train.steps=100000", "train.log_every=1"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_run_dir / "intr" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped by signal SIGINT" in out
    last = records(tmp_run_dir / "intr")[-1]["step"]
    latest = (tmp_run_dir / "intr" / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{last:08d}"
    assert "Traceback" not in err


@pytest.mark.parametrize("command", [[], ["train"], ["data"], ["data", "prepare"], ["generate"], ["convert"],
                                     ["flops"], ["export"], ["submit"], ["status"], ["logs"], ["cancel"]])
def test_help_explains_itself(command):
    proc = subprocess.run([sys.executable, "-m", "moetron", *command, "--help"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0 and "usage: moetron" in proc.stdout and len(proc.stdout) > 200
    text = " ".join(proc.stdout.split())  # argparse wraps lines; judge the words
    assert "%%" not in text and "(default: None)" not in text
    assert text.count("(default:") == text.count("(default: ") and "(default: (default" not in text
    for chunk in text.split("(default:")[1:]:
        assert "(default:" not in chunk.split(")")[0]


def test_extending_a_finished_run_keeps_its_learning_rates(tmp_run_dir):
    """Megatron's --lr-decay-iters: raising train.steps on resume continues at min_lr instead of
    re-bending the schedule under steps already taken; train.lr_decay_steps sets a new length."""
    base = ("train.name=ext", "train.log_every=1", "train.lr_schedule=cosine", "train.lr=1e-3", "train.min_lr=1e-4")
    first = records(train(small(tmp_run_dir, "train.steps=6", *base), console=lambda *_: None))
    said = []
    longer = records(train(small(tmp_run_dir, "train.steps=9", *base), console=said.append))
    assert longer[:6] == first  # what happened stays as it was
    assert [r["lr"] for r in longer[6:]] == [1e-4] * 3  # the schedule ended at step 6: min_lr after
    assert any("keeps the length it was started with (6 steps" in line for line in said)
    # A new length, asked for: steps 10..12 decay along a schedule of 20 steps.
    more = records(train(small(tmp_run_dir, "train.steps=12", "train.lr_decay_steps=20", *base),
                         console=lambda *_: None))
    assert all(1e-4 < r["lr"] < 1e-3 for r in more[9:])
    # Wall time: elapsed_s grows step by step and carries over the restarts (never starts at 0 again).
    elapsed = [r["elapsed_s"] for r in more]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0


def test_a_diverging_run_skips_then_stops_with_one_line_and_no_bad_checkpoint(tmp_run_dir):
    """train.lr=1e6 turns the loss non-finite within a few steps: those steps are skipped (no update,
    counted), three in a row stop the run with one line and status 2, every checkpoint left holds
    finite weights, and metrics.jsonl stays strict JSON (null, never a bare NaN)."""
    from moetron.launcher.checkpoint.store import consolidated_model_state

    args = [sys.executable, "-m", "moetron", "train", str(TINY), *SMALL, f"train.run_dir={tmp_run_dir}",
            "train.name=boom", "train.steps=40", "train.lr=1e6", "train.warmup_steps=0", "train.grad_clip=0",
            "train.log_every=1", "train.checkpoint.every=1", "train.checkpoint.keep=100", "train.max_skipped_steps=3",
            "train.precision=fp32"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert "3 steps in a row were non-finite" in last_line and "the last good checkpoint is" in last_line
    assert "Traceback" not in proc.stderr
    lines = (tmp_run_dir / "boom" / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl")) for line in lines]
    skipped = [r for r in recs if r["loss"] is None or r["grad_norm"] is None]
    assert len(skipped) >= 3 and recs[-1]["skipped_steps"] >= 3
    assert recs[-1]["step"] < 40
    # Every checkpoint holds finite weights, and the newest one is the step named in the line.
    ckpts = sorted((tmp_run_dir / "boom" / "checkpoints").glob("step-*"))
    assert ckpts and str(ckpts[-1]) in last_line
    for ckpt in ckpts:
        state = consolidated_model_state(ckpt)
        assert all(t.isfinite().all() for t in state.values() if t.is_floating_point()), ckpt
    # No checkpoint was written for a skipped step.
    good = int(ckpts[-1].name.split("-")[1])
    assert all(r["loss"] is not None for r in recs if r["step"] <= good)


def test_aux_loss_free_routing_trains_and_resumes_bit_exactly(tmp_run_dir):
    """Sigmoid scores with a balancing bias and no aux loss: the bias moves (a buffer, checkpointed),
    and 4 + resume + 4 steps equal 8 straight, losses and biases alike."""
    from moetron.launcher.checkpoint.store import consolidated_model_state

    free = ("train.steps=8", "train.precision=fp32", "model.moe.score=sigmoid", "model.moe.bias_update_rate=0.01",
            "model.moe.aux_loss_coef=0")
    straight, resumed = straight_and_resumed(tmp_run_dir, free, 4)
    assert [(r["step"], r["loss"], r.get("grad_norm")) for r in straight] == \
           [(r["step"], r["loss"], r.get("grad_norm")) for r in resumed]
    a = consolidated_model_state(tmp_run_dir / "straight" / "checkpoints" / "step-00000008")
    b = consolidated_model_state(tmp_run_dir / "split" / "checkpoints" / "step-00000008")
    biases = [k for k in a if k.endswith("router.expert_bias_E")]
    assert len(biases) == 2  # both MoE layers
    assert all(a[k].equal(b[k]) for k in biases)
    # 8 updates of ±0.01 each: every bias is a multiple of the rate, and they have moved.
    assert all(a[k].abs().max() > 0 and torch.allclose(a[k] / 0.01, (a[k] / 0.01).round(), atol=1e-4) for k in biases)


def test_resuming_a_damaged_checkpoint_by_its_path_exits_2_with_one_line_and_touches_nothing(tmp_run_dir):
    """--resume PATH names one checkpoint: damaged, it is refused (an automatic resume passes it
    over instead, tests/launcher/test_run_dir.py)."""
    args = [sys.executable, "-m", "moetron", "train", str(TINY), *SMALL, f"train.run_dir={tmp_run_dir}",
            "train.name=dmg", "train.steps=2", "train.checkpoint.every=1", "train.checkpoint.keep=5"]
    assert subprocess.run(args, capture_output=True, text=True, timeout=300).returncode == 0
    ckpts = tmp_run_dir / "dmg" / "checkpoints"
    shard = next((ckpts / "step-00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in sorted(tmp_run_dir.rglob("*")) if p.is_file() and "tensorboard" not in p.parts}
    proc = subprocess.run([*args[:-3], "train.steps=4", "--resume", str(ckpts / "step-00000002")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert f"{shard}: corrupt" in line and "previous complete checkpoint is" in line and "step-00000001" in line
    assert "Traceback" not in proc.stderr
    after = {p: p.read_bytes() for p in sorted(tmp_run_dir.rglob("*")) if p.is_file() and "tensorboard" not in p.parts}
    assert after == before


@pytest.mark.parametrize("on_error", ["continue", "stop"])
def test_a_full_disk_during_a_save_keeps_training_or_stops_as_configured(tmp_run_dir, tmpfs, on_error, monkeypatch):
    """A real disk that fills up: a ballast file leaves room for one checkpoint beside the last, so
    the step-4 save fails with ENOSPC; a wrapped train_step deletes the ballast before step 5. With
    on_error=continue training goes on with the uninterrupted run's losses and the final step-6
    save succeeds (its weights equal the uninterrupted run's); with stop the run ends at step 4.
    Either way the step-2 checkpoint stays `latest` while it is the newest, and no partial
    folder is left behind."""
    from moetron.launcher.checkpoint.store import CheckpointError, consolidated_model_state
    from moetron.launcher.train import trainer

    knobs = ("train.steps=6", "train.checkpoint.every=2", "train.checkpoint.keep=1", "train.precision=fp32")
    ref = train(small(tmp_run_dir, *knobs, "train.name=ref"), console=lambda *_: None)
    ckpt_bytes = sum(p.stat().st_size for p in (ref / "checkpoints" / "step-00000006").rglob("*") if p.is_file())
    other_bytes = sum(p.stat().st_size for p in ref.rglob("*") if p.is_file() and "checkpoints" not in p.parts)
    disk = tmpfs(int(2.5 * ckpt_bytes + 4 * other_bytes + 2**20))
    if disk is None:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    ballast = disk / "ballast"
    ballast.write_bytes(b"\0" * ckpt_bytes)

    original, calls = trainer.train_step, []

    def train_step(*args, **kwargs):  # the 5th call is step 5 of the run below
        calls.append(None)
        if len(calls) == 5:
            ballast.unlink(missing_ok=True)
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", train_step)
    lines = []
    cfg = load_config(TINY, [*SMALL, f"train.run_dir={disk}", *knobs, "train.name=full",
                             f"train.checkpoint.on_error={on_error}"])
    ckpts = disk / "full" / "checkpoints"
    if on_error == "stop":
        with pytest.raises(CheckpointError) as err:
            train(cfg, console=lines.append)
        message = str(err.value)
        assert message.startswith("saving checkpoint step-00000004 failed: No space left on device"), message
        assert "step-00000002 and `latest` are intact" in message and "\n" not in message
        assert [r["step"] for r in records(disk / "full")][-1] == 4
        assert (ckpts / "latest").read_text().strip() == "step-00000002"
    else:
        train(cfg, console=lines.append)
        failed = [line for line in lines if "failed" in line]
        assert len(failed) == 1 and failed[0].startswith("saving checkpoint step-00000004 failed: No space left")
        assert failed[0].endswith("training continues (train.checkpoint.on_error=continue)")
        recs = records(disk / "full")
        assert [(r["step"], r["loss"]) for r in recs] == [(r["step"], r["loss"]) for r in records(ref)]
        # Step 4's record is logged before step 4's save, so the count shows from step 6 on.
        assert [r.get("failed_saves") for r in recs if r["step"] in (2, 4, 6)] == [None, None, 1]
        assert (ckpts / "latest").read_text().strip() == "step-00000006"
        ours = consolidated_model_state(ckpts / "step-00000006")
        theirs = consolidated_model_state(ref / "checkpoints" / "step-00000006")
        assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith((".tmp", "step-"))) == \
        (["step-00000002"] if on_error == "stop" else ["step-00000006"])


def test_the_expert_bias_update_runs_once_per_optimizer_step_even_when_steps_nest(monkeypatch):
    """ZeRO-1's optimizer steps through AdamW.step, which torch wraps with the same hooks once any
    AdamW exists: the bias update (a collective) must still run once per step."""
    from types import SimpleNamespace

    from moetron.launcher.train import trainer

    calls = []
    monkeypatch.setattr(trainer, "update_expert_biases", lambda *args: calls.append(args))

    class Nested(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # wraps AdamW.step with the hooks
    p = torch.nn.Parameter(torch.ones(2))
    opt = Nested([p])
    cfg = SimpleNamespace(model=SimpleNamespace(n_layers=1, mtp_depth=0, moe=SimpleNamespace(num_experts=2)))
    trainer.ExpertBiasUpdate(SimpleNamespace(modules=[], mesh=None), cfg, torch.device("cpu")).register(opt)
    for _ in range(3):
        p.grad = torch.ones(2)
        opt.step()
    assert len(calls) == 3

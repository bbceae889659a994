"""`moetron train --layout auto`: at a start on another number of ranks the planner's first layout is
taken, the checkpoint resharded into it, the global batch kept — the losses continue as the
uninterrupted one-process run's — and the run folder's layouts.jsonl records each start; a world
on which nothing fits is refused in one line before a run folder exists.

The runs that train are forked from one process that imported the training stack (the `train`
fixture, tests/forked_ranks.py) with the environment torchrun, or `python -m moetron`, gives them;
the refusal runs in an interpreter of its own, whose whole stderr is that one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moetron.launcher.perf.device_profiles import DeviceProfile, save_profile

ROOT = Path(__file__).resolve().parents[3]
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=32", "model.moe.num_experts=4", "train.seq_len=32", "train.batch_size=8",
         "train.log_every=1", "train.eval_every=100", "train.eval_batches=1", "train.warmup_steps=1",
         "train.threads=1", "train.peak_tflops=1", "train.checkpoint.every=3", "train.precision=fp32",
         "train.steps=6"]


def profile(folder: Path, memory_bytes: float) -> dict:
    """An XDG cache holding a cpu profile (the planner's numbers for this machine), as the env vars
    that point the runs at it."""
    save_profile(DeviceProfile("cpu", 1e10, memory_bytes, 0.8, 1e9, 1e-4, 1e9, 1e-4, hbm_bw=1e10, dp_overlap=0.0),
                 folder / "moetron" / "plan_profile.json")
    return {"XDG_CACHE_HOME": str(folder), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def train(forked_moetron):
    """train(ranks, *args, env) → `moetron train configs/tiny.yaml *args` on `ranks` forked ranks, as
    a CompletedProcess (the forked_moetron fixture)."""
    return lambda ranks, *args, env: forked_moetron(ranks, ["train", "configs/tiny.yaml", *args], env)


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.distributed
def test_a_run_resumed_on_two_ranks_takes_the_planners_layout_and_continues_the_curve(train, tmp_path):
    env = profile(tmp_path / "cache", 8e9)
    base = [*SMALL, f"train.run_dir={tmp_path}"]
    straight = train(1, *base, "train.name=straight", env=env)
    assert straight.returncode == 0, straight.stderr[-2000:]
    first = train(1, *base, "train.name=split", "--exit-after", "3", env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    grown = train(2, *base, "train.name=split", "--layout", "auto", env=env)
    assert grown.returncode == 0, grown.stderr[-3000:]
    assert "--layout auto on 2 × cpu:" in grown.stderr and "predicted" in grown.stderr

    want, got = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in range(4, 7):  # the same global batch on another layout: equal up to summation order
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got[step], want[step])

    starts = [json.loads(line) for line in (tmp_path / "split" / "layouts.jsonl").read_text().splitlines()]
    assert [(s["step"], s["world_size"], s["chosen_by"]) for s in starts] == [(0, 1, "config"), (3, 2, "auto")]
    # One process ran micro-batches of all 8 sequences: of the 2-rank layouts only those that split
    # each sequence (cp2) or each layer (tp2, pp2) keep them whole.
    assert starts[1]["micro_batch"] == 8 and "parallel.dp=1" in starts[1]["overrides"]
    assert starts[1]["prediction"]["profile"] == "cpu" and starts[1]["prediction"]["step_s"] > 0
    saved = (tmp_path / "split" / "config.yaml").read_text()
    assert all(o.split("=")[0].split(".")[-1] + ":" in saved for o in starts[1]["overrides"])
    assert "layout changed at step 3: 1 ranks" in grown.stdout + grown.stderr


@pytest.mark.distributed
def test_a_run_resumed_on_fewer_ranks_keeps_its_micro_batches_and_its_curve(train, tmp_path):
    """2 ranks, then one process: `--layout auto` accumulates 2 micro-batches of the 4 sequences each
    rank had, so every micro-batch's balance loss is the one it was (README, Losing nodes), and the
    curve is one process's with the same micro-batches up to the order of sums."""
    env = profile(tmp_path / "cache", 8e9)
    base = [*SMALL, f"train.run_dir={tmp_path}"]
    straight = train(1, *base, "train.name=straight", "train.grad_accum=2", env=env)
    assert straight.returncode == 0, straight.stderr[-2000:]
    first = train(2, *base, "train.name=split", "--exit-after", "3", env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    shrunk = train(1, *base, "train.name=split", "--layout", "auto", env=env)
    assert shrunk.returncode == 0, shrunk.stderr[-3000:]
    starts = [json.loads(line) for line in (tmp_path / "split" / "layouts.jsonl").read_text().splitlines()]
    assert [(s["world_size"], s["micro_batch"]) for s in starts] == [(2, 4), (1, 4)]
    assert "train.grad_accum=2" in starts[1]["overrides"]
    want, got = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got[step], want[step])


def test_a_resume_no_layout_can_keep_the_micro_batch_of_plans_freely_and_says_so(train, tmp_path):
    """Halving the global batch at a resume leaves no layout with the previous 8-sequence micro-batch:
    the plan is free, one line says the curve shifts, and the run trains on."""
    env = profile(tmp_path / "cache", 8e9)
    base = [*SMALL, f"train.run_dir={tmp_path}", "train.name=halved"]
    first = train(1, *base, "--exit-after", "3", env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    halved = train(1, *base, "train.batch_size=4", "--layout", "auto", env=env)
    assert halved.returncode == 0, halved.stderr[-3000:]
    assert "no layout on 1 ranks keeps the previous start's 8-sequence micro-batches" in halved.stderr
    starts = [json.loads(line) for line in (tmp_path / "halved" / "layouts.jsonl").read_text().splitlines()]
    assert [(s["step"], s["micro_batch"]) for s in starts] == [(0, 8), (3, 4)]
    assert sorted(losses(tmp_path / "halved")) == list(range(1, 7))


def test_a_world_where_no_layout_fits_is_refused_before_anything_is_written(tmp_path):
    env = profile(tmp_path / "cache", 1e5)  # 100 kB per rank: no layout of the model fits
    out = subprocess.run([sys.executable, "-m", "moetron", "train", "configs/tiny.yaml", *SMALL,
                          f"train.run_dir={tmp_path / 'runs'}", "train.name=none", "--layout", "auto"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=600)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--layout auto: no layout of configs/tiny.yaml fits on 1 × cpu" in lines[0]
    assert not (tmp_path / "runs").exists()

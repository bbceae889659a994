"""`moetron submit` where no Slurm is needed: the layout arithmetic, Slurm's time format, the
refusals that come before any Slurm client runs (exit 2, one line), and a requeued run that is
already complete. These run with SLURM_CONF=/dev/null, under which every Slurm client fails at
once: had the command called one before refusing, the refusal would be a different line.

The command against the real local Slurm (partitions, dry runs, submissions, a busy run folder) is
in tests/slurm/test_submit_cli.py; whole jobs in tests/slurm/test_submit_jobs.py."""

import os
from pathlib import Path

import pytest

from moetron.launcher.cli.main import main
from moetron.launcher.cluster.submit import SlurmError, slurm_seconds, tasks_per_node

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
# Variables a launcher sets; the tests may themselves run inside a Slurm job.
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "PMI_", "TORCHELASTIC_")


@pytest.fixture
def no_cluster(tmp_path, monkeypatch):
    """A fresh working folder where no Slurm answers: SLURM_CONF is empty, so sinfo, sbatch and
    squeue exit at once with an error, and nothing can be queued."""
    for key in [k for k in os.environ if k.startswith(_LAUNCH_PREFIXES)]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_CONF", "/dev/null")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def submit(*args: str) -> int:
    return main(["submit", str(CONFIG), "train.run_dir=runs", "train.name=job", *args])


def one_line(err: str) -> str:
    assert err.count("\n") == 1, err
    return err


# --- arithmetic -------------------------------------------------------------------------------------


def test_one_task_per_gpu_must_cover_the_layout():
    assert tasks_per_node(16, 2, 8) == 8
    with pytest.raises(SlurmError, match=r"--nodes 2 × --gpus-per-node 4 = 8 GPUs, but the layout needs parallel.pp × dp × cp × tp = 16"):
        tasks_per_node(16, 2, 4)


def test_cpu_only_nodes_split_the_layout_evenly():
    assert tasks_per_node(4, 1, 0) == 4
    assert tasks_per_node(4, 2, 0) == 2
    with pytest.raises(SlurmError, match=r"--nodes 3 does not divide .* 4 ranks"):
        tasks_per_node(4, 3, 0)


@pytest.mark.parametrize("text,seconds", [
    ("1", 60), ("90", 5400), ("0:30", 60), ("1:30", 120), ("01:00:00", 3600), ("2-00", 172800),
    ("1-02:03", 93780), ("1-00:00:01", 86460), ("UNLIMITED", None),
])
def test_slurm_times_in_whole_minutes(text, seconds):
    assert slurm_seconds(text) == seconds


# --- refusals before any Slurm call ----------------------------------------------------------------


def test_missing_config_is_refused(no_cluster, capsys):
    assert main(["submit", "configs/nope.yaml", "--dry-run"]) == 2
    assert "configs/nope.yaml: no such config file" in one_line(capsys.readouterr().err)
    assert list(no_cluster.iterdir()) == []


def test_world_size_mismatch_shows_the_arithmetic(no_cluster, capsys):
    assert submit("parallel.dp=2", "parallel.tp=2", "--nodes", "1", "--gpus-per-node", "8") == 2
    err = one_line(capsys.readouterr().err)
    assert "--nodes 1 × --gpus-per-node 8 = 8 GPUs" in err and "parallel.pp × dp × cp × tp = 4" in err
    assert not Path("runs").exists()  # no script written, so none submitted


def test_signal_after_the_time_limit_is_refused(no_cluster, capsys):
    assert submit("--time", "2", "--signal-seconds", "120", "--dry-run") == 2
    assert "signal_seconds = 120 must be below the time limit --time 2 (120 s)" in one_line(capsys.readouterr().err)


def test_bad_time_is_refused(no_cluster, capsys):
    assert submit("--time", "soon", "--dry-run") == 2
    assert "--time 'soon' is not a Slurm time" in one_line(capsys.readouterr().err)


def test_dry_run_without_a_controller_renders_and_warns(no_cluster, capsys):
    """A laptop or a stopped cluster: sinfo is installed but fails. The script is still printed;
    the partition is reported as unchecked, and nothing is written."""
    assert submit("--nodes", "1", "--gpus-per-node", "0", "--partition", "gpu", "--dry-run") == 0
    out = capsys.readouterr()
    assert out.out.startswith("#!/bin/bash") and "#SBATCH --partition=gpu" in out.out
    assert "warning: partition not checked" in out.err and "nothing written or submitted" in out.err
    assert not Path("runs").exists()


def test_dp_left_out_fills_the_allocation(no_cluster, capsys):
    """One rank per GPU: 2 nodes × 4 GPUs with tp 2 is dp 4, as torchrun would infer at launch."""
    assert submit("parallel.tp=2", "parallel.ep=2", "--nodes", "2", "--gpus-per-node", "4", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "#SBATCH --ntasks-per-node=4" in out and "#SBATCH --nodes=2" in out


# --- a requeued run ---------------------------------------------------------------------------------


def test_requeued_after_its_last_step_the_run_exits_at_once(tmp_path, monkeypatch, capsys):
    # A warning that comes during the last step requeues a job whose run is already complete.
    monkeypatch.chdir(tmp_path)
    args = ["train", str(CONFIG), "train.run_dir=runs", "train.name=done", "train.steps=2", "train.log_every=1",
            "model.d_model=64", "model.n_layers=2", "model.d_ff=128", "model.moe.d_expert=64",
            "train.seq_len=32", "train.batch_size=2", "train.eval_batches=1", "train.threads=1"]
    assert main(args) == 0
    metrics = (tmp_path / "runs/done/metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(args) == 0
    assert "already finished" in capsys.readouterr().out
    assert (tmp_path / "runs/done/metrics.jsonl").read_text() == metrics

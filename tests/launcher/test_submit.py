"""`moetron submit` without a cluster: the layout arithmetic, refusals (exit 2, one line), the dry
run, and what a submission writes. Slurm's clients are stand-in scripts on PATH that record their
calls, so "nothing was submitted" is checked, not assumed.

Real jobs on the local Slurm are in tests/slurm/test_submit_jobs.py."""

import json
import os
from pathlib import Path

import pytest
import yaml

from moetron.launcher.cli import main
from moetron.launcher.config import load_config
from moetron.launcher.submit import SlurmError, slurm_seconds, tasks_per_node

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """sinfo (partitions debug*, urgent), sbatch (job 4242) and squeue stand-ins; returns the file
    their calls are appended to."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    tools = {
        "sinfo": 'printf "debug*\\nurgent\\n"',
        "sbatch": "echo 4242",
        "squeue": 'cat "$FAKE_SQUEUE" 2>/dev/null || true',
    }
    for name, body in tools.items():
        (bin_dir / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {calls}\n{body}\n')
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    return calls


def submit(*args: str) -> int:
    return main(["submit", str(CONFIG), "train.run_dir=runs", "train.name=job", *args])


def one_line(err: str) -> str:
    assert err.count("\n") == 1, err
    return err


# --- arithmetic -------------------------------------------------------------------------------------


def test_one_task_per_gpu_must_cover_the_layout():
    assert tasks_per_node(16, 2, 8) == 8
    with pytest.raises(SlurmError, match=r"--nodes 2 × --gpus-per-node 4 = 8 GPUs, but the layout needs parallel.pp × dp × tp = 16"):
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


# --- refusals ---------------------------------------------------------------------------------------


def test_missing_config_is_refused(fake_slurm, capsys):
    assert main(["submit", "configs/nope.yaml", "--dry-run"]) == 2
    assert "configs/nope.yaml: no such config file" in one_line(capsys.readouterr().err)
    assert not fake_slurm.exists()


def test_world_size_mismatch_shows_the_arithmetic(fake_slurm, capsys):
    assert submit("parallel.dp=2", "parallel.tp=2", "--nodes", "1", "--gpus-per-node", "8") == 2
    err = one_line(capsys.readouterr().err)
    assert "--nodes 1 × --gpus-per-node 8 = 8 GPUs" in err and "parallel.pp × dp × tp = 4" in err
    assert not fake_slurm.exists() or "sbatch" not in fake_slurm.read_text()


def test_unknown_partition_is_refused_with_the_known_ones(fake_slurm, capsys):
    assert submit("--partition", "gpu") == 2
    assert "unknown partition 'gpu'; this cluster has debug, urgent" in one_line(capsys.readouterr().err)
    assert "sbatch" not in fake_slurm.read_text()
    assert not Path("runs/job").exists()


def test_signal_after_the_time_limit_is_refused(fake_slurm, capsys):
    assert submit("--time", "2", "--signal-seconds", "120", "--dry-run") == 2
    assert "signal_seconds = 120 must be below the time limit --time 2 (120 s)" in one_line(capsys.readouterr().err)


def test_bad_time_is_refused(fake_slurm, capsys):
    assert submit("--time", "soon", "--dry-run") == 2
    assert "--time 'soon' is not a Slurm time" in one_line(capsys.readouterr().err)


def test_folder_with_a_run_but_no_checkpoint_is_refused(fake_slurm, capsys):
    Path("runs/job").mkdir(parents=True)
    Path("runs/job/metrics.jsonl").write_text("{}\n")
    assert submit() == 2
    assert "already holds a run but no complete checkpoint" in one_line(capsys.readouterr().err)
    assert "sbatch" not in fake_slurm.read_text()


# --- dry run and submission -------------------------------------------------------------------------


def test_dry_run_prints_the_script_and_submits_nothing(fake_slurm, capsys):
    assert submit("parallel.dp=2", "--nodes", "1", "--gpus-per-node", "0", "--time", "30",
                  "--partition", "urgent", "--requeue-limit", "2", "--signal-seconds", "90", "--dry-run") == 0
    out = capsys.readouterr()
    run = Path("runs/job").resolve()
    assert out.out.startswith("#!/bin/bash")
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=2", "#SBATCH --partition=urgent",
                 "#SBATCH --time=30", "#SBATCH --requeue", "#SBATCH --signal=B:USR1@90",
                 f"#SBATCH --output={run}/slurm/%j.out", f"#SBATCH --chdir={Path.cwd()}", "requeue_limit=2"):
        assert line in out.out.splitlines()
    assert f"-m moetron train {run}/slurm/config.yaml" in out.out
    assert "--gpus-per-node" not in out.out  # CPU-only: no GRES request
    assert "nothing written or submitted" in out.err
    assert "sbatch" not in fake_slurm.read_text()  # sinfo was asked; nothing else
    assert not Path("runs").exists()


def test_gpu_nodes_get_one_task_per_gpu(fake_slurm, capsys):
    assert submit("parallel.dp=4", "parallel.tp=4", "--nodes", "2", "--gpus-per-node", "8", "--dry-run",
                  "--exclusive", "--account", "lm", "--qos", "high", "--constraint", "h100") == 0
    lines = capsys.readouterr().out.splitlines()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --exclusive", "#SBATCH --account=lm", "#SBATCH --qos=high", "#SBATCH --constraint=h100"):
        assert line in lines


def test_submission_writes_what_the_dry_run_printed(fake_slurm, capsys):
    assert submit("train.steps=7", "--gpus-per-node", "0", "--dry-run") == 0
    printed = capsys.readouterr().out
    assert submit("train.steps=7", "--gpus-per-node", "0") == 0
    assert "submitted job 4242" in capsys.readouterr().out
    folder = Path("runs/job/slurm").resolve()
    assert (folder / "job.sbatch").read_text() == printed
    assert f"sbatch --parsable {folder}/job.sbatch" in fake_slurm.read_text()
    [entry] = [json.loads(line) for line in (folder / "jobs.jsonl").read_text().splitlines()]
    assert entry["job"] == "4242" and entry["tasks"] == 1
    # The job trains from the resolved config: overrides applied, the run folder absolute.
    resolved = load_config(folder / "config.yaml")
    assert resolved.train.steps == 7 and resolved.train.run_dir == str(folder.parent.parent)
    assert resolved.run_name == "job"
    assert yaml.safe_load((folder / "config.yaml").read_text())["slurm"]["requeue_limit"] == 3


def test_second_submission_while_the_first_is_queued_is_refused(fake_slurm, capsys, monkeypatch, tmp_path):
    assert submit("--gpus-per-node", "0") == 0
    queued = tmp_path / "squeue.txt"
    queued.write_text("4242|job|RUNNING|0:05|1:00:00|1|debug|vm|/x/runs/job/slurm/job.sbatch\n")
    monkeypatch.setenv("FAKE_SQUEUE", str(queued))
    capsys.readouterr()
    assert submit("--gpus-per-node", "0") == 2
    assert "job 4242 is already queued or running" in one_line(capsys.readouterr().err)
    assert fake_slurm.read_text().count("sbatch --parsable") == 1


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

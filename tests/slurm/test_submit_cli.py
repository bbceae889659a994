"""`moetron submit` against the local Slurm: partitions as sinfo reports them, the dry run, what a
submission writes and what sbatch was given, and the refusals that need the cluster (exit 2, one
line). "Nothing was submitted" is what Slurm itself says: no job in squeue or sacct whose working
folder is the test's. Every job a test submits is cancelled when it ends; none is left to run.

Whole jobs that train, requeue and resume are in test_submit_jobs.py."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from moetron.launcher.cli.main import main
from moetron.launcher.config import load_config

pytestmark = [pytest.mark.slurm]

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}


def slurm(argv, env) -> str:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{' '.join(argv)} exited {out.returncode}: {out.stderr}"
    return out.stdout


def jobs_from(folder: Path, env) -> set[str]:
    """Every job Slurm knows that was submitted from `folder`: in the controller (squeue, ended
    ones included) or in accounting (sacct)."""
    rows = slurm(["squeue", "-h", "-t", "all", "-o", "%i|%Z"], env)
    rows += slurm(["sacct", "-n", "-X", "-P", "-o", "JobID,WorkDir"], env)
    return {job for job, _, work in (row.partition("|") for row in rows.splitlines()) if work == str(folder)}


def cancel(jobs: set[str], env, timeout: float = 30) -> None:
    """scancel the jobs and wait until the controller has ended every one."""
    if not jobs:
        return
    subprocess.run(["scancel", *sorted(jobs)], env=env, capture_output=True, timeout=60)
    deadline = time.monotonic() + timeout
    while True:
        states = slurm(["squeue", "-h", "-t", "all", "-j", ",".join(sorted(jobs)), "-o", "%T"], env).split()
        if all(state in ENDED for state in states) or time.monotonic() > deadline:
            assert all(state in ENDED for state in states), f"jobs {sorted(jobs)} still {states} after scancel"
            return
        time.sleep(0.2)


@pytest.fixture
def here(slurm_env, tmp_path, monkeypatch):
    """A fresh working folder, with slurm_env as the environment the command (and so sbatch) sees.
    Afterwards every job submitted from the folder is cancelled."""
    for key in set(os.environ) - set(slurm_env):
        monkeypatch.delenv(key)
    for key, value in slurm_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    cancel(jobs_from(tmp_path, slurm_env), slurm_env)


def submit(*args: str) -> int:
    return main(["submit", str(CONFIG), "train.run_dir=runs", "train.name=job", *args])


def one_line(err: str) -> str:
    assert err.count("\n") == 1, err
    return err


def submit_line(job: str, env, timeout: float = 20) -> str:
    """The command line the job was submitted with, per accounting (which may lag a moment)."""
    deadline = time.monotonic() + timeout
    while not (line := slurm(["sacct", "-n", "-X", "-P", "-j", job, "-o", "SubmitLine"], env).strip()):
        assert time.monotonic() < deadline, f"sacct has no record of job {job} after {timeout} s"
        time.sleep(0.2)
    return line.splitlines()[0]


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["submit", "dry-run"])
def test_unknown_partition_is_refused_with_the_known_ones(here, slurm_env, capsys, dry_run):
    """sinfo's partitions (debug, the default, first) name the choices; a dry run asks sinfo too."""
    assert submit("--partition", "gpu", *dry_run) == 2
    assert "unknown partition 'gpu'; this cluster has debug, urgent" in one_line(capsys.readouterr().err)
    assert jobs_from(here, slurm_env) == set()
    assert not Path("runs/job").exists()


def test_folder_with_a_run_but_no_checkpoint_is_refused(here, slurm_env, capsys):
    """Refused after sinfo has answered, before sbatch: Slurm queued nothing."""
    Path("runs/job").mkdir(parents=True)
    Path("runs/job/metrics.jsonl").write_text("{}\n")
    assert submit() == 2
    assert "already holds a run but no complete checkpoint" in one_line(capsys.readouterr().err)
    assert jobs_from(here, slurm_env) == set()
    assert not Path("runs/job/slurm/jobs.jsonl").exists()


# --- dry run and submission -------------------------------------------------------------------------


def test_dry_run_prints_the_script_and_submits_nothing(here, slurm_env, capsys):
    """The partition is checked with the real sinfo; Slurm queued nothing and nothing was written."""
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
    assert jobs_from(here, slurm_env) == set()
    assert not Path("runs").exists()


def test_gpu_nodes_get_one_task_per_gpu(here, slurm_env, capsys):
    """A dry run for GPU nodes the local cluster lacks: rendered, checked against sinfo, not queued."""
    assert submit("parallel.dp=4", "parallel.tp=4", "--nodes", "2", "--gpus-per-node", "8", "--dry-run",
                  "--exclusive", "--account", "lm", "--qos", "high", "--constraint", "h100") == 0
    lines = capsys.readouterr().out.splitlines()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --exclusive", "#SBATCH --account=lm", "#SBATCH --qos=high", "#SBATCH --constraint=h100"):
        assert line in lines
    assert jobs_from(here, slurm_env) == set()


def test_submission_writes_what_the_dry_run_printed(here, slurm_env, capsys):
    """sbatch queues the written script; the job id Slurm gave is the one recorded in jobs.jsonl."""
    assert submit("train.steps=7", "--gpus-per-node", "0", "--dry-run") == 0
    printed = capsys.readouterr().out
    assert submit("train.steps=7", "--gpus-per-node", "0") == 0
    out = capsys.readouterr().out
    [job] = jobs_from(here, slurm_env)
    assert f"submitted job {job}" in out
    folder = Path("runs/job/slurm").resolve()
    assert (folder / "job.sbatch").read_text() == printed
    assert submit_line(job, slurm_env) == f"sbatch --parsable {folder}/job.sbatch"
    [entry] = [json.loads(line) for line in (folder / "jobs.jsonl").read_text().splitlines()]
    assert entry["job"] == job and entry["tasks"] == 1
    # The job trains from the resolved config: overrides applied, the run folder absolute.
    resolved = load_config(folder / "config.yaml")
    assert resolved.train.steps == 7 and resolved.train.run_dir == str(folder.parent.parent)
    assert resolved.run_name == "job"
    assert yaml.safe_load((folder / "config.yaml").read_text())["slurm"]["requeue_limit"] == 3


def test_second_submission_while_the_first_is_queued_is_refused(here, slurm_env, capsys):
    """squeue reports the first job queued or running; the second sbatch never happens."""
    assert submit("--gpus-per-node", "0") == 0
    [first] = jobs_from(here, slurm_env)
    capsys.readouterr()
    assert submit("--gpus-per-node", "0") == 2
    assert f"job {first} is already queued or running" in one_line(capsys.readouterr().err)
    assert jobs_from(here, slurm_env) == {first}
    assert len(Path("runs/job/slurm/jobs.jsonl").read_text().splitlines()) == 1

"""What Slurm knows about moetron's jobs, and what their run folders say: the queries behind
`moetron status`, `moetron logs` and `moetron cancel`.

A job and its run folder find each other both ways: a submission appends the job id to
<run>/slurm/jobs.jsonl, and a job's script is <run>/slurm/job.sbatch, which Slurm reports as the
job's command (squeue, scontrol) or submit line (sacct, after the job has left the queue).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moetron.launcher.cluster.submit import SCRIPT, SLURM_FOLDER, SlurmError, recorded_jobs, slurm_command

JOB_ID = re.compile(r"^\d+(_\d+)?$")
# squeue's states of a job that still holds or waits for resources.
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
          "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "PREEMPTED"}
_SQUEUE = ("%i", "%j", "%T", "%M", "%l", "%D", "%P", "%R", "%o")
_SACCT = ("JobID", "JobName", "State", "Start", "End", "Elapsed", "ExitCode", "Partition", "NNodes",
          "SubmitLine", "WorkDir")


@dataclass(frozen=True)
class QueuedJob:
    """A job as squeue shows it now."""

    job: str
    name: str
    state: str
    elapsed: str
    limit: str
    nodes: str
    partition: str
    reason: str
    command: str


@dataclass(frozen=True)
class Attempt:
    """One start of a job as sacct recorded it; a requeued job has one per start."""

    job: str
    name: str
    state: str
    start: str
    end: str
    elapsed: str
    exit_code: str
    partition: str
    nodes: str
    submit_line: str
    work_dir: str


@dataclass(frozen=True)
class Slurm:
    """The Slurm client commands, with the environment and runner they are called with."""

    env: Optional[dict] = None
    run: Callable = subprocess.run

    def _call(self, argv: list[str]) -> str:
        return slurm_command(argv, run=self.run, env=self.env)

    def queue(self, job_ids: Optional[list[str]] = None) -> list[QueuedJob]:
        """Queued and running jobs: the given ones (those Slurm still knows), or all of this user's."""
        if job_ids == []:
            return []
        select = ["-j", ",".join(job_ids)] if job_ids else ["--me"]
        try:
            out = self._call(["squeue", "-h", *select, "-o", "|".join(_SQUEUE)])
        except SlurmError as e:
            if "Invalid job id" in str(e):
                return []  # finished and purged from the controller
            raise
        rows = [line.split("|", len(_SQUEUE) - 1) for line in out.splitlines() if line.strip()]
        return [QueuedJob(*row) for row in rows if len(row) == len(_SQUEUE)]

    def attempts(self, job_id: str) -> list[Attempt]:
        """Every start of the job, oldest first (needs accounting, i.e. slurmdbd)."""
        out = self._call(["sacct", "-j", job_id, "--duplicates", "-X", "-n", "-P", "-o", ",".join(_SACCT)])
        rows = [line.split("|") for line in out.splitlines() if line.strip()]
        # SubmitLine may itself contain "|": everything between the fixed columns belongs to it.
        fixed = len(_SACCT) - 2
        attempts = [Attempt(*row[:fixed], "|".join(row[fixed:-1]), row[-1]) for row in rows if len(row) >= len(_SACCT)]
        # "CANCELLED by 0" names who cancelled; the state is the first word.
        return [dataclasses.replace(a, state=a.state.split()[0] if a.state else a.state) for a in attempts]

    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict; empty once the controller has forgotten the job."""
        try:
            out = self._call(["scontrol", "show", "job", "-o", job_id])
        except SlurmError as e:
            if "Invalid job id" in str(e):
                return {}
            raise
        fields = {}
        for token in shlex.split(out.splitlines()[0]) if out.strip() else []:
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        return fields

    def cancel(self, job_id: str, signal: Optional[str] = None) -> None:
        self._call(["scancel", *(["--signal", signal] if signal else []), job_id])


# --- job <-> run folder -----------------------------------------------------------------------------


def run_folder_of_script(script: str, work_dir: str = "") -> Optional[Path]:
    """The run folder whose <run>/slurm/job.sbatch `script` is (relative to `work_dir`)."""
    path = Path(work_dir or ".") / script
    if path.name == SCRIPT and path.parent.name == SLURM_FOLDER:
        return path.parent.parent
    return None


def job_run_folder(slurm: Slurm, job_id: str) -> Optional[Path]:
    """The run folder a job trains into: from the controller while it knows the job, else sacct."""
    fields = slurm.job_fields(job_id)
    if fields.get("Command"):
        found = run_folder_of_script(fields["Command"].split()[0], fields.get("WorkDir", ""))
        if found is not None:
            return found
    try:
        attempts = slurm.attempts(job_id)
    except SlurmError:
        return None
    for a in attempts:
        words = shlex.split(a.submit_line) if a.submit_line else []
        for word in words[1:]:
            found = run_folder_of_script(word, a.work_dir)
            if found is not None:
                return found
    return None


def log_path(slurm: Slurm, job_id: str) -> Path:
    """The file the job writes its output to."""
    fields = slurm.job_fields(job_id)
    if fields.get("StdOut"):
        return Path(fields["StdOut"])
    run = job_run_folder(slurm, job_id)
    if run is None:
        raise SlurmError(f"job {job_id} is unknown to Slurm or was not submitted by moetron; "
                         f"give a job id from `moetron status`")
    return run / SLURM_FOLDER / f"{job_id}.out"


def active_jobs(slurm: Slurm, run_path: Path) -> list[str]:
    """Jobs of the run folder that are queued or running now."""
    ids = [entry["job"] for entry in recorded_jobs(run_path)]
    return [q.job for q in slurm.queue(ids) if q.state in ACTIVE] if ids else []


# --- the run folder's own account of itself ---------------------------------------------------------


@dataclass(frozen=True)
class RunProgress:
    """How far a run got, from its files."""

    path: Path
    steps: Optional[int]
    last_step: Optional[int]
    last_loss: Optional[float]
    checkpoint: Optional[Path]


def run_progress(run_path: Path) -> RunProgress:
    from moetron.launcher.checkpoint.folders import latest_checkpoint

    run_path = Path(run_path)
    steps = None
    for config in (run_path / "config.yaml", run_path / SLURM_FOLDER / "config.yaml"):
        if config.is_file():
            import yaml

            steps = ((yaml.safe_load(config.read_text()) or {}).get("train") or {}).get("steps")
            break
    last = _last_record(run_path / "metrics.jsonl")
    ckpt = latest_checkpoint(run_path / "checkpoints") if (run_path / "checkpoints").is_dir() else None
    return RunProgress(run_path, steps, last.get("step"), last.get("loss"), ckpt)


def _last_record(metrics: Path) -> dict:
    if not metrics.is_file():
        return {}
    for line in reversed(metrics.read_text().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written right now
    return {}

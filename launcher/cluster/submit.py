"""`moetron submit`: turn a config and a layout into a Slurm batch job that survives its limits.

Why the rendered `slurm/moetron.sbatch` is submitted with `sbatch`, not through submitit:

- submitit's signal handler (1.5) lets only task 0 act on the time-limit/preemption signal: inside
  the handler it pickles its own state, requeues and exits, while every other task ignores the
  signal and runs on into collectives that rank 0 has left. A sharded checkpoint is a collective:
  every rank must finish its step, write its shards and stop together.
- submitit pickles a function into its own folder and requeues that pickle. The job here is
  exactly the script written into the run folder, so what Slurm ran, what the user reads and
  what they can `sbatch` again by hand are the same file; the run folder alone holds the run.
- The script asks for the warning at the batch shell (`--signal=B:USR1@N`) and forwards it to
  `srun`, which delivers it to every task; the tasks are started by srun directly (torchrun would
  swallow the signal). When they have exited with their checkpoint, the script requeues its own
  job up to the requeue limit; the requeued job resumes the newest checkpoint of the same folder.

What a submission leaves in <run>/slurm/:
  config.yaml    the resolved config (overrides applied, run_dir absolute) the job trains from
  job.sbatch     the batch script; `sbatch <run>/slurm/job.sbatch` submits it again by hand
  jobs.jsonl     one line per submission: job id, time, layout
  <JOBID>.out    the job's log, appended to by every attempt
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from moetron.launcher.cluster.sbatch import SbatchError, render_sbatch
from moetron.launcher.config import Config, ConfigError, SlurmConfig, config_from_dict
from moetron.launcher.run_dir import open_run_dir

SLURM_FOLDER = "slurm"
SCRIPT = "job.sbatch"
RESOLVED_CONFIG = "config.yaml"
JOBS = "jobs.jsonl"


class SlurmError(RuntimeError):
    """A submission or a query that Slurm (or its tools) cannot serve; printed as one line."""


@dataclass(frozen=True)
class Submission:
    """Everything `sbatch` needs: the script text and where it and the resolved config go."""

    config: Config
    run_path: Path
    script: str
    config_yaml: str
    tasks: int
    tasks_per_node: int
    min_nodes: int  # = the allocation's nodes unless the job may run on fewer

    @property
    def nodes_text(self) -> str:
        """The node count as sbatch's --nodes reads it: N, or MIN-MAX."""
        nodes = self.tasks // self.tasks_per_node
        return f"{self.min_nodes}-{nodes}" if self.min_nodes < nodes else str(nodes)

    @property
    def folder(self) -> Path:
        return self.run_path / SLURM_FOLDER

    @property
    def script_path(self) -> Path:
        return self.folder / SCRIPT


# --- the layout ---------------------------------------------------------------------------------


def tasks_per_node(world_size: int, nodes: int, gpus_per_node: int) -> int:
    """One task per GPU; on CPU-only nodes (`gpus_per_node` 0) the layout's ranks spread evenly.
    Raises SlurmError with the arithmetic when the allocation cannot hold the layout exactly."""
    if gpus_per_node > 0:
        if nodes * gpus_per_node != world_size:
            raise SlurmError(
                f"--nodes {nodes} × --gpus-per-node {gpus_per_node} = {nodes * gpus_per_node} GPUs, but the layout "
                f"needs parallel.pp × dp × cp × tp = {world_size} ranks; change the nodes/GPUs or the parallel sizes"
            )
        return gpus_per_node
    if world_size % nodes:
        raise SlurmError(
            f"--nodes {nodes} does not divide the layout's parallel.pp × dp × cp × tp = {world_size} ranks "
            f"({world_size} / {nodes} is not whole); use a node count that divides {world_size}"
        )
    return world_size // nodes


def slurm_seconds(limit: str) -> Optional[int]:
    """Seconds in a Slurm time ("90", "1:30:00", "2-12", ...); None for UNLIMITED. Slurm keeps
    limits in whole minutes, rounding seconds up, and so does this."""
    if limit.upper() in ("UNLIMITED", "INFINITE"):
        return None
    days, _, rest = limit.rpartition("-")
    try:
        parts = [int(p) for p in rest.split(":")]
        int(days or 0)
    except ValueError:
        raise SlurmError(f"--time {limit!r} is not a Slurm time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS") from None
    if len(parts) > 3:
        raise SlurmError(f"--time {limit!r} has more than three ':' fields; use D-HH:MM:SS")
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, s = parts + [0] * (3 - len(parts))
    elif len(parts) == 1:  # M
        h, m, s = 0, parts[0], 0
    elif len(parts) == 2:  # M:S
        h, (m, s) = 0, parts
    else:  # H:M:S
        h, m, s = parts
    minutes = (int(days or 0) * 24 + h) * 60 + m + (1 if s else 0)
    return minutes * 60


# --- partitions ---------------------------------------------------------------------------------


def partitions(run: Callable = subprocess.run) -> list[str]:
    """The partitions `sinfo` reports, the default first (without sinfo's `*` mark)."""
    out = slurm_command(["sinfo", "-h", "-o", "%P"], run=run)
    names = [p.strip() for p in out.split() if p.strip()]
    names.sort(key=lambda p: not p.endswith("*"))
    return [p.rstrip("*") for p in dict.fromkeys(names)]


def check_partition(partition: Optional[str], known: list[str]) -> None:
    if partition is not None and partition not in known:
        raise SlurmError(f"unknown partition {partition!r}; this cluster has {', '.join(known) or 'none'} (from sinfo)")


def slurm_command(argv: list[str], *, run: Callable = subprocess.run, env: Optional[dict] = None, timeout: float = 60) -> str:
    """Run a Slurm client and return its stdout; a missing tool or a failure is one SlurmError line."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"{argv[0]} is not on PATH; run this on a Slurm login node (or set SLURM_CONF for a local cluster)")
    try:
        out = run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv)}` did not answer within {timeout:.0f} s; is slurmctld up?") from None
    if out.returncode != 0:
        reason = (out.stderr.strip().splitlines() or out.stdout.strip().splitlines() or ["no message"])[-1]
        raise SlurmError(f"`{' '.join(argv)}` failed: {reason}")
    return out.stdout


# --- building the submission ----------------------------------------------------------------------


def apply_flags(slurm: SlurmConfig, **flags) -> SlurmConfig:
    """The config's `slurm:` defaults with every flag that was given (not None) put over them."""
    given = {k: v for k, v in flags.items() if v is not None}
    unknown = sorted(set(given) - {f.name for f in dataclasses.fields(SlurmConfig)})
    if unknown:
        raise TypeError(f"not SlurmConfig fields: {', '.join(unknown)}")
    merged = dataclasses.replace(slurm, **given)
    for key, value, rule in merged.problems():
        raise ConfigError(f"slurm.{key} = {value!r}: {rule} (from the config or --{key.replace('_', '-')})")
    return merged


def resolve_for_job(cfg: Config, slurm: SlurmConfig, cwd: Path) -> Config:
    """The config the job trains from: the submission's Slurm settings, and an absolute run folder,
    so every attempt writes to the same place whichever folder it starts in."""
    data = cfg.to_dict()
    data["train"]["run_dir"] = str((cwd / cfg.train.run_dir).resolve())
    data["slurm"] = dataclasses.asdict(slurm)
    return config_from_dict(data)


def build_submission(cfg: Config, slurm: SlurmConfig, *, cwd: Path, python: str = sys.executable,
                     min_nodes: Optional[int] = None, train_args: tuple[str, ...] = ()) -> Submission:
    """Check the layout and limits, and render the batch script of `cfg` on the allocation `slurm`.
    `min_nodes` (below slurm.nodes): the job may start, and after a lost node requeue, on fewer
    nodes, down to this many; `cfg`'s layout is then the one for slurm.nodes, and `train_args`
    (`--layout auto …`) plan another at every start. `train_args` follow the training command."""
    per_node = tasks_per_node(cfg.parallel.world_size, slurm.nodes, slurm.gpus_per_node)
    limit = slurm_seconds(slurm.time)
    if limit is not None and slurm.signal_seconds >= limit:
        raise SlurmError(
            f"slurm.signal_seconds = {slurm.signal_seconds} must be below the time limit --time {slurm.time} "
            f"({limit} s), or the job is told to checkpoint before it trains"
        )
    resolved = resolve_for_job(cfg, slurm, cwd)
    run_path = Path(resolved.train.run_dir) / resolved.run_name
    folder = run_path / SLURM_FOLDER
    command = [python, "-m", "moetron", "train", str(folder / RESOLVED_CONFIG), *train_args]
    try:
        script = render_sbatch({
            "job_name": resolved.run_name,
            "command": command,
            "nodes": slurm.nodes,
            "min_nodes": min_nodes if min_nodes is not None and min_nodes < slurm.nodes else None,
            "tasks_per_node": per_node,
            "gpus_per_node": slurm.gpus_per_node or None,
            "cpus_per_task": slurm.cpus_per_task,
            "partition": slurm.partition,
            "time": slurm.time,
            "account": slurm.account,
            "qos": slurm.qos,
            "constraint": slurm.constraint,
            "exclusive": slurm.exclusive,
            "requeue_limit": slurm.requeue_limit,
            "signal_seconds": slurm.signal_seconds or None,
            "output": str(folder / "%j.out"),
            "chdir": str(cwd.resolve()),
        })
    except SbatchError as e:
        raise SlurmError(str(e)) from None
    config_yaml = yaml.safe_dump(resolved.to_dict(), sort_keys=False)
    return Submission(resolved, run_path, script, config_yaml, slurm.nodes * per_node, per_node,
                      min_nodes if min_nodes is not None else slurm.nodes)


def check_run_folder(cfg: Config, active_jobs: Callable[[Path], list[str]]) -> None:
    """Refuse, before anything is queued, a run folder the job could not use: one that holds a
    run without a checkpoint (RunError), or one another queued job is writing to."""
    run_path = Path(cfg.train.run_dir) / cfg.run_name
    open_run_dir(cfg, "auto", create=False)
    busy = active_jobs(run_path)
    if busy:
        raise SlurmError(
            f"job {', '.join(busy)} is already queued or running for {run_path}; "
            f"wait for it, `moetron cancel {busy[0]}`, or submit with train.name=<new name>"
        )


# --- submitting ---------------------------------------------------------------------------------


def write_submission(sub: Submission) -> Path:
    """Write the resolved config and the script into <run>/slurm/; returns the script's path."""
    sub.folder.mkdir(parents=True, exist_ok=True)
    (sub.folder / RESOLVED_CONFIG).write_text(sub.config_yaml)
    sub.script_path.write_text(sub.script)
    sub.script_path.chmod(0o755)
    return sub.script_path


def sbatch(script_path: Path, *, run: Callable = subprocess.run, env: Optional[dict] = None) -> str:
    """Submit `script_path`; returns the job id."""
    out = slurm_command(["sbatch", "--parsable", str(script_path)], run=run, env=env)
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed {out.strip()!r}, expected a job id")
    return job_id


def record_job(sub: Submission, job_id: str, slurm: SlurmConfig) -> None:
    """Append the job to <run>/slurm/jobs.jsonl, which `moetron status RUN` reads."""
    entry = {
        "job": job_id, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"), "nodes": slurm.nodes,
        **({"min_nodes": sub.min_nodes} if sub.min_nodes < slurm.nodes else {}),
        "tasks": sub.tasks, "gpus_per_node": slurm.gpus_per_node, "partition": slurm.partition,
        "time": slurm.time, "requeue_limit": slurm.requeue_limit, "user": os.environ.get("USER"),
    }
    with (sub.folder / JOBS).open("a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def recorded_jobs(run_path: Path) -> list[dict]:
    """The submissions of a run folder, oldest first."""
    path = Path(run_path) / SLURM_FOLDER / JOBS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

"""`moetron status [RUN|JOB]`, `moetron logs JOB [-f]`, `moetron cancel JOB|RUN`: watch and stop
Slurm jobs, each seen together with the run folder it trains into."""

from __future__ import annotations

import sys
import time


def register(sub) -> None:
    p = sub.add_parser(
        "status", help="Slurm jobs and how far their runs got",
        description="Without an argument: this user's queued and running jobs. With a run folder (or a "
                    "run name under runs/): its jobs and every attempt of each, the last logged step and "
                    "the latest checkpoint. With a job id: the same for that job's run.")
    p.add_argument("target", nargs="?", metavar="RUN|JOB", help="run folder, run name or Slurm job id")
    p.set_defaults(run=status)

    p = sub.add_parser("logs", help="print (or follow) a job's output",
                       description="Print the output file of a Slurm job, which every attempt appends to.")
    p.add_argument("job", metavar="JOB", help="Slurm job id")
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing as the job writes, until it leaves the queue (requeues included)")
    p.set_defaults(run=logs)

    p = sub.add_parser(
        "cancel", help="cancel a job (its ranks checkpoint first)",
        description="Cancel a Slurm job, or every queued job of a run folder. Slurm sends the ranks "
                    "SIGTERM; each finishes its step and checkpoints before it exits (Slurm kills what "
                    "still runs after its KillWait, 30 s by default), so the run can be resumed with "
                    "`moetron submit` of the same config.")
    p.add_argument("target", metavar="JOB|RUN", help="Slurm job id, run folder or run name")
    p.set_defaults(run=cancel)


# --- resolving what the user named -----------------------------------------------------------------


def _target(text: str):
    """("job", id) or ("run", folder); a bare name is looked up under runs/."""
    from pathlib import Path

    from moetron.launcher.cluster.jobs import JOB_ID
    from moetron.launcher.cluster.submit import SlurmError

    if JOB_ID.match(text):
        return "job", text
    for candidate in (Path(text), Path("runs") / text):
        if candidate.is_dir():
            return "run", candidate.resolve()
    raise SlurmError(f"{text!r} is neither a Slurm job id nor a run folder (nor a run name under runs/)")


# --- status ---------------------------------------------------------------------------------------


def status(args) -> int:
    from moetron.launcher.cluster.jobs import Slurm, job_run_folder
    from moetron.launcher.cluster.submit import SlurmError, recorded_jobs

    slurm = Slurm()
    if args.target is None:
        return _print_queue(slurm)
    kind, value = _target(args.target)
    if kind == "job":
        run = job_run_folder(slurm, value)
        if run is None and not slurm.queue([value]) and not _attempts_or_none(slurm, value):
            raise SlurmError(f"job {value} is unknown to Slurm (not queued, no accounting record)")
        jobs = [value]
    else:
        run = value
        jobs = [entry["job"] for entry in recorded_jobs(run)]
    if run is not None:
        _print_run(run)
    if not jobs:
        print("jobs:        none submitted with `moetron submit`")
    for job in jobs:
        _print_job(slurm, job)
    return 0


def _attempts_or_none(slurm, job: str):
    from moetron.launcher.cluster.submit import SlurmError

    try:
        return slurm.attempts(job)
    except SlurmError:
        return None  # no accounting on this cluster


def _print_queue(slurm) -> int:
    from moetron.launcher.cluster.jobs import run_folder_of_script

    queued = slurm.queue()
    if not queued:
        print("no queued or running jobs")
        return 0
    rows = [("JOB", "NAME", "STATE", "ELAPSED", "LIMIT", "NODES", "PARTITION", "REASON/NODES", "RUN")]
    for q in queued:
        run = run_folder_of_script(q.command.split()[0]) if q.command else None
        rows.append((q.job, q.name, q.state, q.elapsed, q.limit, q.nodes, q.partition, q.reason, str(run or "-")))
    _print_table(rows)
    return 0


def _print_run(run) -> None:
    from moetron.launcher.cluster.jobs import run_progress

    p = run_progress(run)
    print(f"run:         {p.path}")
    if p.last_step is None:
        print("progress:    no step logged yet")
    else:
        of = f"/{p.steps}" if p.steps else ""
        loss = f", loss {p.last_loss:.4f}" if p.last_loss is not None else ""
        done = " (finished)" if p.steps and p.last_step >= p.steps else ""
        print(f"progress:    step {p.last_step}{of}{loss}{done}")
    print(f"checkpoint:  {p.checkpoint or 'none yet'}")


def _print_job(slurm, job: str) -> None:
    queued = {q.job: q for q in slurm.queue([job])}
    attempts = _attempts_or_none(slurm, job)
    now = queued.get(job)
    head = f"job {job}:"
    if now is not None:
        head += f" {now.state} for {now.elapsed} (limit {now.limit}) in {now.partition}, {now.reason}"
    elif attempts:
        head += f" {attempts[-1].state}"
    else:
        head += " no longer known to Slurm"
    print(head)
    for number, a in enumerate(attempts or [], start=1):
        print(f"  attempt {number}: {a.state:<11} {a.start} → {a.end}  ({a.elapsed}, exit {a.exit_code})")


def _print_table(rows) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


# --- logs -----------------------------------------------------------------------------------------


def logs(args) -> int:
    from moetron.launcher.cluster.jobs import JOB_ID, Slurm, log_path
    from moetron.launcher.cluster.submit import SlurmError

    if not JOB_ID.match(args.job):
        raise SlurmError(f"{args.job!r} is not a Slurm job id (a number, e.g. 1234)")
    slurm = Slurm()
    path = log_path(slurm, args.job)
    if not args.follow:
        if not path.is_file():
            raise SlurmError(f"job {args.job} has no output yet at {path}; is it still pending? (moetron status {args.job})")
        sys.stdout.write(path.read_text(errors="replace"))
        return 0
    return _follow(slurm, args.job, path)


def _follow(slurm, job: str, path, poll: float = 0.5) -> int:
    """Print what the job appends, until it has left the queue and nothing more arrives."""
    from moetron.launcher.cluster.jobs import ACTIVE

    offset = 0
    while True:
        queued = any(q.state in ACTIVE for q in slurm.queue([job]))
        if path.is_file():
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            if chunk:
                offset += len(chunk)
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
                continue
        if not queued:
            return 0
        time.sleep(poll)


# --- cancel ---------------------------------------------------------------------------------------


def cancel(args) -> int:
    from moetron.launcher.cluster.jobs import ACTIVE, Slurm, active_jobs, job_run_folder
    from moetron.launcher.cluster.submit import SlurmError

    slurm = Slurm()
    kind, value = _target(args.target)
    if kind == "run":
        jobs = active_jobs(slurm, value)
        if not jobs:
            raise SlurmError(f"no queued or running job for {value}")
    else:
        if not any(q.state in ACTIVE for q in slurm.queue([value])):
            attempts = _attempts_or_none(slurm, value)
            state = f" (it ended {attempts[-1].state})" if attempts else ""
            raise SlurmError(f"job {value} is not queued or running{state}")
        jobs = [value]
    for job in jobs:
        slurm.cancel(job)
        run = value if kind == "run" else job_run_folder(slurm, job)
        where = f"; its ranks checkpoint into {run} before they exit" if run else ""
        print(f"cancelled job {job}{where}")
    return 0

"""The run folder's lease: one world trains in a run folder at a time.

Two worlds in one folder would overwrite each other's checkpoints and metrics: a stale group of
ranks that did not notice an elastic restart (a node dropped from the rendezvous that trains on),
or a second job started on the same folder by mistake. So every start takes the folder for a world
id of its own, recorded in <run>/lease.json, and a world checks that it still holds the folder
before it writes:

- Taking (rank 0, just before the start's first write, under a lock on the folder itself): a
  folder held by a live world of another job is refused in one line (exit 2). A world of the same
  job (`cluster/elastic.py`'s `job_identity`: the Slurm job id, torchrun's rendezvous id) is taken
  over at once, since this start is its restart and its ranks are dead or stale; so is a dead one.
  Live: on this host, its rank-0 process still runs; on another, its heartbeat (lease.json's
  mtime, touched every HEARTBEAT_S by a thread of its rank 0) is younger than LIVE_S.
- Checking: rank 0 reads lease.json before every step (its answer rides on the stop flag's
  all-reduce, so every rank stops after the same step) and before every metrics.jsonl record, and
  all ranks agree before a checkpoint is saved and again before it is published. A world that
  lost the folder raises `FenceLost` — one line naming the world that holds it, exit 2 — and
  writes nothing more; a checkpoint it was writing stays a .tmp- folder, which the holder's next
  save removes, and never replaces a published one.
- Releasing: a world that stops (finished, signalled or failed) removes the lease if it is still
  its own, so the next start need not wait for it to age.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from moetron.launcher.run_dir import RunError

LEASE = "lease.json"
HEARTBEAT_S = 10.0
# A lease of another host whose heartbeat is older than this is taken as dead: six missed beats.
LIVE_S = 60.0


class FenceLost(RunError):
    """Another world took the run folder: this one stops, writing nothing more (exit 2)."""


@dataclass(frozen=True)
class Holder:
    """A world holding a run folder, as lease.json records it."""

    world: str  # 12 hex digits, new at every start
    job: str | None  # `job_identity()`: what a restart of the same job shares; None: a job of its own
    host: str
    pid: int  # of its rank 0
    pid_start: str | None  # that process's start time (/proc/PID/stat), so a reused pid is not it
    ranks: int
    step: int  # the step it started at
    since: str

    def describe(self) -> str:
        return (f"world {self.world} ({self.job or 'no job id'}; {self.ranks} rank{'s' * (self.ranks > 1)} "
                f"from step {self.step}, rank 0 pid {self.pid} on {self.host}, since {self.since})")


def read_holder(run: Path) -> tuple[Holder, float] | None:
    """lease.json's holder and the seconds since its heartbeat, or None when the folder has no
    (readable) lease. Written by an atomic replace, so a reader sees the old or the new one."""
    path = run / LEASE
    try:
        text, mtime = path.read_text(), path.stat().st_mtime
        return Holder(**json.loads(text)), max(0.0, time.time() - mtime)
    except (OSError, ValueError, TypeError):
        return None


def is_live(holder: Holder, heartbeat_age: float) -> bool:
    """Whether the world holding a lease may still be training (see the module's docstring)."""
    if holder.host != socket.gethostname():
        return heartbeat_age < LIVE_S
    now = _start_time(holder.pid)
    if now is not None or holder.pid_start is not None:
        return now == holder.pid_start
    try:  # no /proc: only whether the pid exists
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def refusal(run: Path, job: str | None) -> str | None:
    """Why a start of `job` may not take `run` (a live world of another job holds it), as one
    line, or None. Reads only."""
    found = read_holder(run)
    if found is None:
        return None
    holder, age = found
    if (job is not None and holder.job == job) or not is_live(holder, age):
        return None
    gone = (f"once pid {holder.pid} has exited" if holder.host == socket.gethostname()
            else f"{LIVE_S:.0f} s after its last heartbeat")
    return (f"{run} is held by {holder.describe()}, heartbeat {age:.0f} s ago: two runs in one folder would "
            f"overwrite each other's checkpoints and metrics; stop that run first, or start this one with "
            f"train.name=<new name> (the folder is taken over {gone})")


def take(run: Path, job: str | None, ranks: int, step: int) -> tuple[Holder, Holder | None]:
    """Rank 0: hold `run` for a new world → (its record, the world it took the folder from, if
    any). Raises RunError when a live world of another job holds it."""
    run.mkdir(parents=True, exist_ok=True)
    with _locked(run):
        problem = refusal(run, job)
        if problem:
            raise RunError(problem)
        before = read_holder(run)
        me = Holder(uuid.uuid4().hex[:12], job, socket.gethostname(), os.getpid(), _start_time(os.getpid()),
                    ranks, step, time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        tmp = run / f".{LEASE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(me)) + "\n")
        tmp.replace(run / LEASE)
    return me, before[0] if before else None


@contextmanager
def _locked(run: Path) -> Iterator[None]:
    """The lease's read-decide-write, one start at a time (two jobs started at once). The lock is
    on the folder itself, so that no lock file is left in it; where the file system cannot lock
    a folder, the atomic replace alone decides, and the start that lost sees it at its first check."""
    fd = os.open(run, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # and with it the lock


class RunFence:
    """One rank's side of the lease its world took. Rank 0 (`reader`) reads lease.json and beats
    the heartbeat; the other ranks learn what it finds through the collectives below."""

    def __init__(self, run: Path, holder: Holder, reader: bool):
        self.run, self.holder, self.reader = run, holder, reader
        self._lost: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @property
    def world(self) -> str:
        return self.holder.world

    def lost(self) -> str | None:
        """Rank 0: the line to stop with once another world holds the folder (or its lease is
        gone), else None; once lost, always lost. Other ranks: None, reading nothing."""
        if self.reader and self._lost is None:
            found = read_holder(self.run)
            if found is None:
                self._lost = f"{self.run}: world {self.world} lost the run folder (its {LEASE} was removed)"
            elif found[0].world != self.world:
                self._lost = f"{self.run}: world {self.world} lost the run folder to {found[0].describe()}"
            if self._lost:
                self._lost += "; stopping without writing anything more"
        return self._lost

    def held(self) -> bool:
        """Rank 0: whether this world may still write (what MetricsLogger asks before a record)."""
        return self.lost() is None

    def check(self) -> None:
        """Every rank, at the same point: raise FenceLost on all of them when rank 0 finds the
        folder taken (before a checkpoint is saved, and before it is published)."""
        line = [self.lost()]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(line, src=0)
        if line[0]:
            raise FenceLost(line[0])

    def start(self) -> None:
        if self.reader:
            self._beat = threading.Thread(target=self._heartbeat, name="run-lease-heartbeat", daemon=True)
            self._beat.start()

    def _heartbeat(self) -> None:
        # A world stuck in a long step, save or evaluation still beats: its process is alive.
        while not self._stop.wait(HEARTBEAT_S):
            if self.lost() is not None:
                return
            try:
                os.utime(self.run / LEASE)
            except OSError:
                pass  # taken or removed in between: the next check says so

    def release(self) -> None:
        """Stop the heartbeat; rank 0 removes the lease if it is still this world's."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if not self.reader:
            return
        with _locked(self.run):
            found = read_holder(self.run)
            if found is not None and found[0].world == self.world:
                (self.run / LEASE).unlink(missing_ok=True)


@contextmanager
def hold_run(run: Path, job: str | None, ranks: int, step: int, on_rank0: Callable, is_main: bool,
             console: Callable[[str], None]) -> Iterator[RunFence]:
    """The run folder held for this world while the block runs: rank 0 takes it (`take`, its
    verdict handed to every rank by `on_rank0`, the trainer's broadcast), and releases it at the
    end. Says so when it takes the folder over from another world."""
    me, before = on_rank0(lambda: take(run, job, ranks, step))
    if before is not None:
        why = "a restart of the same job" if job is not None and before.job == job else "it is gone"
        console(f"world {me.world} took {run} over from {before.describe()}: {why}")
    fence = RunFence(run, me, reader=is_main)
    fence.start()
    try:
        yield fence
    finally:
        fence.release()

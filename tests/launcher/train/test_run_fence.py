"""The run folder's lease (launcher/train/run_lease.py): one world trains in a run folder at a time.

With real processes: a second run started on a folder a live run holds is refused in one line and
writes nothing; a stale run (held still by fence_worker.py while a restart of the same job takes
its folder over and trains on) stops with one line naming the world that took it, exit 2, and
writes nothing more — no metrics record, no checkpoint. Without the lease both would train on.
The rules themselves (who is live, what a restart is) on lease files written here.
"""

import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moetron.launcher.cluster.elastic import job_identity
from moetron.launcher.run_dir import RunError
from moetron.launcher.train.run_lease import LEASE, LIVE_S, Holder, RunFence, is_live, read_holder, refusal, take

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("fence_worker.py")
STEPS = 10
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=32", "model.moe.num_experts=4", "train.seq_len=32", "train.batch_size=4",
         "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1", "train.warmup_steps=1",
         "train.threads=1", "train.checkpoint.every=2", "train.checkpoint.keep=100", f"train.steps={STEPS}"]
# Variables that make two starts one job (cluster/elastic.py): each test sets its own.
JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


def env_of(job: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    return {**env, "OMP_NUM_THREADS": "1", **({"SLURM_JOB_ID": job} if job else {})}


class Run:
    """One `moetron train` process on <folder>/run; held by fence_worker.py when `hold` is given."""

    def __init__(self, folder: Path, name: str, job: str | None, hold: str | None = None):
        self.folder, self.name = folder, name
        self.marks = folder / "marks"
        self.marks.mkdir(exist_ok=True)
        entry = [str(WORKER)] if hold else ["-m", "moetron"]
        env = {**env_of(job), "FENCE_HOLD": hold or "", "FENCE_MARKS": str(self.marks), "FENCE_NAME": name}
        self.log = folder / f"{name}.log"
        self.proc = subprocess.Popen([sys.executable, *entry, "train", "configs/tiny.yaml", *SMALL,
                                      f"train.run_dir={folder}", "train.name=run"], cwd=ROOT, env=env,
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def wait_held(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while not (self.marks / f"{self.name}.held").exists():
            if self.proc.poll() is not None or time.time() > deadline:
                self.proc.kill()
                pytest.fail(f"{self.name} never reached its hold:\n{self.log.read_text()[-3000:]}", pytrace=False)
            time.sleep(0.05)

    def go(self, timeout: float = 180) -> int:
        (self.marks / f"{self.name}.go").touch()
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text()


def steps_logged(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line]


def world_of(ckpt: Path) -> str:
    return json.loads((ckpt / "state.json").read_text())["world"]


def tree_digest(folder: Path) -> str:
    """One hash of every file's path and bytes under `folder` (a heartbeat changes no bytes)."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


@pytest.mark.slow
def test_a_second_run_on_a_folder_a_live_run_holds_is_refused(tmp_path):
    """Run a holds its folder (paused after step 3); run b, another job on the same folder, is
    refused in one line naming a's world and changes nothing; a then trains to the end."""
    a = Run(tmp_path, "a", job=None, hold="after:3")
    a.wait_held()
    holder, _ = read_holder(tmp_path / "run")
    before = tree_digest(tmp_path / "run")

    b = subprocess.run([sys.executable, "-m", "moetron", "train", "configs/tiny.yaml", *SMALL,
                        f"train.run_dir={tmp_path}", "train.name=run"], cwd=ROOT, env=env_of(None),
                       capture_output=True, text=True, timeout=300)
    assert b.returncode == 2, b.stdout + b.stderr[-3000:]
    lines = b.stderr.strip().splitlines()
    assert len(lines) == 1 and f"is held by world {holder.world}" in lines[0], b.stderr[-3000:]
    assert f"rank 0 pid {a.proc.pid} on {socket.gethostname()}" in lines[0]
    assert tree_digest(tmp_path / "run") == before

    assert a.go() == 0, a.output()[-3000:]
    assert steps_logged(tmp_path / "run") == list(range(1, STEPS + 1))
    assert not (tmp_path / "run" / LEASE).exists()  # released at the end


@pytest.mark.slow
@pytest.mark.parametrize("where", ["after:5", "save:6"])
def test_a_stale_world_stops_once_a_restart_took_its_folder(tmp_path, where):
    """Run a (Slurm job 4242) is held after step 5, or inside its save of step 6; a restart of
    the same job takes the folder over at once, resumes from step 4 and is held after step 7.
    Let go, a stops with one line naming the new world, exit 2: no metrics record, no checkpoint
    of its own after the takeover; b trains to the end over an unbroken metrics.jsonl."""
    a = Run(tmp_path, "a", job="4242", hold=where)
    a.wait_held()
    stale = read_holder(tmp_path / "run")[0].world
    b = Run(tmp_path, "b", job="4242", hold="after:7")
    b.wait_held()
    taker = read_holder(tmp_path / "run")[0]
    assert taker.world != stale and taker.step == 4
    assert f"took {tmp_path / 'run'} over from world {stale}" in b.output()

    assert a.go() == 2, a.output()[-3000:]
    lost = [line for line in a.output().splitlines() if "lost the run folder" in line]
    assert lost == [f"moetron train: {tmp_path / 'run'}: world {stale} lost the run folder to "
                    f"{taker.describe()}; stopping without writing anything more"], a.output()[-3000:]
    assert b.go() == 0, b.output()[-3000:]

    run = tmp_path / "run"
    assert steps_logged(run) == list(range(1, STEPS + 1))  # a's steps 6… would repeat or break the order
    ckpts = sorted(run.glob("checkpoints/step-*"))
    assert [c.name for c in ckpts] == [f"step-{s:08d}" for s in (2, 4, 6, 8, 10)]
    assert {world_of(c) for c in ckpts[:2]} == {stale}
    assert {world_of(c) for c in ckpts[2:]} == {taker.world}  # a's step 6 never replaced b's


def test_who_may_take_a_held_folder(tmp_path):
    """Refused only while a live world of another job holds the folder: on this host, while its
    rank-0 process runs; on another, while its heartbeat is younger than LIVE_S."""
    run = tmp_path / "run"
    me, before = take(run, "Slurm job 7", ranks=4, step=0)
    assert before is None and me.pid == os.getpid()
    assert refusal(run, "Slurm job 7") is None  # a restart of the same job takes it over
    line = refusal(run, None)
    assert f"{run} is held by world {me.world} (Slurm job 7; 4 ranks from step 0, rank 0 pid {me.pid}" in line
    with pytest.raises(RunError, match="is held by"):
        take(run, "Slurm job 8", ranks=2, step=0)

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lease(run, dataclasses.replace(me, pid=dead.pid))
    assert refusal(run, None) is None  # its process is gone
    elsewhere = dataclasses.replace(me, host=socket.gethostname() + "-elsewhere")
    write_lease(run, elsewhere)
    assert refusal(run, None) is not None and is_live(elsewhere, LIVE_S - 5)
    old = time.time() - LIVE_S - 1
    os.utime(run / LEASE, (old, old))
    assert refusal(run, None) is None  # no heartbeat for LIVE_S


def test_a_world_sees_the_folder_taken_and_releases_only_its_own_lease(tmp_path):
    run = tmp_path / "run"
    first, _ = take(run, "Slurm job 9", ranks=1, step=0)
    fence = RunFence(run, first, reader=True)
    assert fence.held() and fence.lost() is None
    second, before = take(run, "Slurm job 9", ranks=1, step=0)  # its restart takes it over
    assert before == first
    assert fence.lost() == (f"{run}: world {first.world} lost the run folder to {second.describe()}; "
                            f"stopping without writing anything more")
    fence.release()
    assert read_holder(run)[0] == second  # not its own: left to the holder
    RunFence(run, second, reader=True).release()
    assert not (run / LEASE).exists()
    assert RunFence(run, first, reader=False).lost() is None  # only rank 0 reads


def test_what_makes_two_starts_one_job():
    assert job_identity({"SLURM_JOB_ID": "42"}) == "Slurm job 42"
    assert job_identity({"TORCHELASTIC_RUN_ID": "run7"}) == "torchrun rdzv id run7"
    assert job_identity({"SLURM_JOB_ID": "42", "TORCHELASTIC_RUN_ID": "run7"}) == "Slurm job 42, torchrun rdzv id run7"
    assert job_identity({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default names no job
    assert job_identity({}) is None


def write_lease(run: Path, holder: Holder) -> None:
    (run / LEASE).write_text(json.dumps(dataclasses.asdict(holder)))

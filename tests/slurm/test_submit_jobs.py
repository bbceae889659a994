"""Real jobs on the local Slurm, submitted with `moetron submit`: a 2-rank CPU run, and the three
ways a run is interrupted (`scontrol requeue`, preemption by the `urgent` partition, the time
limit), each ending in the same losses as the uninterrupted run; a 2-rank run bootstrapped by
mpirun; `moetron status`, `logs` and `cancel` on live jobs; and an unknown partition refused.

Time: the node has 2 CPUs and a 2-rank job takes both, so jobs run one after another. Slurm checks
time limits only every 30 s (a constant of slurmctld) and a requeued job waits ~6 s for its
credential to expire (cred_expire in slurm/start.sh), which sets the floor of the time-limit test.
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from moetron.launcher.perf.device_profiles import DeviceProfile, save_profile

pytestmark = [pytest.mark.slurm]

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
# A few seconds of compute per job (d_model 64, 2 layers, 4 sequences of 32 tokens).
TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
        "model.moe.d_expert=64", "train.seq_len=32", "train.batch_size=4", "train.threads=1",
        "train.warmup_steps=5", "train.eval_batches=2", "train.checkpoint.every=0", "train.checkpoint.keep=5"]
STEPS = 60
TWO_RANKS = TINY + ["parallel.dp=2", f"train.steps={STEPS}", "train.log_every=5", f"train.eval_every={STEPS}"]
# What `moetron plan --calibrate --ranks 2` measured on a 2-core machine, rounded.
CPU_PROFILE = DeviceProfile("cpu", peak_flops=1.2e11, memory_bytes=1.2e10, matmul_efficiency=0.27, intra_bw=1.4e9,
                            intra_latency=4e-4, inter_bw=1.4e9, inter_latency=4e-4, hbm_bw=2e9, dp_overlap=0.0,
                            block_overhead=2e-3, kind_bw={"all_gather": 0.36, "reduce_scatter": 0.15,
                                                          "all_to_all": 0.94, "broadcast": 2.1})
# The time-limit job: 240 steps, each followed by a pause of 0.25 s.
STEPS_TIMED, STEP_PAUSE = 240, 0.25
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "PMI_", "TORCHELASTIC_")
_LAUNCH_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


@pytest.fixture(scope="module")
def env(slurm_conf) -> dict:
    """What jobs inherit: no launcher's variables (the tests may run inside a job), one thread."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_NAMES}
    return {**clean, "SLURM_CONF": slurm_conf, "OMP_NUM_THREADS": "1"}


def paced(env: dict) -> dict:
    """`env` with a pause of STEP_PAUSE seconds after each optimizer step (tests/slurm/paced)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).with_name("paced")), env.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path, "MOETRON_TEST_STEP_PAUSE": str(STEP_PAUSE)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jobs")


def moetron(args, env, cwd, timeout=120, check=True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "moetron", *map(str, args)], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"moetron {' '.join(map(str, args))} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def slurm(argv, env, check=True) -> str:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr}")
    return out.stdout


class Job:
    """A job submitted with `moetron submit` into <workdir>/runs/<name>."""

    def __init__(self, name, overrides, flags, env, workdir):
        self.env, self.workdir = env, workdir
        self.run = workdir / "runs" / name
        out = moetron(["submit", CONFIG, *overrides, "train.run_dir=runs", f"train.name={name}",
                       "--gpus-per-node", "0", *flags], env, workdir)
        self.id = out.stdout.split()[2].rstrip(":")
        self.submit_stderr = out.stderr
        assert out.stdout.startswith(f"submitted job {self.id}:"), out.stdout

    @property
    def log(self) -> str:
        path = self.run / "slurm" / f"{self.id}.out"
        return path.read_text() if path.exists() else ""

    def metrics(self) -> list[dict]:
        path = self.run / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(r["step"] >= step for r in self.metrics()):
            assert time.monotonic() < deadline, f"job {self.id} logged no step {step} in {timeout} s:\n{self.log}"
            assert self.queued(), f"job {self.id} left the queue before step {step}:\n{self.log}"
            time.sleep(0.2)

    def queued(self) -> bool:
        return bool(slurm(["squeue", "-h", "-j", self.id, "-o", "%i"], self.env, check=False).strip())

    def wait_until_gone(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while self.queued():
            if time.monotonic() > deadline:
                slurm(["scancel", self.id], self.env, check=False)
                raise AssertionError(f"job {self.id} still queued after {timeout} s:\n{self.log}")
            time.sleep(0.5)

    def states(self) -> list[str]:
        """Every attempt's final state, per accounting (which may lag the controller a moment)."""
        for _ in range(30):
            out = slurm(["sacct", "-j", self.id, "--duplicates", "-X", "-n", "-P", "-o", "State"], self.env)
            states = [line.split()[0] for line in out.splitlines() if line.strip()]  # "CANCELLED by 0"
            if states and states[-1] not in ("RUNNING", "PENDING", "COMPLETING"):
                return states
            time.sleep(0.5)
        return states

    def checkpoints(self) -> list[str]:
        return sorted(p.name for p in (self.run / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())


def losses(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r.get("val_loss")) for r in records]


def assert_same_losses(job: Job, reference: list[dict]) -> None:
    got = job.metrics()
    assert [r["step"] for r in got] == [r["step"] for r in reference], "the resumed run's metrics.jsonl has gaps or repeats"
    # Resuming is exact: model, optimizer, data position and RNG all come from the checkpoint.
    assert losses(got) == losses(reference)


@pytest.fixture(scope="module")
def reference(env, workdir) -> Job:
    """The uninterrupted 2-rank run the interrupted ones must reproduce. Submitted here, awaited
    by whichever test needs it finished, so the status tests can watch it while it runs."""
    return Job("reference", TWO_RANKS, ["--time", "10"], env, workdir)


# --- watching a live job ----------------------------------------------------------------------------


def test_status_logs_and_cancel_on_live_jobs(reference, env, workdir):
    # A second job waits for the node the first one holds (or has just started); it is cancelled. It
    # is far longer than the reference, so a slow machine cannot let it finish before the cancel,
    # and whatever fails on the way, it is cancelled before the node is needed again. Held, it stays
    # queued when the reference ends: running, its 2 ranks would take the CPUs the `moetron`
    # commands below need.
    waiting = Job("cancelled", [*TWO_RANKS, "train.steps=100000"], ["--time", "10"], env, workdir)
    try:
        slurm(["scontrol", "hold", waiting.id], env)
        _status_logs_and_cancel(reference, waiting, env, workdir)
    finally:
        slurm(["scancel", waiting.id], env, check=False)


def _status_logs_and_cancel(reference, waiting, env, workdir):
    reference.wait_for_step(5)
    listing = moetron(["status"], env, workdir).stdout
    assert waiting.id in listing and str(waiting.run) in listing
    # The reference is listed while it is queued; a slow machine's `moetron status` may start after it ended.
    assert reference.id in listing or not reference.queued(), listing

    by_run = moetron(["status", reference.run], env, workdir).stdout
    assert f"run:         {reference.run}" in by_run
    # Running still, or just finished: the run is short and each `moetron` call takes a moment.
    assert any(f"job {reference.id}: {state}" in by_run for state in ("RUNNING", "COMPLETING", "COMPLETED")), by_run
    assert f"/{STEPS}" in by_run  # progress: step N/60
    assert moetron(["status", reference.id], env, workdir).stdout.splitlines()[0] == f"run:         {reference.run}"
    assert "attempt 1 on" in moetron(["logs", reference.id], env, workdir).stdout

    out = moetron(["cancel", waiting.id], env, workdir).stdout
    assert out.startswith(f"cancelled job {waiting.id}")
    waiting.wait_until_gone(30)
    assert waiting.states() == ["CANCELLED"]
    refused = moetron(["cancel", waiting.id], env, workdir, check=False)
    assert refused.returncode == 2 and "is not queued or running (it ended CANCELLED)" in refused.stderr

    # Following the log returns once the job has left the queue.
    followed = moetron(["logs", reference.id, "-f"], env, workdir, timeout=240).stdout
    assert f"step {STEPS}/{STEPS}" in followed


def test_two_rank_job_finishes_with_checkpoint_and_metrics(reference):
    reference.wait_until_gone()
    assert reference.states() == ["COMPLETED"]
    assert reference.checkpoints() == [f"step-{STEPS:08d}"]
    state = json.loads((reference.run / "checkpoints" / f"step-{STEPS:08d}" / "state.json").read_text())
    assert state["layout"]["world_size"] == 2
    records = reference.metrics()
    assert [r["step"] for r in records] == list(range(5, STEPS + 1, 5))
    assert all(math.isfinite(r["loss"]) for r in records) and records[-1]["val_loss"] > 0
    assert (reference.run / "config.yaml").is_file() and (reference.run / "slurm" / "job.sbatch").is_file()


# --- interrupted runs end where the uninterrupted one did -------------------------------------------


def test_scontrol_requeue_checkpoints_and_resumes(reference, env, workdir):
    reference.wait_until_gone()
    job = Job("requeued", TWO_RANKS, ["--time", "10"], env, workdir)
    job.wait_for_step(5)
    slurm(["scontrol", "requeue", job.id], env)
    job.wait_until_gone()
    # Slurm sends the ranks SIGTERM; they checkpoint and Slurm requeues the job itself.
    assert job.states() == ["REQUEUED", "COMPLETED"]
    assert "stopped by signal SIGTERM" in job.log and "resumed from" in job.log
    stopped, resumed = steps_lost(job.log)
    assert resumed == stopped >= 5  # resumed at the step the signal stopped
    assert len(job.checkpoints()) == 2  # the one written on the signal, and the last
    assert_same_losses(job, reference.metrics())


def steps_lost(log: str) -> tuple[int, int]:
    """(the step a signal stopped the job after, the step the requeued job resumed at), from its log."""
    import re

    stopped = int(re.search(r"stopped by signal SIG\w+ after step (\d+)", log).group(1))
    resumed = int(re.search(r"resumed from \S+ at step (\d+)", log).group(1))
    return stopped, resumed


def test_preemption_by_the_urgent_partition(reference, env, workdir):
    reference.wait_until_gone()
    job = Job("preempted", TWO_RANKS, ["--time", "10", "--partition", "debug"], env, workdir)
    job.wait_for_step(5)
    urgent = slurm(["sbatch", "--parsable", "-p", "urgent", "-n", "1", "-o", "/dev/null", "--wrap", "true"], env).strip()
    job.wait_until_gone()
    # The preempted batch shell gets USR1 (--signal=B:USR1, preempt_send_user_signal), forwards it
    # to every rank through srun, and requeues its job once they have checkpointed.
    assert "stopped by signal SIGUSR1" in job.log and "requeueing" in job.log and "resumed from" in job.log
    # No periodic checkpoints here (checkpoint.every 0): the requeued run starts at the very step
    # the signal stopped, not from an earlier save. Preemption loses no finished step.
    stopped, resumed = steps_lost(job.log)
    assert resumed == stopped >= 5
    assert job.states()[-1] == "COMPLETED" and len(job.states()) == 2
    started = slurm(["sacct", "-j", f"{job.id},{urgent}", "--duplicates", "-X", "-n", "-P", "-o", "JobID,Start"], env).split()
    starts = [line.split("|") for line in started]
    urgent_start = next(s for j, s in starts if j == urgent)
    assert [s for j, s in starts if j == job.id][-1] >= urgent_start  # the urgent job ran in between
    assert_same_losses(job, reference.metrics())


def test_time_limit_checkpoints_requeues_and_resumes(reference, env, workdir):
    # Slurm looks at time limits every 30 s and sends the warning at the first look that is less
    # than `signal_seconds` + 30 s before the limit. Submitted with 10 minutes, the job is given 3
    # once its ranks train (so there is a checkpoint to resume from): with --signal-seconds 150 it
    # is warned at the very next look, 0–30 s later (rather than 30–60 s after the start of a job
    # submitted with 2 minutes and 60 s), and a slow machine still has minutes to checkpoint. The
    # run must outlast that look: each step of its first attempt is followed by a pause
    # (tests/slurm/paced), so that attempt could last STEPS_TIMED × STEP_PAUSE = 60 s on any machine
    # while its ranks idle; the requeued attempt trains unpaused, and the uninterrupted reference
    # trains the same steps without pauses, on one CPU, at the same time.
    reference.wait_until_gone()
    overrides = TINY + [f"train.steps={STEPS_TIMED}", "train.log_every=25", f"train.eval_every={STEPS_TIMED}"]
    job = Job("timed", overrides, ["--time", "10", "--signal-seconds", "150", "--requeue-limit", "3"], paced(env),
              workdir)
    local = subprocess.Popen([sys.executable, "-m", "moetron", "train", CONFIG, *overrides, "train.run_dir=local",
                              "train.name=timed"], env=env, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        job.wait_for_step(25)
        slurm(["scontrol", "update", f"JobId={job.id}", "TimeLimit=3"], env)
        deadline = time.monotonic() + 90
        while "requeueing" not in job.log:
            assert time.monotonic() < deadline and job.queued(), f"job {job.id} was not warned before its limit:\n{job.log}"
            time.sleep(0.5)
        # With 3 minutes, later attempts would be warned again at their first look; the limit it was
        # submitted with lets this test end after a single requeue (the limit counts from each start).
        slurm(["scontrol", "update", f"JobId={job.id}", "TimeLimit=10"], env)
        job.wait_until_gone()
        _, err = local.communicate(timeout=300)
        assert local.returncode == 0, err
    finally:
        local.kill()
    assert "stopped by signal SIGUSR1" in job.log and "checkpointed before its limit" in job.log
    assert "resumed from" in job.log, f"the requeued job did not resume a checkpoint:\n{job.log}"
    assert job.states() == ["REQUEUED", "COMPLETED"]
    reference_records = [json.loads(line) for line in (workdir / "local" / "timed" / "metrics.jsonl").read_text().splitlines()]
    assert_same_losses(job, reference_records)


# --- MPI ----------------------------------------------------------------------------------------------


def test_two_ranks_bootstrapped_by_mpirun_train_the_same_losses(reference, env, workdir):
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (slurm/install.sh installs it)")
    reference.wait_until_gone()
    train = [sys.executable, "-m", "moetron", "train", str(CONFIG), *TWO_RANKS, "train.run_dir=runs", "train.name=mpi"]
    # mpirun inside the allocation: Open MPI's variables name the ranks, not Slurm's (which number
    # mpirun's per-node daemons), and rank 0 broadcasts the rendezvous address through mpi4py.
    command = " ".join(["mpirun", "--allow-run-as-root", "-np", "2", "--bind-to", "none", *train])
    job = slurm(["sbatch", "--parsable", "-n", "2", "--time", "10", "-o", str(workdir / "mpi-%j.out"), "-D", str(workdir),
                 "--wrap", command], env).strip()
    deadline = time.monotonic() + 240
    while slurm(["squeue", "-h", "-j", job, "-o", "%i"], env, check=False).strip():
        assert time.monotonic() < deadline, f"MPI job {job} still queued after 240 s"
        time.sleep(0.5)
    log = (workdir / f"mpi-{job}.out").read_text()
    assert "launched by mpi" in log, log
    records = [json.loads(line) for line in (workdir / "runs" / "mpi" / "metrics.jsonl").read_text().splitlines()]
    assert losses(records) == losses(reference.metrics())


# --- the planner's choice ------------------------------------------------------------------------------


def test_layout_auto_submits_the_planners_first_layout_and_it_trains(reference, env, workdir):
    """`--layout auto` on 2 CPU ranks: the job runs the layout `moetron plan --gpu cpu` ranks first
    (its overrides are in the run's config.yaml) and completes with a checkpoint."""
    reference.wait_until_gone()
    # The cpu profile is stored into a cache of the test's own, so the test neither depends on an
    # earlier calibration nor changes the user's. Its numbers are those `moetron plan --calibrate
    # --ranks 2` measures on 2 cores, fixed: the choice is the test's, not the machine's load
    # (measuring is tested in tests/launcher/perf/test_calibrate.py). train.peak_tflops spares the
    # ranks measuring their MFU peak, which a calibration would have cached.
    env = {**env, "XDG_CACHE_HOME": str(workdir / "cache")}
    save_profile(CPU_PROFILE, workdir / "cache" / "moetron" / "plan_profile.json")
    overrides = [*TINY, "parallel.dp=2", "train.steps=10", "train.log_every=5", "train.eval_every=10",
                 "train.peak_tflops=0.12"]
    plan = moetron(["plan", CONFIG, *overrides, "train.grad_accum=1", "--gpus", "2", "--gpus-per-node", "2",
                    "--gpu", "cpu", "--overrides-only"], env, workdir).stdout.split()
    assert plan and all("=" in o for o in plan)
    job = Job("auto", overrides, ["--time", "10", "--layout", "auto"], env, workdir)
    assert f"--layout auto chose {' '.join(plan)}" in job.submit_stderr
    job.wait_until_gone()
    assert job.states() == ["COMPLETED"], job.log
    assert job.checkpoints() == ["step-00000010"]
    saved = yaml.safe_load((job.run / "config.yaml").read_text())
    for override in plan:
        key, value = override.split("=", 1)
        section, field = key.split(".", 1)
        assert str(saved[section][field]).lower() == value.lower(), (override, saved[section])


# --- refusals against the real cluster ------------------------------------------------------------


def test_unknown_partition_is_refused_by_the_cluster(env, workdir):
    out = moetron(["submit", CONFIG, *TINY, "train.run_dir=runs", "train.name=nowhere", "--partition", "gpu"],
                  env, workdir, check=False)
    assert out.returncode == 2
    assert out.stderr == "moetron submit: unknown partition 'gpu'; this cluster has debug, urgent (from sinfo)\n"
    assert not (workdir / "runs" / "nowhere").exists()

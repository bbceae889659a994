"""A Slurm job of `moetron submit --nodes 1-2 --layout auto` loses a node and trains on.

The cluster is a second local Slurm of two nodes on this machine (`MOETRON_SLURM_NODES=2
slurm/start.sh`: two slurmd, n1 and n2), in its own folder and ports beside the one the other
tests use; like that one it is left running (`MOETRON_SLURM_HOME=/tmp/moetron-slurm-2n
slurm/stop.sh` stops it). The job starts on both nodes, 2 ranks each; once it has a checkpoint,
node n2 dies (its slurmd, step daemon and ranks, SIGKILL). slurmctld declares it down after
SlurmdTimeout (10 s here), srun ends, and the batch script starts the ranks again on the node left
(the job has --no-kill): 2 ranks plan their layout, reshard the checkpoint and train to the end.

Time: ~25 s of it is Slurm noticing the dead node (SlurmdTimeout, and pings that wait out
MessageTimeout), while the one-process run the losses are compared with trains. Its cluster shares
nothing with the one the other Slurm tests use, so under `pytest -n 2 --dist loadgroup` it runs in
a group of its own beside theirs (xdist names a group by all of a test's xdist_group marks:
slurm_two-nodes).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import pytest

from moetron.launcher.perf.device_profiles import DeviceProfile, save_profile

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("two-nodes")]

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
HOME, PORT = "/tmp/moetron-slurm-2n", "6927"
STEPS = 30
# ~0.1-0.2 s a step on 4 ranks here: the kill lands long before the last step.
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=32", "model.moe.num_experts=4", "train.seq_len=128", "train.batch_size=12",
         "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1", "train.warmup_steps=1",
         "train.threads=1", "train.peak_tflops=1", "train.checkpoint.every=2", "train.precision=fp32",
         f"train.steps={STEPS}"]
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "PMI_", "TORCHELASTIC_")
_LAUNCH_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """The environment of the two-node cluster's commands and jobs (started if it is not running)."""
    if shutil.which("slurmctld") is None or os.geteuid() != 0:
        pytest.skip("needs Slurm installed (slurm/install.sh) and root, as slurm/start.sh does")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_NAMES}
    cache = tmp_path_factory.mktemp("cache")
    save_profile(DeviceProfile("cpu", 1e10, 8e9, 0.8, 1e9, 1e-4, 1e9, 1e-4, hbm_bw=1e10, dp_overlap=0.0),
                 cache / "moetron" / "plan_profile.json")
    # The node names n1, n2 do not resolve: the ranks meet at this machine's address.
    env = {**clean, "MOETRON_SLURM_HOME": HOME, "MOETRON_SLURM_PORT": PORT, "MOETRON_SLURM_NODES": "2",
           "XDG_CACHE_HOME": str(cache), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    start, status, stop = (Path(str(resources.files("moetron.slurm") / f"{name}.sh")) for name in ("start", "status", "stop"))
    # status.sh exits 3 when the cluster is down: then this test starts it, and stops it again.
    was_up = subprocess.run(["bash", str(status)], env=env, capture_output=True, timeout=60).returncode != 3
    out = subprocess.run(["bash", str(start)], env=env, capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        pytest.fail(f"slurm/start.sh (2 nodes) failed:\n{out.stderr}", pytrace=False)
    env["SLURM_CONF"] = re.search(r"^export SLURM_CONF=(\S+)$", out.stdout, re.MULTILINE).group(1)
    yield env
    # n2 was killed: a cluster that ran before gets it back, whole for its owner; ours is stopped.
    subprocess.run(["bash", str(start if was_up else stop)], env=env, capture_output=True, text=True, timeout=180)


def run(argv, env, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, argv))} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


def kill_node(node: str) -> list[int]:
    """The node dies: its slurmd, and every rank it started with the step daemon above it."""
    victims = {int(Path(HOME, "run", f"slurmd-{node}.pid").read_text())}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"SLURMD_NODENAME={node}".encode() not in environ.read_bytes().split(b"\0"):
                continue
            parent = int((environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[1])
            stepd = (Path("/proc") / str(parent) / "comm").read_text().strip() == "slurmstepd"
        except (OSError, IndexError, ValueError):
            continue
        victims |= {int(environ.parent.name), *([parent] if stepd else [])}
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return sorted(victims)


def losses(run_path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_path / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_a_job_that_loses_a_node_restarts_its_ranks_on_the_node_left(env, tmp_path):
    # One process with the job's micro-batches: 4 of 3 sequences, as 4 ranks (and 2 accumulating 2) run them.
    straight = subprocess.Popen([sys.executable, "-m", "moetron", "train", str(CONFIG), *SMALL, "train.grad_accum=4",
                                 f"train.run_dir={tmp_path}", "train.name=straight"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        job, log = lose_a_node_and_train_on(env, tmp_path)
        _, err = straight.communicate(timeout=300)
        assert straight.returncode == 0, err
    finally:
        straight.kill()

    text, run_path = log.read_text(), tmp_path / "runs" / "elastic"
    restarted = rf"moetron: job {job} lost a rank \(exit \d+\); restart 1 on the 1 node\(s\) left \(n1\)"
    assert re.search(restarted, text), text
    starts = [json.loads(line) for line in (run_path / "layouts.jsonl").read_text().splitlines()]
    assert [(s["world_size"], s["label"], s["micro_batch"]) for s in starts] == [(4, "dp4 ddp", 3), (2, "dp2 ddp ga2", 3)], \
        text
    assert starts[1]["step"] >= 4 and starts[1]["step"] % 2 == 0  # a checkpoint's step
    got, want = losses(run_path), losses(tmp_path / "straight")
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), text
    # The same global batch in the same micro-batches on 4, then 2 ranks, against one process: equal
    # up to the order of the gradient sums (bench/elastic_recovery.py: 1.6e-7 over 60 steps).
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got[step], want[step])


def lose_a_node_and_train_on(env, tmp_path) -> tuple[str, Path]:
    """Submit the job, kill node n2 once it has a checkpoint, wait for the job to end: (job id, log)."""
    out = run([sys.executable, "-m", "moetron", "submit", str(CONFIG), *SMALL, "parallel.dp=4", "train.run_dir=runs",
               "train.name=elastic", "--nodes", "1-2", "--gpus-per-node", "0", "--layout", "auto", "--time", "10",
               "--requeue-limit", "2"], env, cwd=tmp_path)
    job = out.stdout.split()[2].rstrip(":")
    assert "2 rank(s) on each of 1-2 nodes, its layout planned at every start" in out.stdout
    run_path, log = tmp_path / "runs" / "elastic", tmp_path / "runs" / "elastic" / "slurm" / f"{job}.out"
    assert "#SBATCH --nodes=1-2" in (run_path / "slurm" / "job.sbatch").read_text().splitlines()

    deadline = time.monotonic() + 120
    while not (run_path / "checkpoints" / "step-00000004").is_dir():
        assert time.monotonic() < deadline, f"no checkpoint of step 4 in 120 s:\n{log.exists() and log.read_text()}"
        time.sleep(0.1)
    kill_node("n2")
    deadline = time.monotonic() + 240
    while run(["squeue", "-h", "-j", job, "-o", "%i"], env).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env)
            pytest.fail(f"job {job} still queued 240 s after the node was lost:\n{log.read_text()}")
        time.sleep(0.5)
    return job, log

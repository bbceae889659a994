"""The local Slurm from slurm/start.sh, and what moetron runs on it: srun ranks that bootstrap and
all_reduce, and the batch script template forwarding its time-limit signal and requeueing."""

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from importlib import resources
from pathlib import Path

import pytest

from moetron.launcher.cluster.bootstrap import slurm_hostnames
from moetron.launcher.cluster.sbatch import render_sbatch
from moetron.launcher.cluster.submit import slurm_seconds

pytestmark = [pytest.mark.slurm]

SLURM_DIR = Path(str(resources.files("moetron.slurm") / "start.sh")).parent  # the installed slurm/ folder


def run(argv, env, timeout=60, check=True) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def wait_until_gone(job_id: str, env: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while run(["squeue", "-h", "-j", job_id, "-o", "%i"], env, check=False).stdout.strip():
        if time.monotonic() > deadline:
            run(["scancel", job_id], env, check=False)
            raise AssertionError(f"job {job_id} still queued after {timeout} s: {run(['scontrol', 'show', 'job', job_id], env, check=False).stdout}")
        time.sleep(0.5)


def test_start_again_only_prints_the_config(slurm_conf):
    """With every daemon up, start.sh prints the line to source and restarts nothing: the same
    six daemons (slurmscriptd included) run under the same pids before and after."""
    if not os.path.samefile(Path(slurm_conf).parent.parent, os.environ.get("MOETRON_SLURM_HOME", "/tmp/moetron-slurm")):
        pytest.skip(f"SLURM_CONF={slurm_conf} is not the cluster slurm/start.sh manages")
    before = run(["bash", SLURM_DIR / "status.sh"], os.environ).stdout
    assert before.count(" running (pid ") == 6, before
    out = run(["bash", SLURM_DIR / "start.sh"], os.environ)
    assert out.stdout == f"export SLURM_CONF={slurm_conf}\n"
    assert run(["bash", SLURM_DIR / "status.sh"], os.environ).stdout == before


def test_node_idle_in_both_partitions(slurm_env):
    lines = run(["sinfo", "-h", "-o", "%P %a"], slurm_env).stdout.split("\n")
    assert {"debug* up", "urgent up"} <= set(lines)
    states = run(["sinfo", "-h", "-N", "-o", "%T"], slurm_env).stdout.split()
    assert states and all(s in ("idle", "mixed", "allocated") for s in states)


def test_scontrol_expands_host_lists(slurm_env, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    assert slurm_hostnames("gpu[09-11],cpu1") == ["gpu09", "gpu10", "gpu11", "cpu1"]


def test_time_limits_read_as_slurmctld_records_them(slurm_env):
    """slurm_seconds (the signal-before-the-limit arithmetic of `moetron submit --time`) against
    the TimeLimit slurmctld keeps for the same --time: every format sbatch takes, seconds rounded up
    to a minute. Each job is held and cancelled, so none runs."""
    for text in ("1", "90", "0:30", "1:30", "0:01", "01:00:00", "3:0:59", "2-00", "1-0", "1-02:03", "1-00:00:01",
                 "UNLIMITED"):
        job = run(["sbatch", "--parsable", "--hold", f"--time={text}", "-o", "/dev/null", "--wrap", "true"],
                  slurm_env).stdout.strip().split(";")[0]
        try:
            shown = run(["scontrol", "show", "job", "-o", job], slurm_env).stdout
        finally:
            run(["scancel", job], slurm_env, check=False)
        limit = re.search(r"\bTimeLimit=(\S+)", shown).group(1)
        parts = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d+):(\d+)", limit)
        recorded = None if limit == "UNLIMITED" else (
            ((int(parts.group(1) or 0) * 24 + int(parts.group(2))) * 60 + int(parts.group(3))) * 60 + int(parts.group(4)))
        assert slurm_seconds(text) == recorded, f"--time={text}: slurmctld recorded TimeLimit={limit}"


def test_srun_two_ranks_bootstrap_and_all_reduce(slurm_env):
    out = run(["srun", "-n", "2", "--time", "2", sys.executable, "-m", "moetron.launcher.cluster.bootstrap", "--timeout", "60"],
              slurm_env, timeout=180)
    reports = sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [(r["rank"], r["world_size"], r["local_rank"], r["launcher"]) for r in reports] == [(0, 2, 0, "slurm"), (1, 2, 1, "slurm")]
    assert {r["master_addr"] for r in reports} == {socket.gethostname().split(".")[0]}
    assert all(r["ok"] for r in reports)


TASK = """
import os, signal, sys, time
rank, attempt = os.environ["SLURM_PROCID"], int(os.environ.get("SLURM_RESTART_COUNT", "0"))
def checkpoint_and_exit(signum, frame):
    print(f"rank {rank} checkpointed in attempt {attempt}", flush=True)
    sys.exit(0)
signal.signal(signal.SIGUSR1, checkpoint_and_exit)
if attempt > 0:
    print(f"rank {rank} resumed in attempt {attempt}", flush=True)
print(f"rank {rank} training in attempt {attempt}", flush=True)
time.sleep(120)
"""


def test_batch_script_forwards_the_signal_and_requeues_up_to_its_limit(slurm_env, tmp_path):
    # The signal is sent by hand (to the batch shell only, as --signal=B: would) rather than by
    # waiting for the time limit, which Slurm checks only every ~30 s.
    (tmp_path / "task.py").write_text(textwrap.dedent(TASK))
    script = render_sbatch({
        "job_name": "moetron-requeue-test", "tasks_per_node": 2, "time": "5", "signal_seconds": 60,
        "requeue_limit": 1, "output": str(tmp_path / "slurm-%j.out"), "command": [sys.executable, str(tmp_path / "task.py")],
    })
    (tmp_path / "job.sbatch").write_text(script)
    job = run(["sbatch", "--parsable", str(tmp_path / "job.sbatch")], slurm_env).stdout.strip().split(";")[0]
    log = tmp_path / f"slurm-{job}.out"
    # Warned in each attempt: the first requeues itself, the second is past the limit of 1.
    for attempt in (0, 1):
        deadline = time.monotonic() + 90
        while not (log.exists() and log.read_text().count(f"training in attempt {attempt}") == 2):
            assert time.monotonic() < deadline, f"job {job} did not start both ranks of attempt {attempt}: {log.read_text() if log.exists() else 'no log'}"
            time.sleep(0.3)
        run(["scancel", "--batch", "--signal=USR1", job], slurm_env)
    wait_until_gone(job, slurm_env, timeout=90)

    text = log.read_text()
    for rank in (0, 1):
        assert f"rank {rank} checkpointed in attempt 0" in text
        assert f"rank {rank} resumed in attempt 1" in text
        assert f"rank {rank} checkpointed in attempt 1" in text
    assert text.count("requeueing") == 1, text
    assert "requeued 1 times already (the limit)" in text, text
    # Accounting (slurmdbd) saw both attempts; it may lag the controller by a moment.
    for _ in range(20):
        states = run(["sacct", "-j", job, "--duplicates", "-X", "-n", "-P", "-o", "State"], slurm_env).stdout.split()
        if states == ["REQUEUED", "COMPLETED"]:
            break
        time.sleep(0.5)
    assert states == ["REQUEUED", "COMPLETED"]


def test_stop_stops_only_the_cluster_it_started(slurm_env, slurm_ports):
    # A second cluster in its own folder and ports; stopping it must leave the session's running.
    home = tempfile.mkdtemp(prefix="moetron-slurm-")  # short: unix socket paths are limited
    env = {**slurm_env, "MOETRON_SLURM_HOME": home, "MOETRON_SLURM_PORT": str(slurm_ports)}
    env.pop("SLURM_CONF")
    pids = {}
    try:
        run(["bash", SLURM_DIR / "start.sh"], env, timeout=120)
        pids = {f.name: int(f.read_text()) for f in Path(home, "run").glob("*.pid")}
        assert set(pids) == {"munged.pid", "mariadb.pid", "slurmdbd.pid", "slurmctld.pid", "slurmd.pid"}
    finally:
        run(["bash", SLURM_DIR / "stop.sh"], env, timeout=120)
    for name, pid in pids.items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except FileNotFoundError:
            continue
        assert state in ("Z", "X"), f"{name} (pid {pid}) still running after stop.sh"
    assert not list(Path(home, "run").glob("*.pid"))
    run(["sinfo", "-h"], slurm_env)  # the session's cluster still answers
    subprocess.run(["rm", "-rf", home], check=False)

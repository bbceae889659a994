"""Real launches: 2 ranks started by torchrun and by mpirun each detect themselves, join a gloo
group and all_reduce (`python -m moetron.launcher.cluster.bootstrap` prints one JSON report per rank).

The srun launch is in tests/slurm/test_local_slurm.py, next to the local Slurm it needs."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

# Variables a launcher sets; the test process may itself run under one (CI inside a Slurm job).
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "PMI_", "TORCHELASTIC_")
_LAUNCH_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def launch(argv: list, timeout: float = 120) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_NAMES}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(argv)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])


def check_two_ranks(reports: list[dict], launcher: str) -> None:
    assert [r["rank"] for r in reports] == [0, 1]
    assert {r["world_size"] for r in reports} == {2}
    assert [r["local_rank"] for r in reports] == [0, 1]  # both on this machine
    assert {r["launcher"] for r in reports} == {launcher}
    assert len({(r["master_addr"], r["master_port"]) for r in reports}) == 1
    assert all(r["ok"] and r["all_reduce"] == 1.0 for r in reports)


def test_torchrun_two_ranks():
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "moetron.launcher.cluster.bootstrap", "--timeout", "60"]
    check_two_ranks(launch(argv), "torchrun")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed (slurm/install.sh installs Open MPI)")
def test_mpirun_two_ranks():
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (slurm/install.sh installs it)")
    argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
            sys.executable, "-m", "moetron.launcher.cluster.bootstrap", "--timeout", "60"]
    check_two_ranks(launch(argv), "mpi")


def test_refusal_is_one_line_and_exit_code_2():
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_NAMES}
    env.update(SLURM_JOB_ID="7", SLURM_NTASKS="2", SLURM_PROCID="0")
    out = subprocess.run([sys.executable, "-m", "moetron.launcher.cluster.bootstrap"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "srun" in out.stderr

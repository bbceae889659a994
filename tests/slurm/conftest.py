"""A running local Slurm for the tests in this folder.

`slurm_conf` (session scope) uses the cluster SLURM_CONF already points at when it answers;
otherwise, when Slurm is installed, it runs slurm/start.sh (a few seconds cold, instant when the
daemons already run) and exports SLURM_CONF to every subprocess. The cluster is left running:
other test sessions on this machine may be using it, and the next session starts instantly.
`slurm/stop.sh` stops it.

Under `pytest -n 2` (the README's test command) every test here runs on the same worker, one after
another: they share one cluster's queue and partitions (a test that preempts or fills a partition
would disturb another's job), and they spend most of their time waiting on the scheduler, which
the other worker fills with the rest of the suite.
"""

import os
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest

# Variables a launcher sets; the tests may themselves run inside a Slurm job or under torchrun.
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "PMI_", "TORCHELASTIC_")
_LAUNCH_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before xdist names each test's group from its marks
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.xdist_group("slurm"))


def slurm_script(name: str) -> Path:
    return Path(str(resources.files("moetron.slurm") / name))


def _answers(conf: str) -> bool:
    try:
        out = subprocess.run(["sinfo", "-h"], env={**os.environ, "SLURM_CONF": conf}, capture_output=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


@pytest.fixture(scope="session")
def slurm_conf():
    """Path of the slurm.conf of a running Slurm, also exported as SLURM_CONF."""
    conf = os.environ.get("SLURM_CONF")
    if conf and _answers(conf):
        yield conf
        return
    if shutil.which("slurmctld") is None or shutil.which("sinfo") is None:
        pytest.skip("Slurm is not installed and SLURM_CONF names no running cluster: run slurm/install.sh, then slurm/start.sh")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm runs its daemons as root: run the tests as root, or start it and export SLURM_CONF")
    out = subprocess.run(["bash", str(slurm_script("start.sh"))], capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        pytest.fail(f"slurm/start.sh failed (exit {out.returncode}):\n{out.stderr}", pytrace=False)
    found = re.search(r"^export SLURM_CONF=(\S+)$", out.stdout, re.MULTILINE)
    if found is None:
        pytest.fail(f"slurm/start.sh printed no `export SLURM_CONF=...` line:\n{out.stdout}", pytrace=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", found.group(1))
        yield found.group(1)


@pytest.fixture
def slurm_env(slurm_conf) -> dict:
    """The environment for a Slurm command: ours, without any launcher's variables, one thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_NAMES}
    return {**env, "SLURM_CONF": slurm_conf, "OMP_NUM_THREADS": "1"}

"""`make train` and `make test` install into .venv/ and run only its interpreter; README's Tests section
names what `make test` installs and starts; `make test` stops the local Slurm it started, and
`make stop` stops all six daemons of it."""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "slurm"


def dry_run(*targets: str) -> list[str]:
    """The commands `make -n -B` would run for `targets` (every target out of date), one per line."""
    # Under `make test` the parent make's MAKELEVEL would add "Entering directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    cmd = ["make", "--no-print-directory", "-n", "-B", *targets]
    out = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if line and not line.startswith("#")]


def bash_array(path: Path, name: str) -> list[str]:
    found = re.search(rf"^{name}=\(([^)]*)\)", path.read_text(), re.MULTILINE)
    assert found, f"{path.name} defines no {name}=(...)"
    return found.group(1).split()


def daemons() -> list[str]:
    """The six daemons slurm/start.sh runs: those with a pid file, and slurmctld's slurmscriptd."""
    # Sourced, not parsed: the list depends on the cluster's node count (one node here).
    env = {k: v for k, v in os.environ.items() if k != "root"}
    out = subprocess.run(["bash", "-c", f'source "{SLURM / "live_pid.sh"}"; printf "%s\\n" "${{SLURM_DAEMONS[@]}}"'],
                         env=env, capture_output=True, text=True, check=True, timeout=30)
    names = [entry.split(":")[0] for entry in out.stdout.split()]
    return [*names, "slurmscriptd"]


def readme_tests_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("\n## Tests\n"):].split("\n## ", 2)[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_train_and_test_install_into_the_venv_and_run_only_its_python():
    lines = dry_run("train", "test")
    venv = [line for line in lines if "-m venv" in line]
    assert len(venv) == 1 and venv[0].startswith("python3 -m venv .venv ")
    python = [line for line in lines if re.search(r"\bpython[0-9.]*\b|\bpip\b|pytest", line) and line not in venv]
    strays = [line for line in python if ".venv/bin/python " not in line]
    assert not strays, f"commands that would not run .venv/bin/python: {strays}"
    pips = [line for line in python if " -m pip install " in line]
    assert [line.rsplit(" ", 1)[1] for line in pips] == ["'uv==0.13.10'", "torch==2.13.0"], pips
    # uv installs the rest into the same interpreter, after torch, which every install pins.
    uvs = [line for line in python if " pip install " in line and line not in pips]
    assert uvs and lines.index(pips[1]) < lines.index(uvs[0]), uvs
    assert all(" --python .venv/bin/python " in line and line.endswith(" torch==2.13.0") for line in uvs), uvs
    [deepspeed] = [line for line in uvs if "deepspeed" in line]
    assert deepspeed.startswith("DS_BUILD_OPS=0 ") and "--no-build-isolation" in deepspeed
    assert "bash slurm/run_then_stop.sh .venv/bin/python -m pytest -q -n 2 --dist loadgroup --durations=25" in lines
    assert ".venv/bin/python -m moetron train configs/tiny.yaml" in lines
    assert ".venv/" in (ROOT / ".gitignore").read_text().split()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_readme_names_what_make_test_installs_and_starts_and_make_stop_stops_it():
    section = readme_tests_section()
    for package in bash_array(SLURM / "install.sh", "APT_PACKAGES"):
        assert re.search(rf"[ `]{re.escape(package)}[ `]", section), f"README's Tests section omits apt package {package}"
    for name in daemons():
        assert f"`{name}`" in section, f"README's Tests section omits the daemon {name}"
    assert "`make stop`" in section and ".venv/" in section
    assert dry_run("stop") == ["bash slurm/stop.sh"]
    stop = (SLURM / "stop.sh").read_text()
    stopped = re.findall(r"^\s*stop_(?:daemon \S+|pid \S+) (\S+) \d+$", stop, re.MULTILINE)
    assert sorted(stopped) == sorted(daemons()), f"slurm/stop.sh stops {stopped}, start.sh runs {daemons()}"


# --- with a real local Slurm, in a folder and on ports of its own ---------------------------------------


@pytest.fixture
def own_slurm(tmp_path, slurm_ports):
    """(environment naming a Slurm folder and ports nobody else uses, a fake python for `make test`
    whose `-m pytest` starts that Slurm as the Slurm tests would, then sleeps $FAKE_SLEEP s and
    exits with $FAKE_EXIT)."""
    if shutil.which("slurmctld") is None or shutil.which("make") is None:
        pytest.skip("Slurm is not installed (slurm/install.sh installs it)")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm runs its daemons as root")
    home = tempfile.mkdtemp(prefix="moetron-slurm-")  # short: unix socket paths are limited
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(MOETRON_SLURM_HOME=home, MOETRON_SLURM_PORT=str(slurm_ports), FAKE_SLEEP="0", FAKE_EXIT="0")
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nbash {SLURM / "start.sh"} >/dev/null || exit 99\nsleep "$FAKE_SLEEP"\nexit "$FAKE_EXIT"\n')
    fake.chmod(0o755)
    yield env, fake
    subprocess.run(["bash", SLURM / "stop.sh"], check=False, env=env, capture_output=True, timeout=120)
    shutil.rmtree(home, ignore_errors=True)


def _terminal_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


def running(env) -> dict[str, int]:
    """{daemon: pid} of those slurm/status.sh reports running."""
    out = subprocess.run(["bash", SLURM / "status.sh"], check=False, env=env, capture_output=True, text=True, timeout=60)
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\S+) running \(pid (\d+)\)$", out.stdout, re.MULTILINE)}


def assert_gone(pids: dict[str, int]) -> None:
    for name, pid in pids.items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        assert state in ("Z", "X"), f"{name} (pid {pid}) still runs"


def make(env, fake, *targets) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-o", "setup-test", *targets, f"PYTHON={fake}"], check=False, cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slurm
def test_make_test_stops_the_slurm_its_tests_started_and_keeps_pytests_status(own_slurm):
    env, fake = own_slurm
    out = make({**env, "FAKE_EXIT": "5"}, fake, "test")
    assert out.returncode != 0 and "[Makefile" in out.stderr and "test] Error 5" in out.stderr, out.stderr
    assert running(env) == {}


@pytest.mark.slurm
def test_make_test_stops_it_after_ctrl_c_too(own_slurm):
    env, fake = own_slurm
    # As from a terminal: Ctrl-C's signals at their defaults. A suite started in the background by
    # a non-interactive shell (`pytest ... &`) ignores SIGINT and SIGQUIT, and every child would too.
    proc = subprocess.Popen(["make", "-o", "setup-test", "test", f"PYTHON={fake}"], cwd=ROOT,
                            env={**env, "FAKE_SLEEP": "120"}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_terminal_signals)
    deadline = time.monotonic() + 120
    while len(running(env)) < 6:
        assert proc.poll() is None and time.monotonic() < deadline, "the fake pytest did not start Slurm"
        time.sleep(0.5)
    pids = running(env)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    assert proc.wait(timeout=120) != 0
    assert running(env) == {}
    assert_gone(pids)


@pytest.mark.slurm
def test_a_slurm_started_before_stays_until_make_stop_stops_all_six(own_slurm):
    env, fake = own_slurm
    subprocess.run(["bash", SLURM / "start.sh"], env=env, capture_output=True, timeout=120, check=True)
    before = running(env)
    assert sorted(before) == sorted(daemons())
    assert make(env, fake, "test").returncode == 0
    assert running(env) == before  # someone's cluster: left as it was
    out = make(env, fake, "stop")
    assert out.returncode == 0, out.stderr
    assert running(env) == {}
    assert_gone(before)

"""`moetron submit --nodes MIN-MAX`: the batch script of a job that may start on fewer nodes and
trains on after losing one, built where no Slurm answers (SLURM_CONF=/dev/null: a dry run only
warns that the partition was not checked). A real job losing a node: tests/slurm/test_node_loss.py."""

import os

import pytest

from moetron.launcher.cli.main import main
from moetron.launcher.cluster.sbatch import SbatchError, render_sbatch
from moetron.launcher.perf.device_profiles import DeviceProfile, save_profile

CONFIG = "configs/tiny.yaml"
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "PMI_", "TORCHELASTIC_")


@pytest.fixture
def no_cluster(tmp_path, monkeypatch):
    """No Slurm answers, and --layout auto plans with a fixed cpu profile."""
    for key in [k for k in os.environ if k.startswith(_LAUNCH_PREFIXES)]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_CONF", "/dev/null")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save_profile(DeviceProfile("cpu", 1e10, 8e9, 0.8, 1e9, 1e-4, 1e9, 1e-4, hbm_bw=1e10, dp_overlap=0.0),
                 tmp_path / "cache" / "moetron" / "plan_profile.json")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def submit(*args: str) -> int:
    return main(["submit", CONFIG, "train.run_dir=runs", "train.name=job", "parallel.dp=4", "--gpus-per-node", "0",
                 "--dry-run", *args])


def test_a_node_range_asks_for_it_and_plans_at_every_start(no_cluster, capsys):
    assert submit("--nodes", "1-2", "--layout", "auto") == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    for line in ("#SBATCH --nodes=1-2", "#SBATCH --ntasks-per-node=2", "#SBATCH --no-kill", "min_nodes=1"):
        assert line in lines, out.out
    assert "--layout auto --gpu cpu &" in out.out  # both srun lines: the first start and each restart
    assert '--overlap --nodes="$nodes" --ntasks="$((nodes * 2))"' in out.out
    assert "on 1 node(s) --layout auto would choose" in out.err and "--layout auto chose" in out.err


def test_a_fixed_node_count_keeps_the_script_of_before(no_cluster, capsys):
    assert submit("--nodes", "2", "--layout", "auto") == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in out.splitlines()
    lines = out.splitlines()
    assert "#SBATCH --no-kill" not in lines and not any(line.startswith("min_nodes=") for line in lines)
    assert "--gpu cpu" not in out  # the layout chosen at submission is in the config


def test_a_node_range_needs_the_layout_planned_at_start(no_cluster, capsys):
    assert submit("--nodes", "1-2") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--nodes 1-2: a job that may start on fewer nodes" in err and "--layout auto" in err


@pytest.mark.parametrize("nodes", ["2-1", "0-2", "a-b", "1-"])
def test_unusable_node_ranges_are_refused(no_cluster, capsys, nodes):
    with pytest.raises(SystemExit) as stop:
        submit("--nodes", nodes, "--layout", "auto")
    assert stop.value.code == 2
    assert "--nodes" in capsys.readouterr().err


def test_the_renderer_checks_the_range():
    base = {"job_name": "j", "command": ["python"], "nodes": 2}
    with pytest.raises(SbatchError, match="min_nodes=3 must be at most nodes=2"):
        render_sbatch({**base, "min_nodes": 3})
    assert "#SBATCH --no-kill\n" not in render_sbatch({**base, "min_nodes": 1, "no_kill": False})

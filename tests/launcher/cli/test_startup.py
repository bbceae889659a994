"""A bad config is answered before anything heavy loads, once per launch, with exit status 2 on
every rank; a mistyped command gets the closest one."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moetron.launcher.cli.main import is_rank_zero, main

CONFIG_COMMANDS = [
    ["train"], ["flops"], ["plan", "--gpus", "8"], ["submit", "--nodes", "1", "--gpus-per-node", "8", "--dry-run"],
]


@pytest.mark.parametrize("command", CONFIG_COMMANDS, ids=lambda c: c[0])
def test_a_config_error_loads_no_torch(tmp_path, command):
    """torch takes seconds to import (more under load); a config error must not wait for it."""
    name, *flags = command
    code = ("import sys\nfrom moetron.launcher.cli.main import main\n"
            f"status = main({[name, 'tiny', 'model.d_model=-1', *flags]!r})\n"
            "assert status == 2, status\n"
            "heavy = sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules)\n"
            "assert not heavy, f'imported on the config-error path: {heavy}'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == f"moetron {name}: model.d_model = -1: must be >= 1"


# Commands that plan or look at run folders and the queue: no model, no tensor. `status`, `logs` and
# `cancel` find no Slurm here (one line, exit 2, or an empty listing); the run folder's checkpoint is
# read without torch (launcher/checkpoint/folders.py), the layout rules too (parallel/mesh.py).
LOGIN_NODE_COMMANDS = [["submit", "tiny", "--dry-run", "train.run_dir=runs"], ["status"], ["status", "runs/tiny"],
                       ["logs", "12345"], ["cancel", "12345"], ["plan", "tiny", "--gpus", "8", "--json"]]


@pytest.mark.parametrize("command", LOGIN_NODE_COMMANDS, ids=lambda c: "-".join(c[:2]))
def test_the_login_node_commands_load_no_torch(tmp_path, command):
    """`moetron plan`, `submit` and the job commands run on login nodes, often in loops (watch
    moetron status): each used to import torch for ~2 s of CPU; a run folder with a complete
    checkpoint in it (listed by `status`) must not bring it back."""
    checkpoint = tmp_path / "runs" / "tiny" / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("step-00000002\n")
    code = ("import sys\nfrom moetron.launcher.cli.main import main\n"
            f"status = main({command!r})\n"
            "heavy = sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules)\n"
            "assert not heavy, f'imported: {heavy} (exit status {status})'\n")
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_only_rank_zero_prints_a_user_error():
    assert is_rank_zero({}) and is_rank_zero({"RANK": "0"}) and not is_rank_zero({"RANK": "1"})
    # srun and mpirun number their tasks in their own variables; torchrun's RANK wins over them.
    assert not is_rank_zero({"SLURM_PROCID": "3"}) and not is_rank_zero({"OMPI_COMM_WORLD_RANK": "1"})
    assert is_rank_zero({"RANK": "0", "SLURM_PROCID": "1"})


# The console script beside this interpreter (.venv/bin/torchrun): `make test` runs .venv/bin/python
# without putting .venv/bin on PATH, where a PATH lookup found none and the test only ever skipped.
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")


@pytest.mark.distributed
@pytest.mark.skipif(TORCHRUN is None, reason="no torchrun beside this interpreter or on PATH")
def test_under_torchrun_a_bad_config_prints_once_and_every_rank_exits_2(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "moetron", "train", "tiny",
                           "model.d_model=-1"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
                          check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("model.d_model = -1: must be >= 1") == 1, out
    # torchrun's own failure report lists the ranks' exit statuses: 2, or, for a rank still running
    # when the first one failed, the SIGTERM the agent then sends it (every rank's own status is
    # checked below, without an agent in between).
    statuses = dict(re.findall(r"rank\s*:\s*(\d) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", out))
    assert "2" in statuses.values() and set(statuses.values()) <= {"2", "-15"}, out
    # The only traceback is torchrun's own (ChildFailedError, raised by the agent whenever a rank
    # exits non-zero); no rank printed one, and no frame is moetron's.
    assert out.count("Traceback (most recent call last)") <= 1
    if "Traceback" in out:
        assert "ChildFailedError" in out
    frames = re.findall(r'File "([^"]+)"', out)
    assert all("torch" in Path(f).parts or Path(f).name == "torchrun" for f in frames), frames


def test_every_rank_exits_2_and_only_rank_0_prints(tmp_path):
    """Two ranks of a hand-made env:// launch (what torchrun sets for each) with a bad config."""
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    procs = [subprocess.Popen([sys.executable, "-m", "moetron", "train", "tiny", "model.d_model=-1"], cwd=tmp_path,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = [(p.returncode, *out) for p in procs for out in [p.communicate(timeout=60)]]
    assert [r[0] for r in results] == [2, 2], results
    assert results[0][1:] == ("", "moetron train: model.d_model = -1: must be >= 1\n")
    assert results[1][1:] == ("", "")


@pytest.mark.parametrize("typo, guess", [("trian", "train"), ("evla", "eval"), ("submti", "submit")])
def test_a_mistyped_command_gets_the_closest_one(capsys, typo, guess):
    assert main([typo, "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"unknown command {typo!r}; did you mean `moetron {guess}`?" in err


def test_a_command_like_nothing_lists_the_commands(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "did you mean" not in err and "commands: train, " in err and err.count("\n") == 1


@pytest.mark.parametrize("command,missing", [
    ("train", "config"), ("flops", "config"), ("submit", "config"), ("generate", "RUN_OR_CHECKPOINT"),
    ("eval", "RUN_OR_CHECKPOINT, --seq-len"), ("export", "RUN_OR_CHECKPOINT, --out")])
def test_a_command_without_arguments_names_only_what_is_missing(capsys, command, missing):
    """The key=value overrides after a config or run are optional: argparse lists a `*` positional
    without a default among the missing ones, which told a user that `key=value` was required."""
    with pytest.raises(SystemExit) as stop:
        main([command])
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"moetron {command}: error: the following arguments are required: {missing}"

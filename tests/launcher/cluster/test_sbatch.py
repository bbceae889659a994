"""The batch script renderer: directives present exactly when set, refusals of unusable fields.

Running the rendered script against the local Slurm is in tests/slurm/test_local_slurm.py."""

import shutil
import subprocess

import pytest

from moetron.launcher.cluster.sbatch import FIELDS, SbatchError, render, render_sbatch, template_text

MINIMAL = {"job_name": "tiny", "command": ["python", "-m", "moetron", "train", "configs/tiny.yaml"]}


def directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_minimal_script_has_only_the_required_directives():
    assert directives(render_sbatch(MINIMAL)) == [
        "--job-name=tiny",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--output=%x-%j.out",
        "--open-mode=append",
    ]


def test_every_field_set():
    script = render_sbatch(
        {
            **MINIMAL,
            "nodes": 8,
            "tasks_per_node": 8,
            "gpus_per_node": 8,
            "cpus_per_task": 12,
            "partition": "gpu",
            "time": "2-00:00:00",
            "account": "lm",
            "qos": "high",
            "constraint": "h100",
            "exclusive": True,
            "requeue_limit": 3,
            "signal_seconds": 300,
            "output": "runs/tiny/slurm-%j.out",
        }
    )
    assert directives(script) == [
        "--job-name=tiny",
        "--nodes=8",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--cpus-per-task=12",
        "--partition=gpu",
        "--time=2-00:00:00",
        "--account=lm",
        "--qos=high",
        "--constraint=h100",
        "--exclusive",
        "--requeue",
        "--signal=B:USR1@300",
        "--output=runs/tiny/slurm-%j.out",
        "--open-mode=append",
    ]
    assert "srun --kill-on-bad-exit=1 python -m moetron train configs/tiny.yaml &" in script
    assert "requeue_limit=3\n" in script


def test_requeue_follows_the_limit_unless_given():
    assert "--requeue" not in directives(render_sbatch(MINIMAL))
    assert "--requeue" in directives(render_sbatch({**MINIMAL, "requeue_limit": 1}))
    assert "--requeue" not in directives(render_sbatch({**MINIMAL, "requeue_limit": 1, "requeue": False}))


def test_command_arguments_are_shell_quoted():
    script = render_sbatch({**MINIMAL, "command": ["python", "train.py", "train.name=my run", "x=$HOME"]})
    assert "srun --kill-on-bad-exit=1 python train.py 'train.name=my run' 'x=$HOME' &" in script


def test_shell_variables_in_the_template_are_left_alone():
    script = render_sbatch(MINIMAL)
    assert "${SLURM_RESTART_COUNT:-0}" in script
    assert "{{" not in script


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_rendered_script_is_valid_bash(tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(render_sbatch({**MINIMAL, "signal_seconds": 60, "requeue_limit": 2, "time": "10"}))
    subprocess.run(["bash", "-n", str(path)], check=True)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("nodes", 0, "nodes=0 must be >= 1"),
        ("min_nodes", 0, "min_nodes=0 must be >= 1"),
        ("nodes", "2", "must be an integer"),
        ("exclusive", "yes", "must be true or false"),
        ("time", "48h", "not a Slurm time"),
        ("partition", "gpu large", "without spaces"),
        ("job_name", "a\nb", "without spaces"),
        ("command", [], "non-empty"),
        ("signal_seconds", 0, "signal_seconds=0 must be >= 1"),
    ],
)
def test_refuses_unusable_fields(field, value, message):
    with pytest.raises(SbatchError, match=message):
        render_sbatch({**MINIMAL, field: value})


def test_refuses_unknown_and_missing_fields():
    with pytest.raises(SbatchError, match="unknown sbatch field.*partiton"):
        render_sbatch({**MINIMAL, "partiton": "gpu"})
    with pytest.raises(SbatchError, match="command must be set"):
        render_sbatch({"job_name": "tiny"})


def test_template_uses_every_field_and_only_known_ones():
    import re

    used = set(re.findall(r"\{\{\s*([a-z_]+)\s*\}\}", template_text()))
    assert used == set(FIELDS)


def test_render_is_generic_and_refuses_template_typos():
    assert render("a={{ a }}\nb={{ b }}\nc\n", {"a": 1, "b": None}) == "a=1\nc\n"
    with pytest.raises(SbatchError, match="line 1 uses .* nmae"):
        render("{{ nmae }}\n", {"name": "x"})

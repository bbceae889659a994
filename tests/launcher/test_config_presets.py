"""CONFIG arguments from any folder: the shipped presets by path or by bare name, a local file first;
one-line refusals that say what exists (presets), where YAML broke (file:line:column), and what
is wrong with a layout before how it meets the launch."""

from pathlib import Path

import pytest

from moetron.launcher.cli.main import main
from moetron.launcher.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """The current folder is a fresh one, not the repository."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", ["configs/tiny.yaml", "tiny.yaml", "tiny"])
def test_a_preset_loads_from_another_folder_by_path_or_name(elsewhere, name):
    assert not (elsewhere / "configs").exists()
    assert load_config(name) == load_config(CONFIGS / "tiny.yaml")


def test_a_file_in_the_current_folder_comes_before_the_preset(elsewhere):
    (elsewhere / "configs").mkdir()
    (elsewhere / "configs" / "tiny.yaml").write_text(f"base: {CONFIGS / 'tiny.yaml'}\ntrain:\n  steps: 7\n")
    assert load_config("configs/tiny.yaml").train.steps == 7
    assert load_config("tiny").train.steps == load_config(CONFIGS / "tiny.yaml").train.steps == 500


def test_an_unknown_preset_lists_the_ones_that_exist(elsewhere):
    with pytest.raises(ConfigError) as e:
        load_config("tinyy")
    message = str(e.value)
    assert message.startswith("tinyy: no such config file") and "\n" not in message
    for preset in CONFIGS.glob("*.yaml"):
        assert preset.stem in message
    assert "try configs/tiny.yaml" not in message  # the old hint, which failed the same way from here


@pytest.mark.parametrize("command", [
    ["train"], ["flops"], ["plan", "--gpus", "8"], ["submit", "--nodes", "1", "--gpus-per-node", "8", "--dry-run"],
])
def test_every_command_taking_a_config_resolves_presets(elsewhere, capsys, command):
    """A bad override is reported (so the preset was found and read), not a missing file; a
    missing preset is reported with the list."""
    name, *flags = command
    assert main([name, "tiny", "model.d_model=-1", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"moetron {name}: model.d_model = -1: must be >= 1"
    assert main([name, "configs/nope.yaml", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "configs/nope.yaml: no such config file" in err and "mixtral-8x7b" in err and "\n" not in err


@pytest.mark.parametrize("text, where, problem", [
    ("model:\n  d_model: 3\n   n_heads: 2\n", ":3:11:", "mapping values are not allowed here"),
    ("train:\n\tsteps: 3\n", ":2:1:", "found character '\\t' that cannot start any token"),
    ("model:\n  d_model: [1\n", ":3:1:", "expected ',' or ']'"),
])
def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys, text, where, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}{where} not valid YAML: " in err and problem in err, err


def test_tp_that_does_not_divide_the_heads_says_so_before_the_launch():
    """One process, `parallel.tp=3`: the heads are the problem, not the single launched rank."""
    with pytest.raises(ConfigError, match=r"^parallel.tp = 3: must divide model.n_heads \(8\)$"):
        load_config(CONFIGS / "tiny.yaml", ["parallel.tp=3"], world_size=1)
    with pytest.raises(ConfigError, match=r"^parallel.tp = 2: must divide the KV heads \(1\)$"):
        load_config(CONFIGS / "tiny.yaml", ["parallel.tp=2", "model.n_kv_heads=1"], world_size=3)
    # A layout that is fine in itself is still checked against the launch.
    with pytest.raises(ConfigError, match=r"must divide the number of launched ranks \(3\)"):
        load_config(CONFIGS / "tiny.yaml", ["parallel.tp=2"], world_size=3)

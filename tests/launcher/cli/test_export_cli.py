"""`moetron export` and `moetron convert` leave files as any program would under the user's umask
(safetensors alone creates them 0600), and export's help names the config file it really writes."""

import os
import stat
from pathlib import Path

import pytest
import torch

from moetron.launcher.checkpoint.weights import save_weights
from moetron.launcher.cli.main import build_parser, main
from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.transformer import build_model

MIXTRAL = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64,
                      moe=MoEConfig(num_experts=4, top_k=2, d_expert=32))


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    torch.manual_seed(0)
    return save_weights(build_model(MIXTRAL), tmp_path / "ckpt", source="test")


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


def test_export_help_names_the_config_file_it_writes(checkpoint, tmp_path, capsys):
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["export"]
    help_text = " ".join(sub.format_help().split())
    assert "<out>.config.json" not in help_text
    assert "--out NAME.safetensors also writes NAME.config.json" in help_text
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "out" / "model.safetensors")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.config.json", "model.safetensors"]
    assert f"config: {tmp_path / 'out' / 'model.config.json'}" in capsys.readouterr().out


def test_export_and_convert_respect_the_umask(checkpoint, tmp_path, umask_022):
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "e" / "m.safetensors")]) == 0
    assert main(["convert", "--to-hf", str(checkpoint), "--out", str(tmp_path / "hf")]) == 0
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    written = {**modes(tmp_path / "e"), **{f"hf/{k}": v for k, v in modes(tmp_path / "hf").items()},
               **{f"back/{k}": v for k, v in modes(tmp_path / "back").items()}}
    assert {"m.safetensors", "m.config.json", "hf/model.safetensors", "hf/config.json"} <= set(written)
    assert {k: oct(v) for k, v in written.items() if v != 0o644} == {}


def test_a_tighter_umask_is_kept(checkpoint, tmp_path):
    old = os.umask(0o077)
    try:
        assert main(["export", str(checkpoint), "--out", str(tmp_path / "m.safetensors")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m.safetensors").stat().st_mode) == 0o600

"""Config loading: presets, typed overrides, one-line errors with exit status 2."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moetron.launcher.config import Config, ConfigError, config_from_dict, load_config, validate_launch

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_every_preset_loads_and_validates():
    presets = sorted(CONFIGS.glob("*.yaml"))
    assert presets, "no presets in configs/"
    for preset in presets:
        cfg = load_config(preset)
        assert cfg.train.name == preset.stem


def test_overrides_are_typed_and_nested():
    cfg = load_config(CONFIGS / "tiny.yaml", ["model.moe.top_k=1", "model.moe.weighting=softmax",
                                              "train.lr=1e-3", "train.name=x", "model.moe.capacity_factor=1.25",
                                              "train.checkpoint.async=true"])
    assert cfg.model.moe.top_k == 1 and isinstance(cfg.train.lr, float) and cfg.train.lr == 1e-3
    assert cfg.model.moe.capacity_factor == 1.25 and cfg.train.checkpoint.async_save is True
    assert cfg.train.name == "x"


def test_round_trip_through_plain_data():
    cfg = load_config(CONFIGS / "tiny.yaml", ["model.n_kv_heads=2"])
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again == cfg


@pytest.mark.parametrize("override, expected", [
    (["model.n_head=4"], "unknown key model.n_head (did you mean model.n_heads?)"),
    (["train.stpes=4"], "did you mean train.steps?"),
    (["model.n_heads=eight"], "model.n_heads = 'eight': must be an integer"),
    (["model.n_kv_heads=3"], "model.n_kv_heads = 3: must divide n_heads (8)"),
    (["model.moe.top_k=9"], "model.moe.top_k = 9: must be in 1..num_experts (8)"),
    (["model.position=xpos"], "must be one of rope, alibi, sinusoidal, learned, t5, none"),
    (["model.position=t5", "parallel.pp=2", "parallel.microbatches=2"], "model.position = 't5': T5's bias table is shared by every layer"),
    (["model.position=t5", "model.t5_max_distance=8"], "model.t5_max_distance = 8: must exceed t5_num_buckets // 2"),
    (["model.rope_scaling=longrope"], "must be one of none, linear, ntk, yarn"),
    (["train.grad_accum=3"], "train.grad_accum = 3: must divide batch_size (16)"),
    (["parallel.tp=3"], "parallel.tp = 3: must divide model.n_heads (8)"),
    (["parallel.ep=3", "parallel.dp=3", "train.batch_size=24"], "parallel.ep = 3: must divide model.moe.num_experts (8)"),
    (["train.precision=fp16"], "must be one of auto, fp32, bf16, fp8"),
    (["train.steps"], "expected key=value"),
    (["model.tie_embeddings=true", "parallel.dp=2"], "model.tie_embeddings = True: is not supported with data or context"),
])
def test_bad_input_names_key_value_and_rule(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "tiny.yaml", override)
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="no such config file"):
        load_config("does/not/exist.yaml")


def test_cli_reports_one_line_and_exit_status_2(tmp_path):
    for args, needle in [(["train", "nope.yaml"], "nope.yaml: no such config file"),
                         (["train", str(CONFIGS / "tiny.yaml"), "model.d_modle=3"], "did you mean model.d_model?")]:
        proc = subprocess.run([sys.executable, "-m", "moetron", *args], capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_defaults_are_a_valid_config(tmp_path):
    """A preset that sets nothing is the defaults, through the one validation pass; and the defaults
    README.md states hold."""
    (tmp_path / "empty.yaml").write_text("{}\n")
    cfg = load_config(tmp_path / "empty.yaml")
    assert cfg == dataclasses.replace(Config(), train=dataclasses.replace(Config().train, name="empty"))
    assert (cfg.data.source, cfg.data.tokenizer) == ("stdlib", "byte")  # the interpreter's own source, as bytes
    assert cfg.parallel.dp_mode == "fsdp"
    assert cfg.model.moe.aux_loss_type == "micro_batch"
    assert cfg.train.max_skipped_steps == 5
    assert cfg.train.checkpoint.on_error == "stop"
    assert cfg.train.lr_decay_steps is None  # decay over train.steps of the first start


def test_base_presets_merge_section_by_section(tmp_path):
    (tmp_path / "a.yaml").write_text("model:\n  d_model: 128\n  n_heads: 4\ntrain:\n  steps: 7\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nmodel:\n  n_heads: 2\n")
    cfg = load_config(tmp_path / "b.yaml")
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.train.steps, cfg.train.name) == (128, 2, 7, "b")
    (tmp_path / "c.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "c.yaml")


def test_dp_follows_the_world_size_when_left_out():
    """Megatron-LM and torchtitan infer data parallelism from the launch; so does moetron."""
    cfg = load_config(CONFIGS / "tiny.yaml", ["parallel.tp=2", "parallel.ep=2"], world_size=4)
    assert (cfg.parallel.dp, cfg.parallel.world_size) == (2, 4)
    cfg = load_config(CONFIGS / "tiny.yaml", ["parallel.pp=2", "parallel.microbatches=2"], world_size=8)
    assert cfg.parallel.dp == 4
    assert load_config(CONFIGS / "tiny.yaml").parallel.dp == 1  # no launch known: one data-parallel rank
    with pytest.raises(ConfigError, match=r"parallel.pp × cp × tp = 1 × 1 × 2 = 2: must divide the number of launched ranks \(3\)"):
        load_config(CONFIGS / "tiny.yaml", ["parallel.tp=2"], world_size=3)


def test_an_explicit_dp_is_kept_and_checked_against_the_launch():
    cfg = load_config(CONFIGS / "tiny-tp2-ep2.yaml", world_size=8)
    assert cfg.parallel.dp == 2  # written in the preset: not overridden by the launch
    with pytest.raises(ConfigError, match=r"= 4: must equal the number of launched ranks \(8\)"):
        validate_launch(cfg, 8)
    with pytest.raises(ConfigError, match=r"parallel.ep = 2: must divide dp \(1\)"):
        load_config(CONFIGS / "tiny.yaml", ["parallel.dp=1", "parallel.tp=2", "parallel.ep=2"], world_size=4)

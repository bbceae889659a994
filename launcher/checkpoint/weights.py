"""A trained model outside training: find a run's checkpoint, rebuild the model from it, write a
weights-only checkpoint, and find the tokenizer that goes with it. Used by `generate`, `eval` and
`convert`.

A weights-only checkpoint is a checkpoint folder like the trainer's (DCP shards under the key
"model", state.json holding the resolved config, COMPLETE) without optimizer, sampler or RNG
state, so `load_checkpoint(path, model, None)` and `moetron generate` read it; it does not resume
training. When it was converted from Hugging Face, the source's tokenizer.json sits beside it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from moetron.launcher.checkpoint.folders import COMPLETE, latest_checkpoint, previous_checkpoint
from moetron.launcher.checkpoint.io import CheckpointDamaged, CheckpointError, read_state, verify_checkpoint
from moetron.launcher.checkpoint.store import load_checkpoint
from moetron.launcher.config import Config, ConfigError, TrainConfig, apply_override, config_from_dict
from moetron.launcher.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from moetron.model.config import ModelConfig
from moetron.model.transformer import Decoder, build_model

TOKENIZER_FILE = "tokenizer.json"


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint folder as given, or the newest complete one of a run folder, once its
    files are as its manifest recorded (sizes; hashes are checked as the shards are read) and its
    state.json parses: the check a resume makes, before anything of it is used."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such run or checkpoint folder")
    if (path / COMPLETE).is_file():
        return _intact(path)
    for root in (path / "checkpoints", path):
        if root.is_dir():
            found = latest_checkpoint(root)
            if found is not None:
                return _intact(found)
    raise CheckpointError(f"{path}: neither a complete checkpoint nor a run folder holding one "
                   f"(expected {path}/checkpoints/step-*/{COMPLETE})")


def _intact(ckpt: Path) -> Path:
    """`ckpt`, or CheckpointDamaged in one line: what is damaged, and the previous checkpoint."""
    try:
        problem = verify_checkpoint(ckpt)  # a newer format raises a plain CheckpointError: not damage
    except CheckpointDamaged as e:  # an unreadable manifest or metadata
        problem = str(e)
    if problem:
        previous = previous_checkpoint(ckpt)
        offer = f"; the previous complete checkpoint is {previous}" if previous else "; no earlier complete checkpoint exists"
        raise CheckpointDamaged(f"checkpoint {ckpt} is damaged: {problem}{offer} (nothing was deleted)")
    return ckpt


def checkpoint_config(ckpt: Path) -> Config:
    """The resolved config a checkpoint was written with."""
    state_file = ckpt / "state.json"
    if not state_file.is_file():
        raise CheckpointError(f"{ckpt}: no state.json")
    saved = read_state(ckpt).get("config")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{state_file}: holds no resolved config")
    return config_from_dict(saved)


def with_model_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """`cfg` with `model.key=value` overrides applied and validated: how a trained model is run with
    settings that hold no weights, e.g. RoPE scaling (model.rope_scaling=yarn
    model.rope_scaling_factor=4) or a longer model.max_seq_len. YaRN's original context is pinned
    first to the checkpoint's own max_seq_len, so that raising max_seq_len does not move it.
    An override that changes a weight's shape fails when the weights are loaded."""
    if not overrides:
        return cfg
    data = cfg.to_dict()
    if data["model"].get("rope_original_max_seq_len") is None:
        data["model"]["rope_original_max_seq_len"] = cfg.model.max_seq_len
    for item in overrides:
        if not item.strip().startswith("model."):
            raise ConfigError(f"override {item!r}: only model.* settings apply to a trained model")
        apply_override(data, item)
    return config_from_dict(data)


def load_model(ckpt: Path, *, device: torch.device | str = "cpu", dropless: bool = True,
               overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, Decoder]:
    """Rebuild the checkpoint's model, with `overrides` (see `with_model_overrides`), and load its
    weights, in eval mode.

    `dropless` lifts the capacity limit: capacity is a training-time throughput knob, and with it a
    token's output would depend on which other tokens share its batch, so that a KV-cache decode
    would no longer equal the same text run as a whole.
    """
    cfg = with_model_overrides(checkpoint_config(ckpt), overrides)
    model_cfg = cfg.model
    if dropless and model_cfg.moe.capacity_factor is not None:
        model_cfg = model_cfg.replace(moe=dataclasses.replace(model_cfg.moe, capacity_factor=None))
    # Converted checkpoints record their dtype; the trainer's keep fp32 master weights.
    dtype = getattr(torch, read_state(ckpt).get("dtype", "float32"))
    model = build_model(model_cfg, device=device, dtype=dtype)
    load_checkpoint(ckpt, model, None)
    return cfg, model.eval()


def save_weights(model: Decoder, out: Path, *, source: str, extra_files: tuple[Path, ...] = ()) -> Path:
    """Write `model` (and copies of `extra_files`, e.g. a tokenizer.json) as a weights-only
    checkpoint folder `out` (must not exist or be empty): see `write_weights_folder`."""

    def write(tmp: Path) -> None:
        with warnings.catch_warnings():
            # One process without a process group is a supported layout here, not a mistake.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(tmp))

    return write_weights_folder(out, model.cfg, model.embed.weight.dtype, write, source=source,
                                extra_files=extra_files)


def write_weights_folder(out: Path, model_cfg: ModelConfig, dtype: torch.dtype, write: Callable[[Path], None], *,
                         source: str, extra_files: tuple[Path, ...] = ()) -> Path:
    """A weights-only checkpoint folder `out` (must not exist or be empty) whose DCP shards
    `write(folder)` puts there, with state.json and copies of `extra_files`, atomically: into a
    sibling temporary folder, renamed when complete, removed if anything fails."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {out}: already exists; choose a new folder")
    cfg = weights_config(model_cfg)
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        state = {"step": 0, "tokens": 0, "config": cfg.to_dict(), "source": source,
                 "dtype": str(dtype).removeprefix("torch.")}
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        for f in extra_files:
            shutil.copyfile(f, tmp / Path(f).name)
        (tmp / COMPLETE).write_text(out.name + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def weights_config(model_cfg: ModelConfig) -> Config:
    """A full, valid config around `model_cfg` (the run sections at their defaults, the training
    sequence length clipped to the model's context)."""
    seq_len = min(TrainConfig().seq_len, model_cfg.max_seq_len)
    cfg = Config(model=model_cfg, train=TrainConfig(seq_len=seq_len))
    try:
        return config_from_dict(cfg.to_dict())
    except ConfigError as e:
        raise ConfigError(f"the converted model is not a valid moetron model: {e}") from None


def checkpoint_tokenizer(ckpt: Path, cfg: Config) -> Tokenizer:
    """The tokenizer.json beside the checkpoint if there is one, else the one the run trained with:
    data.tokenizer for the embedded corpus, the token shards' own for data.source=PREFIX. A
    converted checkpoint had no run, so without a tokenizer.json it has no tokenizer."""
    if (ckpt / TOKENIZER_FILE).is_file():
        return HFTokenizer(ckpt / TOKENIZER_FILE)
    source = read_state(ckpt).get("source")
    if source is not None:
        raise FileNotFoundError(f"tokenizer: {ckpt} was converted from {source} without a {TOKENIZER_FILE}; "
                                f"pass --prompt-ids instead of --prompt")
    if cfg.data.source == "stdlib":
        return load_tokenizer(cfg.data.tokenizer)
    header = Path(cfg.data.source + ".json")
    if not header.is_file():
        raise FileNotFoundError(f"tokenizer: the run's token shards {header} are gone; pass --prompt-ids "
                                f"instead of --prompt")
    return load_tokenizer(json.loads(header.read_text())["tokenizer"], header.parent)

"""The run folder <train.run_dir>/<train.name>/: created once, resumed, never clobbered.

  config.yaml      the resolved config of the run's first start
  metrics.jsonl    one JSON object per logged step
  tensorboard/     event files
  checkpoints/     see moetron.launcher.checkpoint.store
  slurm/           batch script, resolved config and logs of `moetron submit` (launcher/cluster/submit.py)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from moetron.launcher.checkpoint.io import (
    CheckpointError,
    load_metadata,
    tensor_mismatches,
    tensor_shapes,
    verify_checkpoint,
)
from moetron.launcher.checkpoint.store import COMPLETE, latest_checkpoint, previous_checkpoint
from moetron.launcher.config import Config


class RunError(RuntimeError):
    """A run folder that cannot be used as asked; printed as one line (exit status 2)."""


@dataclass(frozen=True)
class RunDir:
    path: Path
    resume_from: Path | None

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"


def open_run_dir(cfg: Config, resume: str = "auto", *, create: bool = True) -> RunDir:
    """Decide where the run lives and what it resumes from.

    resume="auto": the newest complete checkpoint of the folder, or a fresh start when the folder
    is new; a folder that already holds a run but no checkpoint is refused, not overwritten,
    unless that run had the same config (it starts again from step 0).
    resume="none": a fresh start, refused if the folder already holds a run.
    resume=PATH: that checkpoint folder.
    The chosen checkpoint's files must have the sizes its manifest recorded; a damaged one is
    reported with the previous complete checkpoint to resume from instead (nothing is deleted).
    """
    path = Path(cfg.train.run_dir) / cfg.run_name
    # slurm/ holds what `moetron submit` wrote before the job's first start: not yet a run.
    used = path.is_dir() and any(p.name != "slurm" for p in path.iterdir())
    if resume == "none":
        if used:
            raise RunError(f"{path} already holds a run; resume it with --resume auto, "
                           f"or start another with train.name=<new name>")
        ckpt = None
    elif resume == "auto":
        ckpt = latest_checkpoint(path / "checkpoints") if used else None
        if used and ckpt is None and not _restarted_before_first_checkpoint(path, cfg):
            raise RunError(f"{path} already holds a run but no complete checkpoint to resume from; "
                           f"start another with train.name=<new name> or remove the folder")
    else:
        ckpt = Path(resume)
        if not (ckpt / COMPLETE).is_file():
            found = latest_checkpoint(ckpt.parent) if ckpt.parent.is_dir() else None
            offer = f"; the newest complete one there is {found}" if found else ""
            raise RunError(f"--resume {resume}: not a complete checkpoint{offer}")
    if ckpt is not None:
        _check_intact(ckpt)
        _check_same_model(cfg, ckpt)
    if create:
        path.mkdir(parents=True, exist_ok=True)
        if ckpt is None:
            (path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            truncate_metrics(path, 0)
    return RunDir(path, ckpt)


def _restarted_before_first_checkpoint(path: Path, cfg: Config) -> bool:
    """The same config started here and stopped before its first checkpoint (a first attempt that
    was preempted, failed or requeued while starting): nothing to resume, nothing else to keep."""
    saved = path / "config.yaml"
    return saved.is_file() and yaml.safe_load(saved.read_text()) == cfg.to_dict()


def _check_intact(ckpt: Path) -> None:
    """Refuse a checkpoint with a missing or truncated file, offering the previous one."""
    try:
        problem = verify_checkpoint(ckpt)
    except CheckpointError as e:
        problem = str(e)
    if problem:
        previous = previous_checkpoint(ckpt)
        offer = (f"; resume from the previous complete checkpoint with --resume {previous}" if previous
                 else "; no earlier complete checkpoint exists")
        raise RunError(f"checkpoint {ckpt} is damaged: {problem}{offer} (nothing was deleted)")


def _check_same_model(cfg: Config, ckpt: Path) -> None:
    """Refuse to resume a checkpoint of another architecture, naming the first differing config
    key and the tensors that differ (shapes, missing or unexpected names)."""
    saved = json.loads((ckpt / "state.json").read_text()).get("config", {}).get("model", {})
    now = cfg.to_dict()["model"]
    for key in sorted(set(saved) | set(now)):
        if key not in ("attention",) and saved.get(key) != now.get(key):
            raise RunError(f"checkpoint {ckpt} is of another model: model.{key} was {saved.get(key)!r}, "
                           f"now {now.get(key)!r}{_tensor_differences(cfg, ckpt)}")


def _tensor_differences(cfg: Config, ckpt: Path) -> str:
    """The checkpoint's tensors against a meta-device build of the configured model, as text."""
    from moetron.model.transformer import build_model

    expected = {k: tuple(v.shape) for k, v in build_model(cfg.model, device="meta").state_dict().items()}
    problems = tensor_mismatches(tensor_shapes(load_metadata(ckpt), "model."), expected)
    return f" (tensors: {'; '.join(problems[:4])})" if problems else ""


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records after `last_step` (logged by a run that died before its next checkpoint),
    so a resumed run's metrics.jsonl reads as if it had never stopped."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        return
    keep = [line for line in metrics.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    # Call on one rank only, before the metrics log is opened: a replace behind an open log's back
    # would orphan what it writes next.
    tmp = metrics.with_name(f".{metrics.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(metrics)

"""The run folder <train.run_dir>/<train.name>/: created once, resumed, never clobbered.

  config.yaml      the resolved config of the run's latest start (each checkpoint's state.json
                   holds the one it was trained with)
  metrics.jsonl    one JSON object per logged step
  tensorboard/     event files
  checkpoints/     see moetron.launcher.checkpoint.store
  slurm/           batch script, resolved config and logs of `moetron submit` (launcher/cluster/submit.py)
  lease.json       the world training here now, while it trains (launcher/train/run_lease.py)

A start decides first and writes afterwards: `open_run_dir(..., create=False)` reads the folder and
chooses what to resume from, writing nothing, so that the trainer can check the config, the data
and the checkpoint before `write_run_dir` creates anything. A start refused on the way leaves no
folder behind to block `--resume none` or a corrected rerun.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

# The checkpoint's files are read (checkpoint/io.py, which imports torch and DCP) only where a
# checkpoint is there to resume: `moetron submit`, `status`, `logs` and `cancel` open run folders
# without paying torch's import (~2 s of CPU each).
from moetron.launcher.checkpoint.folders import (
    COMPLETE,
    complete_checkpoints,
    latest_checkpoint,
    previous_checkpoint,
    set_aside,
    step_of,
)
from moetron.launcher.config import Config

CONFIG = "config.yaml"


class RunError(RuntimeError):
    """A run folder that cannot be used as asked; printed as one line (exit status 2)."""


@dataclass(frozen=True)
class RunDir:
    path: Path
    resume_from: Path | None
    # resume="auto": a damaged checkpoint is passed over for the newest intact one.
    automatic: bool = False
    # The damaged checkpoints passed over, newest first, each with what is wrong with it;
    # `write_run_dir` sets them aside.
    damaged: tuple[tuple[Path, str], ...] = ()

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"


@dataclass(frozen=True)
class SetAside:
    """A damaged checkpoint, renamed where no resume picks it up again."""

    checkpoint: Path  # its name when it was found
    now: Path  # its name now
    problem: str


def open_run_dir(cfg: Config, resume: str = "auto", *, create: bool = True) -> RunDir:
    """Decide where the run lives and what it resumes from; with `create`, `write_run_dir` too.

    resume="auto": the newest intact complete checkpoint of the folder, or a fresh start when the
    folder is new. A damaged checkpoint (a missing or cut file, an unreadable state.json) is passed
    over for the newest intact one before it, so that a requeued job goes on; the trainer says so
    loudly. A folder that already holds a run but no complete checkpoint is refused, not
    overwritten, unless that run had the same config (it starts again from step 0).
    resume="none": a fresh start, refused if the folder already holds a run.
    resume=PATH: that checkpoint folder; a damaged one is refused, naming the previous one.
    """
    path = Path(cfg.train.run_dir) / cfg.run_name
    # slurm/ holds what `moetron submit` wrote before the job's first start: not yet a run.
    used = path.is_dir() and any(p.name != "slurm" for p in path.iterdir())
    if resume == "none":
        if used:
            raise RunError(f"{path} already holds a run; resume it with --resume auto, "
                           f"or start another with train.name=<new name>")
        run = RunDir(path, None)
    elif resume == "auto":
        run = _automatic(cfg, path, used)
    else:
        run = RunDir(path, _chosen(cfg, Path(resume)))
    if create:
        write_run_dir(run, cfg)
    return run


def _automatic(cfg: Config, path: Path, used: bool) -> RunDir:
    if not used:
        return RunDir(path, None, automatic=True)
    ckpt, damaged = newest_intact(path / "checkpoints")
    if ckpt is None and damaged:
        raise RunError(f"{path}: no intact checkpoint to resume from; the newest, {damaged[0][0]}, is damaged: "
                       f"{damaged[0][1]}{_and_more(damaged)} (nothing was deleted); start another with "
                       f"train.name=<new name>")
    if ckpt is None and not _restarted_before_first_checkpoint(path, cfg):
        raise RunError(f"{path} already holds a run but no complete checkpoint to resume from; "
                       f"start another with train.name=<new name> or remove the folder")
    if ckpt is not None:
        _check_same_model(cfg, ckpt)
    return RunDir(path, ckpt, automatic=True, damaged=tuple(damaged))


def _chosen(cfg: Config, ckpt: Path) -> Path:
    """The checkpoint --resume PATH names, refused in one line unless complete, intact and of this model."""
    if not (ckpt / COMPLETE).is_file():
        found = latest_checkpoint(ckpt.parent) if ckpt.parent.is_dir() else None
        offer = f"; the newest complete one there is {found}" if found else ""
        raise RunError(f"--resume {ckpt}: not a complete checkpoint{offer}")
    problem = damage(ckpt)
    if problem:
        previous = previous_checkpoint(ckpt)
        offer = (f"; resume from the previous complete checkpoint with --resume {previous}" if previous
                 else "; no earlier complete checkpoint exists")
        raise RunError(f"checkpoint {ckpt} is damaged: {problem}{offer} (nothing was deleted)")
    _check_same_model(cfg, ckpt)
    return ckpt


def damage(ckpt: Path) -> str | None:
    """What is wrong with a checkpoint's files, as one line (cheap: sizes, not hashes), or None.
    A checkpoint of a newer format is not damaged: its CheckpointError propagates."""
    from moetron.launcher.checkpoint.io import CheckpointDamaged, verify_checkpoint

    try:
        return verify_checkpoint(ckpt)
    except CheckpointDamaged as e:
        return str(e)


def newest_intact(root: Path, *, before: Path | None = None) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint of `root` (older than `before`, if given) whose files are
    intact, and the damaged ones newer than it, newest first, with their problems."""
    damaged = []
    for ckpt in reversed(complete_checkpoints(root)):
        if before is not None and ckpt.name >= before.name:
            continue
        problem = damage(ckpt)
        if problem is None:
            return ckpt, damaged
        damaged.append((ckpt, problem))
    return None, damaged


def fall_back(run: RunDir, cfg: Config, problem: str) -> RunDir:
    """`run` resuming instead from the newest intact checkpoint older than the one it was to
    resume from, which turned out damaged while it loaded (a hash, not a size): resume="auto" only."""
    ckpt, more = newest_intact(run.checkpoints, before=run.resume_from)
    damaged = (*run.damaged, (run.resume_from, problem), *more)
    if ckpt is None:
        raise RunError(f"{run.path}: no intact checkpoint to resume from; {run.resume_from} is damaged: "
                       f"{problem}{_and_more(damaged[len(run.damaged):])} (nothing was deleted); start another "
                       f"with train.name=<new name>")
    _check_same_model(cfg, ckpt)
    return dataclasses.replace(run, resume_from=ckpt, damaged=damaged)


def _and_more(damaged) -> str:
    more = len(damaged) - 1
    return f"; the {more} older one{'s are' if more > 1 else ' is'} damaged too" if more else ""


def write_run_dir(run: RunDir, cfg: Config) -> list[SetAside]:
    """Make the decision real, on one rank, once the start has been checked. A fresh run: the
    folder, config.yaml and an empty metrics.jsonl. A resumed one: the damaged checkpoints it
    passed over set aside (damaged-step-N, nothing deleted), metrics.jsonl cut back to the step it
    resumes at, and config.yaml replaced (atomically) when this start's config differs, e.g. a
    raised train.steps. Returns what was set aside."""
    run.path.mkdir(parents=True, exist_ok=True)
    if run.resume_from is None:
        _write_config(run.path, cfg)
        truncate_metrics(run.path, 0)
        return []
    moved = [SetAside(ckpt, set_aside(ckpt), problem) for ckpt, problem in run.damaged]
    truncate_metrics(run.path, checkpoint_step(run.resume_from))
    saved = run.path / CONFIG
    if not saved.is_file() or yaml.safe_load(saved.read_text()) != cfg.to_dict():
        _write_config(run.path, cfg)
    return moved


def checkpoint_step(ckpt: Path) -> int:
    """The step a checkpoint holds (its state.json's, else its folder name's)."""
    from moetron.launcher.checkpoint.io import read_state

    return int(read_state(ckpt).get("step", step_of(ckpt)))


def _write_config(path: Path, cfg: Config) -> None:
    tmp = path / f".{CONFIG}.{os.getpid()}.tmp"
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(path / CONFIG)


def _restarted_before_first_checkpoint(path: Path, cfg: Config) -> bool:
    """The same config started here and stopped before its first checkpoint (a first attempt that
    was preempted, failed or requeued while starting): nothing to resume, nothing else to keep."""
    saved = path / CONFIG
    return saved.is_file() and yaml.safe_load(saved.read_text()) == cfg.to_dict()


def _check_same_model(cfg: Config, ckpt: Path) -> None:
    """Refuse to resume a checkpoint of another architecture, naming the first differing config
    key and the tensors that differ (shapes, missing or unexpected names)."""
    from moetron.launcher.checkpoint.io import read_state

    saved = read_state(ckpt).get("config", {}).get("model", {})
    now = cfg.to_dict()["model"]
    for key in sorted(set(saved) | set(now)):
        if key not in ("attention",) and saved.get(key) != now.get(key):
            raise RunError(f"checkpoint {ckpt} is of another model: model.{key} was {saved.get(key)!r}, "
                           f"now {now.get(key)!r}{_tensor_differences(cfg, ckpt)}")


def _tensor_differences(cfg: Config, ckpt: Path) -> str:
    """The checkpoint's tensors against a meta-device build of the configured model, as text."""
    from moetron.launcher.checkpoint.io import load_metadata, tensor_mismatches, tensor_shapes
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

"""What a run checks before its folder changes, and what it says about how it started.

The trainer writes nothing until the config, the data and the checkpoint have all been found
usable: a start that is refused answers in one line and leaves no folder (nor a changed one)
behind. Here:
- `checked_data`: the corpus (or each corpus of a blend), refused when a split cannot fill one
  window of seq_len + 1 tokens, or its tokenizer or token ids outgrow the model's vocabulary;
- `already_finished`: a run whose checkpoint is at (or past) train.steps;
- `load_resumable`: the checkpoint's tensors, passing over one found damaged while it loads when
  the resume is automatic (launcher/run_dir.py set aside the ones whose files are cut short);
- `report_set_aside`: the loud warning such a resume leaves on the console, in metrics.jsonl and
  in TensorBoard;
- `schedule_warnings`: a warmup longer than the learning-rate schedule, as torchtitan warns.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from moetron.launcher.checkpoint.io import CheckpointDamaged
from moetron.launcher.config import Config, ConfigError, TrainConfig
from moetron.launcher.data.corpus import Source, TokenData, load_token_data, window_shortage
from moetron.launcher.run_dir import RunDir, RunError, SetAside, checkpoint_step, fall_back


def checked_data(cfg: Config) -> TokenData:
    """The run's token data, once it can feed this config: raises ConfigError (one line) when its
    tokenizer has more ids than model.vocab_size, a source holds a token id the model has no row
    for (the id its writer recorded, or one among its first tokens), or a split of a source holds
    no window of seq_len + 1."""
    d = cfg.data
    data = load_token_data(d.source, d.tokenizer, d.val_fraction, d.blend_pairs())
    vocab = cfg.model.vocab_size
    if data.vocab_size > vocab:
        raise ConfigError(f"model.vocab_size = {vocab}: must be >= the tokenizer's "
                          f"vocabulary ({data.vocab_size}, {data.tokenizer.name})")
    if cfg.train.objective == "mlm" and data.vocab_size == vocab:
        raise ConfigError(f"model.vocab_size = {vocab}: train.objective mlm adds a mask token past the tokenizer's "
                          f"{vocab} ids: set model.vocab_size >= {vocab + 1}")
    for source in data.sources:
        where = f"data.source = {d.source!r}" if d.blend is None else f"data.blend source {source.prefix!r}"
        for split, shards in (("train", source.train), ("validation", source.val)):
            problem = window_shortage(split, [len(s) for s in shards], cfg.train.seq_len)
            if problem:
                raise ConfigError(f"{where}: {problem}")
        problem = token_id_problem(source, vocab)
        if problem:
            raise ConfigError(f"{where}: {problem}")
    return data


def token_id_problem(source: Source, vocab_size: int, first: int = 1 << 20) -> str | None:
    """Why `source` holds ids outside [0, vocab_size) — by the largest id its writer recorded, else
    among the first `first` tokens of each split (a corpus made with another tokenizer shows it
    at once; reading all of a large corpus would not pay) — or None."""
    if source.max_id is not None and source.max_id >= vocab_size:
        return (f"holds token id {source.max_id} (the largest `moetron data prepare` wrote); model.vocab_size "
                f"= {vocab_size} must be above it: set model.vocab_size >= {source.max_id + 1}")
    for split, arrays in (("train", source.train), ("validation", source.val)):
        for tokens in arrays:
            head = np.asarray(tokens[:first])
            if not head.size:
                continue
            first_n = f"among the first {min(first, len(tokens)):,} tokens of its {split} split"
            if head.min() < 0:
                return f"token id {int(head.min())} {first_n} is negative: these are not token ids"
            if head.max() >= vocab_size:
                return (f"token id {int(head.max())} {first_n} is outside model.vocab_size = {vocab_size} "
                        f"(ids 0..{vocab_size - 1}): was it tokenized with a larger vocabulary? set "
                        f"model.vocab_size >= {int(head.max()) + 1} or re-tokenize")
    return None


def already_finished(run: RunDir, steps: int, console: Callable[[str], None]) -> bool:
    """Whether the checkpoint the run resumes from is at train.steps already (said on the
    console: a job requeued after its last step ends at once). One past it is refused: the
    config asks for less than the run has done."""
    done = checkpoint_step(run.resume_from)
    if done > steps:
        raise RunError(f"{run.path} is at step {done} ({run.resume_from}), past train.steps = {steps}; to train "
                       f"it further set train.steps above {done}, or start a new run with "
                       f"train.name=<new name> --resume none")
    if done == steps:
        console(f"{run.path} already finished: {run.resume_from} is at step {done} = train.steps; nothing to "
                f"train (set train.steps above {done} to train further)")
    return done == steps


def load_resumable(run: RunDir, cfg: Config, load: Callable[[Path], dict],
                   on_rank0: Callable) -> tuple[dict, RunDir]:
    """`load(run.resume_from)` → (its state, the run). Under resume="auto", a checkpoint found
    damaged while loading (a shard's hash, a file DCP cannot parse) is passed over for the newest
    intact one before it, decided on rank 0 for all (every rank sees the failure: DCP gathers
    them). A later load overwrites every tensor an earlier, failed one may have touched."""
    while True:
        try:
            return load(run.resume_from), run
        except CheckpointDamaged as e:
            if not run.automatic:
                raise
            problem = e.problem
        run = on_rank0(partial(fall_back, run, cfg, problem))


def report_set_aside(moved: list[SetAside], run: RunDir, step: int, metrics, console: Callable[[str], None]) -> None:
    """The loud warning of an automatic resume that passed over damaged checkpoints: one console
    line each, a metrics.jsonl record and TensorBoard text and scalar (`damaged_checkpoints`)."""
    for m in moved:
        line = (f"WARNING: checkpoint {m.checkpoint} is damaged ({m.problem}); set aside as {m.now}; "
                f"resumed from {run.resume_from} at step {step} instead")
        console(line)
        metrics.text("warnings", line, step)
    if moved:
        metrics.log(step, {"damaged_checkpoints": len(moved), "resumed_from": str(run.resume_from),
                           "set_aside": [str(m.now) for m in moved]})


def schedule_warnings(t: TrainConfig, decay_steps: int) -> list[str]:
    """What is odd about the learning-rate schedule, as lines to print: a warmup longer than the
    schedule (train.lr_decay_steps, else train.steps of the run's first start). torchtitan warns
    of it and Megatron refuses it; here it is said once and trained as configured."""
    if t.warmup_steps <= decay_steps:
        return []
    if t.steps < t.warmup_steps:
        what = f"the learning rate reaches only {t.steps / t.warmup_steps:.0%} of train.lr = {t.lr:g}, at the last step"
    else:
        what = "the learning rate drops to train.min_lr as soon as it has warmed up"
    line = (f"warning: train.warmup_steps = {t.warmup_steps} is longer than the learning-rate schedule "
            f"({decay_steps} steps): {what}; set train.warmup_steps to at most {decay_steps}")
    return [line]

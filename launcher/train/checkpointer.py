"""When the training loop checkpoints, and what a failed save does to the run.

The loop reports each finished step (`after_step`) and asks for the final save when it stops
(`finish`); `CheckpointManager` decides the rest:
- every `train.checkpoint.every` steps it saves, but never after a skipped (non-finite) step: its
  weights are the previous step's, already saved or about to be;
- an async save in flight is polled after every step (one tiny collective) and published once
  every rank has written its part;
- at the stop (last step, signal, `exit_after`) it saves the step trained last, unless that step
  was saved (or attempted) already, nothing was trained, or the run diverged;
- `train.checkpoint.on_error`: a periodic save that fails stops the run ("stop", the
  CheckpointError propagates) or is reported, counted in `failed_saves` and left behind
  ("continue"); the final save's failure always stops the run;
- weights or optimizer state that are not finite are never saved: NonFiniteError instead;
- `guard()` (the run lease's check, launcher/train/run_lease.py) runs on every rank before a save
  starts and again before it is published: a world that lost the run folder raises there.
The writing itself (atomic, verified, async, kept K deep) is `store.Checkpointer`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from moetron.launcher.checkpoint.io import CheckpointError
from moetron.launcher.checkpoint.store import Checkpointer
from moetron.launcher.config import CheckpointConfig
from moetron.launcher.train.nonfinite import NonFiniteError, all_finite, optimizer_tensors
from moetron.parallel.expert_shards import ExpertShards


class CheckpointManager:
    """The checkpoints of one training run on this rank; every rank makes the same calls.

    `resumed_from` is the checkpoint the run resumed from (None for a fresh run) and `step` the
    step it holds; `state()` gives the plain data of a checkpoint (step, tokens, sampler, …) at
    the moment it is saved. `last` is the newest finished checkpoint, for messages."""

    def __init__(self, root: Path, cfg: CheckpointConfig, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 device: torch.device, expert_shards: ExpertShards | None, resumed_from: Path | None, step: int,
                 state: Callable[[], dict], console: Callable[[str], None], guard: Callable[[], None] = lambda: None):
        # Creates process groups: every rank constructs its manager at the same point.
        self.writer = Checkpointer(root, keep=cfg.keep, async_save=cfg.async_save, expert_shards=expert_shards,
                                   before_publish=guard)
        self.guard = guard
        self.cfg, self.model, self.optimizer, self.device = cfg, model, optimizer, device
        self.state, self.console = state, console
        self.last: Path | None = resumed_from
        self.failed_saves = 0
        self._saved_step = step if resumed_from is not None else None

    def after_step(self, step: int, skipped: bool) -> None:
        """Poll the save in flight; save `step` when it is due."""
        self._under_policy(self.writer.poll)
        if self.cfg.every and step % self.cfg.every == 0 and not skipped:
            self._under_policy(lambda: self._save(step))

    def finish(self, step: int, *, diverged: bool) -> Path | None:
        """The save at the stop; returns the newest finished checkpoint once nothing is in flight."""
        # A periodic save still in flight settles first, so its failure is not the final one's.
        self._under_policy(self.writer.wait)
        # Before a fresh run's first step there is nothing to save, and a checkpoint of an optimizer
        # that never stepped would not restore as one (DCP initializes its state by stepping it).
        if self._saved_step != step and step > 0 and not diverged:
            self.last = self._save(step) or self.last
        self.last = self.writer.wait() or self.last
        return self.last

    def _save(self, step: int) -> Path | None:
        """The finished checkpoint, or None while an async one is being written."""
        self._saved_step = step
        self.guard()
        if not all_finite([*self.model.parameters(), *optimizer_tensors(self.optimizer)], self.device):
            raise NonFiniteError(f"step {step}: weights or optimizer state are not finite; no checkpoint "
                                 f"written, the last good one is {self.last or 'none'}")
        return self.writer.save(step, self.model, self.optimizer, self.state())

    def _under_policy(self, save: Callable[[], Path | None]) -> None:
        """A periodic save (or the poll or wait of one in flight) under train.checkpoint.on_error."""
        try:
            self.last = save() or self.last
        except CheckpointError as e:  # raised on every rank alike, so every rank goes on alike
            if self.cfg.on_error == "stop":
                raise
            self.failed_saves += 1
            self.console(f"{e}; training continues (train.checkpoint.on_error=continue)")

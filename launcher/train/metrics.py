"""Where numbers go: one JSON object per logged step in metrics.jsonl, and TensorBoard scalars.

Only the writing rank (rank 0) opens files; elsewhere every call is a no-op. `may_write` (the run
lease's `held`, launcher/train/run_lease.py) is asked before each write: a world that lost the run
folder to another writes nothing more into it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, run_path: Path, *, enabled: bool = True, purge_step: int | None = None,
                 may_write: Callable[[], bool] = lambda: True):
        self.enabled = enabled
        self.may_write = may_write
        self.path = run_path / "metrics.jsonl"
        self.tb_path = run_path / "tensorboard"
        self._tb = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.tb_path), purge_step=purge_step)
            self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, values: dict[str, Any], *, tb_prefix: str = "") -> None:
        """Append `values` (with `step`) to metrics.jsonl and each number to TensorBoard."""
        if not self.enabled or not self.may_write():
            return
        # JSON has no NaN or Infinity: a non-finite number is written as null, so every line parses.
        record = {"step": step, **{k: _json_number(v) for k, v in values.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._tb.add_scalar(tb_prefix + key, value, step)

    def text(self, tag: str, markdown: str, step: int = 0) -> None:
        if self.enabled and self.may_write():
            self._tb.add_text(tag, markdown, step)

    @property
    def tensorboard(self):
        """The SummaryWriter (None off rank 0), for images, histograms and layouts."""
        return self._tb

    def close(self) -> None:
        if self.enabled:
            self._tb.close()
            self._file.close()


def _json_number(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value

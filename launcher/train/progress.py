"""A progress bar with loss, tokens/s and ETA on a terminal; plain log lines elsewhere (CI, Slurm)."""

from __future__ import annotations

import sys
import time

from moetron.launcher.perf import display


class Progress:
    def __init__(self, total: int, start: int = 0, *, enabled: bool = True, stream=None):
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream or sys.stderr
        self._bar = None
        self._last: dict = {}
        self._t0 = time.perf_counter()

    def __enter__(self) -> "Progress":
        if self.enabled and self.stream.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self._bar.start()
            self._task = self._bar.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def update(self, step: int, record: dict) -> None:
        if not self.enabled:
            return
        shown = ("loss", "mtp_loss", "val_loss", "tokens_per_s", "mfu")
        self._last.update({k: v for k, v in record.items() if k in shown})
        if self._bar is not None:  # the bar shows the newest of each, val_loss included
            info = "  ".join(_shown(k, v) for k, v in self._last.items())
            self._bar.update(self._task, completed=step, info=info)
        elif "tokens_per_s" in record or "val_loss" in record:
            # A log line shows val_loss only where an evaluation ran.
            info = "  ".join(_shown(k, v) for k, v in self._last.items() if k != "val_loss" or k in record)
            rate = (step - self.start) / max(time.perf_counter() - self._t0, 1e-9)
            eta = (self.total - step) / rate if rate > 0 else float("nan")
            print(f"step {step}/{self.total}  {info}  eta {eta:,.0f}s", file=self.stream, flush=True)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def _shown(key: str, value: float) -> str:
    """'loss 2.345', '9,768 tok/s', 'MFU 26.0%'."""
    if key == "tokens_per_s":
        return display.tokens_per_s(value)
    if key == "mfu":
        return f"MFU {display.mfu(value)}"
    return f"{key} {value:.4g}"

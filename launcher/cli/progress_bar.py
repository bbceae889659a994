"""The progress bar of a long command (tokenize, convert, eval) on a terminal's stderr; none
elsewhere, where logs and pipes get the command's summary lines only."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

Advance = Callable[[int], None]


@contextlib.contextmanager
def progress_bar(label: str, unit: str = "count") -> Iterator[Callable[[int], Advance]]:
    """Yields on_plan(total) → advance(n): the work's size once known, then each piece done.
    `unit`: "count" (done / total) or "bytes" (size, speed)."""
    if not sys.stderr.isatty():
        yield lambda total: lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    amount = (DownloadColumn(), TransferSpeedColumn()) if unit == "bytes" else (MofNCompleteColumn(),)
    with Progress(f"[bold]{label}", BarColumn(), *amount, TimeRemainingColumn(), console=Console(stderr=True),
                  transient=True) as bar:

        def on_plan(total: int) -> Advance:
            task = bar.add_task(label, total=total)
            return lambda n: bar.advance(task, n)

        yield on_plan

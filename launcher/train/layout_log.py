"""layouts.jsonl in the run folder: one line per start of a run — the step it starts at, the world
size, the layout, and how it was chosen (the config's, or `--layout auto`'s with the planner's
predicted step time and memory) — so a run that lost or gained ranks overnight says in the morning
where it changed and why. A change of layout is also marked in TensorBoard and on the console."""

from __future__ import annotations

import json
import time
from pathlib import Path

from moetron.launcher.config import Config, sequences_per_micro_batch
from moetron.launcher.perf.planner import Layout

LAYOUTS = "layouts.jsonl"


def layout_of(cfg: Config) -> Layout:
    t = cfg.train
    return Layout(cfg.parallel, grad_accum=t.grad_accum, activation_checkpoint=t.activation_checkpoint)


def record_start(run: Path, cfg: Config, step: int, world_size: int, choice: dict | None) -> tuple[dict | None, dict]:
    """Append this start's line; → (the previous start's line or None, this one's). `choice`: how
    `--layout auto` chose (prediction and profile), None for the config's own layout."""
    path = run / LAYOUTS
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    layout = layout_of(cfg)
    entry = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "world_size": world_size,
             "label": layout.label(), "overrides": layout.overrides(), "micro_batch": sequences_per_micro_batch(cfg),
             "chosen_by": "auto" if choice else "config",
             **({"prediction": choice} if choice else {})}
    # Every start stays, even one a later restart went back before: it happened.
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
    return (lines[-1] if lines else None), entry


def previous_micro_batch(run: Path) -> int | None:
    """Sequences per micro-batch of the run's last start (layouts.jsonl), or None before its first."""
    path = run / LAYOUTS
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1]).get("micro_batch") if lines else None


def change_line(before: dict, now: dict) -> str | None:
    """One line for a change of world size or layout between two starts, or None."""
    if before["world_size"] == now["world_size"] and before["overrides"] == now["overrides"]:
        return None
    return (f"layout changed at step {now['step']}: {before['world_size']} ranks ({before['label']}) → "
            f"{now['world_size']} ranks ({now['label']}), chosen by {now['chosen_by']}")

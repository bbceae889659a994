"""The checkpoint folder on disk, without torch: which checkpoints are complete, the newest, the
one before, the `latest` pointer, and setting a damaged one aside. The commands that only look at
run folders (`moetron submit`, `status`, `logs`, `cancel`) read checkpoints through this module
and so start without importing torch (~2 s of CPU each); store.py writes and loads them.

Layout of <run>/checkpoints/: see store.py.
"""

from __future__ import annotations

import os
from pathlib import Path

COMPLETE = "COMPLETE"
DAMAGED = "damaged-"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(ckpt: Path) -> int:
    return int(Path(ckpt).name.split("-")[-1])


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Every complete checkpoint of a folder, oldest first."""
    return sorted(p for p in Path(ckpt_root).glob("step-*") if (p / COMPLETE).is_file())


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint. A folder is named step-* only once COMPLETE is in it, so the
    scan is authoritative; the `latest` pointer (for people and scripts) can lag one save behind
    when a process dies between the rename and the pointer update, and must not lose that save."""
    done = complete_checkpoints(ckpt_root)
    return done[-1] if done else None


def previous_checkpoint(ckpt: Path) -> Path | None:
    """The newest complete checkpoint older than `ckpt` in the same folder."""
    older = [p for p in complete_checkpoints(Path(ckpt).parent) if p.name < Path(ckpt).name]
    return older[-1] if older else None


def set_aside(ckpt: Path) -> Path:
    """Rename a damaged checkpoint to damaged-step-N (damaged-step-N.2, … when that is taken) in its
    folder, where nothing resumes from it or prunes it, and point `latest` at the newest complete
    checkpoint left (or remove it when none is). Returns the new name. Nothing is deleted."""
    ckpt = Path(ckpt)
    target, n = ckpt.with_name(DAMAGED + ckpt.name), 2
    while target.exists():
        target, n = ckpt.with_name(f"{DAMAGED}{ckpt.name}.{n}"), n + 1
    ckpt.rename(target)
    newest = latest_checkpoint(ckpt.parent)
    if newest is not None:
        point_latest(ckpt.parent, newest)
    else:
        (ckpt.parent / "latest").unlink(missing_ok=True)
    return target


def point_latest(root: Path, final: Path) -> None:
    """Replace root/latest with `final`'s name, atomically."""
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name + "\n")
    fsync(pointer)
    pointer.replace(root / "latest")
    fsync_dir(root)


def fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

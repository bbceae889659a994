"""Sharded checkpoints on torch.distributed.checkpoint (DCP): atomic, kept K deep, layout-independent.

Layout of <run>/checkpoints/:
  step-00000100/            one complete checkpoint: DCP shards of {"model", "optim"} (keys are
                            parameter names, so any TP/PP/EP/DP layout reloads them), plus
                            state.json (step, tokens, sampler, scheduler, config, layout) and
                            rng-rank<R>.json per rank; COMPLETE marks it finished
  .tmp-step-00000100/       a checkpoint being written; never read, removed on the next save
  latest                    name of the newest complete checkpoint, replaced atomically
Only tensors (DCP) and JSON are written, so loading unpickles nothing but tensors.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

COMPLETE = "COMPLETE"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, as plain JSON-able data."""
    state = {
        "torch": torch.get_rng_state().tolist(),
        "python": _to_lists(random.getstate()),
        "numpy": _to_lists(np.random.get_state(legacy=False)),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _to_lists(obj: Any) -> Any:
    if isinstance(obj, (tuple, list)):
        return [_to_lists(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_lists(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint: the `latest` pointer if it names one, else a scan."""
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        target = ckpt_root / pointer.read_text().strip()
        if (target / COMPLETE).is_file():
            return target
    done = sorted(p for p in ckpt_root.glob("step-*") if (p / COMPLETE).is_file())
    return done[-1] if done else None


def save_checkpoint(ckpt_root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], *, keep: int = 3) -> Path:
    """Write the checkpoint of `step` atomically; every rank calls this."""
    name = f"step-{step:08d}"
    final, tmp = ckpt_root / name, ckpt_root / f".tmp-{name}"
    rank = _rank()
    if rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    _quiet(dcp.save, {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    (tmp / f"rng-rank{rank}.json").write_text(json.dumps(rng_state()))
    _barrier()
    if rank == 0:
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        (tmp / COMPLETE).write_text(name + "\n")
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        pointer_tmp = ckpt_root / ".latest.tmp"
        pointer_tmp.write_text(name + "\n")
        pointer_tmp.replace(ckpt_root / "latest")
        older = sorted(p for p in ckpt_root.glob("step-*") if p != final)
        for old in older[: max(len(older) - (keep - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load model (and optimizer) tensors into the live, possibly sharded, objects; restore this
    rank's RNGs when the checkpoint has them; return the plain state (step, sampler, …)."""
    if optimizer is None:
        to_load = {"model": get_model_state_dict(model)}
        _quiet(dcp.load, to_load, checkpoint_id=str(path))
        set_model_state_dict(model, to_load["model"])
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        to_load = {"model": model_sd, "optim": optim_sd}
        _quiet(dcp.load, to_load, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=to_load["model"], optim_state_dict=to_load["optim"])
    rng_file = path / f"rng-rank{_rank()}.json"
    if rng_file.is_file():
        set_rng_state(json.loads(rng_file.read_text()))
    return json.loads((path / "state.json").read_text())


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())


def _quiet(fn, *args, **kwargs):
    """Call a DCP function without its warning about running without a process group: one
    process is a supported layout here, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)

"""Sharded checkpoints on torch.distributed.checkpoint (DCP): atomic, verified, async, kept K deep,
and layout-independent, so a run resumes on any TP/PP/EP/DP layout and world size.

Layout of <run>/checkpoints/:
  step-00000100/            one complete checkpoint:
      __R_I.distcp, .metadata   DCP shards of {"model", "optim"}; keys are parameter names (the
                                optimizer state flattened per parameter name too), tensors carry
                                their global shape, each rank writes the pieces it holds
      state.json                step, tokens, sampler, scheduler, resolved config, layout
      rng-rank<R>.json          every RNG of rank R (torch CPU/CUDA, Python, NumPy)
      manifest.json             size and sha256 of every file above (see checkpoint_io.py)
      COMPLETE                  written last, just before the rename
  .tmp-step-00000100/       a checkpoint being written; never read, removed by the next save
  damaged-step-00000100/    a checkpoint found damaged by an automatic resume, set aside (folders.py `set_aside`):
                            kept for inspection, never resumed from nor pruned
  latest                    name of the newest complete checkpoint, replaced atomically
Only tensors and plain data are written, and only those are unpickled on load.

A save: every rank stages its state dict (async: copies to CPU memory and returns to training),
writes its shards and hashes them; once *every* rank has finished (all ranks agree through a
one-integer all_reduce, polled once per step when async), rank 0 merges the manifest, writes
COMPLETE, renames the folder and moves `latest`. A failed save (full disk, quota) removes its
temporary folder and raises `CheckpointError`; the previous checkpoint and `latest` are untouched.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions

from moetron.launcher.checkpoint.folders import (
    COMPLETE,
    checkpoint_name,
    complete_checkpoints,
    fsync,
    latest_checkpoint,
    point_latest,
    previous_checkpoint,
)
from moetron.launcher.checkpoint.io import (
    MANIFEST,
    CheckpointDamaged,
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    manifest_part,
    read_state,
    tensor_mismatches,
    tensor_shapes,
    verify_checkpoint,
    write_manifest,
)
from moetron.launcher.checkpoint.state import (
    dcp_call,
    global_views,
    live_state,
    restore_live_state,
    rng_state,
    set_rng_state,
    views_of,
)
from moetron.parallel.expert_shards import ExpertShards

STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass
class _Pending:
    step: int
    tmp: Path
    done: Future  # this rank's shards written, hashed and synced


class Checkpointer:
    """Saves the checkpoints of one run; every rank creates one (in the same order: it creates
    process groups) and calls `save`, `poll` and `wait` at the same steps.

    Sync: `save` returns the finished checkpoint. Async: `save` returns None once the state is
    copied off the training tensors; `poll()` (every step) returns the checkpoint once all ranks
    have finished writing it; `wait()` blocks until then (call it before the process exits).
    """

    def __init__(self, ckpt_root: Path, *, keep: int = 3, async_save: bool = False,
                 expert_shards: ExpertShards | None = None, before_publish: Callable[[], None] = lambda: None):
        self.root = Path(ckpt_root)
        # Called on every rank once all have written their parts, before rank 0 publishes; it may
        # raise on every rank alike to keep the checkpoint a .tmp- folder (the trainer's run lease).
        self.before_publish = before_publish
        self.keep = keep
        self.async_save = async_save
        self.expert_shards = expert_shards
        self.rank = _rank()
        self.world = _world()
        # Gloo groups of their own: the polls and barriers carry CPU integers whatever the training
        # backend is, and an async write's DCP collectives run in a background thread while the
        # main thread keeps using the other groups.
        self._control = dist.new_group(backend="gloo") if _distributed() else None
        self._io = dist.new_group(backend="gloo") if _distributed() and async_save else self._control
        self._pending: _Pending | None = None
        if self.rank == 0 and self.root.is_dir():
            for stale in self.root.glob(".tmp-step-*"):  # left by a process killed mid-write
                shutil.rmtree(stale, ignore_errors=True)

    # -- saving -------------------------------------------------------------------------------

    def save(self, step: int, model: nn.Module | Sequence[nn.Module],
             optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
             state: dict[str, Any]) -> Path | None:
        """Start (async) or write (sync) the checkpoint of `step`. `state` is plain JSON data
        (rank 0's is written). Returns the finished checkpoint, or None while it is in flight."""
        self.wait()
        tmp = self.root / f".tmp-{checkpoint_name(step)}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        self._barrier()
        done: Future = Future()
        try:
            if self.rank == 0:
                tmp.mkdir(parents=True, exist_ok=True)
            self._barrier()
            (tmp / f"rng-rank{self.rank}.json").write_text(json.dumps(rng_state()))
            if self.rank == 0:
                (tmp / "state.json").write_text(json.dumps(state, indent=1))
            views = global_views(model, optimizer, self.expert_shards, STATE_OPTIONS)
            writer = FileSystemWriter(str(tmp), thread_count=1, sync_files=True)
            if self.async_save:
                written = dcp_call(dcp.async_save, views, storage_writer=writer, process_group=self._io,
                                   no_dist=self._io is None)
                written.add_done_callback(lambda f: self._after_write(f, step, tmp, done))
            else:
                dcp_call(dcp.save, views, storage_writer=writer, process_group=self._io, no_dist=self._io is None)
                self._finish_rank(step, tmp)
                done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - every rank must learn of the failure
            if isinstance(e, KeyboardInterrupt):
                raise
            done.set_exception(e)
        self._pending = _Pending(step, tmp, done)
        return None if self.async_save and not done.done() else self.wait()

    def _after_write(self, written: Future, step: int, tmp: Path, done: Future) -> None:
        """Runs in the writer thread when DCP finished this rank's shards."""
        try:
            written.result()
            self._finish_rank(step, tmp)
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            done.set_exception(e)

    def _finish_rank(self, step: int, tmp: Path) -> None:
        """Hash what this rank wrote (its shards, its RNGs; rank 0 also the metadata and state)."""
        group_rank = dist.get_rank(self._io) if self._io is not None else 0
        names = [p.name for p in tmp.glob(f"__{group_rank}_*.distcp")] + [f"rng-rank{self.rank}.json"]
        if self.rank == 0:
            names += [".metadata", "state.json"]
        part = tmp / f"{MANIFEST}.rank{self.rank}"
        part.write_text(json.dumps(manifest_part(tmp, names)))
        fsync(part)

    def poll(self) -> Path | None:
        """The checkpoint in flight, finished, once every rank has written its part; else None.
        NOTE: one tiny all_reduce on the control group when distributed."""
        if self._pending is None:
            return None
        busy = 0 if self._pending.done.done() else 1
        if self._control is not None:
            t = torch.tensor([busy])
            dist.all_reduce(t, group=self._control)
            busy = int(t.item())
        return None if busy else self._commit()

    def wait(self) -> Path | None:
        """Block until the checkpoint in flight is finished (or failed); return it."""
        if self._pending is None:
            return None
        try:
            self._pending.done.result()
        except BaseException:  # noqa: BLE001 - reported by _commit on every rank
            pass
        return self._commit()

    def _commit(self) -> Path:
        pending, self._pending = self._pending, None
        error = pending.done.exception()
        if self._any(error is not None):
            self._discard(pending.tmp)
            raise _save_error(pending, error, latest_checkpoint(self.root))
        self.before_publish()
        final = self.root / checkpoint_name(pending.step)
        error = None
        if self.rank == 0:
            try:
                self._publish(pending.tmp, final)
            except OSError as e:
                error = e
        if self._any(error is not None):
            self._discard(pending.tmp)
            raise _save_error(pending, error, latest_checkpoint(self.root))
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rank 0, once every rank's part is on disk: manifest → COMPLETE → rename → `latest` → prune.
        A process killed between two phases leaves a state that the next start handles (the crash
        tests stop a save before each phase method to kill it there)."""
        self._merge_manifest(tmp)
        self._mark_complete(tmp, final)
        self._move_into_place(tmp, final)
        self._point_latest(final)
        self._prune(final)

    def _merge_manifest(self, tmp: Path) -> None:
        files: dict[str, Any] = {}
        for r in range(self.world):
            files.update(json.loads((tmp / f"{MANIFEST}.rank{r}").read_text()))
        write_manifest(tmp, files)
        fsync(tmp / MANIFEST)

    def _mark_complete(self, tmp: Path, final: Path) -> None:
        (tmp / COMPLETE).write_text(final.name + "\n")
        fsync(tmp / COMPLETE)
        for r in range(self.world):
            (tmp / f"{MANIFEST}.rank{r}").unlink()

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)

    def _point_latest(self, final: Path) -> None:
        point_latest(self.root, final)

    def _prune(self, final: Path) -> None:
        older = [p for p in complete_checkpoints(self.root) if p != final]
        for old in older[: max(len(older) - (self.keep - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)

    def _discard(self, tmp: Path) -> None:
        self._barrier()
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _any(self, flag: bool) -> bool:
        if self._control is None:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control)
        return bool(t.item())

    def _barrier(self) -> None:
        if self._control is not None:
            dist.barrier(group=self._control)


def _save_error(pending: _Pending, error: BaseException | None, previous: Path | None) -> CheckpointError:
    reason = _root_cause(error) if error is not None else "another rank failed to write its part (see its log)"
    kept = f"the previous checkpoint {previous} and `latest` are intact" if previous else "no earlier checkpoint exists"
    return CheckpointError(f"saving checkpoint {checkpoint_name(pending.step)} failed: {reason}; "
                           f"its temporary folder was removed and {kept}")


def _root_cause(error: BaseException) -> str:
    """The innermost OSError (full disk, quota, permissions) of DCP's wrapped exceptions, as text."""
    seen: list[BaseException] = []
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, OSError):
            where = f" ({e.filename})" if e.filename else ""
            return f"{e.strerror or e}{where}"
        stack += [e.__cause__, e.__context__]
        stack += _failures(e)
    # No OSError: the innermost exception that is not DCP's wrapper (the EOFError of a cut file),
    # by its type too, since some carry no message at all.
    inner = next((e for e in reversed(seen) if not isinstance(e, CheckpointException)), error)
    text = str(inner).splitlines()[0] if str(inner) else ""
    if inner is error:
        return text or type(error).__name__
    return f"{type(inner).__name__}: {text}" if text else type(inner).__name__


def _failures(e: BaseException) -> list[BaseException]:
    """The per-rank exceptions DCP gathers into CheckpointException.failures ({rank: (exception,
    traceback)})."""
    out = []
    for f in getattr(e, "failures", {}).values():
        f = f[0] if isinstance(f, tuple) else getattr(f, "exception", f)
        if isinstance(f, BaseException):
            out.append(f)
    return out


def save_checkpoint(ckpt_root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], *, keep: int = 3, expert_shards: ExpertShards | None = None) -> Path:
    """Write the checkpoint of `step` now (every rank calls this); see `Checkpointer`."""
    return Checkpointer(ckpt_root, keep=keep, expert_shards=expert_shards).save(step, model, optimizer, state)


def load_checkpoint(path: Path, model: nn.Module | Sequence[nn.Module],
                    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None, *,
                    expert_shards: ExpertShards | None = None) -> dict[str, Any]:
    """Load model (and optimizer) tensors into the live, possibly sharded, objects of this rank —
    any layout, any world size; restore this rank's RNGs when the checkpoint has them; return the
    plain state (step, sampler, …). Every file this rank reads is checked against the manifest
    first; a damaged checkpoint or one of another model raises `CheckpointError` before anything
    is changed."""
    path = Path(path)
    reader = _open_verified(path)
    metadata = reader.read_metadata()
    live = live_state(model, optimizer, STATE_OPTIONS)
    views = views_of(live.merged(), expert_shards)
    _check_fits(path, tensor_shapes(metadata, "model."), {k: tuple(v.shape) for k, v in views["model"].items()})
    try:
        dcp_call(dcp.load, views, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as e:
        raise _load_error(path, e) from None
    restore_live_state(live, STATE_OPTIONS)
    rng_file = path / f"rng-rank{_rank()}.json"
    if optimizer is not None and rng_file.is_file():
        set_rng_state(json.loads(rng_file.read_text()))
    return read_state(path)


def consolidated_model_state(path: Path, part: str = "model") -> dict[str, torch.Tensor]:
    """The whole model of a checkpoint as {parameter name: full tensor} on the CPU, in the saved
    dtypes, read on this process alone from however many shards the save wrote (for export,
    conversion and inference). Verified against the manifest like a resume. `part="optim"`
    gives the optimizer's tensors instead, flattened the same way ({"state.<param>.exp_avg": …})."""
    path = Path(path)
    reader = _open_verified(path)
    metadata = reader.read_metadata()
    prefix = part + "."
    entries = {k: md for k, md in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    if not entries:
        raise CheckpointError(f"{path}: holds no {part} tensors")
    model = {k[len(prefix):]: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in entries.items()
             if hasattr(md, "properties")}
    try:
        dcp_call(dcp.load, {part: model}, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointException as e:
        raise _load_error(path, e) from None
    return model


def _open_verified(path: Path) -> SafeFileSystemReader:
    """A reader for `path` once its files have the sizes its manifest recorded (hashes are
    checked as each rank reads its files)."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: not a checkpoint folder (no .metadata){_offer(path)}")
    try:
        problem = verify_checkpoint(path)
    except CheckpointDamaged as e:  # an unreadable manifest or metadata
        raise CheckpointDamaged(f"{e}{_offer(path)}", e.problem) from None
    except CheckpointError as e:  # a newer format
        raise CheckpointError(f"{e}{_offer(path)}") from None
    if problem:
        raise CheckpointDamaged(f"{problem}{_offer(path)}", problem)
    return SafeFileSystemReader(path)


def _offer(path: Path) -> str:
    previous = previous_checkpoint(path)
    return (f"; the previous complete checkpoint is {previous} (nothing was deleted)" if previous
            else "; no earlier complete checkpoint exists (nothing was deleted)")


def _check_fits(path: Path, saved: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    """Refuse a checkpoint whose tensors are not this model's, naming them. Under pipeline
    parallelism each rank holds some layers only, so the expected names are gathered from all."""
    if _distributed():
        everyone: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, expected)
        expected = {k: v for e in everyone for k, v in e.items()}
    problems = tensor_mismatches(saved, expected)
    if problems:
        raise CheckpointError(f"checkpoint {path} is of another model: " + "; ".join(problems[:6]))


def _load_error(path: Path, e: CheckpointException) -> CheckpointError:
    """The first CheckpointError any rank raised inside DCP (a corrupt shard, a refused pickle);
    any other failure to read the shards (a cut or overwritten file DCP could not parse) is
    damage too, named by its folder."""
    for inner in _failures(e):
        if isinstance(inner, CheckpointDamaged):
            return CheckpointDamaged(f"{inner}{_offer(path)}", inner.problem)
        if isinstance(inner, CheckpointError):
            return CheckpointError(f"{inner}{'' if 'refused' in str(inner) else _offer(path)}")
    problem = f"reading its shards failed ({_root_cause(e)}): a file is cut short or overwritten"
    return CheckpointDamaged(f"checkpoint {path} is damaged: {problem}{_offer(path)}", problem)

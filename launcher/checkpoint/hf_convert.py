"""Hugging Face folder ↔ weights-only checkpoint, streamed: `moetron convert` never holds the model.

From Hugging Face: the folder's headers are checked against the family's mapping first (every
tensor read, none left over, every shape the config's: model/hf.py `plan_from_hf`), so a folder
that cannot convert is refused before anything is written. Then DCP writes the checkpoint from a
plan of meta tensors, in the mapping's order, and pulls each tensor's data from the safetensors
files only when its turn comes (`_PullingSavePlanner`); each tensor goes to a file of its own, because
DCP's writer keeps every tensor of a file referenced until that file is closed. The files are
synced once, at the end, before the folder is renamed into place.

To Hugging Face: the checkpoint's metadata gives the model's tensors as meta tensors, from which
the safetensors shards are planned; then each tensor is read from the checkpoint's shards
(launcher/checkpoint/shard_reader.py) when the mapping looks it up (`CheckpointTensors`) and
written to its shard at once; a stack of experts is read, converted and written an expert at a
time (a `Rows`), so a stack larger than a shard is never held.

The resident memory stays near the few tensors one converted tensor needs, whatever the model's
size: to Hugging Face, about the largest tensor written whole (at most a shard); from it, a
layer's stacked experts and the pieces they are made of.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moetron.launcher.checkpoint.io import CheckpointError, SafeFileSystemReader, SafeLoadPlanner, read_state
from moetron.launcher.checkpoint.shard_reader import ShardReader
from moetron.launcher.checkpoint.state import dcp_call
from moetron.launcher.checkpoint.weights import (
    TOKENIZER_FILE,
    checkpoint_config,
    checkpoint_tokenizer,
    write_weights_folder,
)
from moetron.model.hf import (
    Weights,
    hf_dtype,
    hf_problems,
    open_hf_folder,
    plan_from_hf,
    plan_to_hf,
    read_from_hf,
    write_hf,
)
from moetron.model.hf_files import Rows

OnTensor = Callable[[int], None]


class _PullingSavePlanner(DefaultSavePlanner):
    """DCP's save planner over a state dict of meta tensors: each tensor's data is taken from
    `tensors` ((name, tensor) in about the plan's order) when the writer reaches it. A tensor
    yielded before its turn waits in `_early` (the mapping may yield a layer's tensors in another
    order than the model lists them)."""

    def __init__(self, tensors: Iterator[tuple[str, torch.Tensor]], on_tensor: OnTensor | None):
        super().__init__()
        self._tensors, self._on_tensor = tensors, on_tensor
        self._early: dict[str, torch.Tensor] = {}

    def resolve_data(self, write_item):
        name = write_item.index.fqn.removeprefix("model.")
        while name not in self._early:
            got, tensor = next(self._tensors)
            self._early[got] = tensor
        tensor = self._early.pop(name).detach()
        if self._on_tensor is not None:
            self._on_tensor(tensor.numel() * tensor.element_size())
        return tensor


def save_streamed(folder: Path, plan: dict[str, torch.Tensor], tensors: Iterator[tuple[str, torch.Tensor]],
                  on_tensor: OnTensor | None = None) -> None:
    """Write DCP shards of the model tensors `plan` lists (meta tensors, in writing order) into
    `folder`, their data pulled from `tensors` as the writer reaches each. The shards are synced
    to disk once, all written (`sync_folder`), rather than each as it closes: the disk writes one
    back while the next is read, instead of the conversion waiting on each."""
    writer = FileSystemWriter(str(folder), single_file_per_rank=False, sync_files=False)
    dcp_call(dcp.save, {"model": plan}, storage_writer=writer, planner=_PullingSavePlanner(tensors, on_tensor),
             no_dist=True)
    sync_folder(folder)


def sync_folder(folder: Path) -> None:
    """fsync every file of `folder`, then the folder itself (its entries)."""
    for path in sorted(folder.iterdir()):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointTensors(Mapping[str, torch.Tensor | Rows]):
    """A checkpoint's model tensors by parameter name, each read from the shards when it is
    looked up and converted to `dtype`: a stack of experts (3 dims or more) as `Rows`, read an
    expert at a time when its rows are asked for, any other tensor whole (the last one kept for a
    second look). The checkpoint is taken as found: verify it first (`resolve_checkpoint`);
    `close` the shard files when done."""

    # Rows converted to `dtype` at a time, for a tensor saved in another dtype: the saved copy is
    # never held whole beside the converted one.
    BLOCK_BYTES = 64 << 20

    def __init__(self, ckpt: Path, dtype: torch.dtype):
        self.reader = SafeFileSystemReader(ckpt)
        metadata = self.reader.read_metadata()
        self.saved = {k.removeprefix("model."): md for k, md in metadata.state_dict_metadata.items()
                      if k.startswith("model.") and isinstance(md, TensorStorageMetadata)}
        if not self.saved:
            raise CheckpointError(f"{ckpt}: holds no model tensors")
        self.shards = ShardReader(ckpt, metadata)
        self.dtype = dtype
        self._last: tuple[str, torch.Tensor] | None = None

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor's shape, in `dtype`, no data."""
        return {k: torch.empty(tuple(md.size), dtype=self.dtype, device="meta") for k, md in self.saved.items()}

    def __getitem__(self, name: str) -> torch.Tensor | Rows:
        size = tuple(self.saved[name].size)
        if len(size) >= 3 and self.shards.readable(f"model.{name}"):
            return Rows(size, self.dtype, lambda e: self._rows(name, e, e + 1)[0])
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        self._last = None  # let go of the previous tensor before reading the next
        self._last = (name, self._whole(name))
        return self._last[1]

    def _rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self.shards.read_rows(f"model.{name}", lo, hi).to(self.dtype)

    def _whole(self, name: str) -> torch.Tensor:
        md = self.saved[name]
        if not self.shards.readable(f"model.{name}"):
            tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            dcp_call(dcp.load, {"model": {name: tensor}}, storage_reader=self.reader, planner=SafeLoadPlanner(),
                     no_dist=True)
            return tensor.to(self.dtype)
        if len(md.size) == 0 or md.properties.dtype == self.dtype:
            return self._rows(name, 0, md.size[0] if len(md.size) else 0)
        out = torch.empty(tuple(md.size), dtype=self.dtype)
        step = max(1, self.BLOCK_BYTES // max(1, out[0].numel() * md.properties.dtype.itemsize))
        for lo in range(0, len(out), step):
            out[lo:lo + step] = self._rows(name, lo, min(lo + step, len(out)))
        return out

    def __contains__(self, name: object) -> bool:
        return name in self.saved  # without reading it

    def __iter__(self):
        return iter(self.saved)

    def __len__(self) -> int:
        return len(self.saved)

    def close(self) -> None:
        self._last = None
        self.shards.close()


def from_hf(src: Path, out: Path, *, dtype: torch.dtype | None = None,
            on_plan: Callable[[int], OnTensor | None] = lambda total: None) -> tuple[int, torch.dtype]:
    """Convert the Hugging Face folder `src` into the weights-only checkpoint `out` (must not
    exist or be empty); its tokenizer.json travels along. `on_plan(total bytes)` is called once
    the conversion is checked and may return `on_tensor(bytes)`, called after each tensor read.
    ValueError (one line) for a folder that cannot convert, before anything is written.
    → (parameters, dtype)."""
    hf_cfg, cfg, folder = open_hf_folder(src)
    try:
        dtype = dtype or hf_dtype(hf_cfg, folder)
        plan = plan_from_hf(folder, cfg, dtype)
        on_tensor = on_plan(sum(t.numel() * t.element_size() for t in plan.values()))
        tokenizer = src / TOKENIZER_FILE

        def write(tmp: Path) -> None:
            save_streamed(tmp, plan, read_from_hf(folder, cfg, plan), on_tensor)

        write_weights_folder(out, cfg, dtype, write, source=f"huggingface:{src.resolve()}",
                             extra_files=(tokenizer,) if tokenizer.is_file() else ())
    finally:
        folder.close()
    tied = {"head.weight"} if cfg.tie_embeddings else set()
    return sum(t.numel() for k, t in plan.items() if k not in tied), dtype


def to_hf(ckpt: Path, out: Path, *, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
          on_plan: Callable[[int], OnTensor | None] = lambda total: None) -> tuple[int, torch.dtype]:
    """Convert the (verified) checkpoint `ckpt` into the Hugging Face folder `out` (must not exist
    or be empty), atomically: into a sibling temporary folder, renamed when complete. The
    tokenizer.json beside the checkpoint travels along. `on_plan` as for `from_hf`.
    CheckpointError for a model its family cannot express, before anything is written.
    → (parameters, dtype)."""
    cfg = checkpoint_config(ckpt)
    for key, value, rule in hf_problems(cfg.model):
        raise CheckpointError(f"{ckpt}: model.{key} = {value!r}: {rule}")
    try:
        eos_id = checkpoint_tokenizer(ckpt, cfg).eos_id
    except FileNotFoundError:
        eos_id = None
    # Converted checkpoints record their dtype; the trainer's keep fp32 master weights.
    dtype = dtype or getattr(torch, read_state(ckpt).get("dtype", "float32"))
    tensors = CheckpointTensors(ckpt, dtype)
    meta = tensors.meta()
    plan = plan_to_hf(cfg.model, meta)
    on_tensor = on_plan(sum(t.numel() * t.element_size() for _, t in plan))
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_hf(Weights(cfg.model, tensors), tmp, dtype, plan, eos_id=eos_id, max_shard_bytes=max_shard_bytes,
                 on_tensor=on_tensor)
        if (ckpt / TOKENIZER_FILE).is_file():
            shutil.copyfile(ckpt / TOKENIZER_FILE, tmp / TOKENIZER_FILE)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        tensors.close()
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    tied = {"head.weight"} if cfg.model.tie_embeddings else set()
    return sum(t.numel() for k, t in meta.items() if k not in tied), dtype

"""Hugging Face weight folders on disk, one tensor at a time: safetensors files read and written
without holding more than the tensors in hand.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the
tensors' bytes back to back, offsets counted from the end of the header. A sharded folder adds
model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map": {name: file}}).

A tensor to write may be a `Rows`: an [N, ...] tensor produced one row at a time (one expert's
matrix of a stacked [E, ...] weight), written row by row, so that a stack larger than a shard is
never held whole.

Why not `safetensors.safe_open`: it memory-maps the file, and every page a read touches stays
in the process's resident memory until the file is closed, so reading a folder tensor by tensor
with the files open grows the resident set to the whole checkpoint. Plain reads into fresh
tensors keep it at the tensors held; writes stream each tensor's bytes as it is produced, where
`safetensors.torch.save_file` first copies a whole shard into bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Safetensors' dtype names.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class Rows:
    """A tensor [N, ...] never held whole: `rows[i]` produces row i ([...], contiguous or not),
    each call anew. What `write_shard` needs of a tensor (shape, dtype, sizes) without its data."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, row: Callable[[int], torch.Tensor]):
        self.shape, self.dtype, self._row = torch.Size(shape), dtype, row

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of a tensor of {len(self)} rows")
        return self._row(i)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...] | None = None,
            dtype: torch.dtype | None = None) -> Rows:
        """Rows whose row i is fn(self[i]), of `shape` and `dtype` (default: these)."""
        return Rows(shape or self.shape, dtype or self.dtype, lambda i: fn(self[i]))


class SafetensorsFile:
    """One .safetensors file: its tensors' names, shapes and dtypes from the header, and each
    tensor read into fresh memory on request."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with self.path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than its header length)")
            (n,) = struct.unpack("<Q", head)
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise ValueError(f"{self.path}: unreadable safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict] = header
        self._start = 8 + n
        self._file = None

    def keys(self) -> list[str]:
        return list(self.entries)

    def dtype(self, key: str) -> torch.dtype:
        name = self.entries[key]["dtype"]
        if name not in DTYPES:
            raise ValueError(f"{self.path}: tensor {key} has dtype {name}, which does not convert")
        return DTYPES[name]

    def meta(self, key: str) -> torch.Tensor:
        """The tensor's shape and dtype, no data (device meta)."""
        return torch.empty(self.entries[key]["shape"], dtype=self.dtype(key), device="meta")

    def read(self, key: str) -> torch.Tensor:
        entry = self.entries[key]
        begin, end = entry["data_offsets"]
        raw = torch.empty(end - begin, dtype=torch.uint8)
        if self._file is None:
            self._file = self.path.open("rb")
        self._file.seek(self._start + begin)
        if end > begin and self._file.readinto(raw.numpy()) != end - begin:
            raise ValueError(f"{self.path}: tensor {key} is cut short (the file is truncated)")
        return raw.view(self.dtype(key)).reshape(entry["shape"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class HFFolder:
    """The safetensors tensors of a Hugging Face folder, by name: `meta` (shape and dtype) and
    `read` (the data), sharded or not. File handles are opened on first read, one per file."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            paths = [self.folder / n for n in names]
        else:
            paths = sorted(self.folder.glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"{self.folder}: no *.safetensors files (only safetensors weights convert)")
        self.files = [SafetensorsFile(p) for p in paths]
        self.where = {k: f for f in self.files for k in f.keys()}

    def keys(self) -> set[str]:
        return set(self.where)

    def _file_of(self, key: str) -> SafetensorsFile:
        if key not in self.where:
            raise KeyError(f"{self.folder}: tensor {key} missing from the safetensors files")
        return self.where[key]

    def meta(self, key: str) -> torch.Tensor:
        return self._file_of(key).meta(key)

    def read(self, key: str) -> torch.Tensor:
        return self._file_of(key).read(key)

    def largest_file_bytes(self) -> int:
        return max(f.path.stat().st_size for f in self.files)

    def close(self) -> None:
        for f in self.files:
            f.close()


def shard_plan(entries: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """(name, tensor or meta tensor) in writing order, cut into shards of at most
    `max_shard_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in entries:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    return shards


def shard_names(n: int) -> list[str]:
    return [WEIGHTS_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_shard(path: Path, plan: list[tuple[str, torch.Tensor]], tensors: Iterator[tuple[str, torch.Tensor | Rows]],
                on_tensor: Callable[[int], None] | None = None) -> None:
    """Write one safetensors file holding `plan`'s tensors (names, shapes, dtypes: meta tensors
    will do) with the data `tensors` yields, in the same order, written as each arrives (a `Rows`
    a row at a time)."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in plan:
        if t.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensors start 8-byte aligned, as safetensors writes them
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for want, meta in plan:
            name, tensor = next(tensors)
            if name != want or tuple(tensor.shape) != tuple(meta.shape) or tensor.dtype != meta.dtype:
                raise ValueError(f"{path}: expected {want} {list(meta.shape)} {meta.dtype}, got {name} "
                                 f"{list(tensor.shape)} {tensor.dtype}")
            pieces = (tensor[i] for i in range(len(tensor))) if isinstance(tensor, Rows) else (tensor,)
            written = sum(_write_tensor(f, piece, meta.dtype) for piece in pieces)
            nbytes = meta.numel() * meta.element_size()
            if written != nbytes:
                raise ValueError(f"{path}: {want} came to {written} bytes, its shape takes {nbytes}")
            if on_tensor is not None:
                on_tensor(nbytes)


def _write_tensor(f, tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """`tensor`'s bytes, row-major, at `f`'s position (a copy only when it is not contiguous);
    → how many."""
    if tensor.dtype != dtype:
        raise ValueError(f"{f.name}: a piece of dtype {tensor.dtype} where {dtype} was planned")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    f.write(memoryview(flat.view(torch.uint8).numpy()))
    return flat.numel() * flat.element_size()


def write_index(folder: Path, shards: list[list[tuple[str, torch.Tensor]]], names: list[str]) -> None:
    """model.safetensors.index.json for a folder of more than one shard."""
    weight_map = {k: name for name, shard in zip(names, shards) for k, _ in shard}
    total = sum(t.numel() * t.element_size() for shard in shards for _, t in shard)
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2) + "\n")

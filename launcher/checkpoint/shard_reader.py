"""A DCP checkpoint's tensors read straight from its shard files, any range of rows at a time.

Legend: N rows (a tensor's first dim; E for a stack of experts).

`dcp.load` reads each saved chunk of a tensor through `torch.load` into fresh memory, then
copies it into the destination: the tensor twice, and no way to read a part of it (one expert of
an [E, ...] stack) but by reading the whole chunk. The shards DCP's `FileSystemWriter` writes hold
each chunk as a `torch.save` archive whose storage is stored uncompressed; unpickling the
archive's small header with `map_location="meta"` finds where that storage lies in the file
without reading it. From there any rows of the chunk are one `readinto` away, straight into the
destination.

A chunk written some other way (a storage transform such as compression, a non-contiguous
storage) cannot be read like this: `readable` says so, and the caller falls back to `dcp.load`.
Shards are checked against the checkpoint's manifest (size and sha256) before their first read,
as `SafeFileSystemReader` does; a shard cut short is `CheckpointDamaged`.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from moetron.launcher.checkpoint.io import CheckpointDamaged, check_file, read_manifest


class _Window(io.RawIOBase):
    """Bytes [begin, begin + length) of an open file, as a file of their own (for `torch.load`)."""

    def __init__(self, f, begin: int, length: int):
        super().__init__()
        self._f, self._begin, self._length, self._pos = f, begin, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence] + pos
        return self._pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self._length - self._pos))
        self._f.seek(self._begin + self._pos)
        got = self._f.readinto(memoryview(buf)[:n])
        self._pos += got
        return got


class ShardReader:
    """Rows of the tensors of the DCP checkpoint `folder` whose metadata is `metadata`, read from
    its shard files (opened on first read, one handle each; `close` them)."""

    def __init__(self, folder: Path, metadata: Metadata):
        self.folder, self.metadata = Path(folder), metadata
        self.manifest = read_manifest(self.folder)
        self._files: dict[str, io.BufferedReader] = {}
        # (fqn, chunk offsets) → (shard file, byte where the chunk's storage begins), or None when
        # the chunk is not stored as plain bytes.
        self._where: dict[tuple[str, tuple[int, ...]], tuple[str, int] | None] = {}

    def _tensor(self, fqn: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata[fqn]
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"{fqn}: not a tensor of the checkpoint")
        return md

    def readable(self, fqn: str) -> bool:
        """Whether every chunk of tensor `fqn` lies in its shard as plain bytes."""
        md = self._tensor(fqn)
        return all(self._locate(fqn, md, chunk) is not None for chunk in md.chunks)

    def read_rows(self, fqn: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of tensor `fqn` ([hi - lo, ...], its saved dtype; a 0-dim tensor whole),
        each chunk's share read into place. Only for a `readable` tensor."""
        md = self._tensor(fqn)
        if len(md.size) == 0:
            out = torch.empty((), dtype=md.properties.dtype)
            self._read_into(*self._locate(fqn, md, md.chunks[0]), out)
            return out
        out = torch.empty((hi - lo, *md.size[1:]), dtype=md.properties.dtype)
        filled = 0
        for chunk in md.chunks:
            first, rows = chunk.offsets[0], chunk.sizes[0]
            a, b = max(lo, first), min(hi, first + rows)
            if a >= b:
                continue
            path, begin = self._locate(fqn, md, chunk)
            row_bytes = math.prod(chunk.sizes[1:]) * out.element_size()
            whole_rows = tuple(chunk.sizes[1:]) == tuple(md.size[1:])
            # A chunk as wide as the tensor reads into place; a narrower one (split along a later
            # dim) through a buffer of its own.
            buf = out[a - lo:b - lo] if whole_rows else out.new_empty((b - a, *chunk.sizes[1:]))
            self._read_into(path, begin + (a - first) * row_bytes, buf)
            if not whole_rows:
                inner = tuple(slice(o, o + s) for o, s in zip(chunk.offsets[1:], chunk.sizes[1:]))
                out[(slice(a - lo, b - lo), *inner)].copy_(buf)
            filled += buf.numel()
        if filled != out.numel():
            raise CheckpointDamaged(f"{self.folder}: the chunks of {fqn} do not cover rows {lo}..{hi}")
        return out

    def _locate(self, fqn: str, md: TensorStorageMetadata, chunk: ChunkStorageMetadata) -> tuple[str, int] | None:
        key = (fqn, tuple(chunk.offsets))
        if key not in self._where:
            self._where[key] = self._find_storage(fqn, md, chunk)
        return self._where[key]

    def _find_storage(self, fqn: str, md: TensorStorageMetadata, chunk: ChunkStorageMetadata) -> tuple[str, int] | None:
        """Where the chunk's storage begins, from its archive's header (`torch.load` onto the meta
        device reads no data), or None when it is not stored as plain contiguous bytes."""
        info = self.metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
        if info.transform_descriptors:
            return None
        window = _Window(self._file(info.relative_path), info.offset, info.length)
        try:
            meta = torch.load(io.BufferedReader(window), map_location="meta", weights_only=True)
        except Exception as e:  # a damaged archive: torch raises RuntimeError, pickle its own errors
            raise CheckpointDamaged(f"{self.folder / info.relative_path}: {fqn} is unreadable ({e})") from None
        offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
        if (offset is None or tuple(meta.shape) != tuple(chunk.sizes) or meta.dtype != md.properties.dtype
                or not meta.is_contiguous()):
            return None
        return info.relative_path, info.offset + offset + meta.storage_offset() * meta.element_size()

    def _file(self, name: str) -> io.BufferedReader:
        if name not in self._files:
            if self.manifest is not None:
                problem = check_file(self.folder, name, self.manifest.get(name), hash_it=True)
                if problem:
                    raise CheckpointDamaged(problem)
            self._files[name] = (self.folder / name).open("rb")
        return self._files[name]

    def _read_into(self, name: str, begin: int, buf: torch.Tensor) -> None:
        f = self._file(name)
        f.seek(begin)
        want = buf.numel() * buf.element_size()
        if want and f.readinto(memoryview(buf.reshape(-1).view(torch.uint8).numpy())) != want:
            raise CheckpointDamaged(f"{self.folder / name}: cut short (truncated after it was written)")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

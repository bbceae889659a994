"""Reading and checking checkpoint files: a manifest of sizes and hashes, a DCP reader that
unpickles nothing but its own metadata classes, and a tensor-by-tensor comparison with the model.

A checkpoint folder is only as good as its bytes. Three things go wrong in practice:
  - a shard is shorter than written (node died, quota hit, copy interrupted) or its bytes changed
    (bad disk, a partial rsync over it): `manifest.json` holds every file's size and sha256,
    written when the checkpoint was saved; sizes are checked before a resume is chosen (cheap:
    one stat per file) and each shard's hash before a rank reads it. Without a manifest, each
    shard must still hold the bytes `.metadata` says were written into it, and state.json must
    parse. Such damage raises `CheckpointDamaged`, which an automatic resume answers by setting
    the checkpoint aside for an older one;
  - it belongs to another model: `tensor_mismatches` names the tensors whose shapes differ and
    those missing on either side;
  - DCP's `.metadata` is a pickle, and DCP unpickles non-tensor entries with `torch.load(...,
    weights_only=False)`: `SafeFileSystemReader` and `SafeLoadPlanner` allow only DCP's own
    metadata classes, torch.Size, dtypes and plain containers, so a crafted file cannot run code.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

MANIFEST = "manifest.json"
# The checkpoint folder's format; a reader refuses a newer one rather than misread it.
MANIFEST_VERSION = 1
METADATA = ".metadata"
STATE = "state.json"

# (module, name) pairs a DCP .metadata pickle may name; anything else is refused.
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
              "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name ("torch.strided") to the layout
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: where the shards were written
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or used as asked; one line naming the file and the fix."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files are not as they were written (missing, truncated, corrupt,
    unreadable): an automatic resume may set it aside for an older one (launcher/run_dir.py).
    `problem` is what is wrong, without the advice the message adds."""

    def __init__(self, message: str, problem: str | None = None):
        super().__init__(message)
        self.problem = problem or message


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}")


def load_metadata(folder: Path) -> Metadata:
    """DCP's `.metadata` of `folder`, unpickled with only DCP's own classes allowed."""
    path = Path(folder) / METADATA
    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {folder} is not a DCP checkpoint") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointDamaged(f"{path}: not a valid checkpoint metadata file ({e}); "
                                f"it may only hold DCP metadata, tensors' sizes and dtypes") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointDamaged(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata unpickled by an allow-list, and each shard's size and
    sha256 checked against the manifest (when the checkpoint has one) before it is read."""

    def __init__(self, path: str | Path):
        super().__init__(str(path))
        self.folder = Path(path)
        self.manifest = read_manifest(self.folder)
        self._verified: set[str] = set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is None:
            self._verify(METADATA)
        metadata = load_metadata(self.folder)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        for item in plan.items:
            self._verify(self.storage_data[item.storage_index].relative_path)
        return super().read_data(plan, planner)

    def _verify(self, name: str) -> None:
        if self.manifest is None or name in self._verified:
            return
        problem = check_file(self.folder, name, self.manifest.get(name), hash_it=True)
        if problem:
            raise CheckpointDamaged(problem)
        self._verified.add(name)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but non-tensor entries (optimizer hyper-parameters: floats, bools,
    tuples) are read with `weights_only=True`: plain data only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn}: refused to unpickle "
                                  f"({str(e).splitlines()[0]}); only tensors and plain data load") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of one file, read in 8 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def manifest_part(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {"size", "sha256"}} for the given files of `folder` (the ones this rank wrote)."""
    out = {}
    for name in sorted(names):
        size, digest = file_digest(folder / name)
        out[name] = {"size": size, "sha256": digest}
    return out


def write_manifest(folder: Path, files: Mapping[str, Mapping[str, Any]]) -> None:
    (folder / MANIFEST).write_text(json.dumps({"version": MANIFEST_VERSION, "files": dict(sorted(files.items()))},
                                              indent=1))


def read_manifest(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's {file: {"size", "sha256"}}, or None for a checkpoint written without one."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        files, version = data["files"], data.get("version", 1)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointDamaged(f"{path}: unreadable ({e}); the checkpoint cannot be verified") from None
    if not isinstance(version, int) or version > MANIFEST_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {version!r} was written by a newer moetron; this one reads "
                              f"format {MANIFEST_VERSION} and older (upgrade moetron to resume from it)")
    return files


def check_file(folder: Path, name: str, expected: Mapping[str, Any] | None, *, hash_it: bool) -> str | None:
    """What is wrong with one file of a checkpoint, as one line, or None."""
    path = Path(folder) / name
    if expected is None:
        return f"{path}: not listed in {MANIFEST}; the checkpoint was changed after it was written"
    if not path.is_file():
        return f"{path}: missing (the manifest lists {expected['size']} bytes)"
    size = path.stat().st_size
    if size != expected["size"]:
        return f"{path}: truncated or overwritten: {size} bytes, the manifest says {expected['size']}"
    if hash_it and file_digest(path)[1] != expected["sha256"]:
        return f"{path}: corrupt: its sha256 differs from the one recorded when it was written"
    return None


def verify_checkpoint(folder: Path, *, hash_files: bool = False) -> str | None:
    """The first problem of a checkpoint folder, as one line, or None: every file against its
    manifest (sizes; hashes too if asked); without a manifest (a checkpoint written by
    `dcp.save` alone), each shard against the extent its `.metadata` records. Then state.json,
    which must parse. Raises CheckpointDamaged for an unreadable manifest or metadata, and
    CheckpointError for a newer format."""
    manifest = read_manifest(folder)
    if manifest is not None:
        for name, expected in manifest.items():
            problem = check_file(folder, name, expected, hash_it=hash_files)
            if problem:
                return problem
    elif (Path(folder) / METADATA).is_file():
        problem = _extent_problem(Path(folder), load_metadata(folder))
        if problem:
            return problem
    try:
        read_state(folder)
    except CheckpointDamaged as e:
        return str(e)
    return None


def _extent_problem(folder: Path, metadata: Metadata) -> str | None:
    """A shard missing or shorter than the bytes `.metadata` says were written into it."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if isinstance(name, str):
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            return f"{path}: missing (its {METADATA} records {size} bytes written there)"
        if path.stat().st_size < size:
            return (f"{path}: truncated: {path.stat().st_size} bytes, its {METADATA} records {size} "
                    f"bytes written there")
    return None


def read_state(folder: Path) -> dict[str, Any]:
    """A checkpoint's state.json (step, tokens, sampler, resolved config, …); {} when it has none.
    Raises CheckpointDamaged, naming the file, when it does not parse (cut short or overwritten)."""
    path = Path(folder) / STATE
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointDamaged(f"{path}: unreadable, cut short or overwritten ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointDamaged(f"{path}: holds a {type(state).__name__}, not the checkpoint's state")
    return state


def tensor_shapes(metadata: Metadata, prefix: str) -> dict[str, tuple[int, ...]]:
    """{key: global shape} of the tensors saved under `prefix` ("model." → parameter names)."""
    return {k[len(prefix):]: tuple(md.size) for k, md in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}


def tensor_mismatches(saved: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    """One phrase per difference between a checkpoint's tensors and the model's: shape, missing
    from the checkpoint, unexpected in it."""
    out = [f"{k} is {list(saved[k])} there, {list(expected[k])} here"
           for k in sorted(set(saved) & set(expected)) if tuple(saved[k]) != tuple(expected[k])]
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing:
        out.append(f"missing there: {_some(missing)}")
    if unexpected:
        out.append(f"unexpected there: {_some(unexpected)}")
    return out


def _some(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")

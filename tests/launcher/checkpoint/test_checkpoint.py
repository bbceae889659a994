"""Checkpoints on one process: atomic publish, async = sync, manifest checks, safe unpickling,
model mismatches, export, and a real full disk."""

import json
import os
import pickle
import random
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from moetron.launcher.checkpoint import store as checkpoint
from moetron.launcher.checkpoint.folders import complete_checkpoints, latest_checkpoint, set_aside
from moetron.launcher.checkpoint.io import (
    MANIFEST,
    CheckpointDamaged,
    CheckpointError,
    load_metadata,
    read_manifest,
    verify_checkpoint,
)
from moetron.launcher.checkpoint.store import (
    Checkpointer,
    consolidated_model_state,
    load_checkpoint,
    save_checkpoint,
)


def make(seed=0, width=16):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_steps(model, opt, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(torch.randn(5, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def saved_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return consolidated_model_state(ckpt)


def test_save_publishes_atomically_and_keeps_k(tmp_path):
    model, opt = make()
    for step in (1, 2, 3, 4):
        train_steps(model, opt, 1)
        save_checkpoint(tmp_path, step, model, opt, {"step": step}, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000004"
    assert not list(tmp_path.glob(".tmp-*"))
    ckpt = latest_checkpoint(tmp_path)
    files = read_manifest(ckpt)
    assert {".metadata", "state.json", "rng-rank0.json"} <= set(files)
    assert any(name.endswith(".distcp") for name in files)
    assert all(f["size"] == (ckpt / n).stat().st_size for n, f in files.items())


def test_resume_restores_model_optimizer_and_rng(tmp_path):
    model, opt = make()
    train_steps(model, opt, 3)
    save_checkpoint(tmp_path, 3, model, opt, {"step": 3})
    expected_draws = (torch.rand(3), random.random(), np.random.rand(3))
    train_steps(model, opt, 2, seed=7)
    random.random(), np.random.rand(5)  # moved on, so only a restore brings them back
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2 = make(seed=99)
    assert load_checkpoint(tmp_path / "step-00000003", model2, opt2) == {"step": 3}
    torch_draw, python_draw, numpy_draw = expected_draws
    assert torch.equal(torch.rand(3), torch_draw)
    assert random.random() == python_draw
    assert np.array_equal(np.random.rand(3), numpy_draw)
    train_steps(model2, opt2, 2, seed=7)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, reference[k]), k


class SlowWriter(FileSystemWriter):
    """Starts writing only after the training thread has moved on."""

    def write_data(self, plan, planner):
        time.sleep(0.5)
        return super().write_data(plan, planner)


def test_async_save_writes_the_same_tensors_as_sync(tmp_path, monkeypatch):
    model, opt = make()
    train_steps(model, opt, 2)
    sync = save_checkpoint(tmp_path / "sync", 2, model, opt, {"step": 2})
    monkeypatch.setattr(checkpoint, "FileSystemWriter", SlowWriter)
    ckpt = Checkpointer(tmp_path / "async", async_save=True)
    assert ckpt.save(2, model, opt, {"step": 2}) is None
    # The next steps change every parameter in place while the write is still to come.
    train_steps(model, opt, 3)
    assert ckpt.poll() is None
    done = ckpt.wait()
    assert done == tmp_path / "async" / "step-00000002"
    a, b = saved_tensors(sync), saved_tensors(done)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model2, opt2 = make(seed=5)
    load_checkpoint(done, model2, opt2)
    assert opt2.state_dict()["state"][0]["exp_avg"].abs().sum() > 0
    assert ckpt.poll() is None and ckpt.wait() is None


def test_poll_publishes_only_when_the_write_finished(tmp_path):
    model, opt = make()
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, model, opt, {"step": 1})
    for _ in range(1000):
        if (found := ckpt.poll()) is not None:
            break
        assert latest_checkpoint(tmp_path) is None  # nothing is published before the write ends
        train_steps(model, opt, 1)
    assert found == tmp_path / "step-00000001" and latest_checkpoint(tmp_path) == found


def test_export_equals_live_state_dict(tmp_path):
    model, opt = make()
    train_steps(model, opt, 2)
    ckpt = save_checkpoint(tmp_path, 2, model, opt, {"step": 2})
    exported = consolidated_model_state(ckpt)
    live = model.state_dict()
    assert exported.keys() == live.keys() and all(torch.equal(exported[k], live[k]) for k in live)


def _shard(ckpt: Path) -> Path:
    return next(ckpt.glob("*.distcp"))


def test_truncated_shard_is_reported_with_previous_checkpoint(tmp_path):
    model, opt = make()
    save_checkpoint(tmp_path, 1, model, opt, {"step": 1})
    ckpt = save_checkpoint(tmp_path, 2, model, opt, {"step": 2})
    shard = _shard(ckpt)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard}: truncated.*previous complete checkpoint is .*step-00000001"):
        load_checkpoint(ckpt, *make())
    assert shard.exists() and (tmp_path / "step-00000001").is_dir()


def test_corrupt_shard_is_caught_by_its_hash(tmp_path):
    model, opt = make()
    ckpt = save_checkpoint(tmp_path, 1, model, opt, {"step": 1})
    shard = _shard(ckpt)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard}: corrupt.*no earlier complete checkpoint"):
        load_checkpoint(ckpt, *make())
    with pytest.raises(CheckpointError, match="corrupt"):
        consolidated_model_state(ckpt)


def _two_checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    """step-1 and step-2 of one model."""
    model, opt = make()
    return save_checkpoint(tmp_path, 1, model, opt, {"step": 1}), save_checkpoint(tmp_path, 2, model, opt, {"step": 2})


def _contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("damage", ["missing_file", "unlisted_file", "manifest_size", "newer_format",
                                    "unreadable_manifest"])
def test_damaged_checkpoint_is_refused_with_the_previous_one_offered(tmp_path, damage):
    """Each damage gives one CheckpointError line naming the file and what is wrong, offers step-1,
    and leaves every file of every checkpoint as it was (after the damage)."""
    first, second = _two_checkpoints(tmp_path)
    shard = _shard(second)
    manifest = json.loads((second / MANIFEST).read_text())
    if damage == "missing_file":
        shard.unlink()
        expected = rf"{shard}: missing"
    elif damage == "unlisted_file":
        del manifest["files"][shard.name]
        (second / MANIFEST).write_text(json.dumps(manifest))
        expected = rf"{shard}: not listed in {MANIFEST}"
    elif damage == "manifest_size":
        manifest["files"][shard.name]["size"] += 1
        (second / MANIFEST).write_text(json.dumps(manifest))
        expected = rf"{shard}: truncated or overwritten"
    elif damage == "newer_format":
        manifest["version"] = 2
        (second / MANIFEST).write_text(json.dumps(manifest))
        expected = r"checkpoint format 2 was written by a newer moetron"
    else:
        (second / MANIFEST).write_text("{not json")
        expected = rf"{second / MANIFEST}: unreadable"
    before = _contents(tmp_path)
    model, opt = make(seed=1)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=rf"{expected}.*previous complete checkpoint is .*step-00000001") as e:
        load_checkpoint(second, model, opt)
    assert "\n" not in str(e.value)
    assert _contents(tmp_path) == before  # nothing deleted, rewritten or moved
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))  # the live model untouched
    load_checkpoint(first, model, opt)  # the one offered loads


@pytest.mark.parametrize("damage", ["shard", "state"])
def test_without_a_manifest_a_cut_file_is_still_named(tmp_path, damage):
    """A checkpoint without its manifest (removed, or written by dcp.save alone) still has its
    .metadata, which records how many bytes went into each shard; and its state.json must parse."""
    first, second = _two_checkpoints(tmp_path)
    (second / MANIFEST).unlink()
    bad = _shard(second) if damage == "shard" else second / "state.json"
    size = bad.stat().st_size
    bad.write_bytes(bad.read_bytes()[:10])
    expected = (rf"{bad}: truncated: 10 bytes, its \.metadata records {size} bytes written there" if damage == "shard"
                else rf"{bad}: unreadable, cut short or overwritten")
    for read in (lambda: load_checkpoint(second, *make()), lambda: consolidated_model_state(second)):
        with pytest.raises(CheckpointDamaged, match=rf"{expected}.*previous complete checkpoint is .*step-00000001"):
            read()
    assert verify_checkpoint(first) is None and re.match(expected, verify_checkpoint(second))


def test_set_aside_keeps_a_damaged_checkpoint_out_of_every_listing(tmp_path):
    first, second = _two_checkpoints(tmp_path)
    files = _contents(second)
    moved = set_aside(second)
    assert moved == tmp_path / "damaged-step-00000002" and _contents(moved) == files
    assert complete_checkpoints(tmp_path) == [first] and latest_checkpoint(tmp_path) == first
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    # The same step damaged again (saved anew, then damaged) does not overwrite the first one set aside.
    again = save_checkpoint(tmp_path, 2, *make(), {"step": 2})
    assert set_aside(again) == tmp_path / "damaged-step-00000002.2"
    assert set_aside(first) == tmp_path / "damaged-step-00000001"
    assert complete_checkpoints(tmp_path) == [] and not (tmp_path / "latest").exists()


def test_a_plain_file_where_a_checkpoint_folder_is_expected(tmp_path):
    (tmp_path / "step-00000003").write_text("not a folder")
    with pytest.raises(CheckpointError, match=r"step-00000003: not a checkpoint folder"):
        load_checkpoint(tmp_path / "step-00000003", *make())
    with pytest.raises(CheckpointError, match=r"step-00000003: not a checkpoint folder"):
        consolidated_model_state(tmp_path / "step-00000003")


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_malicious_metadata_pickle_is_refused(tmp_path):
    model, opt = make()
    ckpt = save_checkpoint(tmp_path, 1, model, opt, {"step": 1})
    (ckpt / MANIFEST).unlink()  # as if crafted without a manifest: only the unpickler stands guard
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match=r"\.metadata: not a valid checkpoint metadata file \(refused to load posix.system"):
        load_metadata(ckpt)
    with pytest.raises(CheckpointError, match="refused to load"):
        load_checkpoint(ckpt, *make())


def test_malicious_entry_inside_a_shard_is_refused(tmp_path):
    """DCP reads non-tensor entries with torch.load(weights_only=False); ours with weights_only=True."""
    model2, opt2 = make()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from moetron.launcher.checkpoint.store import STATE_OPTIONS

    msd, osd = get_state_dict(model2, opt2, options=STATE_OPTIONS)
    key = next(k for k, v in osd.items() if k.startswith("param_groups.") and k.endswith(".lr"))
    osd[key] = _Boom()
    bad = tmp_path / "bad"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(bad), no_dist=True)
    (bad / "state.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"optim.{key}: refused to unpickle"):
        load_checkpoint(bad, *make())


def test_other_model_names_the_mismatched_tensors(tmp_path):
    model, opt = make(width=16)
    ckpt = save_checkpoint(tmp_path, 1, model, opt, {"step": 1})
    other, other_opt = make(width=32)
    with pytest.raises(CheckpointError, match=r"another model: 0.bias is \[16\] there, \[32\] here; 0.weight"):
        load_checkpoint(ckpt, other, other_opt)
    bigger = nn.Sequential(*make()[0], nn.Linear(4, 4))
    with pytest.raises(CheckpointError, match=r"missing there: 3.bias, 3.weight"):
        load_checkpoint(ckpt, bigger, None)
    smaller = nn.Sequential(nn.Linear(8, 16))
    with pytest.raises(CheckpointError, match=r"unexpected there: 2.bias, 2.weight"):
        load_checkpoint(ckpt, smaller, None)


FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, torch
    from pathlib import Path
    from torch import nn
    from moetron.launcher.checkpoint.store import save_checkpoint
    from moetron.launcher.checkpoint.io import CheckpointError
    root, limit = Path(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    small = nn.Linear(8, 8)
    save_checkpoint(root, 1, small, torch.optim.AdamW(small.parameters()), {"step": 1})
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    big = nn.Linear(512, 512)
    try:
        save_checkpoint(root, 2, big, torch.optim.AdamW(big.parameters()), {"step": 2})
    except CheckpointError as e:
        print(e)
        sys.exit(3)
""")


@pytest.fixture
def small_disk(tmp_path, tmpfs):
    """A 256 KiB tmpfs when this process may mount one (root), else None (RLIMIT_FSIZE instead)."""
    where = tmpfs(256 * 1024)
    if where is not None:
        return where, 0
    (tmp_path / "disk").mkdir()
    return tmp_path / "disk", 64 * 1024


def test_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(small_disk):
    root, limit = small_disk
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(root / "ckpts"), str(limit)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    message = proc.stdout.strip()
    assert message.startswith("saving checkpoint step-00000002 failed: ")
    assert ("No space left on device" in message) or ("File too large" in message)
    assert "step-00000001 and `latest` are intact" in message and "\n" not in message
    ckpts = root / "ckpts"
    assert (ckpts / "latest").read_text().strip() == "step-00000001"
    assert [p.name for p in ckpts.iterdir() if p.name.startswith(".tmp")] == []
    state = consolidated_model_state(ckpts / "step-00000001")
    assert state["weight"].shape == (8, 8)
    assert json.loads((ckpts / "step-00000001" / "state.json").read_text()) == {"step": 1}

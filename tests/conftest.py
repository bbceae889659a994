"""Test-wide setup.

Triton's interpreter must be chosen before anything imports triton (see the kernel tests), so it is
set here, at collection, whenever no CUDA device is present.
"""

import os
import subprocess

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing means no CUDA either
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _one_thread_in_forked_tests(request):
    """A forked child inherits the parent's OpenMP thread pool but not its threads: once the
    parent has run a parallel torch op, the child's first one waits forever at a barrier. The
    child therefore runs torch single-threaded (the interpreter is the bottleneck anyway)."""
    if request.node.get_closest_marker("forked") is not None:
        import torch

        torch.set_num_threads(1)


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size_bytes) → a fresh tmpfs of that size, or None where this process may not mount
    one (tmpfs needs root). Each is unmounted afterwards, and a plain umount fails while a file
    on it is still open: that is a leak in the code under test."""
    mounted = []

    def mount(size: int):
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                                               capture_output=True).returncode != 0:
            return None
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        assert subprocess.run(["umount", str(where)], capture_output=True).returncode == 0, f"a file on {where} is left open"


@pytest.fixture
def tmp_run_dir(tmp_path):
    """A fresh folder for run outputs (metrics, checkpoints, TensorBoard)."""
    d = tmp_path / "runs"
    d.mkdir()
    return d

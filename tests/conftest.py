"""Test-wide setup.

Triton's interpreter must be chosen before anything imports triton (see the kernel tests), so it is
set here, at collection, whenever no CUDA device is present.
"""

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing means no CUDA either
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def tmp_run_dir(tmp_path):
    """A fresh folder for run outputs (metrics, checkpoints, TensorBoard)."""
    d = tmp_path / "runs"
    d.mkdir()
    return d

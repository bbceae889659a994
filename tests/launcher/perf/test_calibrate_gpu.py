"""`moetron plan --calibrate` on a GPU machine (launcher/perf/calibrate_gpu.py), run here on the CPU
with small shapes: the "gpu" profile keeps the data sheet's peak and links, takes the measured
matmul rate, copy bandwidth and block overhead, and `moetron plan --gpu gpu` plans with it."""

import contextlib
import io
import json

import pytest
import torch

from moetron.launcher.cli.main import main
from moetron.launcher.config import ConfigError
from moetron.launcher.perf.calibrate_gpu import calibrate_gpu, gpu_profile_name
from moetron.launcher.perf.device_profiles import PROFILES, get_profile

SMALL = {"shapes": ((64, 128, 256),), "copy_bytes": 2**20, "repeats": 2}


def plan_json(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


def test_the_calibrated_profile_is_the_data_sheet_with_what_one_device_measures(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^--gpu gpu: no calibrated GPU profile on this machine; run `moetron plan"):
        get_profile("gpu")
    base = PROFILES["H200"]
    profile, stored = calibrate_gpu(torch.device("cpu"), base=base, console=lambda _: None, **SMALL)
    assert stored == tmp_path / "moetron" / "plan_profile_gpu.json" and get_profile("gpu") == profile
    assert profile.name == "gpu" and "measured on cpu" in profile.sources["calibrated"]
    kept = ("peak_flops", "memory_bytes", "intra_bw", "intra_latency", "inter_bw", "inter_latency", "dp_overlap")
    assert all(getattr(profile, k) == getattr(base, k) for k in kept)
    # A CPU is far below an H200's data sheet: each measured number replaced the estimate.
    assert 0 < profile.matmul_efficiency < base.matmul_efficiency and 0 < profile.hbm_bw < base.hbm_bw
    assert 0 < profile.block_overhead < 5
    plan = plan_json(["configs/tiny.yaml", "--gpus", "1", "--gpu", "gpu"])
    assert plan["profile"]["name"] == "gpu" and plan["profile"]["matmul_efficiency"] == profile.matmul_efficiency
    # Slower matmuls and memory than the data sheet: the same layout takes longer.
    sheet = plan_json(["configs/tiny.yaml", "--gpus", "1", "--gpu", "H200"])
    assert plan["ranked"][0]["step_s"] > sheet["ranked"][0]["step_s"]


def test_a_gpu_without_a_data_sheet_profile_is_refused_in_one_line():
    assert gpu_profile_name("NVIDIA H200") == "H200" and gpu_profile_name("NVIDIA H100 80GB HBM3") == "H100"
    with pytest.raises(ConfigError, match=r"no data-sheet profile for 'NVIDIA GeForce RTX 4090' to start from"):
        gpu_profile_name("NVIDIA GeForce RTX 4090")

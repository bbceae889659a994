"""`moetron plan --calibrate` where a CUDA GPU is: this GPU's profile, "gpu", measured and cached.

It starts from the data-sheet profile of the GPU's model (device_profiles.PROFILES). The peak, the
MFU denominator, stays the data sheet's bf16 dense figure, as GPU dashboards report it; what one
device can measure replaces the data sheet's estimate:
  matmul_efficiency  the best bf16 rate over MATMUL_SHAPES (a Mixtral FFN's tokens × d_model × d_ff
                     and back) over the peak;
  hbm_bw             the rate of copying COPY_BYTES (bytes read + written per second);
  block_overhead     one forward + backward of a one-block model of width 32 on 8 tokens
                     (calibrate.block_step): kernel launches and Python, no FLOPs to speak of.
Collective bandwidths and latencies stay the data sheet's: one GPU has no peer to measure them
with, and nccl-tests measures a cluster's better. Every number is the best of `repeats` runs.
`moetron plan --gpu gpu` then plans with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from moetron.launcher.config import ConfigError
from moetron.launcher.perf.calibrate import block_step, to_stderr
from moetron.launcher.perf.device_profiles import PROFILES, DeviceProfile, gpu_profile_cache, save_profile
from moetron.launcher.perf.display import significant

MATMUL_SHAPES = ((8192, 4096, 14336), (8192, 14336, 4096))
COPY_BYTES = 2**30
REPEATS = 5


def gpu_profile_name(device_name: str) -> str:
    """The data-sheet profile whose name the device's contains ("NVIDIA H200" → "H200")."""
    name = next((n for n in PROFILES if n in device_name.upper()), None)
    if name is None:
        raise ConfigError(f"moetron plan --calibrate: no data-sheet profile for {device_name!r} to start from "
                          f"(known: {', '.join(PROFILES)}); plan with --gpu and one of them")
    return name


def best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one warm-up call."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NOTE: host-device sync, so the time covers the kernels

    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(device: torch.device, *, shapes=MATMUL_SHAPES, copy_bytes: int = COPY_BYTES,
            repeats: int = REPEATS) -> dict[str, float]:
    """{"matmul_rate": FLOP/s, "hbm_bw": bytes/s, "block_overhead": s} of `device` (bf16 matmuls on
    CUDA, fp32 elsewhere)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rates = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        rates.append(2.0 * m * k * n / best_seconds(lambda a=a, b=b: a @ b, device, repeats))
    src = torch.empty(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    return {"matmul_rate": max(rates), "hbm_bw": 2.0 * copy_bytes / best_seconds(lambda: dst.copy_(src), device, repeats),
            "block_overhead": best_seconds(block_step(device), device, repeats)}


def calibrate_gpu(device: torch.device, *, base: DeviceProfile | None = None, path: Path | None = None,
                  console: Callable[[str], None] = to_stderr, **measure_options) -> tuple[DeviceProfile, Path]:
    """Measure `device`, store the "gpu" profile (`base`: the data-sheet profile it starts from; by
    default the device's own) and return it with the file it went to."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    base = base or PROFILES[gpu_profile_name(device_name)]
    console(f"calibrating the gpu profile on {device_name}, from the {base.name} data sheet")
    got = measure(device, **measure_options)
    profile = replace(
        base, name="gpu", matmul_efficiency=min(got["matmul_rate"] / base.peak_flops, 1.0), hbm_bw=got["hbm_bw"],
        block_overhead=got["block_overhead"],
        sources={**base.sources, "calibrated": f"matmul_efficiency, hbm_bw and block_overhead measured on "
                                               f"{device_name} by moetron plan --calibrate; the rest: {base.name}"})
    stored = save_profile(profile, path or gpu_profile_cache())
    console(f"matmul {significant(got['matmul_rate'] / 1e12)} TFLOP/s ({profile.matmul_efficiency:.0%} of the "
            f"{base.peak_flops / 1e12:.0f} TFLOP/s peak), copy {significant(got['hbm_bw'] / 1e12)} TB/s, block overhead "
            f"{got['block_overhead'] * 1e3:.2f} ms; stored in {stored} (moetron plan --gpu gpu)")
    return profile, stored

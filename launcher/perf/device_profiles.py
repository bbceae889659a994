"""What the layout planner assumes about a device and its links, with where each number comes from.

Every GPU profile is a data-sheet peak plus published measurements; `cpu` is measured on the
machine it runs on (`moetron plan --calibrate`) and cached beside the CPU matmul peak
($XDG_CACHE_HOME/moetron/plan_profile.json). `peak_flops` follows PEAK_DEFINITION, the one peak
both the planner's and training's MFU divide by (launcher/perf/mfu.py). Bandwidths are
nccl-tests' *bus* bandwidth per GPU (what one rank sustains inside a collective, the same for
every collective kind after the (n−1)/n or 2(n−1)/n factor), latencies the small-message time of
one collective step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from moetron.launcher.config import ConfigError

GB = 1e9

PEAK_DEFINITION = ("peak = the fastest dense matmul FLOP/s (no sparsity) of one rank's device in a training "
                   "precision: a GPU's bf16 data-sheet figure; on CPU the faster of bf16 and fp32, measured by "
                   "one rank alone at its thread count")

# bf16 dense tensor-core peaks from NVIDIA's data sheets (SXM parts unless named), in TFLOP/s.
# Longer names first: "H100 PCIe" must match before "H100".
GPU_BF16_DENSE_TFLOPS = (
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A100", 312.0),
)


def _datasheet(name: str) -> float:
    return dict(GPU_BF16_DENSE_TFLOPS)[name] * 1e12


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_flops: float  # PEAK_DEFINITION: per device (rank), per second
    memory_bytes: float  # usable device memory
    matmul_efficiency: float  # sustained fraction of peak on a model's large GEMMs
    intra_bw: float  # bus bandwidth per rank inside a node, bytes/s
    intra_latency: float  # seconds per collective step inside a node
    inter_bw: float  # bus bandwidth per rank across nodes, bytes/s
    inter_latency: float
    hbm_bw: float = 3e12  # device memory bandwidth, bytes/s (elementwise work and the optimizer step)
    # Fraction of data-parallel communication hidden behind compute (FSDP prefetch, DDP buckets on
    # their own streams); 0 where collectives block the compute (gloo on CPU).
    dp_overlap: float = 0.8
    # Seconds of fixed cost per block and micro-batch (forward + backward: kernel launches,
    # Python dispatch; GPUs: ~40 kernels per block at ~5 µs each); matters for small models.
    block_overhead: float = 2e-4
    # Bus bandwidth of each collective kind relative to all_reduce's, where they differ (gloo on
    # CPU: measured by --calibrate); a kind not named runs at the link's bandwidth (NCCL's ring
    # collectives reach about the same bus bandwidth, so the GPU profiles name none).
    kind_bw: dict[str, float] = field(default_factory=dict)
    # Ranks per core (CPU runs with more ranks than cores; devices: 1). An idle rank's core goes to
    # the busy ones, so a pipeline bubble costs 1/oversubscription of its time on a device.
    oversubscription: float = 1.0
    sources: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# nccl-tests all_reduce bus bandwidth on 8-GPU NVLink/NVSwitch systems and on NDR/HDR InfiniBand
# (one 400 Gb/s or 200 Gb/s NIC per GPU), as published by NVIDIA and cloud providers.
PROFILES = {
    "H100": DeviceProfile(
        "H100", _datasheet("H100"), 80 * GB, 0.70, 360 * GB, 15e-6, 45 * GB, 25e-6,
        hbm_bw=3.35e12,
        sources={"peak_flops": "NVIDIA H100 SXM data sheet: 989 TFLOP/s bf16 dense",
                 "memory_bytes": "H100 SXM data sheet: 80 GB HBM3",
                 "matmul_efficiency": "cuBLAS bf16 GEMMs at d_model 4096-8192 sustain ~650-750 TFLOP/s",
                 "intra_bw": "nccl-tests all_reduce busbw ~360-480 GB/s on DGX H100 (NVLink 4, 900 GB/s bidirectional)",
                 "inter_bw": "8 × 400 Gb/s NDR per node = 50 GB/s per GPU; nccl-tests busbw ~40-45 GB/s",
                 "hbm_bw": "H100 SXM data sheet: 3.35 TB/s HBM3",
                 "latencies": "NCCL small-message all_reduce ~10-20 µs in a node, ~20-30 µs across nodes"}),
    "H200": DeviceProfile(
        "H200", _datasheet("H200"), 141 * GB, 0.72, 360 * GB, 15e-6, 45 * GB, 25e-6,
        hbm_bw=4.8e12,
        sources={"peak_flops": "NVIDIA H200 data sheet: 989 TFLOP/s bf16 dense (H100's compute)",
                 "memory_bytes": "H200 data sheet: 141 GB HBM3e (4.8 TB/s)",
                 "matmul_efficiency": "as H100, slightly higher from the faster memory",
                 "intra_bw": "NVLink 4 as H100", "inter_bw": "8 × 400 Gb/s NDR as H100",
                 "hbm_bw": "H200 data sheet: 4.8 TB/s HBM3e",
                 "latencies": "as H100"}),
    "A100": DeviceProfile(
        "A100", _datasheet("A100"), 80 * GB, 0.75, 230 * GB, 12e-6, 22 * GB, 25e-6,
        hbm_bw=2.0e12,
        sources={"peak_flops": "NVIDIA A100 SXM data sheet: 312 TFLOP/s bf16 dense",
                 "memory_bytes": "A100 80GB data sheet",
                 "matmul_efficiency": "cuBLAS bf16 GEMMs sustain ~230-260 TFLOP/s",
                 "intra_bw": "nccl-tests all_reduce busbw ~230 GB/s on DGX A100 (NVLink 3, 600 GB/s bidirectional)",
                 "inter_bw": "8 × 200 Gb/s HDR per node = 25 GB/s per GPU; busbw ~22 GB/s",
                 "hbm_bw": "A100 80GB SXM data sheet: 2.0 TB/s HBM2e",
                 "latencies": "NCCL small-message all_reduce"}),
    "B200": DeviceProfile(
        "B200", _datasheet("B200"), 180 * GB, 0.65, 720 * GB, 15e-6, 45 * GB, 25e-6,
        hbm_bw=8.0e12,
        sources={"peak_flops": "NVIDIA HGX B200 data sheet: 2.25 PFLOP/s bf16 dense per GPU",
                 "memory_bytes": "HGX B200: 180 GB HBM3e per GPU",
                 "matmul_efficiency": "early published bf16 GEMM rates ~1.4-1.6 PFLOP/s",
                 "intra_bw": "NVLink 5: 1.8 TB/s bidirectional; busbw taken as ~80% of 900 GB/s",
                 "inter_bw": "8 × 400 Gb/s per node as H100",
                 "hbm_bw": "HGX B200: 8 TB/s HBM3e",
                 "latencies": "as H100"}),
}
INTERCONNECTS = {
    # name → inter-node bus bandwidth per GPU (bytes/s); overrides the profile's.
    "ndr": 45 * GB,  # 400 Gb/s InfiniBand per GPU
    "hdr": 22 * GB,  # 200 Gb/s per GPU
    "roce400": 40 * GB,
    "eth100": 10 * GB,
}


def profile_cache() -> Path:
    from moetron.launcher.perf.mfu import cache_dir

    return cache_dir() / "plan_profile.json"


def gpu_profile_cache() -> Path:
    from moetron.launcher.perf.mfu import cache_dir

    return cache_dir() / "plan_profile_gpu.json"


def cached_cpu_profile(path: Path | None = None) -> DeviceProfile | None:
    path = path or profile_cache()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return DeviceProfile(**data)


def save_profile(profile: DeviceProfile, path: Path | None = None) -> Path:
    path = path or profile_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1))
    tmp.replace(path)
    return path


def calibrate_on_first_use(path: Path | None = None, measure=None,
                           console: Callable[[str], None] | None = None) -> DeviceProfile:
    """This machine's cpu profile, measured now and cached, for a planner asked about "cpu" before
    anything was calibrated. Ranks that start together take turns (a lock beside the cache): the
    first measures, the others read what it stored. A busy machine is measured anyway (the spread
    is printed, with the command that measures again): a first run must not stop for it."""
    import fcntl

    from moetron.launcher.perf import calibrate as cal

    path = path or profile_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    console = console or cal.to_stderr
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        profile = cached_cpu_profile(path)
        if profile is not None:
            return profile
        console(f"no cpu profile yet: measuring this machine once (cached in {path}; "
                f"`moetron plan --calibrate` measures it again)")
        kwargs = {"measure": measure} if measure is not None else {}
        profile, _ = cal.calibrate(path=path, max_spread=float("inf"), console=console, **kwargs)
        return profile


def get_profile(name: str, *, interconnect: str | None = None) -> DeviceProfile:
    """The profile of `name` (H100, H200, A100, B200; cpu, measured on first use; gpu, this machine's
    GPU as `moetron plan --calibrate` measured it)."""
    if name == "cpu":
        profile = cached_cpu_profile() or calibrate_on_first_use()
    elif name == "gpu":
        profile = cached_cpu_profile(gpu_profile_cache())
        if profile is None:
            raise ConfigError("--gpu gpu: no calibrated GPU profile on this machine; run `moetron plan --calibrate` "
                              "where the GPU is, or name a data-sheet profile (H100, H200, A100, B200)")
    elif name.upper() in PROFILES:
        profile = PROFILES[name.upper()]
    else:
        raise ConfigError(f"--gpu {name!r}: unknown; choose one of {', '.join([*PROFILES, 'cpu', 'gpu'])}")
    if interconnect:
        if interconnect not in INTERCONNECTS:
            raise ConfigError(f"--interconnect {interconnect!r}: unknown; choose one of {', '.join(INTERCONNECTS)}")
        profile = replace(profile, inter_bw=INTERCONNECTS[interconnect],
                          sources={**profile.sources, "inter_bw": f"--interconnect {interconnect}"})
    return profile

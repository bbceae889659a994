"""Model FLOP utilization: tokens/s → model TFLOP/s per device → MFU against the device's peak.

Two numerators, side by side:
- analytic: `moetron.launcher.perf.flops.flops_per_token` (6·active params + full-square attention);
- measured: FLOPs counted by `ComponentFlopCounter` on one real training step, per token.
They differ when the run does other work than the accounting assumes (capacity drops, a kernel
that a formula misses); above 5% the run says so.

Peaks: a table of bf16 dense (no sparsity) peaks for data-center GPUs, `train.peak_tflops` to
override it, and on CPU a matmul peak measured once in the run's precision and cached under
$XDG_CACHE_HOME/moetron (default ~/.cache/moetron), keyed by CPU model, thread count, dtype and
torch version.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from moetron.launcher.perf.flops import accounting, flops_per_token
from moetron.launcher.perf.memory import memory_per_rank
from moetron.model.config import ModelConfig

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
# Measured MFU may differ from the analytic one by this much before the run warns.
MFU_TOLERANCE = 0.05
# Shapes (M, K, N) timed for the CPU peak: square, and a token-batch × d_model × d_ff projection.
CPU_PEAK_SHAPES = ((2048, 2048, 2048), (4096, 256, 1024), (4096, 1024, 4096))
# Larger shapes are skipped once one product would take longer than this at the rate seen so far.
MAX_SECONDS_PER_MATMUL = 1.0


@dataclass(frozen=True)
class Peak:
    flops: float  # per device, per second
    source: str  # how it was obtained, shown beside every MFU figure


def gpu_peak_tflops(device_name: str) -> float | None:
    for name, tflops in GPU_BF16_DENSE_TFLOPS:
        if name.lower() in device_name.lower():
            return tflops
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moetron"


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def time_matmul(m: int, k: int, n: int, dtype: torch.dtype, *, seconds: float = 0.25) -> float:
    """Best FLOP/s of (m×k)·(k×n) over repeats lasting about `seconds`."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    t0 = time.perf_counter()
    a @ b
    first = time.perf_counter() - t0
    if first > seconds:
        # An emulated dtype (bf16 without AVX512-BF16/AMX runs at ~1 GFLOP/s): one call already
        # says how slow it is, and repeats would take minutes.
        return 2.0 * m * k * n / first
    a @ b  # oneDNN builds a kernel per new shape on the first calls
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / best


def cpu_matmul_peak(dtype: torch.dtype, *, directory: Path | None = None,
                    measure: Callable[..., float] = time_matmul) -> tuple[float, bool]:
    """(FLOP/s, came from the cache): the best of CPU_PEAK_SHAPES at the current thread count,
    measured on first use and cached. Other load on the machine lowers it (and so raises MFU);
    delete the cache file to measure again on a quiet machine."""
    path = (directory or cache_dir()) / "cpu_matmul_peak.json"
    key = f"{_cpu_name()} | {torch.get_num_threads()} threads | {dtype} | torch {torch.__version__}"
    cached: dict = {}
    with contextlib.suppress(OSError, ValueError):
        cached = json.loads(path.read_text())
    if key in cached:
        return float(cached[key]), True
    peak = 0.0
    for m, k, n in sorted(CPU_PEAK_SHAPES, key=lambda shape: math.prod(shape)):
        if peak and 2.0 * m * k * n / peak > MAX_SECONDS_PER_MATMUL:
            break  # a slow dtype: larger shapes would take minutes and change nothing
        peak = max(peak, measure(m, k, n, dtype))
    cached[key] = peak
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cached, indent=1))
    tmp.replace(path)
    return peak, False


def device_peak(device: torch.device, bf16: bool, override_tflops: float = 0.0, *,
                directory: Path | None = None) -> Peak:
    """The peak MFU is measured against: the override, the GPU table, or the measured CPU matmul."""
    if override_tflops > 0:
        return Peak(override_tflops * 1e12, f"train.peak_tflops = {override_tflops:g}")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = gpu_peak_tflops(name)
        if tflops is None:
            raise ValueError(f"no bf16 peak known for {name!r}; set train.peak_tflops")
        return Peak(tflops * 1e12, f"{name} bf16 dense peak (data sheet)")
    dtype = torch.bfloat16 if bf16 else torch.float32
    flops, cached = cpu_matmul_peak(dtype, directory=directory)
    where = "cached" if cached else "measured now"
    return Peak(flops, f"CPU {str(dtype).removeprefix('torch.')} matmul peak, {torch.get_num_threads()} threads "
                       f"({where}, {cache_dir() if directory is None else directory})")


def memory_gib(device: torch.device) -> float:
    """CUDA: peak allocated since the last call; CPU: the process's resident set."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    with contextlib.suppress(OSError, ValueError):
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def config_accounting(cfg, *, seq_len: int | None = None, batch: int | None = None, kv_bytes: int = 2) -> dict:
    """`moetron.launcher.perf.flops.accounting` for a whole job config: the model at the run's sequence
    length and batch, with the memory estimate for its parallel layout and precision."""
    par, t = cfg.parallel, cfg.train
    seq_len, batch = seq_len or t.seq_len, batch or t.batch_size
    micro = max(batch // (par.dp * t.grad_accum * (par.microbatches if par.pp > 1 else 1)), 1)
    memory = memory_per_rank(cfg.model, par, seq_len=seq_len, micro_batch=micro,
                             activation_checkpoint=t.activation_checkpoint,
                             activation_bytes=4 if t.precision == "fp32" else 2)
    out = accounting(cfg.model, seq_len=seq_len, batch=batch, kv_bytes_per_element=kv_bytes, memory=memory.to_dict())
    out["layout"] = {"pp": par.pp, "tp": par.tp, "cp": par.cp, "ep": par.ep, "etp": par.etp, "dp": par.dp,
                     "dp_mode": par.dp_mode, "dp_shard": par.shard_group}
    return out


class MfuMeter:
    """Turns the trainer's log windows into throughput and MFU figures.

        meter = MfuMeter(cfg.model, seq_len, peak, device=device, world_size=world_size)
        with meter.step(model, tokens):      # counts the FLOPs of the first step
            result = train_step(...)
        record.update(meter.window(window_tokens, elapsed))

    The counted step runs slower (every op goes through Python), so its time and tokens are left
    out of the window it falls in.
    """

    def __init__(self, model_cfg: ModelConfig, seq_len: int, peak: Peak, *, device: torch.device | None = None,
                 world_size: int = 1, warn: Callable[[str], None] = print):
        self.analytic_per_token = float(flops_per_token(model_cfg, seq_len))
        self.peak, self.device, self.world_size, self.warn = peak, device, world_size, warn
        self.counted_per_token: float | None = None
        self._skip_tokens, self._skip_seconds = 0, 0.0
        self._counted = False

    @contextlib.contextmanager
    def step(self, model: torch.nn.Module, tokens: int):
        """Wrap one training step of `tokens` tokens (all ranks); the first is counted (pipeline
        stages are given their shapes, so it runs the same work as every later step)."""
        if self._counted:
            yield
            return
        self._counted = True
        from moetron.launcher.perf.flop_counter import ComponentFlopCounter

        t0 = time.perf_counter()
        with ComponentFlopCounter(model) as counter:
            yield
        self._skip_seconds += time.perf_counter() - t0
        self._skip_tokens += tokens
        # Each rank counts its own share: its data-parallel slice, its tensor-parallel shards, its
        # pipeline stages (not all equal). Their sum is the step's FLOPs.
        counted = float(counter.total)
        if self.world_size > 1 and torch.distributed.is_initialized():
            total = torch.tensor([counted], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(total)
            counted = float(total.item())
        self.counted_per_token = counted / tokens
        gap = self.counted_per_token / self.analytic_per_token - 1.0
        if abs(gap) > MFU_TOLERANCE:
            self.warn(f"warning: FLOPs counted on a real step ({self.counted_per_token:.4g}/token) differ from "
                      f"the analytic count ({self.analytic_per_token:.4g}/token) by {gap:+.1%}; the measured MFU "
                      f"is the one to trust (capacity drops? an op without a FLOP formula?)")

    def window(self, tokens: int, seconds: float) -> dict[str, float]:
        """Figures for a log window of `tokens` tokens in `seconds` (all ranks together)."""
        tokens, seconds = tokens - self._skip_tokens, seconds - self._skip_seconds
        self._skip_tokens, self._skip_seconds = 0, 0.0
        if tokens <= 0 or seconds <= 0:
            return {}
        tokens_per_s = tokens / seconds
        per_device = tokens_per_s / self.world_size
        out = {
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": per_device * self.analytic_per_token / 1e12,
            "mfu": per_device * self.analytic_per_token / self.peak.flops,
        }
        if self.device is not None:
            out["memory_gib"] = memory_gib(self.device)
        if self.counted_per_token is not None:
            out["tflops_per_device_measured"] = per_device * self.counted_per_token / 1e12
            out["mfu_measured"] = per_device * self.counted_per_token / self.peak.flops
        return out

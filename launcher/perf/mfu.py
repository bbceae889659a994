"""Model FLOP utilization: tokens/s → model TFLOP/s per device → MFU against the device's peak.

Two numerators, side by side:
- analytic: `moetron.launcher.perf.flops.flops_per_token` (6·active params + full-square attention);
- measured: FLOPs counted by `ComponentFlopCounter` on one real training step, per token.
They differ when the run does other work than the accounting assumes (capacity drops, a kernel
that a formula misses); above 5% the run says so.

The denominator is the one peak `moetron plan` uses too (`device_profiles.PEAK_DEFINITION`): on a
GPU the bf16 dense data-sheet peak, `train.peak_tflops` to override it; on CPU the best dense
matmul rate of bf16 and fp32 at the rank's thread count, whatever precision the run trains in.
It is measured once and cached under $XDG_CACHE_HOME/moetron (default ~/.cache/moetron), keyed
by CPU model, thread count, dtype and torch version; `moetron plan --calibrate` measures it again
for one-thread ranks and stores it there, beside the planner's profile.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moetron.launcher.perf.device_profiles import GPU_BF16_DENSE_TFLOPS
from moetron.launcher.perf.display import gflops_by_dtype
from moetron.launcher.perf.flops import accounting, flops_per_token, human
from moetron.launcher.perf.memory import memory_per_rank
from moetron.model.config import ModelConfig

# Measured MFU may differ from the analytic one by this much before the run warns.
MFU_TOLERANCE = 0.05
# Shapes (M, K, N) timed for the CPU peak: square, and a token-batch × d_model × d_ff projection.
CPU_PEAK_SHAPES = ((2048, 2048, 2048), (4096, 256, 1024), (4096, 1024, 4096))
# Larger shapes are skipped once one product would take longer than this at the rate seen so far.
MAX_SECONDS_PER_MATMUL = 1.0
# The training precisions whose fastest matmul is a CPU's peak: bf16 where the CPU runs it natively
# (AVX512-BF16, AMX), fp32 where bf16 is emulated (~1 GFLOP/s) and would put MFU above 100%.
PEAK_DTYPES = (torch.bfloat16, torch.float32)


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


def _peak_key(dtype, threads: int) -> str:
    return f"{_cpu_name()} | {threads} threads | {dtype} | torch {torch.__version__}"


def _peak_file(directory: Path | None) -> Path:
    return (directory or cache_dir()) / "cpu_matmul_peak.json"


def _read_peaks(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return {}


def store_cpu_matmul_peak(peaks: dict, *, threads: int, directory: Path | None = None) -> Path:
    """Write {dtype (or its str): FLOP/s} for `threads` threads into the cache cpu_matmul_peak reads,
    replacing what was there for them (`moetron plan --calibrate` measured them again)."""
    path = _peak_file(directory)
    cached = _read_peaks(path)
    cached.update({_peak_key(dtype, threads): float(flops) for dtype, flops in peaks.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cached, indent=1))
    tmp.replace(path)
    return path


def cpu_matmul_peak(dtype: torch.dtype, *, directory: Path | None = None,
                    measure: Callable[..., float] = time_matmul) -> tuple[float, bool]:
    """(FLOP/s, came from the cache): the best of CPU_PEAK_SHAPES at the current thread count,
    measured on first use and cached. Other load on the machine lowers it (and so raises MFU);
    `moetron plan --calibrate` measures it again (one thread), or delete the cache file."""
    threads = torch.get_num_threads()
    cached = _read_peaks(_peak_file(directory))
    if _peak_key(dtype, threads) in cached:
        return float(cached[_peak_key(dtype, threads)]), True
    peak = max(sweep_matmul_peak(dtype, measure).values())
    store_cpu_matmul_peak({dtype: peak}, threads=threads, directory=directory)
    return peak, False


def sweep_matmul_peak(dtype: torch.dtype, measure: Callable[..., float] = time_matmul) -> dict[tuple, float]:
    """{(m, k, n): FLOP/s} of CPU_PEAK_SHAPES, smallest first, skipping those one product of which
    would take over MAX_SECONDS_PER_MATMUL at the best rate seen so far."""
    rates: dict[tuple, float] = {}
    for m, k, n in sorted(CPU_PEAK_SHAPES, key=lambda shape: math.prod(shape)):
        if rates and 2.0 * m * k * n / max(rates.values()) > MAX_SECONDS_PER_MATMUL:
            break  # a slow dtype: larger shapes would take minutes and change nothing
        rates[(m, k, n)] = measure(m, k, n, dtype)
    return rates


def cpu_peak(*, directory: Path | None = None, measure: Callable[..., float] = time_matmul) -> Peak:
    """This CPU's peak by PEAK_DEFINITION at the current thread count: the faster of PEAK_DTYPES."""
    rates = {dtype: cpu_matmul_peak(dtype, directory=directory, measure=measure) for dtype in PEAK_DTYPES}
    best = max(rates, key=lambda dtype: rates[dtype][0])
    each = gflops_by_dtype({str(d): flops for d, (flops, _) in rates.items()})
    where = "cached" if all(cached for _, cached in rates.values()) else "measured now"
    return Peak(rates[best][0], f"CPU dense matmul at {torch.get_num_threads()} threads, the faster of "
                                f"{each} ({where}, {_peak_file(directory)})")


def gpu_peak(device_name: str) -> Peak:
    """A GPU's peak by PEAK_DEFINITION: its data sheet's bf16 dense FLOP/s."""
    tflops = gpu_peak_tflops(device_name)
    if tflops is None:
        raise ValueError(f"no bf16 peak known for {device_name!r}; set train.peak_tflops")
    return Peak(tflops * 1e12, f"{device_name} bf16 dense peak (data sheet)")


def device_peak(device: torch.device, bf16: bool, override_tflops: float = 0.0, *,
                directory: Path | None = None) -> Peak:
    """The peak MFU is measured against (PEAK_DEFINITION): the override, the GPU's data sheet, or
    this CPU's measured one. The same whatever the run's precision (`bf16` is not consulted): MFU
    compares runs, and precisions, against one figure of the device."""
    if override_tflops > 0:
        return Peak(override_tflops * 1e12, f"train.peak_tflops = {override_tflops:g}")
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device))
    return cpu_peak(directory=directory)


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
    chunks = t.grad_accum * par.pipeline_chunks
    micro = max(batch // (par.dp * chunks), 1)
    memory = memory_per_rank(cfg.model, par, seq_len=seq_len, micro_batch=micro,
                             activation_checkpoint=t.activation_checkpoint,
                             activation_bytes=4 if t.precision == "fp32" else 2, chunks=chunks)
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
            self.warn(f"warning: FLOPs counted on a real step ({human(self.counted_per_token, 'FLOP')}/token) differ "
                      f"from the analytic count ({human(self.analytic_per_token, 'FLOP')}/token) by {gap:+.1%}; the measured MFU "
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

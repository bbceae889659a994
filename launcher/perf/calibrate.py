"""`moetron plan --calibrate`: measure this machine as a `DeviceProfile` named "cpu" and cache it.

The peak (the MFU denominator, `device_profiles.PEAK_DEFINITION`) is timed by rank 0 alone, with
one thread, as the best dense matmul rate of bf16 and fp32 over `mfu.CPU_PEAK_SHAPES`: the figure a
one-thread training rank measures its MFU against, and it is stored in the same cache entry, so
`moetron plan --gpu cpu` and `moetron train` report MFU against one number.

Everything else is timed with `ranks` processes (gloo, one thread each, as `torchrun` starts them)
running at once, so every number is what one rank gets while the others work too (rates averaged
over the ranks; a collective's time is its slowest rank's):
  matmul_efficiency  the fp32 rate at a small model's shapes (tokens × d_model × d_ff) over the peak;
  hbm_bw             the rate of copying a 64 MiB tensor (read + write bytes per second);
  intra_bw, latency  an all_reduce of 4 KiB and of 16 MiB over all ranks: the small one's time is
                     the latency, the large one's bus bytes (2(n−1)/n × size) over its time minus
                     that latency the bus bandwidth (inter-node: the same, one host has no other);
  kind_bw            the same for a 16 MiB all_gather, reduce_scatter, all_to_all (bus bytes
                     (n−1)/n × size) and broadcast (bus bytes = size), each over all_reduce's:
                     gloo's kinds differ by 2× either way;
  block_overhead     one forward + backward of a one-block model of width 32 on 8 tokens, whose
                     FLOPs are negligible: the fixed cost of a block's operators in Python/ATen.

Other load on the machine slows every number, by 4× and more on a shared 2-core machine, and a
profile measured then would choose other layouts. So the whole measurement runs REPEATS times, each
short (together about as long as one long run), every number is the best of its repeats (highest
rate, lowest time), and the spread of each (min, median, max) is printed. When the compute numbers,
which set most of a step's predicted time, spread by more than MAX_SPREAD (max over min), the
machine was busy: nothing is stored, and the refusal says so.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetron.launcher.config import ConfigError
from moetron.launcher.perf.device_profiles import PEAK_DEFINITION, DeviceProfile, profile_cache, save_profile
from moetron.launcher.perf.display import gflops_by_dtype, significant
from moetron.launcher.perf.mfu import PEAK_DTYPES, store_cpu_matmul_peak, sweep_matmul_peak, time_matmul

SMALL_BYTES, LARGE_BYTES = 4096, 16 * 2**20
CALIBRATED_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "broadcast")  # the order _worker measures them in
REPEATS = 5
# Seconds each matmul is timed for in one repeat (one long measurement took 0.25 s per shape): the
# peak's best call, and the rate at model shapes, several calls sustained while every rank works.
MATMUL_SECONDS = 0.05
SUSTAINED_SECONDS = 0.1
# Refused when a gated number's slowest repeat is more than this far from its fastest (max/min).
MAX_SPREAD = 1.5
# The numbers behind a step's compute time, which must agree for two calibrations to choose alike.
# The collectives' spread is shown, not gated: a busy machine shows in these too.
GATED = ("peak", "matmul_rate", "block_overhead")
# name → (higher is better, unit scale, unit, label) for the console; kind_* follow the same rule as bus.
QUANTITIES = {
    "peak": (True, 1e9, "GFLOP/s", "peak matmul, rank alone"),
    "matmul_rate": (True, 1e9, "GFLOP/s", "matmul at model shapes"),
    "block_overhead": (False, 1e-3, "ms", "block overhead"),
    "hbm_bw": (True, 1e9, "GB/s", "memory copy"),
    "latency": (False, 1e-3, "ms", "all_reduce latency"),
    "bus": (True, 1e9, "GB/s", "all_reduce bus bandwidth"),
    **{f"kind_{k}": (True, 1e9, "GB/s", f"{k} bus bandwidth") for k in CALIBRATED_KINDS},
}


class NoisyCalibration(ConfigError):
    """The repeats disagree: the machine was busy, and a profile measured now would mislead the planner.
    A user error in the CLI's sense: one line, exit status 2, and the fix is to rerun on a quiet machine."""


@dataclass(frozen=True)
class Measurement:
    """What the calibration measured. `samples`: one {quantity: value} per repeat (QUANTITIES' names);
    `dtype_peaks`: the best matmul FLOP/s of one rank alone in each of PEAK_DTYPES (by str(dtype))."""

    samples: list[dict[str, float]]
    dtype_peaks: dict[str, float]


def timed_median(fn, repeats: int, warm: bool = True) -> float:
    """Median seconds of `fn` over `repeats` calls (after one warm-up call when `warm`), all ranks in step."""
    if warm:
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def block_step(device: torch.device | None = None) -> Callable[[], None]:
    """One forward + backward of a one-block model of width 32 on 8 tokens, on `device`: its FLOPs
    are negligible, its time the fixed cost of a block's operators (Python, ATen, kernel launches)."""
    from moetron.model.config import ModelConfig
    from moetron.model.transformer import build_model

    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, d_ff=64, max_seq_len=16,
                                    attention="sdpa"), device=device or "cpu")
    ids = torch.randint(0, 64, (1, 8), device=device or "cpu")
    return lambda: model(ids).logits_BSV.sum().backward()


def _peak_alone(best: dict[tuple, float]) -> float:
    """The peak of this repeat on rank 0 (the others wait at a barrier): the first repeat sweeps every
    dtype and shape as training's peak does into `best` {(dtype, m, k, n): FLOP/s}, later ones time
    only the fastest of them, which is all the peak depends on."""
    if not best:
        for dtype in PEAK_DTYPES:
            rates = sweep_matmul_peak(dtype, functools.partial(time_matmul, seconds=MATMUL_SECONDS))
            best.update({(dtype, *shape): rate for shape, rate in rates.items()})
        return max(best.values())
    key = max(best, key=best.get)
    rate = time_matmul(*key[1:], key[0], seconds=MATMUL_SECONDS)
    best[key] = max(best[key], rate)
    return rate


def _sustained_matmul(m: int, k: int, n: int, seconds: float) -> float:
    """FLOP/s of back-to-back fp32 (m×k)·(k×n) products over about `seconds`, after two warm-up calls.
    All of them, not the best one: with more ranks than cores a rank's rate is its share of a core,
    and the best single call only tells which one the scheduler happened to leave alone."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    a @ b
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        a @ b
        calls += 1
    return 2.0 * m * k * n * calls / elapsed


def _concurrent(ranks: int, first: bool, tensors: dict, block_step) -> tuple[dict, dict]:
    """One repeat of what every rank times at once: ({rates and local times, to average over ranks},
    {collectives' seconds, whose slowest rank is the collective's time})."""
    reps = 3 if first else 1  # later repeats add samples of their own: the best of all is kept
    big, small_t, large_t, shard_t, out_t = (tensors[k] for k in ("big", "small", "large", "shard", "out"))
    local = {"matmul_rate": _sustained_matmul(4096, 256, 1024, SUSTAINED_SECONDS),
             "block_overhead": timed_median(block_step, 8, first),
             "hbm_bw": 2 * big.nbytes / timed_median(lambda: big.clone(), reps, first)}
    # torch 2.13 renamed the tensor forms *_single; older releases have only the old names.
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    collectives = {"latency": (lambda: dist.all_reduce(small_t), 10),
                   "all_reduce": (lambda: dist.all_reduce(large_t), reps),
                   "all_gather": (lambda: gather(large_t, shard_t), reps),
                   "reduce_scatter": (lambda: scatter(shard_t, large_t), reps),
                   "all_to_all": (lambda: dist.all_to_all_single(out_t, large_t), reps),
                   "broadcast": (lambda: dist.broadcast(large_t, src=0), reps)}
    return local, {name: timed_median(fn, n, first) for name, (fn, n) in collectives.items()}


def _bandwidths(seconds: dict[str, float], ranks: int) -> dict[str, float]:
    """Latency, all_reduce's bus bandwidth and each kind's, from the collectives' times."""
    latency = seconds["latency"]
    # Bus bytes per byte of the 16 MiB: all_reduce 2(n − 1)/n, broadcast 1, the others (n − 1)/n.
    wire = {"all_reduce": 2 * (ranks - 1) / ranks, "broadcast": 1.0}
    out = {"latency": latency}
    for name in ("all_reduce", *CALIBRATED_KINDS):
        bw = wire.get(name, (ranks - 1) / ranks) * LARGE_BYTES / max(seconds[name] - latency, 1e-9)
        out["bus" if name == "all_reduce" else f"kind_{name}"] = bw
    return out


def _worker(rank: int, ranks: int, repeats: int, store_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, ranks), rank=rank, world_size=ranks)
    try:
        tensors = {"big": torch.empty(16 * 2**20), "small": torch.zeros(SMALL_BYTES // 4),
                   "large": torch.zeros(LARGE_BYTES // 4), "shard": torch.zeros(LARGE_BYTES // 4 // ranks),
                   "out": torch.zeros(LARGE_BYTES // 4)}
        step, best, samples = block_step(), {}, []
        for r in range(repeats):
            dist.barrier()
            peak = _peak_alone(best) if rank == 0 else 0.0
            dist.barrier()
            local, seconds = _concurrent(ranks, r == 0, tensors, step)
            mean = torch.tensor(list(local.values()), dtype=torch.float64)
            slowest = torch.tensor(list(seconds.values()), dtype=torch.float64)
            dist.all_reduce(mean)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            samples.append({"peak": peak, **dict(zip(local, (mean / ranks).tolist())),
                            **_bandwidths(dict(zip(seconds, slowest.tolist())), ranks)})
        if rank == 0:
            dtype_peaks = {str(d): max(v for key, v in best.items() if key[0] == d) for d in PEAK_DTYPES}
            torch.save({"samples": samples, "dtype_peaks": dtype_peaks}, out_path)
    finally:
        dist.destroy_process_group()


def measure_spawned(ranks: int, repeats: int) -> Measurement:
    """The real measurement: `ranks` spawned gloo processes, `repeats` times."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "values.pt")
        mp.start_processes(_worker, args=(ranks, repeats, store, out), nprocs=ranks, start_method="spawn")
        result = torch.load(out)
    return Measurement(result["samples"], result["dtype_peaks"])


def summarize(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """{quantity: {best, min, median, max, spread}}; best is the highest rate or the lowest time, and
    spread is max / min (1.0 = every repeat agreed)."""
    out = {}
    for name, (higher, *_) in QUANTITIES.items():
        values = [s[name] for s in samples]
        low, high = min(values), max(values)
        out[name] = {"best": high if higher else low, "min": low, "median": statistics.median(values), "max": high,
                     "spread": high / low if low > 0 else float("inf")}
    return out


def spread_table(stats: dict[str, dict[str, float]], max_spread: float = MAX_SPREAD) -> list[str]:
    """Console lines: each quantity's best, min, median and max in its unit, and the spread."""
    labels = {name: f"{label}, {unit}" for name, (_, _, unit, label) in QUANTITIES.items()}
    width = max(map(len, labels.values()))
    lines = [f"  {'':<{width}} {'best':>8} {'min':>8} {'median':>8} {'max':>8}  spread (max/min)"]
    for name, (_, scale, _, _) in QUANTITIES.items():
        s = stats[name]
        cells = " ".join(f"{significant(s[k] / scale):>8}" for k in ("best", "min", "median", "max"))
        gated = f", at most {max_spread:g}" if name in GATED else ""
        lines.append(f"  {labels[name]:<{width}} {cells}  {s['spread']:.2f}{gated}")
    return lines


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def calibrate(*, ranks: int = 4, path: Path | None = None, repeats: int = REPEATS, max_spread: float = MAX_SPREAD,
              measure: Callable[[int, int], Measurement] = measure_spawned,
              console: Callable[[str], None] = to_stderr) -> tuple[DeviceProfile, Path]:
    """Measure with `ranks` concurrent processes, `repeats` times; write and return the "cpu" profile
    (and the MFU peak training reads, beside it). Raises NoisyCalibration, storing nothing, when a
    GATED number's repeats spread by more than `max_spread`. Progress and the spread go to `console`
    (stderr by default: stdout may be --json)."""
    path = Path(path) if path is not None else profile_cache()
    console(f"calibrating the cpu profile: {repeats} repeats, {ranks} gloo ranks on {os.cpu_count()} cores")
    began = time.perf_counter()
    result = measure(ranks, repeats)
    stats = summarize(result.samples)
    console(f"measured in {time.perf_counter() - began:.1f} s; each number is the best of its repeats:")
    for line in spread_table(stats, max_spread):
        console(line)
    noisy = [name for name in GATED if stats[name]["spread"] > max_spread]
    if noisy:
        raise NoisyCalibration(_refusal(noisy, stats, repeats, max_spread))
    profile = _profile(stats, result.dtype_peaks, ranks, repeats)
    stored = save_profile(profile, path)
    peaks_file = store_cpu_matmul_peak(result.dtype_peaks, threads=1, directory=path.parent)
    console(f"stored the cpu profile in {stored}, and its MFU peak ({significant(profile.peak_flops / 1e9)} GFLOP/s "
            f"per one-thread rank) in {peaks_file}")
    return profile, stored


def _refusal(noisy: list[str], stats: dict, repeats: int, max_spread: float) -> str:
    parts = []
    for name in noisy:
        _, scale, unit, label = QUANTITIES[name]
        s = stats[name]
        parts.append(f"{label} ranged {significant(s['min'] / scale)}-{significant(s['max'] / scale)} {unit} "
                     f"(max/min {s['spread']:.2f}, more than {max_spread:g})")
    return (f"calibration refused, nothing stored: over {repeats} repeats the {'; the '.join(parts)}. Something "
            "else was using the CPU; rerun `moetron plan --calibrate` on a quiet machine")


def _profile(stats: dict, dtype_peaks: dict[str, float], ranks: int, repeats: int) -> DeviceProfile:
    best = {name: s["best"] for name, s in stats.items()}
    # The stored peak is the best of every dtype and repeat: exactly what training reads back.
    peak = max(dtype_peaks.values())
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    source = (f"measured by moetron plan --calibrate, best of {repeats} repeats, with {ranks} gloo ranks "
              f"on {os.cpu_count()} cores")
    return DeviceProfile(
        "cpu", peak_flops=peak, memory_bytes=pages / ranks, matmul_efficiency=min(best["matmul_rate"] / peak, 1.0),
        intra_bw=best["bus"], intra_latency=best["latency"], inter_bw=best["bus"], inter_latency=best["latency"],
        hbm_bw=best["hbm_bw"], dp_overlap=0.0, block_overhead=best["block_overhead"],
        kind_bw={k: best[f"kind_{k}"] / best["bus"] for k in CALIBRATED_KINDS},
        oversubscription=max(ranks / len(os.sched_getaffinity(0)), 1.0),
        sources={"all": source, "peak_flops": f"{PEAK_DEFINITION}: {_dtype_note(dtype_peaks)}",
                 "memory_bytes": "physical memory / ranks",
                 "dp_overlap": "gloo collectives block the compute on CPU"})


def _dtype_note(dtype_peaks: dict[str, float]) -> str:
    return gflops_by_dtype(dtype_peaks) + " for one rank alone with one thread"

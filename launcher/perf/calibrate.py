"""`moetron plan --calibrate`: measure this machine as a `DeviceProfile` named "cpu" and cache it.

`ranks` processes (gloo, one thread each, as `torchrun` starts them) run at once, so every number
is what one rank gets while the others work too:
  peak_flops         the best fp32 matmul rate of one rank over large square products;
  matmul_efficiency  the rate at a small model's shapes (tokens × d_model × d_ff) over that peak;
  hbm_bw             the rate of copying a 64 MiB tensor (read + write bytes per second);
  intra_bw, latency  an all_reduce of 4 KiB and of 16 MiB over all ranks: the small one's time is
                     the latency, the large one's bus bytes (2(n−1)/n × size) over its time minus
                     that latency the bus bandwidth (inter-node: the same, one host has no other);
  kind_bw            the same for a 16 MiB all_gather, reduce_scatter, all_to_all (bus bytes
                     (n−1)/n × size) and broadcast (bus bytes = size), each over all_reduce's:
                     gloo's kinds differ by 2× either way;
  block_overhead     one forward + backward of a one-block model of width 32 on 8 tokens, whose
                     FLOPs are negligible: the fixed cost of a block's operators in Python/ATen.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetron.launcher.perf.device_profiles import DeviceProfile, save_profile
from moetron.launcher.perf.mfu import time_matmul

SMALL_BYTES, LARGE_BYTES = 4096, 16 * 2**20
CALIBRATED_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "broadcast")  # the order _worker measures them in


def _timed(fn, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` calls after one warm-up, all ranks in step."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _block_overhead() -> float:
    from moetron.model.config import ModelConfig
    from moetron.model.transformer import build_model

    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, d_ff=64, max_seq_len=16,
                                    attention="sdpa"))
    ids = torch.randint(0, 64, (1, 8))

    def step():
        model(ids).logits_BSV.sum().backward()

    return _timed(step, 20)


def _worker(rank: int, ranks: int, store_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, ranks), rank=rank, world_size=ranks)
    try:
        dist.barrier()
        peak = max(time_matmul(n, n, n, torch.float32) for n in (512, 1024))
        small = time_matmul(4096, 256, 1024, torch.float32)
        big = torch.empty(16 * 2**20)
        copy_s = _timed(lambda: big.clone(), 5)
        small_t, large_t = torch.zeros(SMALL_BYTES // 4), torch.zeros(LARGE_BYTES // 4)
        latency = _timed(lambda: dist.all_reduce(small_t), 20)
        large_s = _timed(lambda: dist.all_reduce(large_t), 5)
        bus = 2 * (ranks - 1) / ranks * LARGE_BYTES / max(large_s - latency, 1e-9)
        shard_t, out_t = torch.zeros(LARGE_BYTES // 4 // ranks), torch.zeros(LARGE_BYTES // 4)
        # torch 2.13 renamed the tensor forms *_single; older releases have only the old names.
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        kinds = {"all_gather": lambda: gather(large_t, shard_t),
                 "reduce_scatter": lambda: scatter(shard_t, large_t),
                 "all_to_all": lambda: dist.all_to_all_single(out_t, large_t),
                 "broadcast": lambda: dist.broadcast(large_t, src=0)}
        wire = {"broadcast": 1.0}  # bus bytes per byte of size; the others (n − 1)/n
        kind_bus = [wire.get(k, (ranks - 1) / ranks) * LARGE_BYTES / max(_timed(kinds[k], 5) - latency, 1e-9) / bus
                    for k in CALIBRATED_KINDS]
        overhead = _block_overhead()
        values = torch.tensor([peak, small, 2 * big.nbytes / copy_s, latency, bus, overhead, *kind_bus],
                              dtype=torch.float64)
        dist.all_reduce(values)
        if rank == 0:
            torch.save(values / ranks, out_path)
    finally:
        dist.destroy_process_group()


def calibrate(*, ranks: int = 4, path: Path | None = None) -> tuple[DeviceProfile, Path]:
    """Measure with `ranks` concurrent processes; write and return the "cpu" profile."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "values.pt")
        mp.start_processes(_worker, args=(ranks, store, out), nprocs=ranks, start_method="spawn")
        peak, small, mem_bw, latency, bus, overhead, *kind_bus = torch.load(out).tolist()
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    source = f"measured by moetron plan --calibrate with {ranks} gloo ranks on {os.cpu_count()} cores"
    profile = DeviceProfile(
        "cpu", peak_flops=peak, memory_bytes=pages / ranks, matmul_efficiency=min(small / peak, 1.0),
        intra_bw=bus, intra_latency=latency, inter_bw=bus, inter_latency=latency, hbm_bw=mem_bw,
        dp_overlap=0.0, block_overhead=overhead, kind_bw=dict(zip(CALIBRATED_KINDS, kind_bus)),
        oversubscription=max(ranks / len(os.sched_getaffinity(0)), 1.0),
        sources={"all": source, "memory_bytes": "physical memory / ranks",
                 "dp_overlap": "gloo collectives block the compute on CPU"})
    return profile, save_profile(profile, path)

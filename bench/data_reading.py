"""Reading time and host memory per rank of the training sampler, before and after ranks read
only their part of the global batch.

    python bench/data_reading.py                         # 512 x 4096 tokens, dp 1 2 4, ~20-40 s
    python bench/data_reading.py --dp 1 8 --steps 5 --cp 2

A synthetic uint16 token shard (the format `moetron data prepare` writes, memory-mapped as the
trainer maps it) holds steps + 1 global batches, so every step reads windows not read before. Each
rank runs in its own forked process (ranks one after another: the numbers are one rank's, not a
contended machine's) and times `steps` batches of the sampler, as the trainer takes them:
  global   the whole global batch read on every rank, its dp slice kept (the trainer before)
  local    only this rank's rows (and, with --cp, its two context-parallel chunks) read
Per rank: milliseconds per step (the median), tokens gathered per step, the batch it keeps (what
goes to the device each step), the peak of the arrays one step allocates (tracemalloc, one more
step), and its peak RSS above what it held before reading (that also counts the shard's pages
mapped while reading: page cache, shared between the ranks of a host). The largest rank is shown.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=512, help="global batch, sequences (default 512)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per rank (default 8)")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="data-parallel sizes (default 1 2 4)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size of every layout (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    return p.parse_args(argv)


def write_shard(folder: Path, tokens: int) -> Path:
    path = folder / "bench.train-00000.bin"
    (np.arange(tokens, dtype=np.uint32) % 50_000).astype("<u2").tofile(path)
    return path


def vm_rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def rank_part(batch: int, seq_len: int, dp: int, cp: int, rank: int) -> tuple[slice, list | None]:
    """Rows and spans of one rank, cut as `ParallelModel.batch_rows` / `window_spans` cut them
    (rank = dp_rank * cp + cp_rank; dp divides the batch)."""
    dp_rank, cp_rank = divmod(rank, cp)
    rows = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)
    if cp == 1:
        return rows, None
    C = seq_len // (2 * cp)
    return rows, [(c * C, (c + 1) * C + 1) for c in (cp_rank, 2 * cp - 1 - cp_rank)]


def take_batch(sampler, args, rows: slice, spans: list | None, mode: str):
    """One step's batch for this rank, as the trainer takes it in `mode`."""
    import torch

    if mode == "local":
        return sampler.next_batch(args.batch, rows, spans)
    # The trainer before: the whole batch stacked on every rank, then this rank's part of it.
    whole = np.stack([sampler.window(w) for w in sampler.next_windows(args.batch)])
    return torch.from_numpy(whole[rows] if spans is None else np.stack([whole[rows, a:b] for a, b in spans], 1))


def run_rank(shard: str, args, dp: int, rank: int, mode: str, out) -> None:
    """One rank in a forked process: `steps` timed batches (the median is kept: the machine may be
    shared), then one more under tracemalloc for the peak of the arrays a step allocates (numpy
    reports its buffers to it) → a dict on `out`."""
    import tracemalloc

    from moetron.launcher.data.corpus import WindowSampler

    start_kib = vm_rss_kib()
    sampler = WindowSampler([np.memmap(shard, dtype="<u2", mode="r")], args.seq_len, seed=0)
    rows, spans = rank_part(args.batch, args.seq_len, dp, args.cp, rank)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        part = take_batch(sampler, args, rows, spans, mode)
        times.append(time.perf_counter() - t0)
    tokens_per_step = sampler.tokens_read // args.steps
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del part  # as in the trainer, where a step's batch is gone before the next is read
    tracemalloc.start()
    part = take_batch(sampler, args, rows, spans, mode)
    alloc_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    out.put({"ms_per_step": 1e3 * statistics.median(times), "tokens_per_step": tokens_per_step,
             "batch_mib": part.nbytes / 2**20, "alloc_peak_mib": alloc_peak / 2**20,
             "rss_peak_mib": (peak_kib - start_kib) / 1024})


def measure(shard: str, args, dp: int, mode: str) -> dict:
    """The largest rank's numbers, over the dp × cp ranks run one after another."""
    ctx = multiprocessing.get_context("fork")
    rows = []
    for rank in range(dp * args.cp):
        out = ctx.Queue()
        proc = ctx.Process(target=run_rank, args=(shard, args, dp, rank, mode, out))
        proc.start()
        rows.append(out.get(timeout=300))
        proc.join()
    return {"dp": dp, "cp": args.cp, "mode": mode, "ranks": len(rows),
            **{k: max(r[k] for r in rows) for k in rows[0]}}


def print_table(results: list[dict], args) -> None:
    print(f"global batch {args.batch} x {args.seq_len} tokens, {args.steps} steps per rank, cp {args.cp}")
    print(f"{'dp':>3} {'mode':>7} {'ms/step':>9} {'tokens/step':>12} {'batch MiB':>10} {'alloc peak MiB':>15} "
          f"{'RSS peak MiB':>13}")
    for r in results:
        print(f"{r['dp']:>3} {r['mode']:>7} {r['ms_per_step']:>9.1f} {r['tokens_per_step']:>12,} "
              f"{r['batch_mib']:>10.1f} {r['alloc_peak_mib']:>15.1f} {r['rss_peak_mib']:>13.1f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if any(args.batch % dp for dp in args.dp) or args.seq_len % (2 * args.cp):
        print(f"data_reading: --batch {args.batch} must be divisible by every --dp {args.dp} and --seq-len "
              f"{args.seq_len} by 2 x --cp ({2 * args.cp})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        shard = str(write_shard(Path(tmp), (args.steps + 1) * args.batch * args.seq_len + 1))
        results = [measure(shard, args, dp, mode) for dp in args.dp for mode in ("global", "local")]
    if args.json:
        print(json.dumps({"batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "results": results}))
    else:
        print_table(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

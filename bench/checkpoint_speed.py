"""How long a checkpoint blocks training, sync vs async, and how fast it writes; side by side.

One process trains a model (tiny.yaml, widened by --d-model) with AdamW and saves a sharded
checkpoint every --every steps, once with `train.checkpoint.async=false` and once with `true`.
For each save it records
  blocked   seconds the training loop spent inside save() / poll() / wait() for it
            (sync: the whole write; async: staging the copy, then the commit once done)
  latency   seconds from save() to the checkpoint being published (renamed, `latest` moved)
  MB/s      checkpoint bytes (model + optimizer + manifest-listed files) / latency; for async
            the latency is only known at the next poll, so it rounds up to whole steps
and the mean step time of the steps that overlapped a write. Prints a table and one JSON line.

    python bench/checkpoint_speed.py                       # d_model 256, 4 layers, 3 saves per mode
    python bench/checkpoint_speed.py --d-model 512 --saves 2 --dir /scratch/ckpt-bench
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moetron.launcher.checkpoint.io import read_manifest
from moetron.launcher.checkpoint.store import Checkpointer
from moetron.launcher.config import load_config
from moetron.model.transformer import build_model

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def run_mode(async_save: bool, args, root: Path) -> dict:
    cfg = load_config(TINY, [f"model.d_model={args.d_model}", f"model.n_layers={args.layers}",
                             f"model.d_ff={4 * args.d_model}", f"model.moe.d_expert={2 * args.d_model}",
                             f"model.n_heads={max(args.d_model // 64, 1)}", f"model.n_kv_heads={max(args.d_model // 64, 1)}"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq_len + 1))
    ckpt = Checkpointer(root, keep=2, async_save=async_save)

    def step() -> None:
        out = model(tokens[:, :-1])
        loss = F.cross_entropy(out.logits_BSV.flatten(0, 1), tokens[:, 1:].flatten()) + out.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up, and the optimizer state exists before the first save
        step()
    saves, overlapped_steps, plain_steps = [], [], []
    current = None
    for i in range(args.saves * args.every):
        t0 = time.perf_counter()
        step()
        dt = time.perf_counter() - t0
        (overlapped_steps if current is not None else plain_steps).append(dt)
        t0 = time.perf_counter()
        done = ckpt.poll()
        if current is not None:
            current["blocked"] += time.perf_counter() - t0
            if done is not None:
                current.update(latency=time.perf_counter() - current.pop("start"), path=done)
                saves.append(current)
                current = None
        if (i + 1) % args.every == 0:
            if current is not None:  # still in flight: save() waits for it, which counts as blocking
                t0 = time.perf_counter()
                done = ckpt.wait()
                current["blocked"] += time.perf_counter() - t0
                current.update(latency=time.perf_counter() - current.pop("start"), path=done)
                saves.append(current)
            start = time.perf_counter()
            done = ckpt.save(i, model, opt, {"step": i})
            current = {"blocked": time.perf_counter() - start, "start": start}
            if done is not None:
                current.update(latency=time.perf_counter() - current.pop("start"), path=done)
                saves.append(current)
                current = None
    if current is not None:
        t0 = time.perf_counter()
        done = ckpt.wait()
        current["blocked"] += time.perf_counter() - t0
        current.update(latency=time.perf_counter() - current.pop("start"), path=done)
        saves.append(current)
    size = sum(f["size"] for f in read_manifest(saves[-1]["path"]).values())
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"mode": "async" if async_save else "sync", "saves": len(saves), "bytes": size,
            "blocked_s": mean([s["blocked"] for s in saves]), "latency_s": mean([s["latency"] for s in saves]),
            "write_MBps": size / 1e6 / mean([s["latency"] for s in saves]),
            "step_s": mean(plain_steps), "step_during_write_s": mean(overlapped_steps)}


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--every", type=int, default=4, help="steps between saves")
    p.add_argument("--saves", type=int, default=3, help="saves per mode")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = p.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="moetron-ckpt-bench-"))
    rows = []
    try:
        for async_save in (False, True):
            rows.append(run_mode(async_save, args, base / ("async" if async_save else "sync")))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    sync, asy = rows
    print(f"checkpoint of {sync['bytes'] / 1e6:.1f} MB (model + AdamW state), {sync['saves']} saves per mode, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'mode':<7}{'blocked s':>11}{'latency s':>11}{'MB/s':>9}{'step s':>9}{'step s (writing)':>18}")
    for r in rows:
        print(f"{r['mode']:<7}{r['blocked_s']:>11.3f}{r['latency_s']:>11.3f}{r['write_MBps']:>9.1f}"
              f"{r['step_s']:>9.3f}{_cell(r['step_during_write_s']):>18}")
    print(f"async blocks training {sync['blocked_s'] / asy['blocked_s']:.1f}x less than sync "
          f"(a write that overlaps steps slows them when the cores are shared)")
    print(json.dumps({"bench": "checkpoint", "sync": sync, "async": asy,
                      "blocked_ratio_sync_over_async": sync["blocked_s"] / asy["blocked_s"]}))


if __name__ == "__main__":
    main()

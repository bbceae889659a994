"""Memory per rank of the four data-parallel modes, measured on a real 4-rank run beside the
estimate `moetron flops` prints.

    python bench/dp_memory.py                         # configs/tiny.yaml, DP4 each mode, ~1 min
    python bench/dp_memory.py --config configs/tiny.yaml --modes fsdp zero1

One `torchrun --nproc-per-node 4` launch runs each mode in turn with the trainer's own pieces
(`build_parallel_model`, `build_optimizer`, `train_step`) for two steps of the config (fp32) and
reads, on every rank, the bytes it holds:
  weights    the local tensors of its parameters between steps (FSDP's unsharded copies live
             only inside a block's forward and backward, so they are not counted)
  grads      the local gradients right after backward (before the optimizer and zero_grad)
  optimizer  the AdamW state tensors after the step
The table shows the largest rank; "estimate" is `moetron.launcher.perf.memory.memory_per_rank` for the same
layout. Activations are not measured here (the CPU allocator gives no per-tensor peak).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODES = {"ddp": ["parallel.dp_mode=ddp"], "zero1": ["parallel.dp_mode=zero1"], "fsdp": ["parallel.dp_mode=fsdp"],
         "hsdp": ["parallel.dp_mode=hsdp", "parallel.dp_shard=2"]}
RANKS = 4


def measure(config: str, mode: str) -> dict:
    import torch.distributed as dist
    from gloo_ranks import local_part  # bench/gloo_ranks.py, beside this script

    from moetron.launcher.config import load_config
    from moetron.launcher.perf.mfu import config_accounting
    from moetron.launcher.train.optim import optimizer_for
    from moetron.launcher.train.trainer import build_parallel_model, train_step

    cfg = load_config(config, [*MODES[mode], "train.precision=fp32"], world_size=RANKS)
    t = cfg.train
    torch.manual_seed(t.seed)
    pm = build_parallel_model(cfg, torch.device("cpu"))
    optimizer = optimizer_for(pm, t)
    params = [p for _, p in pm.named_parameters()]
    held: dict[str, int] = {}

    def after_backward():
        held["grads"] = sum(local_part(p.grad).nbytes for p in params if p.grad is not None)

    g = torch.Generator().manual_seed(t.seed)
    for _ in range(2):
        batch = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=g)
        train_step(pm, optimizer, batch, grad_accum=t.grad_accum, grad_clip=t.grad_clip,
                   autocast=contextlib.nullcontext, after_backward=after_backward)
    held["weights"] = sum(local_part(p).nbytes for p in params)
    held["optimizer"] = sum(local_part(v).nbytes for s in optimizer.state.values() for v in s.values()
                            if isinstance(v, torch.Tensor) and v.ndim > 0)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    estimate = config_accounting(cfg)["memory_per_rank"]
    return {"mode": mode, "measured": {k: max(e[k] for e in everyone) for k in held},
            "estimate": {k: estimate[k] for k in ("weights", "grads", "optimizer")}}


def table(results: list[dict]) -> str:
    mib = 2**20
    lines = ["| DP4 mode | weights MiB (est.) | grads MiB (est.) | AdamW state MiB (est.) | total MiB |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        m, e = r["measured"], r["estimate"]
        cells = [f"{m[k] / mib:.1f} ({e[k] / mib:.1f})" for k in ("weights", "grads", "optimizer")]
        lines.append(f"| {r['mode']} | " + " | ".join(cells) + f" | {sum(m.values()) / mib:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        from gloo_ranks import each_on_gloo  # bench/gloo_ranks.py, beside this script

        raise SystemExit(each_on_gloo(lambda mode: measure(args.config, mode), args.modes))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
            __file__, "--worker", "--config", args.config, "--modes", *args.modes]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        sys.exit(f"the {RANKS}-rank launch failed:\n{proc.stderr[-3000:]}")
    print(table(results))
    print(json.dumps(results))


if __name__ == "__main__":
    main()

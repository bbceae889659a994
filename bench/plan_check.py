"""`moetron plan`'s predictions against measured runs: memory per rank, communication bytes and step
time of several layouts of one config on 4 gloo ranks, with the calibrated `cpu` profile.

    python -m moetron plan --calibrate          # once, on a quiet machine
    python bench/plan_check.py                  # ~4 min on 2 cores
    python bench/plan_check.py --layouts dp4_fsdp tp2_ep2 --steps 6

One `torchrun --nproc-per-node 4` launch runs each layout in turn with the trainer's pieces
(`build_parallel_model`, `build_optimizer`, `train_step`): `--warmup` steps (2), then `--steps` timed
steps (median, all ranks in step), one step under bench/comm_volume.py's `CollectiveCounter`
(bytes summed over ranks, nccl-tests' size), and one under an allocator probe:
  memory, measured  bytes of this rank's parameters and optimizer state (counted tensors) plus the
                    rise of glibc's in-use heap (mallinfo2: arena + mmapped blocks) from before the
                    step to its highest point, read after every operator (grads, activations,
                    communication buffers, temporaries); the largest rank is reported.
  memory, predicted `launcher.perf.planner.predict_memory` (weights + grads + optimizer + activations +
                    buffers), under expert parallelism for the routing the probed step had: the
                    busiest ep rank's routes over the mean (`moetron plan --expert-imbalance`).
Then it prints predicted against measured for each layout, the ratio, Kendall's tau between the
predicted and measured order of step times, and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
BASE = ["train.batch_size=16", "train.seq_len=128", "train.precision=fp32", "train.threads=1", "train.peak_tflops=1"]
RANKS = 4
LAYOUTS = {
    "tp2_ep2": ["parallel.dp=2", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"],
    "pp2_dp2_1f1b": ["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2", "parallel.schedule=1f1b"],
    # GPipe keeps the activations of all 4 micro-batches in flight on the first stage, 1F1B of pp = 2.
    "pp2_dp2_gpipe4": ["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=4", "parallel.schedule=gpipe"],
    "pp2_dp2_1f1b4": ["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=4", "parallel.schedule=1f1b"],
    "pp2_dp2_interleaved": ["parallel.pp=2", "parallel.dp=2", "parallel.vpp=2", "parallel.microbatches=2",
                            "parallel.schedule=interleaved_1f1b"],
    "dp4_fsdp": ["parallel.dp=4"],
    "dp4_fsdp_ga4": ["parallel.dp=4", "train.grad_accum=4"],
    "dp4_ddp": ["parallel.dp=4", "parallel.dp_mode=ddp"],
    "dp4_zero1": ["parallel.dp=4", "parallel.dp_mode=zero1"],
    "ep4": ["parallel.dp=4", "parallel.ep=4"],
    "dp4_fsdp_ac": ["parallel.dp=4", "train.activation_checkpoint=full"],
    "dp4_fsdp_sac": ["parallel.dp=4", "train.activation_checkpoint=selective"],
    "tp4": ["parallel.tp=4", "parallel.sequence_parallel=true"],
    # ddp and zero1 hold their gathered weights beside the gradients of earlier micro-batches.
    "dp4_ddp_ga2": ["parallel.dp=4", "parallel.dp_mode=ddp", "train.grad_accum=2"],
    "dp4_zero1_ga2": ["parallel.dp=4", "parallel.dp_mode=zero1", "train.grad_accum=2"],
    "pp2_dp2_ddp_1f1b4": ["parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=ddp", "parallel.microbatches=4",
                          "parallel.schedule=1f1b"],
    # A vocabulary large enough that the fp32 logits and their gradient count: with an MTP module
    # (its own logits), and on a pipeline's last stage.
    "dp4_fsdp_v8k_mtp": ["parallel.dp=4", "model.vocab_size=8192", "model.mtp_depth=1"],
    "pp2_dp2_1f1b_v8k": ["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2", "parallel.schedule=1f1b",
                         "model.vocab_size=8192"],
}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


class HeapPeak(TorchDispatchMode):
    """The highest in-use heap (glibc arena + mmapped blocks) seen after any operator."""

    def __init__(self):
        super().__init__()
        libc = ctypes.CDLL("libc.so.6")
        self._mallinfo2 = libc.mallinfo2
        self._mallinfo2.restype = _MallInfo2
        self.start = self.peak = self.in_use()

    def in_use(self) -> int:
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out


def layout_config(name: str, world_size: int = RANKS):
    from moetron.launcher.config import load_config

    return load_config(TINY, [*BASE, *LAYOUTS[name]], world_size=world_size)


def measure(name: str, steps: int, warmup: int = 2) -> dict:
    import torch.distributed as dist
    from comm_volume import CollectiveCounter  # bench/comm_volume.py, beside this script
    from gloo_ranks import local_part  # bench/gloo_ranks.py, beside this script

    from moetron.launcher.perf.calibrate import timed_median
    from moetron.launcher.train.optim import optimizer_for
    from moetron.launcher.train.trainer import build_parallel_model, train_step

    cfg = layout_config(name)
    t = cfg.train
    torch.manual_seed(t.seed)
    pm = build_parallel_model(cfg, torch.device("cpu"))
    optimizer = optimizer_for(pm, t)
    g = torch.Generator().manual_seed(t.seed)

    def step():
        batch = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=g)
        return train_step(pm, optimizer, batch, grad_accum=t.grad_accum, grad_clip=t.grad_clip,
                          autocast=contextlib.nullcontext)

    for _ in range(warmup):
        step()
    # --steps 0: memory and bytes only (the counted step also creates the optimizer state).
    step_s = torch.tensor(timed_median(step, steps, warm=False) if steps else float("nan"), dtype=torch.float64)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    counter = CollectiveCounter()
    with counter:
        step()
    held = sum(local_part(p).nbytes for _, p in pm.named_parameters()) + sum(
        local_part(v).nbytes for s in optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.ndim > 0)
    probe = HeapPeak()
    with probe:
        result = step()
    mine = {"bytes": sum(counter.bytes.values()), "memory": held + probe.peak - probe.start}
    imbalance = expert_imbalance(result.moe, cfg.parallel) if cfg.parallel.pp == 1 else 1.0
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"layout": name, "step_s": float(step_s), "comm_bytes": sum(e["bytes"] for e in everyone),
            "memory": max(e["memory"] for e in everyone), "expert_imbalance": imbalance}


def expert_imbalance(moe: dict, par) -> float:
    """Routes of the probed step's last micro-batch held by the busiest ep rank over the mean,
    summed over the MoE layers (a collective; tp copies scale every rank alike); 1 without EP."""
    import torch.distributed as dist

    if par.ep == 1 or not moe:
        return 1.0
    counts_LE = torch.stack([moe[layer].counts_E.double() for layer in sorted(moe)])
    dist.all_reduce(counts_LE)
    per_rank = counts_LE.sum(0).view(par.ep, -1).sum(1)
    return float(per_rank.max() / per_rank.mean())


def predicted(name: str, expert_imbalance: float = 1.0) -> dict:
    from moetron.launcher.perf.comm_volume import predict_step
    from moetron.launcher.perf.device_profiles import get_profile
    from moetron.launcher.perf.planner import Layout, predict

    cfg = layout_config(name)
    t = cfg.train
    layout = Layout(cfg.parallel, t.grad_accum, t.activation_checkpoint)
    p = predict(cfg, layout, get_profile("cpu"), gpus_per_node=RANKS, expert_imbalance=expert_imbalance)
    # Bytes summed over ranks, as measured (the planner works per rank).
    total = sum(item.bytes for item in predict_step(cfg.model, cfg.parallel, batch=t.batch_size, seq_len=t.seq_len,
                                                     grad_accum=t.grad_accum))
    return {"step_s": p.step_s, "comm_bytes": total, "memory": p.memory["total"], "times": p.times}


def compare(runs: list[dict]) -> list[dict]:
    """One row per measured run (the workers' JSON lines): measured beside predicted step time,
    communication bytes and memory. Memory is predicted for the routing the probed step measured
    (the planner's --expert-imbalance); balanced routing is the planner's default."""
    rows = []
    for run in runs:
        pred = predicted(run["layout"], run["expert_imbalance"])
        rows.append({"layout": run["layout"], "measured": {k: run[k] for k in ("step_s", "comm_bytes", "memory")},
                     "predicted": {k: pred[k] for k in ("step_s", "comm_bytes", "memory")},
                     "predicted_times": pred["times"], "expert_imbalance": run["expert_imbalance"]})
    return rows


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a between two orderings of the same items (NaN for fewer than two)."""
    n, score = len(a), 0
    if n < 2:
        return float("nan")
    for i in range(n):
        for j in range(i + 1, n):
            score += (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
    return score / (n * (n - 1) / 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--steps", type=int, default=4, help="timed steps per layout (median; 0: memory and bytes only)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps first (the counted and probed steps follow the timed ones, so "
                        "0 still measures bytes and memory on a step after the first; step times want more)")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        from gloo_ranks import each_on_gloo  # bench/gloo_ranks.py, beside this script

        raise SystemExit(each_on_gloo(lambda name: measure(name, args.steps, args.warmup), args.worker))
    from moetron.launcher.perf.device_profiles import get_profile

    profile = get_profile("cpu")  # fails early, with the command to run, when not calibrated
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}", __file__,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--worker", *args.layouts]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(runs) != len(args.layouts):
        sys.exit(f"the measuring launch failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = compare(runs)
    tau = kendall_tau([r["predicted"]["step_s"] for r in rows], [r["measured"]["step_s"] for r in rows])
    print(f"tiny config, {BASE}; {RANKS} gloo ranks; cpu profile: {profile.peak_flops / 1e9:.1f} GFLOP/s per rank, "
          f"bus {profile.intra_bw / 1e9:.2f} GB/s, latency {profile.intra_latency * 1e3:.2f} ms, "
          f"block overhead {profile.block_overhead * 1e3:.2f} ms")
    print("| layout | step s pred / meas (ratio) | comm MB pred / meas | memory MiB pred / meas (ratio) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        pr, me = r["predicted"], r["measured"]
        print(f"| {r['layout']} | {pr['step_s']:.3f} / {me['step_s']:.3f} ({pr['step_s'] / me['step_s']:.2f}) | "
              f"{pr['comm_bytes'] / 1e6:.2f} / {me['comm_bytes'] / 1e6:.2f} | "
              f"{pr['memory'] / 2**20:.1f} / {me['memory'] / 2**20:.1f} ({pr['memory'] / me['memory']:.2f}) |")
    within_time = sum(abs(r["predicted"]["step_s"] / r["measured"]["step_s"] - 1) <= 0.35 for r in rows)
    within_mem = sum(abs(r["predicted"]["memory"] / r["measured"]["memory"] - 1) <= 0.15 for r in rows)
    print(f"Kendall's tau of the step-time order: {tau:.2f}; step time within 35%: {within_time}/{len(rows)}; "
          f"memory within 15%: {within_mem}/{len(rows)}")
    print(json.dumps({"tau": tau, "rows": rows, "profile": profile.to_dict()}))


if __name__ == "__main__":
    main()

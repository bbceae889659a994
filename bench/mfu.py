"""MFU of a short training run against the device's peak, measured side by side in one process.

    python bench/mfu.py [CONFIG] [key=value ...] [--steps 10] [--warmup 3] [--threads 2]

On CPU the peak is the best matmul FLOP/s in the run's precision (bf16 under autocast, else fp32),
timed just before and just after the training steps, so both see the same machine load; the
higher of the two is used. On a GPU it is the bf16 dense data-sheet peak (or train.peak_tflops).
Tokens are random, so routing stays near its initial balance. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from moetron.launcher.config import ConfigError, load_config
from moetron.launcher.perf.flop_counter import ComponentFlopCounter, single_process_step
from moetron.launcher.perf.flops import flops_by_component, flops_per_token, flops_per_token_6n
from moetron.launcher.perf.mfu import PEAK_DTYPES, device_peak, memory_gib, sweep_matmul_peak
from moetron.launcher.train.device import check_fp8, resolve_device, use_bf16
from moetron.launcher.train.optim import build_optimizer
from moetron.model.transformer import build_model
from moetron.parallel.float8 import apply_float8
from moetron.parallel.parallelize import apply_compile

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def cpu_peak() -> float:
    """This CPU's peak by PEAK_DEFINITION (the faster of bf16 and fp32 dense matmul), measured now:
    the bench takes it before and after its steps instead of training's cached figure."""
    return max(max(sweep_matmul_peak(dtype).values()) for dtype in PEAK_DTYPES)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        # NOTE: host-device sync so the step's wall time includes its kernels.
        torch.cuda.synchronize(device)


def time_steps(step, compiled_model, device, warmup: int, steps: int) -> tuple[float, list[float]]:
    """(seconds the compiling step took, or 0 for eager; each timed step's seconds). A model given
    as `compiled_model` has its blocks compiled first; CUDA's peak memory is reset before the
    timed steps, so the caller's `memory_gib` reads their own peak."""
    compile_s = 0.0
    if compiled_model is not None:
        apply_compile(compiled_model)
        synchronize(device)
        t0 = time.perf_counter()
        step()  # compiles every block's forward and backward
        synchronize(device)
        compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    memory_gib(device)
    times = []
    for _ in range(steps):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return compile_s, times


def run(args) -> dict:
    cfg = load_config(args.config, args.overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(cfg)
    bf16 = use_bf16(cfg, device)
    t = cfg.train
    torch.manual_seed(t.seed)
    check_fp8(cfg, device)
    model = build_model(cfg.model, device=device)
    if t.precision == "fp8":
        apply_float8(model)
    model.set_kernel_backend(cfg.kernel.backend)
    optimizer = build_optimizer(model, t)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def step() -> None:
        tokens_BS1 = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), device=device)
        single_process_step(model, optimizer, tokens_BS1, autocast)

    load_before = os.getloadavg()[0]
    peak_before = cpu_peak() if device.type == "cpu" else None
    # FLOPs are counted on an eager step: the counter sees aten ops and moetron's kernels, not
    # the code that torch.compile generates for them.
    step()
    with ComponentFlopCounter(model) as counter:
        step()
    compile_s, times = time_steps(step, model if t.compile else None, device, args.warmup, args.steps)
    memory = memory_gib(device)
    peak_after = cpu_peak() if device.type == "cpu" else None
    load_after = os.getloadavg()[0]

    if device.type == "cpu":
        peak = max(peak_before, peak_after)
        peak_source = "CPU dense matmul peak (the faster of bf16 and fp32) measured before and after the steps"
    else:
        resolved = device_peak(device, bf16, t.peak_tflops)
        peak, peak_source = resolved.flops, resolved.source
    step_time = statistics.median(times)
    tokens_per_s = t.batch_size * t.seq_len / step_time
    analytic, counted = flops_per_token(cfg.model, t.seq_len), counter.total / (t.batch_size * t.seq_len)
    return {
        "bench": "mfu", "config": str(args.config), "overrides": args.overrides, "device": str(device),
        "precision": "fp8" if t.precision == "fp8" else "bf16" if bf16 else "fp32", "threads": torch.get_num_threads(),
        "kernel_backend": cfg.kernel.backend, "compile": t.compile, "compile_s": compile_s,
        "params": sum(p.numel() for p in model.parameters()), "memory_gib_peak": memory,
        "batch": t.batch_size, "seq_len": t.seq_len, "steps": args.steps,
        "step_time_s_median": step_time, "step_time_s_spread": [min(times), max(times)],
        "tokens_per_s": tokens_per_s,
        "flops_per_token_analytic": analytic, "flops_per_token_6n": flops_per_token_6n(cfg.model),
        "flops_per_token_counted": counted,
        "flops_per_token_by_component": {
            "analytic": flops_by_component(cfg.model, t.seq_len),
            "counted": {k: v / (t.batch_size * t.seq_len) for k, v in counter.by_component().items()}},
        "tflops": tokens_per_s * analytic / 1e12, "tflops_measured": tokens_per_s * counted / 1e12,
        "peak_tflops": peak / 1e12, "peak_source": peak_source,
        "peak_tflops_before_after": [p / 1e12 for p in (peak_before, peak_after) if p is not None],
        "mfu": tokens_per_s * analytic / peak, "mfu_measured": tokens_per_s * counted / peak,
        "load_average_before_after": [load_before, load_after],
    }


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"MFU: {Path(result['config']).name} {' '.join(result['overrides'])}".rstrip(),
                  title_justify="left")
    table.add_column("quantity", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    rows = [
        ("device / precision / threads", f"{result['device']} / {result['precision']} / {result['threads']}"),
        ("tokens per step", f"{result['batch']} × {result['seq_len']}"),
        ("step time (median, s)", f"{result['step_time_s_median']:.3f}"),
        ("tokens/s", f"{result['tokens_per_s']:,.0f}"),
        ("FLOP/token analytic | counted", f"{result['flops_per_token_analytic']:.4g} | "
                                          f"{result['flops_per_token_counted']:.4g}"),
        ("model TFLOP/s", f"{result['tflops']:.3f}"),
        ("peak TFLOP/s", f"{result['peak_tflops']:.3f}"),
        ("kernels / compile (s)", f"{result['kernel_backend']} / {result['compile']} ({result['compile_s']:.1f})"),
        ("parameters | peak memory (GiB)", f"{result['params'] / 1e9:.2f}B | {result['memory_gib_peak']:.1f}"),
        ("MFU analytic | measured", f"{result['mfu']:.1%} | {result['mfu_measured']:.1%}"),
        ("load average before | after", " | ".join(f"{x:.2f}" for x in result["load_average_before_after"])),
    ]
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    print(f"peak: {result['peak_source']} (before/after: "
          f"{', '.join(f'{p:.3f}' for p in result['peak_tflops_before_after'])} TFLOP/s)")
    if result["load_average_before_after"][0] > 0.5 * os.cpu_count():
        print("note: the machine was busy; step time and peak both suffer, MFU less so")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG))
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads; 0 keeps torch's default")
    parser.add_argument("--json", type=Path, help="also write the JSON result here")
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except ConfigError as e:  # a config this machine cannot run (train.precision fp8 on a CPU): one line
        raise SystemExit(f"mfu.py: {e}") from None
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

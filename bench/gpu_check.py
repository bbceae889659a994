"""The Python side of bench/gpu_check.sh: the device's measured ceilings, and the report.

    python bench/gpu_check.py env --json env.json          # device, versions, copy and matmul ceilings
    python bench/gpu_check.py plan CONFIG --env env.json --json plan.json   # the planner's step time here,
                                                                            # with this GPU calibrated
    python bench/gpu_check.py report --work W --out OUT    # W's section outputs → OUT/gpu_check.{json,md}, logs.txt

The report states every target as met or missed: grouped GEMM >= 0.9x cuBLAS at equal FLOPs and
>= 1.0x torch._grouped_mm in every pass; flash attention forward >= 0.9x and backward >= 1.0x SDPA's flash
backend; training MFU beside Megatron-Core's ~47% and torchtitan's ~39% (their published
Mixtral-8x7B figures on H100 clusters, so a reference point rather than a like-for-like peer).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

SCHEMA_VERSION = 1
TARGETS = {
    ("grouped_mm", "ratio_vs_dense"): 0.9,
    ("grouped_mm", "ratio_vs_grouped_mm"): 1.0,
    ("attention", "fwd"): 0.9,
    ("attention", "bwd"): 1.0,
}
PEER_MFU = {"Megatron-Core": 0.47, "torchtitan": 0.39}
TRAIN_SECTIONS = {"train_compiled": "Triton kernels, compiled", "train_eager": "Triton kernels, eager",
                  "train_torch": "torch paths (SDPA, torch._grouped_mm), eager",
                  "train_fp8": "FP8 linears and experts (torchao), eager"}
LOG_TAIL_LINES = 300
# Counted and analytic MFU must agree this closely (relative), or the report names the components apart.
MFU_AGREEMENT = 0.02


def measure_env() -> dict:
    """Versions, the device, and the two ceilings METHOD.md asks for: a device-to-device copy
    (bytes read + written) and a large bf16 matmul on random data, 10 timed runs after 3 warm-ups."""
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    env["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    if cuda:
        props = torch.cuda.get_device_properties(device)
        env |= {"sms": props.multi_processor_count, "memory_gib": props.total_memory / 2**30,
                "capability": f"{props.major}.{props.minor}"}
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            env["nvidia_smi"] = None
    from moetron.kernels.fp8 import fp8_problem

    # Whether train.precision fp8 can run here (torchao present, importable with this torch, the GPU's capability).
    env["fp8"] = fp8_problem(device) or "ok"
    n_copy, n_mm = (2**30, 8192) if cuda else (2**24, 512)

    def timed(fn, reps=10) -> float:
        for _ in range(3):
            fn()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    src = torch.randn(n_copy // 4, device=device)
    dst = torch.empty_like(src)
    env["copy_tb_s"] = 2 * src.numel() * 4 / timed(lambda: dst.copy_(src)) / 1e12
    dtype = torch.bfloat16 if cuda else torch.float32
    a, b = (torch.randn(n_mm, n_mm, device=device, dtype=dtype) for _ in range(2))
    env["matmul_tflops"] = 2 * n_mm**3 / timed(lambda: a @ b) / 1e12
    env["matmul_shape"] = f"{n_mm}x{n_mm}x{n_mm} {str(dtype).removeprefix('torch.')}"
    return env


def predict_step(config: str, overrides: list[str], env: dict, profile_name: str | None = None) -> dict:
    """The planner's step time for the trained config's own layout on this device: with the GPU's
    data-sheet profile, and with the "gpu" profile `moetron plan --calibrate` measures here from it
    (launcher/perf/calibrate_gpu.py; stored where `moetron plan --gpu gpu` reads it). `profile_name`:
    the data sheet to start from; by default the one whose name the device's name contains. On a
    CPU (the dry run) the calibration times small shapes."""
    import torch

    from moetron.launcher.config import ConfigError, load_config
    from moetron.launcher.perf.calibrate_gpu import calibrate_gpu, gpu_profile_name
    from moetron.launcher.perf.device_profiles import PROFILES
    from moetron.launcher.perf.planner import Layout, predict

    try:
        name = profile_name or gpu_profile_name(str(env.get("device", "")))
    except ConfigError as e:
        return {"profile": None, "reason": str(e)}
    cfg = load_config(config, overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = {} if device.type == "cuda" else {"shapes": ((256, 256, 256),), "copy_bytes": 2**22}
    calibrated, _ = calibrate_gpu(device, base=PROFILES[name], console=print, **small)
    layout = Layout(cfg.parallel, cfg.train.grad_accum, cfg.train.activation_checkpoint)
    out = {"profile": name, "layout": layout.label(), "matmul_efficiency_measured": calibrated.matmul_efficiency}
    for key, profile in (("datasheet", PROFILES[name]), ("calibrated", calibrated)):
        p = predict(cfg, layout, profile, gpus_per_node=1)
        out[key] = {"step_s": p.step_s, "mfu": p.mfu, "times": p.times}
    return out


def read_tests(path: Path) -> dict | None:
    """Counts and failed test ids from pytest's JUnit XML."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return counts | {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
                     "failed": failed}


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def kernel_verdicts(kernels: dict) -> list[dict]:
    """One row per measured kernel pass and target: the ratio, the target, met or missed."""
    out = []
    for r in kernels.get("results", []):
        if r["op"] == "grouped_mm":
            for key in ("ratio_vs_dense", "ratio_vs_grouped_mm"):
                if key in r:
                    target = TARGETS[("grouped_mm", key)]
                    out.append({"what": f"grouped GEMM {r['shape']} {r['pass']} {key.removeprefix('ratio_')}",
                                "value": r[key], "target": target, "met": r[key] >= target})
        else:
            target = TARGETS[("attention", r["pass"])]
            out.append({"what": f"attention {r['shape']} {r['pass']} vs SDPA-flash",
                        "value": r["ratio_vs_sdpa_flash"], "target": target, "met": r["ratio_vs_sdpa_flash"] >= target})
    return out


def mfu_agreement(run: dict, within: float = MFU_AGREEMENT) -> str:
    """One line on whether a run's counted MFU (the FLOP formulas of the ops that ran, one eager
    step) agrees with its analytic MFU (6N + attention from the config), and where not, which
    components differ: their counted and analytic GFLOP per token."""
    ratio = run["flops_per_token_counted"] / run["flops_per_token_analytic"]
    line = f"counted / analytic MFU {ratio:.3f}"
    if abs(ratio - 1) <= within:
        return f"{line} (within {within:.0%})"
    parts = run.get("flops_per_token_by_component") or {}
    analytic, counted = parts.get("analytic", {}), parts.get("counted", {})
    off = [f"{name} {counted.get(name, 0) / 1e9:.3f} counted vs {analytic.get(name, 0) / 1e9:.3f} analytic"
           for name in [*analytic, *(n for n in counted if n not in analytic)]
           if abs(counted.get(name, 0) - analytic.get(name, 0)) > within * max(analytic.get(name, 0), 1)]
    return f"{line} (more than {within:.0%} apart; GFLOP/token: {'; '.join(off) or 'no single component'})"


def build_report(work: Path) -> dict:
    sections = [json.loads(line) for line in (work / "sections.jsonl").read_text().splitlines()] \
        if (work / "sections.jsonl").exists() else []
    kernels = _load(work / "kernels.json")
    train = {name: _load(work / f"{name}.json") for name in TRAIN_SECTIONS}
    report = {
        "schema": SCHEMA_VERSION, "sections": sections, "env": _load(work / "env.json"),
        "tests": read_tests(work / "tests.xml"), "kernels": kernels,
        "kernel_verdicts": kernel_verdicts(kernels) if kernels else [],
        "train": {k: v for k, v in train.items() if v is not None},
        "fp8_loss": _load(work / "fp8_loss.json"),
        "plan": _load(work / "plan.json"),
    }
    env = report["env"] or {}
    for result in report["train"].values():
        if env.get("matmul_tflops") and env.get("device") != "cpu":
            result["mfu_vs_measured_matmul"] = result["tflops"] / env["matmul_tflops"]
    on, off = train.get("train_compiled") or train.get("train_eager"), train.get("train_torch")
    if on and off:
        report["kernels_speedup_in_training"] = on["tokens_per_s"] / off["tokens_per_s"]
    plan = report["plan"] or {}
    if plan.get("profile"):  # measured over predicted step time, for each run of the same layout
        report["measured_over_predicted"] = {
            name: {k: r["step_time_s_median"] / plan[k]["step_s"] for k in ("datasheet", "calibrated")}
            for name, r in report["train"].items() if name in ("train_eager", "train_compiled")}
    fp8, bf16 = train.get("train_fp8"), train.get("train_eager")
    if fp8 and bf16:  # the same config and kernels, eager both: what FP8 buys
        report["fp8_speedup_in_training"] = fp8["tokens_per_s"] / bf16["tokens_per_s"]
    return report


def markdown(report: dict) -> str:
    env = report["env"] or {}
    lines = ["# gpu_check", ""]
    if env:
        lines += [f"{env.get('device')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, Triton {env.get('triton')}; "
                  f"measured ceilings: copy {env.get('copy_tb_s', 0):.2f} TB/s, matmul {env.get('matmul_tflops', 0):.0f} "
                  f"TFLOP/s ({env.get('matmul_shape')}); FP8: {env.get('fp8')}", ""]
    lines += ["| section | exit | seconds |", "| --- | --- | --- |"]
    lines += [f"| {s['section']} | {s['rc']}{' (time limit)' if s['rc'] in (124, 137) else ''} | {s['seconds']} |"
              for s in report["sections"]]
    tests = report["tests"]
    if tests:
        lines += ["", f"Kernel tests: {tests['passed']} passed, {tests['failures'] + tests['errors']} failed, "
                      f"{tests['skipped']} skipped" + (f" — failed: {', '.join(tests['failed'][:10])}" if tests["failed"] else "")]
    kernels = report["kernels"]
    if kernels:
        lines += ["", "Kernel checks: " + "; ".join(f"{c['check']} max rel err {c['max_rel_err']:.1e} "
                                                     f"{'ok' if c['ok'] else 'FAILED'}" for c in kernels["checks"])]
        lines += ["", "| kernel | shape | pass | ours TFLOP/s | cuBLAS dense | torch._grouped_mm | SDPA-flash | "
                      "× dense | × grouped_mm | × SDPA |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in kernels["results"]:
            cell = lambda k, f=".1f": format(r[k], f) if k in r else "–"  # noqa: E731
            lines.append(f"| {r['op']} | {r['shape']} | {r['pass']} | {cell('ours_tflops')} | {cell('dense_tflops')} | "
                         f"{cell('grouped_mm_tflops')} | {cell('sdpa_flash_tflops')} | {cell('ratio_vs_dense', '.2f')} | "
                         f"{cell('ratio_vs_grouped_mm', '.2f')} | {cell('ratio_vs_sdpa_flash', '.2f')} |")
        verdicts = report["kernel_verdicts"]
        missed = [v for v in verdicts if not v["met"]]
        lines += ["", f"Kernel targets: {len(verdicts) - len(missed)} of {len(verdicts)} met"]
        lines += [f"- missed: {v['what']}: {v['value']:.2f}× (target {v['target']}×)" for v in missed]
        best = [b for b in kernels.get("best_tiles", []) if b.get("best")]
        if best:
            lines += ["", "| tuned kernel | shape | pass | best TFLOP/s | × shipped tile | best tile |",
                      "| --- | --- | --- | --- | --- | --- |"]
            for b in best:
                gain = f"{b['speedup_vs_shipped']:.2f}" if b.get("speedup_vs_shipped") else "–"
                lines.append(f"| {b['kernel']} | {b['shape']} | {b['pass']} | {b['best_tflops']:.1f} | {gain} | "
                             f"{' '.join(f'{k}={v}' for k, v in b['tile'].items())} |")
    if report["train"]:
        lines += ["", "| training | tokens/s | step s | MFU (data sheet) | MFU counted | MFU vs measured matmul | "
                      "peak GiB | compile s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in report["train"].items():
            vs = f"{r['mfu_vs_measured_matmul']:.1%}" if "mfu_vs_measured_matmul" in r else "–"
            lines.append(f"| {TRAIN_SECTIONS[name]} | {r['tokens_per_s']:,.0f} | {r['step_time_s_median']:.3f} | "
                         f"{r['mfu']:.1%} | {r['mfu_measured']:.1%} | {vs} | {r['memory_gib_peak']:.1f} | "
                         f"{r['compile_s']:.0f} |")
        any_run = next(iter(report["train"].values()))
        lines += ["", f"Model: {any_run['config']} {' '.join(any_run['overrides'])}, {any_run['params'] / 1e9:.2f}B "
                      f"parameters, {any_run['batch']}×{any_run['seq_len']} tokens a step; MFU numerator "
                      f"{any_run['flops_per_token_analytic'] / 1e9:.2f} GFLOP/token analytic (6N + full-square "
                      f"attention), counted {any_run['flops_per_token_counted'] / 1e9:.2f}; peak: {any_run['peak_source']}."]
        lines += [f"- {TRAIN_SECTIONS[name]}: {mfu_agreement(r)}" for name, r in report["train"].items()]
        best_mfu = max(r["mfu"] for r in report["train"].values())
        lines += [f"- MFU {best_mfu:.1%} vs {name} ~{mfu:.0%}: {'met' if best_mfu >= mfu else 'missed'}"
                  for name, mfu in PEER_MFU.items()]
        if "kernels_speedup_in_training" in report:
            lines.append(f"- Triton kernels vs torch paths in training: {report['kernels_speedup_in_training']:.2f}× tokens/s")
        if "fp8_speedup_in_training" in report:
            lines.append(f"- FP8 vs bf16 (eager, same kernels): {report['fp8_speedup_in_training']:.2f}× tokens/s "
                         "(MFU counts the same model FLOPs against the bf16 peak)")
    plan = report.get("plan") or {}
    if plan.get("profile"):
        lines += ["", (f"Planner, {plan['layout']} on {plan['profile']}: predicted {plan['datasheet']['step_s']:.3f} s a "
                       f"step from the data sheet, {plan['calibrated']['step_s']:.3f} s calibrated on this GPU (matmul "
                       f"efficiency {plan['matmul_efficiency_measured']:.0%} measured)")]
        lines += [f"- {TRAIN_SECTIONS[name]}: measured / predicted {r['datasheet']:.2f}× (data sheet), "
                  f"{r['calibrated']:.2f}× (calibrated)" for name, r in report.get("measured_over_predicted", {}).items()]
    elif plan:
        lines += ["", f"Planner: {plan['reason']}"]
    loss = report.get("fp8_loss")
    if loss:
        lines.append(f"- FP8 loss after {loss['step']} steps {loss['loss_fp8']:.4f} vs bf16 {loss['loss_bf16']:.4f}: "
                     f"{loss['rel_diff_last']:.2%} apart (largest {loss['rel_diff_max']:.2%}; goal ≤ {loss['goal']:.0%}, "
                     f"{'met' if loss['met'] else 'missed'})")
    return "\n".join(lines) + "\n"


def write_report(work: Path, out: Path) -> dict:
    report = build_report(work)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))
    logs = []
    for s in report["sections"]:
        log = work / f"{s['section']}.log"
        if log.exists():
            text = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            logs += [f"==== {s['section']} (exit {s['rc']}, {s['seconds']} s)", *text]
    (out / "logs.txt").write_text("\n".join(logs) + "\n")
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("--json", type=Path, required=True)
    pl = sub.add_parser("plan")
    pl.add_argument("config")
    pl.add_argument("overrides", nargs="*", metavar="key=value")
    pl.add_argument("--env", type=Path, required=True, help="the env section's JSON (the device's name)")
    pl.add_argument("--profile", help="device profile to start from (default: the device's own)")
    pl.add_argument("--json", type=Path, required=True)
    r = sub.add_parser("report")
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd == "env":
        env = measure_env()
        args.json.write_text(json.dumps(env, indent=1))
        print(json.dumps(env))
    elif args.cmd == "plan":
        plan = predict_step(args.config, args.overrides, json.loads(args.env.read_text()), args.profile)
        args.json.write_text(json.dumps(plan, indent=1))
        print(json.dumps(plan))
    else:
        write_report(args.work, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

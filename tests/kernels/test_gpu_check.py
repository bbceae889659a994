"""bench/gpu_check.sh, the one call a lent GPU gets, dry-run on CPU: every section runs, and the
report it leaves under $OUT has the promised shape and numbers that agree with each other."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without a GPU")
def test_dry_run_writes_a_complete_report(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "XDG_CACHE_HOME": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "plan", "tests", "kernels", "train_torch"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", "logs.txt"]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["schema"] == gpu_check.SCHEMA_VERSION
    # env is always run first, even when not named.
    assert [s["section"] for s in report["sections"]] == ["env", "plan", "tests", "kernels", "train_torch"]
    assert all(s["rc"] == 0 for s in report["sections"]), report["sections"]
    assert report["env"]["matmul_tflops"] > 0 and report["env"]["copy_tb_s"] > 0
    assert report["env"]["fp8"].startswith("FP8 GEMMs need a CUDA GPU")  # why fp8 cannot run on this CPU
    assert report["tests"]["passed"] >= 1 and not report["tests"]["failed"]
    kernels = report["kernels"]
    assert all(c["ok"] for c in kernels["checks"])
    passes = {(r["op"], r["pass"]) for r in kernels["results"]}
    assert passes == {("grouped_mm", "fwd"), ("grouped_mm", "dx"), ("grouped_mm", "dw"),
                      ("attention", "fwd"), ("attention", "bwd")}
    # Every tuned candidate reproduced torch's result on the interpreter, and each tuned kernel
    # reports a winner.
    assert kernels["tuning"] and all(t["status"] == "ok" for t in kernels["tuning"]), kernels["tuning"]
    assert {b["kernel"] for b in kernels["best_tiles"]} == {"forward", "wgrad", "attn_fwd", "attn_dkdv", "attn_dq"}
    assert len(report["kernel_verdicts"]) == sum(
        ("ratio_vs_dense" in r) + ("ratio_vs_grouped_mm" in r) + ("ratio_vs_sdpa_flash" in r) for r in kernels["results"])
    train = report["train"]["train_torch"]
    # tiny.yaml's model FLOPs per token at 64 tokens, by hand: per layer W_q, W_k, W_v, W_o on D = 256
    # with 8 query and 4 KV heads of 32 (196,608), the router (2,048) and 2 of 8 SwiGLU experts of
    # 3 × 256 × 512 (786,432); 4 layers and the head (81,920): 4,022,272 active weights, 6 FLOPs each,
    # plus attention over the full square 12·4·8·32·64 = 786,432: 24,920,064.
    assert (train["batch"], train["seq_len"]) == (2, 64)
    assert train["flops_per_token_analytic"] == 24_920_064
    # The FLOP counter's count of what ran agrees with it.
    assert train["flops_per_token_counted"] == pytest.approx(24_920_064, rel=0.02)
    # 2 × 64 = 128 tokens a step; MFU is their model FLOPs per second over the peak.
    assert train["tokens_per_s"] == pytest.approx(128 / train["step_time_s_median"], rel=1e-9)
    assert train["mfu"] == pytest.approx(train["tokens_per_s"] * 24_920_064 / (train["peak_tflops"] * 1e12), rel=1e-9)
    # The planner's step time for the trained layout, as `moetron plan` gives it for one device of
    # the dry run's stand-in data sheet, and with the "gpu" profile the section calibrated from it
    # (stored under XDG_CACHE_HOME, where `moetron plan --gpu gpu` reads it).
    plan = report["plan"]
    tiny = ["configs/tiny.yaml", "train.batch_size=2", "train.seq_len=64", "train.precision=fp32", "--gpus", "1"]
    want = moetron_plan([*tiny, "--gpu", "H100"])
    assert plan["layout"] == "1 rank" and plan["datasheet"]["step_s"] == pytest.approx(want["step_s"], rel=1e-12)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path))
        calibrated = moetron_plan([*tiny, "--gpu", "gpu"])
    assert plan["calibrated"]["step_s"] == pytest.approx(calibrated["step_s"], rel=1e-12)
    assert plan["calibrated"]["step_s"] > plan["datasheet"]["step_s"]  # a CPU is slower than an H100's data sheet
    md = (out / "gpu_check.md").read_text()
    assert "Planner, 1 rank on H100: predicted" in md
    assert "| torch paths (SDPA, torch._grouped_mm), eager |" in md and "Kernel targets:" in md
    assert "==== kernels (exit 0" in (out / "logs.txt").read_text()


def moetron_plan(argv: list[str]) -> dict:
    """`moetron plan ARGV --json`'s one-rank layout."""
    from moetron.launcher.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", *argv, "--json"]) == 0
    plan = json.loads(buf.getvalue())
    (one,) = [p for p in plan["ranked"] if p["layout"]["label"] == "1 rank"]
    return one


def test_verdicts_compare_each_ratio_with_its_target():
    kernels = {"results": [
        {"op": "grouped_mm", "shape": "s", "pass": "fwd", "ratio_vs_dense": 0.95, "ratio_vs_grouped_mm": 0.99},
        {"op": "attention", "shape": "a", "pass": "fwd", "ratio_vs_sdpa_flash": 0.89},
        {"op": "attention", "shape": "a", "pass": "bwd", "ratio_vs_sdpa_flash": 1.02},
        {"op": "attention", "shape": "b", "pass": "bwd", "ratio_vs_sdpa_flash": 0.95},  # the goal is now 1.0×
    ]}
    verdicts = {v["what"]: v["met"] for v in gpu_check.kernel_verdicts(kernels)}
    assert verdicts == {"grouped GEMM s fwd vs_dense": True, "grouped GEMM s fwd vs_grouped_mm": False,
                        "attention a fwd vs SDPA-flash": False, "attention a bwd vs SDPA-flash": True,
                        "attention b bwd vs SDPA-flash": False}


def test_unknown_section_is_refused_in_one_line(tmp_path):
    run = subprocess.run(["bash", "bench/gpu_check.sh", "benchmarks"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OUT": str(tmp_path)}, timeout=60)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "unknown argument 'benchmarks'" in run.stderr


def test_the_fp8_loss_comparison_reaches_the_report(tmp_path):
    (tmp_path / "fp8_loss.json").write_text(json.dumps({
        "bench": "fp8_loss", "step": 100, "loss_bf16": 2.0, "loss_fp8": 2.01, "rel_diff_last": 0.005,
        "rel_diff_max": 0.007, "goal": 0.01, "met": True}))
    report = gpu_check.build_report(tmp_path)
    assert report["fp8_loss"]["loss_fp8"] == 2.01
    assert ("- FP8 loss after 100 steps 2.0100 vs bf16 2.0000: 0.50% apart (largest 0.70%; goal ≤ 1%, met)"
            in gpu_check.markdown(report))


def test_measured_step_times_are_set_against_the_planners(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"profile": "H200", "layout": "1 rank",
                                                    "datasheet": {"step_s": 0.1}, "calibrated": {"step_s": 0.16}}))
    (tmp_path / "train_eager.json").write_text(json.dumps({"step_time_s_median": 0.2}))
    report = gpu_check.build_report(tmp_path)
    assert report["measured_over_predicted"] == {"train_eager": {"datasheet": pytest.approx(2.0),
                                                                 "calibrated": pytest.approx(1.25)}}


def test_counted_and_analytic_mfu_agree_or_the_components_apart_are_named():
    run = {"flops_per_token_analytic": 100e9, "flops_per_token_counted": 101e9}
    assert gpu_check.mfu_agreement(run) == "counted / analytic MFU 1.010 (within 2%)"
    run = {"flops_per_token_analytic": 100e9, "flops_per_token_counted": 110e9, "flops_per_token_by_component": {
        "analytic": {"attention_projections": 40e9, "attention_scores": 20e9, "experts": 40e9},
        "counted": {"attention_projections": 40e9, "attention_scores": 30e9, "experts": 40e9, "other": 0.0}}}
    assert gpu_check.mfu_agreement(run) == ("counted / analytic MFU 1.100 (more than 2% apart; GFLOP/token: "
                                            "attention_scores 30.000 counted vs 20.000 analytic)")

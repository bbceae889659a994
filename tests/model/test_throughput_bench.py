"""bench/model_throughput.py runs from another folder and splits each model's step into profile
classes: the MoE's time has expert GEMMs, its dense twin's none, and both have attention; with
--compile it also times the compiled twins and reports their ratios."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "model_throughput.py"


def test_quick_run_reports_a_profile_breakdown_per_model(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--no-transformers", "--precision", "fp32",
                          "--threads", "1", "--compile"], capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    moe, dense = result["profile_ms"]["moetron-moe/fp32"], result["profile_ms"]["moetron-dense/fp32"]
    assert set(moe) == set(dense) == {"expert_gemms", "attention", "other_matmuls", "everything_else"}
    assert moe["expert_gemms"] > 0 and dense["expert_gemms"] == 0
    assert moe["attention"] > 0 and dense["attention"] > 0 and dense["other_matmuls"] > 0
    assert "profile of one step" in out.stdout
    compiled = result["profile_ms"]["moetron-moe-compiled/fp32"]
    assert compiled["expert_gemms"] > 0 and compiled["attention"] > 0
    assert set(result["ratios"]["fp32"]) == {"moe/dense", "compiled/eager moe", "compiled/eager dense",
                                             "moe/dense compiled"}


def test_moe_layer_bench_splits_expert_gemms_from_the_rest(tmp_path):
    """bench/moe_layer.py: the layer's profiled time splits into expert GEMMs (grouped GEMMs
    present) and the rest (routing, permutes, SwiGLU: present too)."""
    script = BENCH.parent / "moe_layer.py"
    out = subprocess.run([sys.executable, str(script), "--tokens", "256", "--d-model", "64", "--d-expert", "128",
                          "--steps", "2", "--warmup", "1", "--profile-calls", "2", "--no-compile"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    eager = json.loads(out.stdout.strip().splitlines()[-1])["eager"]
    assert 0 < eager["expert_gemm_ms"] < eager["profiled_ms"]
    assert 0 < eager["not_expert_gemm_share"] < 1


def test_sum_routes_bench_times_both_ways(tmp_path):
    """bench/moe_layer.py --sum-routes times scatter-add and gather, eager and compiled."""
    out = subprocess.run([sys.executable, str(BENCH.parent / "moe_layer.py"), "--sum-routes", "--tokens", "64",
                          "--d-model", "16", "--steps", "2"], capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    ms = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(ms[f"{how}_{mode}"] > 0 for how in ("scatter", "gather") for mode in ("eager", "compiled"))

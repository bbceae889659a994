"""One peak (device_profiles.PEAK_DEFINITION) under both MFUs: for the same config on the same device
profile, the planner's predicted MFU and training's MFU meter equal 6·N_active·tokens/s (+ attention)
over world × peak, worked out here by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetron.launcher.config import load_config
from moetron.launcher.perf.calibrate import Measurement, calibrate
from moetron.launcher.perf.device_profiles import PROFILES
from moetron.launcher.perf.mfu import MfuMeter, cpu_peak, device_peak, gpu_peak
from moetron.launcher.perf.planner import Layout, predict

CONFIGS = Path(__file__).resolve().parents[3] / "configs"

# configs/tiny.yaml: D 256, 4 layers, 8 heads and 4 KV heads of 32, 8 SwiGLU experts of 512, top-2,
# vocabulary 320, S 256. Weights one token passes through, per layer: W_q and W_o 256×256 each, W_k
# and W_v 256×128 each (196,608); the router 256×8 (2,048); 2 experts × 3 × 256×512 (786,432);
# then the head 256×320 (81,920) once.
N_ACTIVE = 4 * (196_608 + 2_048 + 786_432) + 81_920  # 4,022,272
ATTENTION = 12 * 4 * 8 * 32 * 256  # QKᵀ and PV over the full 256×256 square, forward + backward
FLOPS_PER_TOKEN = 6 * N_ACTIVE + ATTENTION  # 27,279,360


def both_mfus(cfg, profile, peak, world: int) -> tuple[float, float, float]:
    """(planner's MFU, training meter's MFU for a log window at the planner's tokens/s, that tokens/s)."""
    prediction = predict(cfg, Layout(cfg.parallel), profile, gpus_per_node=world)
    meter = MfuMeter(cfg.model, cfg.train.seq_len, peak, world_size=world)
    seconds = 10.0
    trained = meter.window(prediction.tokens_per_s * seconds, seconds)["mfu"]
    return prediction.mfu, trained, prediction.tokens_per_s


def test_h100_planner_and_training_divide_by_the_data_sheets_bf16_peak():
    cfg = load_config(CONFIGS / "tiny.yaml", ["parallel.dp=8"], world_size=8)
    planned, trained, tokens_per_s = both_mfus(cfg, PROFILES["H100"], gpu_peak("NVIDIA H100 80GB HBM3"), 8)
    by_hand = FLOPS_PER_TOKEN * tokens_per_s / (8 * 989e12)  # H100 SXM: 989 TFLOP/s bf16 dense
    assert trained == pytest.approx(by_hand, rel=1e-12)
    assert planned == pytest.approx(by_hand, rel=1e-12)


def test_cpu_planner_and_training_divide_by_the_calibrated_peak(tmp_path):
    # What the calibration measured: bf16 runs natively here (2.1e11 FLOP/s for one rank alone),
    # so it is the peak, whichever precision a run trains in.
    repeat = {"peak": 2.1e11, "matmul_rate": 5e10, "block_overhead": 1e-3, "hbm_bw": 4e9, "latency": 1e-3,
              "bus": 1e9, "kind_all_gather": 1e9, "kind_reduce_scatter": 1e9, "kind_all_to_all": 1e9,
              "kind_broadcast": 1e9}
    measured = Measurement([repeat] * 5, {"torch.bfloat16": 2.1e11, "torch.float32": 0.9e11})
    profile, _ = calibrate(ranks=4, path=tmp_path / "plan_profile.json", measure=lambda ranks, n: measured,
                           console=lambda _: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a rank as torchrun starts it, as calibrated
    try:
        peak = device_peak(torch.device("cpu"), False, directory=tmp_path)  # an fp32 run
    finally:
        torch.set_num_threads(threads)
    assert peak.flops == profile.peak_flops == 2.1e11
    cfg = load_config(CONFIGS / "tiny.yaml", ["parallel.dp=4", "train.precision=fp32"], world_size=4)
    planned, trained, tokens_per_s = both_mfus(cfg, profile, peak, 4)
    by_hand = FLOPS_PER_TOKEN * tokens_per_s / (4 * 2.1e11)
    assert trained == pytest.approx(by_hand, rel=1e-12)
    assert planned == pytest.approx(by_hand, rel=1e-12)


def test_cpu_peak_is_the_faster_precision(tmp_path):
    """Where bf16 is emulated (~1 GFLOP/s without AVX512-BF16 or AMX) the peak is fp32's, so an fp32
    run's MFU stays below 100%."""
    rates = {torch.bfloat16: 1e9, torch.float32: 1e11}
    peak = cpu_peak(directory=tmp_path, measure=lambda m, k, n, dtype: rates[dtype])
    assert peak.flops == 1e11 and "float32 100 GFLOP/s" in peak.source and "bfloat16 1 GFLOP/s," in peak.source


def test_cpu_peak_names_an_amx_core_s_rate_without_an_exponent(tmp_path):
    """An AMX core's bf16 matmul is over 1 TFLOP/s: the console line says 1,870 GFLOP/s, not 1.87e+03
    GFLOP/s (the console shows no exponent notation, tests/launcher/cli/test_console_numbers.py)."""
    rates = {torch.bfloat16: 1.87e12, torch.float32: 1.83e11}
    peak = cpu_peak(directory=tmp_path, measure=lambda m, k, n, dtype: rates[dtype])
    assert peak.flops == 1.87e12
    assert "bfloat16 1,870 GFLOP/s, float32 183 GFLOP/s (measured now" in peak.source, peak.source

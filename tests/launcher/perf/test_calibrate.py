"""`moetron plan --calibrate`: the best of several repeats is stored, with its spread printed and the
path it went to; repeats that disagree (a busy machine) are refused and nothing is stored. The
measurement is passed in as a function, so these tests choose what the "machine" reported."""

from __future__ import annotations

import json
import math

import pytest

from moetron.launcher.config import ConfigError
from moetron.launcher.perf.calibrate import (
    MAX_SPREAD,
    QUANTITIES,
    REPEATS,
    Measurement,
    NoisyCalibration,
    calibrate,
    measure_spawned,
)
from moetron.launcher.perf.device_profiles import cached_cpu_profile

# One repeat as a 2-core machine reports it (4 ranks): rates in FLOP/s and bytes/s, times in s.
QUIET = {"peak": 2.0e11, "matmul_rate": 5.0e10, "block_overhead": 1.2e-3, "hbm_bw": 4.0e9, "latency": 1.0e-3,
         "bus": 1.0e9, "kind_all_gather": 1.5e9, "kind_reduce_scatter": 0.5e9, "kind_all_to_all": 1.0e9,
         "kind_broadcast": 2.0e9}
DTYPE_PEAKS = {"torch.bfloat16": 2.1e11, "torch.float32": 0.9e11}


def repeats(scales: dict[str, list[float]]) -> list[dict[str, float]]:
    """REPEATS samples of QUIET, each quantity in `scales` multiplied by its factor of each repeat."""
    return [{name: value * scales.get(name, [1.0] * REPEATS)[r] for name, value in QUIET.items()}
            for r in range(REPEATS)]


def fixed(samples, dtype_peaks=DTYPE_PEAKS):
    calls = []

    def measure(ranks: int, n: int) -> Measurement:
        calls.append((ranks, n))
        return Measurement(samples, dtype_peaks)

    return measure, calls


def test_a_quiet_calibration_stores_the_best_of_each_repeat_and_prints_where(tmp_path):
    # Load slows rates and lengthens times: the best is the highest rate and the lowest time.
    samples = repeats({"matmul_rate": [0.9, 1.0, 0.8, 1.1, 0.95], "latency": [1.3, 1.0, 1.2, 1.1, 1.4],
                       "peak": [1.0, 0.95, 0.9, 1.05, 1.0], "bus": [0.5, 1.0, 0.7, 0.6, 0.8]})
    measure, calls = fixed(samples)
    lines = []
    profile, path = calibrate(ranks=4, path=tmp_path / "plan_profile.json", measure=measure, console=lines.append)
    assert calls == [(4, REPEATS)]
    assert path == tmp_path / "plan_profile.json"
    printed = "\n".join(lines)
    assert str(path) in printed and str(tmp_path / "cpu_matmul_peak.json") in printed
    # min / median / max of the model-shape matmul rate, in GFLOP/s: 40, 47.5, 55; spread 55/40.
    [row] = [line for line in lines if "matmul at model shapes" in line]
    assert row.split()[5:] == ["55", "40", "47.5", "55", "1.38,", "at", "most", "1.5"]
    stored = cached_cpu_profile(path)
    assert stored == profile
    assert profile.peak_flops == 2.1e11  # the faster dtype, as training reads it back
    assert profile.matmul_efficiency == pytest.approx(5.0e10 * 1.1 / 2.1e11)
    assert profile.intra_latency == pytest.approx(1.0e-3) and profile.intra_bw == pytest.approx(1.0e9)
    assert profile.kind_bw["all_gather"] == pytest.approx(1.5)  # over all_reduce's best bus bandwidth
    assert profile.block_overhead == pytest.approx(1.2e-3)


def test_an_amx_core_s_teraflops_print_without_an_exponent(tmp_path):
    """With AMX a core's bf16 matmul passes 1 TFLOP/s: the table, the stored peak's line and its
    source print 1,870 GFLOP/s, never 1.87e+03."""
    fast = [{**sample, "peak": 1.87e12, "matmul_rate": 1.2e12 * (1 + r / 100)} for r, sample in enumerate(repeats({}))]
    measure, _ = fixed(fast, {"torch.bfloat16": 1.87e12, "torch.float32": 1.83e11})
    lines = []
    profile, _ = calibrate(ranks=4, path=tmp_path / "plan_profile.json", measure=measure, console=lines.append)
    printed = "\n".join(lines)
    [row] = [line for line in lines if "peak matmul" in line]
    assert row.split()[5:9] == ["1,870"] * 4, row
    assert "its MFU peak (1,870 GFLOP/s per one-thread rank)" in printed
    assert "bfloat16 1,870 GFLOP/s, float32 183 GFLOP/s" in profile.sources["peak_flops"]
    assert "e+" not in printed, printed


def test_a_noisy_calibration_is_refused_and_stores_nothing(tmp_path):
    # Two calibrations under different load once differed 4x in matmul efficiency (0.12 vs 0.49);
    # here both loads fall inside one calibration's repeats.
    samples = repeats({"matmul_rate": [0.49, 0.12, 0.45, 0.3, 0.49]})
    measure, _ = fixed(samples)
    lines = []
    with pytest.raises(NoisyCalibration) as refused:
        calibrate(path=tmp_path / "plan_profile.json", measure=measure, console=lines.append)
    message = str(refused.value)
    assert "matmul at model shapes ranged 6-24.5 GFLOP/s (max/min 4.08, more than 1.5)" in message
    assert "quiet machine" in message and "nothing stored" in message and "\n" not in message
    assert "peak" not in message and "block overhead" not in message  # only what was noisy is named
    assert isinstance(refused.value, ConfigError)  # the CLI prints it as one line and exits with 2
    assert list(tmp_path.iterdir()) == []
    assert any("matmul at model shapes" in line for line in lines)  # the spread was shown before refusing


def test_spread_just_inside_the_limit_is_stored_and_just_outside_is_not(tmp_path):
    inside = repeats({"block_overhead": [1.0, 1.0, MAX_SPREAD, 1.0, 1.0]})
    outside = repeats({"block_overhead": [1.0, 1.0, MAX_SPREAD * 1.01, 1.0, 1.0]})
    calibrate(path=tmp_path / "a" / "p.json", measure=fixed(inside)[0], console=lambda _: None)
    assert (tmp_path / "a" / "p.json").exists()
    with pytest.raises(NoisyCalibration, match="block overhead ranged"):
        calibrate(path=tmp_path / "b" / "p.json", measure=fixed(outside)[0], console=lambda _: None)
    assert not (tmp_path / "b").exists()


@pytest.mark.distributed
def test_the_real_measurement_reports_every_quantity_each_repeat():
    result = measure_spawned(2, 2)
    assert len(result.samples) == 2
    for sample in result.samples:
        assert set(sample) == set(QUANTITIES)
        assert all(math.isfinite(v) and v > 0 for v in sample.values()), sample
        # In FLOP/s, not GFLOP/s: a matmul at a small model's shapes beside another working rank
        # reaches at most about what one rank alone does (with slack for timing noise).
        assert 1e8 < sample["matmul_rate"] < max(result.dtype_peaks.values()) * 1.5
    assert set(result.dtype_peaks) == {"torch.bfloat16", "torch.float32"}
    assert max(s["peak"] for s in result.samples) <= max(result.dtype_peaks.values())
    json.dumps(result.samples)  # plain numbers, storable


def test_first_use_measures_once_even_busy_and_later_uses_read_the_cache(tmp_path):
    """A planner asked about "cpu" before any calibration measures the machine (a busy one too: the
    spread that `--calibrate` would refuse is stored, and said), and every later use, or a rank
    that waited on the lock meanwhile, reads the stored profile without measuring again."""
    import threading

    from moetron.launcher.perf.device_profiles import calibrate_on_first_use

    busy = repeats({"matmul_rate": [1.0, 0.3, 1.0, 1.0, 1.0]})
    measure, calls = fixed(busy)
    path = tmp_path / "plan_profile.json"
    lines: list[str] = []
    got = []
    ranks = [threading.Thread(target=lambda: got.append(calibrate_on_first_use(path, measure, lines.append)))
             for _ in range(3)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    assert len(calls) == 1 and len(got) == 3 and got[0] == got[1] == got[2]
    assert got[0] == cached_cpu_profile(path)
    assert got[0].matmul_efficiency == pytest.approx(QUIET["matmul_rate"] / DTYPE_PEAKS["torch.bfloat16"])
    assert any("measuring this machine once" in line and str(path) in line for line in lines)
    assert any("matmul" in line.lower() and "3.33" in line for line in lines), lines  # the spread, max/min
    assert calibrate_on_first_use(path, measure, lines.append) == got[0] and len(calls) == 1

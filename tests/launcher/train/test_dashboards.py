"""TensorBoard output of a real tiny run, read back with EventAccumulator and through a real
`tensorboard` server; MFU peaks, the CPU peak cache and the disagreement warning."""

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from moetron.launcher.config import load_config
from moetron.launcher.perf.flops import human
from moetron.launcher.perf.mfu import MfuMeter, Peak, cpu_matmul_peak, device_peak, gpu_peak_tflops
from moetron.launcher.train.dashboards import (
    custom_scalars_layout,
    expert_bias_figure,
    expert_load_figure,
    figure_rgb,
    load_ratios,
)
from moetron.launcher.train.trainer import train
from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.transformer import build_model

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
PEAK_TFLOPS = 0.001  # an override, so the run needs no CPU peak measurement
TINY_RUN = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
            "model.moe.num_experts=4", "model.moe.d_expert=32", "train.seq_len=32", "train.batch_size=2",
            "train.steps=4", "train.log_every=2", "train.eval_every=4", "train.eval_batches=1",
            "train.warmup_steps=1", "train.threads=1", f"train.peak_tflops={PEAK_TFLOPS}", "train.name=dash"]

# TINY_RUN's model FLOPs per token, by hand: per layer W_q, W_k, W_v, W_o on D = 32 with 4 query and
# 2 KV heads of 8: 2·32·32 + 2·32·16 = 3,072; the router 32·4 = 128; 2 of 4 SwiGLU experts of 3 × 32
# × 32: 6,144. Two layers: 18,688, plus the head 32 × 320 = 10,240: 28,928 active weights, 6 FLOPs
# each = 173,568; attention scores over the full 32 × 32 square, 12·L·H·Dh·S = 12·2·4·8·32 = 24,576.
TINY_RUN_FLOPS_PER_TOKEN = 198_144


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs")
    path = train(load_config(TINY, [*TINY_RUN, f"train.run_dir={run_dir}"]), console=lambda *_: None)
    return path, [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def events(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "histograms": 0,
                                                                        "tensors": 0})
    acc.Reload()
    return acc


def test_scalars_are_logged_with_the_metrics_values(run):
    path, records = run
    acc = events(path)
    scalars = set(acc.Tags()["scalars"])
    assert {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "mfu_measured",
            "tflops_per_device_measured", "memory_gib", "step_time"} <= scalars
    for layer in (0, 1):
        assert {f"moe/layer_{layer}/{k}" for k in ("dropped_fraction", "router_entropy", "aux_loss", "z_loss",
                                                   "max_load")} <= scalars
    logged = [r for r in records if "mfu" in r]
    assert [e.step for e in acc.Scalars("mfu")] == [r["step"] for r in logged] == [2, 4]
    for event, record in zip(acc.Scalars("loss"), [r for r in records if "loss" in r]):
        assert event.value == pytest.approx(record["loss"], rel=1e-6)
    for record in logged:
        # TINY_RUN_FLOPS_PER_TOKEN model FLOPs per token over the 1e9 FLOP/s peak.
        assert record["tflops_per_device"] == pytest.approx(TINY_RUN_FLOPS_PER_TOKEN * record["tokens_per_s"] / 1e12,
                                                            rel=1e-9)
        assert record["mfu"] == pytest.approx(TINY_RUN_FLOPS_PER_TOKEN * record["tokens_per_s"] / 1e9, rel=1e-9)
        # Dropless routing: the FLOPs counted on the first step are the analytic ones.
        assert record["mfu_measured"] == pytest.approx(record["mfu"], rel=1e-9)
        assert record["memory_gib"] > 0


def test_expert_load_image_histograms_text_and_layout(run):
    path, _ = run
    acc = events(path)
    image = acc.Images("moe/expert_load")[-1]
    counts_LE = []
    for layer in (0, 1):
        hist = acc.Histograms(f"moe/expert_load/layer_{layer}")[-1].histogram_value
        assert list(hist.bucket_limit) == [0.5, 1.5, 2.5, 3.5]
        assert sum(hist.bucket) == 2 * 32 * 2  # every token's two routes of the last micro-batch
        counts_LE.append(list(hist.bucket))
    # The image is, pixel for pixel, the heatmap of the loads the histograms hold (PNG is lossless).
    import io

    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"))
    want = figure_rgb(expert_load_figure(load_ratios(np.array(counts_LE)), [0, 1], step=image.step))
    assert pixels.shape == want.shape == (image.height, image.width, 3)
    assert np.array_equal(pixels, want)
    tensors = acc.Tags()["tensors"]
    assert {"config/text_summary", "accounting/text_summary", "custom_scalars__config__"} <= set(tensors)
    text = acc.Tensors("accounting/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "params_active" in text and "flops_per_token" in text and f"train.peak_tflops = {PEAK_TFLOPS:g}" in text

    from tensorboard.plugins.custom_scalar import layout_pb2

    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    assert charts["MFU (analytic vs measured)"] == ["^mfu$", "^mfu_measured$"]
    assert "dropped fraction per layer" in charts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_tensorboard_server_serves_the_loss_series(run, tmp_path):
    path, records = run
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(path / "tensorboard"), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "tensorboard.log").open("w"))
    url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=.&tag=loss"
    try:
        series, deadline = None, time.monotonic() + 90
        while time.monotonic() < deadline and series is None:
            assert server.poll() is None, (tmp_path / "tensorboard.log").read_text()
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    series = json.loads(response.read())
            except OSError:  # not listening yet, or the run not loaded yet (HTTP 400)
                time.sleep(0.5)
        assert series is not None, "tensorboard did not serve the series within 90 s"
        expected = [(r["step"], r["loss"]) for r in records if "loss" in r]
        assert [(step, pytest.approx(value, rel=1e-6)) for _, step, value in series] == expected
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_gpu_peak_table_and_override():
    assert gpu_peak_tflops("NVIDIA H200") == 989.0
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("NVIDIA B200") == 2250.0
    assert gpu_peak_tflops("Tesla T4") is None
    assert device_peak(torch.device("cpu"), True, override_tflops=123.0).flops == 123e12


def test_cpu_peak_is_measured_once_per_precision_and_cached(tmp_path):
    calls = []

    def fake_measure(m, k, n, dtype):  # ~100 GFLOP/s, a little faster on larger products
        calls.append(dtype)
        return 1e11 * (m * k * n) ** (1 / 3) / 2048

    first, cached = cpu_matmul_peak(torch.bfloat16, directory=tmp_path, measure=fake_measure)
    assert not cached and len(calls) == 3 and first == pytest.approx(1e11 * 4096 ** (2 / 3) * 1024 ** (1 / 3) / 2048)
    again, cached = cpu_matmul_peak(torch.bfloat16, directory=tmp_path, measure=fake_measure)
    assert cached and again == first and len(calls) == 3
    _, cached = cpu_matmul_peak(torch.float32, directory=tmp_path, measure=fake_measure)
    assert not cached and calls[-1] == torch.float32
    assert len(json.loads((tmp_path / "cpu_matmul_peak.json").read_text())) == 2


def test_cpu_peak_of_an_emulated_dtype_takes_seconds_not_minutes(tmp_path):
    """bf16 without AVX512-BF16/AMX runs at ~1 GFLOP/s: the smallest shape tells, larger ones are skipped."""
    shapes = []

    def slow_measure(m, k, n, dtype):
        shapes.append((m, k, n))
        return 1e9

    peak, _ = cpu_matmul_peak(torch.bfloat16, directory=tmp_path, measure=slow_measure)
    assert peak == 1e9 and shapes == [(4096, 256, 1024)]


def test_meter_warns_when_counted_and_analytic_disagree():
    model_cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32,
                            moe=MoEConfig(num_experts=4, top_k=2))
    model = build_model(model_cfg)
    warnings = []
    # The meter's analytic figure is for a model with twice the layers: a 5%+ disagreement.
    meter = MfuMeter(model_cfg.replace(n_layers=4), 16, Peak(1e12, "test"), warn=warnings.append)
    tokens_BS1 = torch.randint(0, 64, (2, 17))
    with meter.step(model, 32):
        model(tokens_BS1[:, :-1]).logits_BSV.sum().backward()
    assert len(warnings) == 1 and "differ from the analytic count" in warnings[0]
    # Both counts with decimal prefixes, as `moetron flops` prints them (433 kFLOP), never 4.332e+05.
    assert f"({human(meter.counted_per_token, 'FLOP')}/token) differ" in warnings[0], warnings[0]
    assert f"analytic count ({human(meter.analytic_per_token, 'FLOP')}/token)" in warnings[0], warnings[0]
    assert not re.search(r"\de[+-]\d", warnings[0]), warnings[0]
    with meter.step(model, 32):  # only the first step is counted
        model(tokens_BS1[:, :-1])
    # The counted step's 32 tokens and its time are left out of the window: 60 s outlasts that step
    # on any machine, however loaded.
    figures = meter.window(tokens=96, seconds=60.0)
    assert figures["mfu_measured"] < figures["mfu"]
    assert meter.window(tokens=0, seconds=0.0) == {}


def test_meter_figures_from_tokens_and_seconds():
    """A window of 640 tokens in 2 s on 2 devices of 2e12 FLOP/s: 320 tokens/s, 160 per device,
    each of TINY_RUN_FLOPS_PER_TOKEN model FLOPs: 3.170304e7 FLOP/s per device, MFU 1.585152e-5."""
    model_cfg = load_config(TINY, TINY_RUN).model
    meter = MfuMeter(model_cfg, 32, Peak(2e12, "test"), world_size=2)
    assert meter.window(tokens=640, seconds=2.0) == {
        "tokens_per_s": 320.0,
        "tflops_per_device": pytest.approx(3.170304e-5, rel=1e-12),
        "mfu": pytest.approx(1.585152e-5, rel=1e-12),
    }


def test_expert_load_heatmap_has_axes_scale_and_true_colours():
    from matplotlib import colormaps

    ratios = load_ratios(np.array([[10, 10, 10, 10], [40, 0, 0, 0]]))
    assert ratios.tolist() == [[1, 1, 1, 1], [4, 0, 0, 0]]
    fig = expert_load_figure(ratios, [1, 3], step=7)
    ax, bar = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("expert", "MoE layer")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "3"]  # the model's layer numbers
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2", "3"]
    assert "mean" in bar.get_ylabel() and bar.get_ylim() == (0.0, 2.0)
    rgb = figure_rgb(fig).astype(int)  # the pixels the dashboards write
    H = rgb.shape[0]
    # Each cell's centre, located through the axes' own transform, has the colour map's colour.
    for (row, col), ratio in (((0, 0), 1.0), ((1, 0), 2.0), ((1, 2), 0.0)):
        x, y = ax.transData.transform((col, row))
        want = np.array(colormaps["viridis"](ratio / 2.0)[:3]) * 255
        assert np.abs(rgb[int(round(H - y)), int(round(x))] - want).max() <= 3, (row, col)
    assert "MoE routing" not in custom_scalars_layout(moe=False)


def test_validation_curve_starts_at_step_zero_near_uniform(tmp_path):
    """Before any update the model predicts ~uniformly over the vocabulary: ln(V) nats."""
    import math

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moetron.launcher.config import load_config
    from moetron.launcher.train.trainer import train

    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
    cfg = load_config(tiny, ["model.d_model=64", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
                             "model.d_ff=128", "model.moe.d_expert=64", "train.seq_len=32", "train.batch_size=4",
                             "train.steps=2", "train.eval_batches=2", "train.peak_tflops=1",
                             f"train.run_dir={tmp_path}"])
    run = train(cfg, console=lambda *_: None)
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    first = acc.Scalars("val_loss")[0]
    assert first.step == 0 and abs(first.value - math.log(cfg.model.vocab_size)) < 0.1


def test_expert_bias_image_over_steps(tmp_path):
    """Aux-loss-free routing writes its biases as an image at every logged step, on a colour scale
    symmetric about zero; without a bias there is no such image."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moetron.launcher.config import load_config
    from moetron.launcher.train.trainer import train

    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
    cfg = load_config(tiny, ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                             "model.d_ff=64", "model.moe.d_expert=32", "train.seq_len=16", "train.batch_size=4",
                             "train.steps=4", "train.log_every=2", "train.eval_batches=1", "train.peak_tflops=1",
                             "model.moe.score=sigmoid", "model.moe.bias_update_rate=0.01", f"train.run_dir={tmp_path}"])
    run = train(cfg, console=lambda *_: None)
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("moe/expert_bias")] == [2, 4]
    fig = expert_bias_figure(np.array([[0.02, -0.01], [0.0, 0.01]]), [0, 1], step=4)
    ax, bar = fig.axes
    assert bar.get_ylim() == (-0.02, 0.02) and (ax.get_xlabel(), ax.get_ylabel()) == ("expert", "MoE layer")

"""`moetron plan`: the layouts it emits are accepted by `moetron train`, its memory and volume
formulas equal what a real run holds and sends, and the command refuses bad input in one line.
The comparison of predicted and measured step times lives in bench/plan_check.py (a benchmark,
not a test); here the slow test checks that run's memory and bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetron.launcher.config import load_config, validate_launch
from moetron.launcher.perf.device_profiles import PROFILES, DeviceProfile, save_profile
from moetron.launcher.perf.planner import Layout, plan, predict_memory
from moetron.launcher.train.optim import build_optimizer
from moetron.model.transformer import build_model

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "configs"


def moetron(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moetron", *argv], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.mark.parametrize("config, gpus, per_node, batch", [("tiny.yaml", 4, 8, 16), ("tiny.yaml", 6, 2, 24),
                                                           ("deepseek-moe-16b.yaml", 16, 8, 512)])
def test_every_layout_it_emits_is_accepted_by_train(config, gpus, per_node, batch):
    cfg = load_config(CONFIGS / config, ["train.grad_accum=1", f"train.batch_size={batch}"], world_size=gpus)
    result = plan(cfg, gpus, PROFILES["H100"], gpus_per_node=per_node)
    assert result.ranked, "nothing fits"
    emitted = result.ranked + result.dropped
    for p in emitted:
        again = load_config(CONFIGS / config, [f"train.batch_size={batch}", *p.layout.overrides()], world_size=gpus)
        validate_launch(again, gpus)
        assert again.parallel == p.layout.parallel
    # Every dimension is explored, not one corner of the space.
    seen = {field: {getattr(p.layout.parallel, field) for p in emitted} for field in ("tp", "pp", "ep", "dp_mode")}
    if gpus == 4:
        assert seen["tp"] >= {1, 2, 4} and seen["pp"] >= {1, 2, 4} and seen["ep"] >= {1, 2, 4}
        assert seen["dp_mode"] == {"fsdp", "hsdp", "ddp", "zero1"}
    times = [p.step_s for p in result.ranked]
    assert times == sorted(times)


def test_what_does_not_fit_is_dropped_with_the_reason():
    cfg = load_config(CONFIGS / "mixtral-8x7b.yaml", ["train.batch_size=64", "train.grad_accum=1"], world_size=8)
    small = DeviceProfile(**{**PROFILES["H100"].to_dict(), "memory_bytes": 40e9})
    result = plan(cfg, 8, small, gpus_per_node=8)
    assert result.dropped and all("GiB per rank" in p.reason for p in result.dropped)
    assert all(p.memory["total"] <= 0.9 * 40e9 for p in result.ranked)
    # 47B parameters with AdamW do not fit replicated on one 40 GB device.
    assert not any(p.layout.parallel.dp_mode == "ddp" and p.layout.parallel.tp == 1 and p.layout.parallel.ep == 1
                   for p in result.ranked)


def test_predicted_weights_grads_and_optimizer_equal_a_real_model():
    cfg = load_config(CONFIGS / "tiny.yaml", ["train.precision=fp32"])
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.train)
    model(torch.randint(0, cfg.model.vocab_size, (2, 16))).logits_BSV.sum().backward()
    optimizer.step()
    mem = predict_memory(cfg, Layout(cfg.parallel))
    weights = sum(p.nbytes for p in model.parameters())
    assert mem["weights"] == weights and mem["grads"] == sum(p.grad.nbytes for p in model.parameters())
    assert mem["optimizer"] == sum(v.nbytes for s in optimizer.state.values() for v in s.values() if v.ndim > 0)


def test_per_kind_bandwidth_fsdp_copies_and_oversubscription_enter_the_time_as_stated():
    """The CPU profile's refinements, each against its formula: a collective kind at half the bus
    bandwidth takes its bytes' time twice; FSDP's copies move 2× the gathered and 4× the scattered
    bytes through memory; a bubble on an oversubscribed CPU costs 1/oversubscription."""
    from moetron.launcher.perf.comm_volume import predict_step
    from moetron.launcher.perf.planner import WIRE_FACTOR, predict

    cfg = load_config(CONFIGS / "tiny.yaml", ["train.precision=fp32", "train.batch_size=16"])
    base = DeviceProfile("cpu", 1e11, 6e9, 0.5, 1e9, 0.0, 1e9, 0.0, hbm_bw=1e10, dp_overlap=0.0)
    fsdp = Layout(load_config(CONFIGS / "tiny.yaml", ["parallel.dp=4"], world_size=4).parallel)
    plain, slow = (predict(cfg, fsdp, DeviceProfile(**{**base.to_dict(), "kind_bw": kind}), gpus_per_node=4)
                   for kind in ({}, {"reduce_scatter": 0.5}))
    traffic = predict_step(cfg.model, fsdp.parallel, batch=16, seq_len=cfg.train.seq_len)
    scattered = sum(t.bytes for t in traffic if t.kind == "reduce_scatter") / 4  # per rank
    gathered = sum(t.bytes for t in traffic if t.kind == "all_gather") / 4
    assert slow.times["comm_total"] - plain.times["comm_total"] == pytest.approx(
        scattered * WIRE_FACTOR["reduce_scatter"](4) / 1e9)
    ddp = Layout(load_config(CONFIGS / "tiny.yaml", ["parallel.dp=4", "parallel.dp_mode=ddp"], world_size=4).parallel)
    no_copies = predict(cfg, ddp, base, gpus_per_node=4).times["memory_bound"]
    # The optimizer reads and writes what the rank holds (DDP: all of it, FSDP: a quarter); beyond
    # that the two differ by FSDP's copies only.
    def optimizer_pass(layout):
        m = predict_memory(cfg, layout)
        return 2 * (m["weights"] + m["grads"] + m["optimizer"]) / 1e10

    copies = plain.times["memory_bound"] - optimizer_pass(fsdp) - (no_copies - optimizer_pass(ddp))
    assert copies == pytest.approx((2 * gathered + 4 * scattered) / 1e10)
    pp = Layout(load_config(CONFIGS / "tiny.yaml", ["parallel.pp=2", "parallel.microbatches=2"], world_size=2).parallel)
    one, two = (predict(cfg, pp, DeviceProfile(**{**base.to_dict(), "oversubscription": o}), gpus_per_node=2)
                for o in (1.0, 2.0))
    assert one.bubble == pytest.approx(0.5) and two.bubble == pytest.approx(0.25)


def test_plan_cli_json_and_overrides(tmp_path):
    out = moetron("plan", "configs/tiny.yaml", "--gpus", "4", "--gpu", "H100", "--json", "--top", "3")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["ranked"]) == 3 and data["considered"] > 100
    first = data["ranked"][0]
    assert {"weights", "grads", "optimizer", "activations", "buffers", "total"} <= set(first["memory"])
    assert set(first["link_bytes"]) == {"intra", "inter"} and first["tokens_per_s"] > 0 and 0 < first["mfu"] < 1
    best = moetron("plan", "configs/tiny.yaml", "--gpus", "4", "--gpu", "H100", "--overrides-only")
    assert best.stdout.split() == first["layout"]["overrides"]
    table = moetron("plan", "configs/tiny.yaml", "--gpus", "4", "--gpu", "A100", "--top", "2")
    assert table.returncode == 0 and "best as overrides: parallel.pp=" in table.stdout


@pytest.mark.parametrize("argv, message", [
    (["configs/tiny.yaml", "--gpus", "4", "--gpu", "V100"], "--gpu 'V100': unknown; choose one of H100"),
    (["configs/tiny.yaml", "--gpus", "4", "--gpu", "H100", "--interconnect", "carrier-pigeon"], "--interconnect"),
    (["configs/tiny.yaml", "--gpus", "0"], "--gpus 0: must be >= 1"),
    (["configs/tiny.yaml"], "needs a CONFIG and --gpus N"),
    (["configs/tiny.yaml", "--gpus", "4", "--gpu", "cpu"], "run `moetron plan --calibrate` first"),
])
def test_bad_input_is_one_line(tmp_path, argv, message):
    out = moetron("plan", *argv, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_plan_check_memory_and_bytes_match_a_measured_run(tmp_path):
    """bench/plan_check.py on three layouts of 4 gloo ranks: communication bytes equal the counted
    ones, and peak memory per rank is within 15% of the allocator's measurement."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    # A profile is needed to predict times; its numbers do not enter memory or bytes.
    save_profile(DeviceProfile("cpu", 1e10, 6e9, 0.8, 1e9, 1e-4, 1e9, 1e-4, hbm_bw=1e10, dp_overlap=0.0),
                 tmp_path / "moetron" / "plan_profile.json")
    out = subprocess.run([sys.executable, "bench/plan_check.py", "--layouts", "dp4_fsdp", "tp2_ep2", "pp2_dp2_1f1b",
                          "--steps", "1"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    assert len(rows) == 3
    for r in rows:
        assert r["predicted"]["comm_bytes"] == pytest.approx(r["measured"]["comm_bytes"], rel=1e-3), r
        assert r["predicted"]["memory"] == pytest.approx(r["measured"]["memory"], rel=0.15), r


def test_expert_imbalance_scales_only_the_routed_rows_of_expert_parallel_layouts():
    """The busiest ep rank's routes over the mean multiply the routed rows (their activations and
    the received all-to-all buffer); capacity caps it; without EP nothing changes."""
    from moetron.launcher.perf.flops import activation_elements_per_token

    cfg = load_config(CONFIGS / "tiny.yaml", ["train.precision=fp32", "train.batch_size=16", "parallel.dp=4",
                                              "parallel.ep=4"], world_size=4)
    layout = Layout(cfg.parallel)
    one, two = (predict_memory(cfg, layout, expert_imbalance=x) for x in (1.0, 2.0))
    m = cfg.model
    per_route = activation_elements_per_token(m)["moe_layer"] - activation_elements_per_token(
        m, expert_imbalance=0.0)["moe_layer"]  # the routed rows' elements per token, balanced
    n_moe = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    tokens = 16 // 4 * cfg.train.seq_len
    assert two["activations"] - one["activations"] == pytest.approx(n_moe * per_route * tokens * 4, rel=1e-6)
    assert two["buffers"] - one["buffers"] == pytest.approx(tokens * m.moe.top_k * m.d_model * 4)
    capped = load_config(CONFIGS / "tiny.yaml", ["train.precision=fp32", "train.batch_size=16", "parallel.dp=4",
                                                 "parallel.ep=4", "model.moe.capacity_factor=1.25"], world_size=4)
    assert predict_memory(capped, layout, expert_imbalance=2.0) == predict_memory(capped, layout,
                                                                                   expert_imbalance=1.25)
    dp = load_config(CONFIGS / "tiny.yaml", ["train.precision=fp32", "train.batch_size=16", "parallel.dp=4"],
                     world_size=4)
    assert predict_memory(dp, Layout(dp.parallel), expert_imbalance=2.0) == predict_memory(dp, Layout(dp.parallel))

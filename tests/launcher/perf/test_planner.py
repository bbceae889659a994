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

from moetron.launcher.config import ConfigError, load_config, sequences_per_micro_batch, validate_launch
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


def test_a_micro_batch_size_set_is_the_only_one_the_plan_uses_and_train_checks_it():
    # 24 sequences on 4 ranks: without the setting each section's fastest fitting variant has the least
    # accumulation (micro-batches of 3 to 24 sequences); with train.micro_batch_size=2, only the
    # accumulation that gives 2 (dp4 ga3, dp2 ga6, ...).
    free = plan(load_config(CONFIGS / "tiny.yaml", ["train.grad_accum=1", "train.batch_size=24"], world_size=4), 4,
                PROFILES["H100"], gpus_per_node=4)
    pinned = plan(load_config(CONFIGS / "tiny.yaml", ["train.grad_accum=1", "train.batch_size=24",
                                                      "train.micro_batch_size=2"], world_size=4), 4,
                  PROFILES["H100"], gpus_per_node=4)
    sizes = lambda result: {sequences_per_micro_batch(load_config(  # noqa: E731
        CONFIGS / "tiny.yaml", ["train.batch_size=24", *p.layout.overrides()], world_size=4)) for p in result.ranked}
    assert pinned.ranked and sizes(pinned) == {2} and sizes(free) - {2}
    for p in pinned.ranked:
        validate_launch(load_config(CONFIGS / "tiny.yaml", ["train.batch_size=24", "train.micro_batch_size=2",
                                                            *p.layout.overrides()], world_size=4), 4)
    wrong = load_config(CONFIGS / "tiny.yaml", ["train.batch_size=24", "train.micro_batch_size=2", "parallel.dp=4",
                                                "train.grad_accum=1"], world_size=4)
    with pytest.raises(ConfigError, match=r"train.micro_batch_size = 2: the layout gives 6 sequences per micro-batch .*"
                                          r"set train.grad_accum=3, or train.micro_batch_size=0"):
        validate_launch(wrong, 4)


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


# tiny.yaml's parameters, by hand: per block two RMSNorm gains, W_q (8 heads of 32), W_k and W_v
# (4 heads each) and W_o on D = 256, the router (8 × 256) and 8 SwiGLU experts (3 matrices of
# 256 × 512): 512 + 131,072 + 65,536 + 2,048 + 3,145,728 = 3,344,896; then 4 blocks, the embedding
# (320 × 256), the final norm (256) and the untied head (320 × 256): 13,543,680.


def test_per_kind_bandwidth_fsdp_copies_and_oversubscription_enter_the_time_as_stated():
    """The CPU profile's refinements, each against its formula: a collective kind at half the bus
    bandwidth takes its bytes' time twice; FSDP's copies move 2× the gathered and 4× the scattered
    bytes through memory; a bubble on an oversubscribed CPU costs 1/oversubscription."""
    from moetron.launcher.perf.planner import predict

    cfg = load_config(CONFIGS / "tiny.yaml", ["train.precision=fp32", "train.batch_size=16"])
    base = DeviceProfile("cpu", 1e11, 6e9, 0.5, 1e9, 0.0, 1e9, 0.0, hbm_bw=1e10, dp_overlap=0.0)
    fsdp = Layout(load_config(CONFIGS / "tiny.yaml", ["parallel.dp=4"], world_size=4).parallel)
    plain, slow = (predict(cfg, fsdp, DeviceProfile(**{**base.to_dict(), "kind_bw": kind}), gpus_per_node=4)
                   for kind in ({}, {"reduce_scatter": 0.5}))
    # Per rank, FSDP over 4 ranks reduce-scatters every fp32 gradient once (the full input):
    # 13,543,680 × 4 B = 54,174,720 B, and gathers every fp32 parameter twice (forward, then again
    # for backward): 108,349,440 B.
    # A reduce-scatter over 4 ranks puts 3/4 of its input on the wire, 40,631,040 B: 0.04063104 s
    # at 1 GB/s, 0.08126208 s at 0.5 GB/s, 0.04063104 s more.
    assert slow.times["comm_total"] - plain.times["comm_total"] == pytest.approx(0.04063104, rel=1e-9)
    ddp = Layout(load_config(CONFIGS / "tiny.yaml", ["parallel.dp=4", "parallel.dp_mode=ddp"], world_size=4).parallel)
    no_copies = predict(cfg, ddp, base, gpus_per_node=4).times["memory_bound"]
    # The two differ by FSDP's copies (gathered bytes read + written, scattered bytes packed and
    # divided): 2 × 108,349,440 + 4 × 54,174,720 = 433,397,760 B more; and by the optimizer's pass,
    # which reads and writes what the rank holds: weights, grads and both AdamW moments, 4 + 4 + 8
    # bytes per parameter, all of them under DDP and a quarter under FSDP: 2 × 16 × 13,543,680 × 3/4
    # = 325,048,320 B less. Net 108,349,440 B at 10 GB/s: 0.010834944 s.
    assert plain.times["memory_bound"] - no_copies == pytest.approx(0.010834944, rel=1e-9)
    pp = Layout(load_config(CONFIGS / "tiny.yaml", ["parallel.pp=2", "parallel.microbatches=2"], world_size=2).parallel)
    one, two = (predict(cfg, pp, DeviceProfile(**{**base.to_dict(), "oversubscription": o}), gpus_per_node=2)
                for o in (1.0, 2.0))
    # 1F1B over 2 stages and 2 micro-batches idles (2 - 1) / 2 of its busy time; half that with 2 ranks a core.
    assert one.bubble == pytest.approx(0.5) and two.bubble == pytest.approx(0.25)
    # So a step is 1.5 busy times at oversubscription 1 and 1.25 at 2; the busy time is the same,
    # and the bubble is the step less the busy time: 1/3 of the step, then 1/5 of it.
    assert one.step_s / 1.5 == pytest.approx(two.step_s / 1.25)
    assert one.times["bubble"] == pytest.approx(one.step_s / 3)
    assert two.times["bubble"] == pytest.approx(two.step_s / 5)


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


def test_plan_cli_json_with_dropped_layouts_says_what_the_table_says(tmp_path):
    """A device of 100 MB: of tiny's 156 parallel sections on 4 ranks, 59 fit and 97 do not. The
    JSON carries the same counts, rows and leanest dropped layout as the table."""
    save_profile(DeviceProfile("cpu", 1e11, 1e8, 0.5, 1e9, 1e-5, 1e9, 1e-5, hbm_bw=1e10, dp_overlap=0.0),
                 tmp_path / "moetron" / "plan_profile.json")
    argv = ("plan", "configs/tiny.yaml", "--gpus", "4", "--gpus-per-node", "4", "--gpu", "cpu", "--top", "1000")
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    out, table = moetron(*argv, "--json", env=env), moetron(*argv, env=env)
    assert out.returncode == 0, out.stderr
    assert table.returncode == 0, table.stderr
    data = json.loads(out.stdout)
    assert (len(data["ranked"]), len(data["dropped"])) == (59, 97)
    assert (f"{data['considered']} layouts valid, 59 parallel sections fit, 97 do not"
            in " ".join(table.stdout.split()))
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in table.stdout.splitlines()
            if line.startswith("│")]
    assert [(int(r[0]), r[1], r[2]) for r in rows] == [
        (p["rank"], p["layout"]["label"], f"{p['step_s']:.3g}") for p in data["ranked"]]
    for p in data["dropped"]:
        assert not p["fits"] and p["memory"]["total"] > 0.9 * 1e8
        assert p["reason"] == f"needs {p['memory']['total'] / 2**30:.1f} GiB per rank, more than 90% of 0 GiB"
    totals = [p["memory"]["total"] for p in data["dropped"]]
    assert totals == sorted(totals)
    leanest = data["dropped"][0]
    assert f"e.g. {leanest['layout']['label']}: {leanest['reason']}" in table.stdout
    # --where filters the dropped layouts as it does the ranked ones.
    where = json.loads(moetron(*argv, "--json", "--where", "dp_mode=ddp", env=env).stdout)
    assert where["dropped"] == [p for p in data["dropped"] if "parallel.dp_mode=ddp" in p["layout"]["overrides"]]
    assert where["dropped"] and len(where["dropped"]) < len(data["dropped"])


@pytest.mark.parametrize("argv, message", [
    (["configs/tiny.yaml", "--gpus", "4", "--gpu", "V100"], "--gpu 'V100': unknown; choose one of H100"),
    (["configs/tiny.yaml", "--gpus", "4", "--gpu", "H100", "--interconnect", "carrier-pigeon"], "--interconnect"),
    (["configs/tiny.yaml", "--gpus", "0"], "--gpus 0: must be >= 1"),
    # No layout is valid (dp = 6 does not split 16 sequences, nor pp, tp or cp the model): said in
    # the plan's terms, not as the config's own dp inferred from --gpus.
    (["configs/tiny.yaml", "--gpus", "6"], "no layout of configs/tiny.yaml is valid on 6 devices: no split into pp"),
    (["configs/tiny.yaml"], "needs a CONFIG and --gpus N"),
])
def test_bad_input_is_one_line(tmp_path, argv, message):
    out = moetron("plan", *argv, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_plan_check_memory_and_bytes_match_a_measured_run(tmp_path, monkeypatch, forked_script, bench_script):
    """bench/plan_check.py on six layouts of 4 gloo ranks: communication bytes equal the counted
    ones, and peak memory per rank is within 15% of the allocator's measurement. The script's
    workers run on 4 ranks forked as its torchrun launch would start them (tests/forked_ranks.py);
    its `compare` sets the predictions beside what they measured."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # A profile is needed to predict times; its numbers do not enter memory or bytes.
    save_profile(DeviceProfile("cpu", 1e10, 6e9, 0.8, 1e9, 1e-4, 1e9, 1e-4, hbm_bw=1e10, dp_overlap=0.0),
                 tmp_path / "moetron" / "plan_profile.json")
    # No warm-up or timed steps: bytes are counted on the first step and memory probed on the second,
    # once the optimizer state exists; only step times (not checked here) need more.
    # Accumulation under FSDP keeps gradients sharded (dp4_fsdp_ga4: 1.26× the prediction when every
    # micro-batch skipped its reduce-scatter); GPipe keeps every micro-batch in flight, 1F1B pp of them
    # (4 micro-batches, pp = 2), and the pipeline's FSDP stages hold whole gradients until its step ends.
    # ZeRO-1 (torch's replicate) holds its gathered weights beside the gradients accumulated so far
    # (dp4_zero1_ga2: 1.35× the prediction without them).
    layouts = ["dp4_fsdp", "dp4_fsdp_ga4", "tp2_ep2", "pp2_dp2_gpipe4", "pp2_dp2_1f1b4", "dp4_zero1_ga2"]
    runs = forked_script(ROOT / "bench" / "plan_check.py", 4, ["--steps", "0", "--warmup", "0", "--worker", *layouts],
                         900)
    rows = bench_script("plan_check").compare(runs)
    assert [r["layout"] for r in rows] == layouts
    for r in rows:
        assert r["predicted"]["comm_bytes"] == pytest.approx(r["measured"]["comm_bytes"], rel=1e-3), r
        assert r["predicted"]["memory"] == pytest.approx(r["measured"]["memory"], rel=0.15), r


def test_expert_imbalance_scales_only_the_routed_rows_of_expert_parallel_layouts():
    """The busiest ep rank's routes over the mean multiply the routed rows (their activations and
    the received all-to-all buffer); capacity caps it; without EP nothing changes."""
    cfg = load_config(CONFIGS / "tiny.yaml", ["train.precision=fp32", "train.batch_size=16", "parallel.dp=4",
                                              "parallel.ep=4"], world_size=4)
    layout = Layout(cfg.parallel)
    one, two = (predict_memory(cfg, layout, expert_imbalance=x) for x in (1.0, 2.0))
    # A rank runs 16 / 4 sequences of 256 tokens at once, fp32. Per token and MoE layer each of
    # its K = 2 routes keeps the dispatched row and the expert's output row (D = 256 each) and
    # SwiGLU's four hidden tensors (gate, up, silu(gate), product: 4 × 512); twice the routes
    # (imbalance 2) keep that again, in each of the 4 MoE layers.
    # 1,024 tokens × 2 routes × (2 × 256 + 4 × 512 = 2,560) = 5,242,880 elements per layer; × 4 layers
    # × 4 B = 83,886,080 B more.
    assert two["activations"] - one["activations"] == pytest.approx(83_886_080, rel=1e-6)
    # The all-to-all receive buffer holds the K routes' rows of D fp32, 1,024 × 2 × 256 × 4 B =
    # 2,097,152 B; twice the routes, twice that.
    assert two["buffers"] - one["buffers"] == pytest.approx(2_097_152, rel=1e-9)
    capped = load_config(CONFIGS / "tiny.yaml", ["train.precision=fp32", "train.batch_size=16", "parallel.dp=4",
                                                 "parallel.ep=4", "model.moe.capacity_factor=1.25"], world_size=4)
    assert predict_memory(capped, layout, expert_imbalance=2.0) == predict_memory(capped, layout,
                                                                                   expert_imbalance=1.25)
    capped_one = predict_memory(capped, layout)
    # Capacity 1.25 lets the busiest rank take a quarter more routes than the mean: 83,886,080 / 4 B.
    assert predict_memory(capped, layout, expert_imbalance=2.0)["activations"] - capped_one["activations"] == (
        pytest.approx(20_971_520, rel=1e-6))
    dp = load_config(CONFIGS / "tiny.yaml", ["train.precision=fp32", "train.batch_size=16", "parallel.dp=4"],
                     world_size=4)
    assert predict_memory(dp, Layout(dp.parallel), expert_imbalance=2.0) == predict_memory(dp, Layout(dp.parallel))

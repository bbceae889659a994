"""Checkpoints across layouts, for real (gloo ranks with torchrun's environment, forked from one
process that imported the training stack once: tests/forked_ranks.py): 4 + resume + 4 steps on TP2×EP2 equals
8 straight bit for bit; its step-4 checkpoint resumes on one process with the next step's loss
within 1e-6 relative of the uninterrupted run (tests/launcher/checkpoint/test_reshard.py resumes it under
every other layout). Three launches.

Asynchronous saves on two ranks (DP2×EP2): 3 steps + resume + 3 steps, saving every 2 in the
background, equals 6 straight steps saved synchronously, bit for bit, and every checkpoint it
published is complete and verified. Three launches (~30 s).

Pipeline stages reshard too: a PP2×TP2 step-10 checkpoint resumes on one process and on DP2 with
the uninterrupted run's step-11 loss within 1e-6 relative. Two launches (~25 s).

An interleaved pipeline (PP2 × vpp 2: two stages per rank) and PP2 × TP2 with sequence parallel
train like one process (aux loss off, as the pipeline takes it per micro-batch: losses within 1e-5
relative for 11 steps), count its FLOPs, and their step-10 checkpoints resume on one process. One
launch each (~15 s, ~25 s).

Expert-tensor parallel (TP2 × ETP2 × EP2 × DP2, sequence parallel): 4 + resume + 4 steps equal 8
straight bit for bit, with every expert weight saved whole (E, D, F); the step-4 checkpoint loads
on one process bit for bit (trained on with lr 0, its next checkpoint holds the same weights) with
the next loss within 1e-6 relative, and that one-process checkpoint loads back on the 4-rank layout
bit for bit the same way. The FLOPs counted on a real step are one process's plus only the
router's, which every tp rank repeats. Four launches and one process."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from moetron.launcher.checkpoint.folders import COMPLETE
from moetron.launcher.checkpoint.io import MANIFEST, verify_checkpoint
from moetron.launcher.checkpoint.store import consolidated_model_state
from moetron.launcher.config import load_config
from moetron.launcher.perf.flops import flops_by_component, flops_per_token
from moetron.launcher.train.trainer import train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "model.moe.d_expert=64", "train.seq_len=32", "train.batch_size=4", "train.log_every=1",
         "train.eval_every=100", "train.eval_batches=1", "train.warmup_steps=2", "train.precision=fp32",
         "train.threads=1"]
KEYS = ("step", "loss", "lr", "tokens", "grad_norm", "val_loss")


@pytest.fixture(scope="session")
def torchrun(forked_ranks):
    """torchrun(nproc, config, *overrides): `moetron train` on `nproc` gloo ranks, as torchrun would
    start them (forked from one process: the forked_ranks fixture)."""

    def run(nproc: int, config: str, *overrides: str) -> None:
        result = forked_ranks({"ranks": nproc, "argv": ["train", str(CONFIGS / config), *SMALL, *overrides]})
        assert result["codes"] == [0] * nproc, json.dumps(result, indent=1)

    return run


def records(run: Path) -> list[dict]:
    return [{k: r.get(k) for k in KEYS} for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def runs(torchrun, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    # The uninterrupted run leaves parallel.dp out, as Megatron-LM users do: 4 ranks / tp 2 gives the
    # preset's dp 2, so its losses must equal those of the preset with dp written out.
    torchrun(4, "tiny.yaml", f"train.run_dir={root}", "train.name=straight", "train.steps=8",
             "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true")
    torchrun(4, "tiny-tp2-ep2.yaml", f"train.run_dir={root}", "train.name=split", "train.steps=8",
             "--exit-after", "4")
    shutil.copytree(root / "split", root / "one")
    torchrun(4, "tiny-tp2-ep2.yaml", f"train.run_dir={root}", "train.name=split", "train.steps=8")
    return root


def test_tp2_ep2_resume_is_bit_exact(runs):
    assert records(runs / "split") == records(runs / "straight")
    a = consolidated_model_state(runs / "split" / "checkpoints" / "step-00000008")
    b = consolidated_model_state(runs / "straight" / "checkpoints" / "step-00000008")
    assert a["layers.0.ffn.experts.w_up_EDF"].shape[0] == 8  # experts saved whole, not one ep rank's half
    assert all(a[k].equal(b[k]) for k in b)


def _next_loss_matches(resumed: Path, straight: Path, step: int = 11) -> None:
    got = records(resumed)[-1]
    want = next(r for r in records(straight) if r["step"] == step)
    assert got["step"] == step
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


def test_tp2_ep2_checkpoint_resumes_on_one_process(runs):
    cfg = load_config(CONFIGS / "tiny.yaml", [*SMALL, f"train.run_dir={runs}", "train.name=one", "train.steps=5"])
    train(cfg, console=lambda *_: None)
    _next_loss_matches(runs / "one", runs / "straight", step=5)


@pytest.fixture(scope="module")
def async_runs(torchrun, tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    common = ("parallel.dp=2", "parallel.ep=2", f"train.run_dir={root}", "train.steps=6",
              "train.checkpoint.every=2", "train.checkpoint.keep=10")
    torchrun(2, "tiny.yaml", *common, "train.name=sync")
    for _ in range(2):  # stopped after step 3 (as a preemption would), then resumed to the end
        torchrun(2, "tiny.yaml", *common, "train.name=async", "train.checkpoint.async=true", "--exit-after", "3")
    return root


def test_async_save_on_two_ranks_resumes_bit_exactly(async_runs):
    assert records(async_runs / "async") == records(async_runs / "sync")
    published = {}
    for run in ("sync", "async"):
        ckpts = async_runs / run / "checkpoints"
        published[run] = sorted(p.name for p in ckpts.glob("step-*"))
        for name in published[run]:
            assert (ckpts / name / COMPLETE).is_file() and (ckpts / name / MANIFEST).is_file(), name
            assert verify_checkpoint(ckpts / name, hash_files=True) is None, name
        assert not list(ckpts.glob(".tmp-*"))
        assert (ckpts / "latest").read_text().strip() == "step-00000006"
    assert published["sync"] == ["step-00000002", "step-00000004", "step-00000006"]
    assert published["async"] == ["step-00000002", "step-00000003", "step-00000004", "step-00000006"]
    a = consolidated_model_state(async_runs / "async" / "checkpoints" / "step-00000006")
    b = consolidated_model_state(async_runs / "sync" / "checkpoints" / "step-00000006")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in b)


def test_two_ranks_pass_over_a_checkpoint_found_corrupt_while_loading(torchrun, async_runs, tmp_path):
    """An automatic resume on two ranks whose newest checkpoint has a flipped byte in rank 1's
    shard (seen by its hash as it loads, on the rank that reads it): every rank falls back to
    step 4 together, the damaged one is set aside, and steps 5-6 repeat the run's own numbers."""
    run = Path(shutil.copytree(async_runs / "sync", tmp_path / "sync"))
    ckpts = run / "checkpoints"
    shard = ckpts / "step-00000006" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    torchrun(2, "tiny.yaml", "parallel.dp=2", "parallel.ep=2", f"train.run_dir={tmp_path}", "train.name=sync",
             "train.steps=7", "train.checkpoint.every=2", "train.checkpoint.keep=10")
    assert (ckpts / "damaged-step-00000006" / "__1_0.distcp").read_bytes() == bytes(data)
    assert sorted(p.name for p in ckpts.glob("step-*")) == [f"step-0000000{i}" for i in (2, 4, 6, 7)]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    noted = [r for r in recs if "damaged_checkpoints" in r]
    assert noted == [{"step": 4, "damaged_checkpoints": 1, "resumed_from": str(ckpts / "step-00000004"),
                      "set_aside": [str(ckpts / "damaged-step-00000006")]}]
    # (The 6-step run evaluated at its last step; this one, going on to 7, did not at step 6.)
    resumed = [{k: r.get(k) for k in KEYS if k != "val_loss"} for r in recs if r not in noted and r["step"] <= 6]
    assert resumed == [{k: v for k, v in r.items() if k != "val_loss"} for r in records(async_runs / "sync")]


@pytest.fixture(scope="module")
def pp_runs(torchrun, tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    # The uninterrupted run: its step-10 checkpoint is the one resumed elsewhere, and its step 11
    # the loss to reach.
    torchrun(4, "tiny.yaml", f"train.run_dir={root}", "train.name=straight", "train.steps=11",
             "train.checkpoint.every=10", "parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2")
    return root


def test_pp2_tp2_checkpoint_resumes_on_one_process_and_dp2(torchrun, pp_runs):
    ckpt = pp_runs / "straight" / "checkpoints" / "step-00000010"
    cfg = load_config(CONFIGS / "tiny.yaml", [*SMALL, f"train.run_dir={pp_runs}", "train.name=one", "train.steps=11"])
    train(cfg, resume=str(ckpt), console=lambda *_: None)
    _next_loss_matches(pp_runs / "one", pp_runs / "straight")
    torchrun(2, "tiny.yaml", f"train.run_dir={pp_runs}", "train.name=dp2", "train.steps=11", "parallel.dp=2",
             "--resume", str(ckpt))
    _next_loss_matches(pp_runs / "dp2", pp_runs / "straight")


PIPELINES = {
    "interleaved": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.microbatches=2", "parallel.schedule=interleaved_1f1b"]),
    "pp2_tp2_sp": (4, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.microbatches=2"]),
}


@pytest.mark.parametrize("layout", list(PIPELINES))
def test_pipeline_trains_like_one_process_and_its_checkpoint_resumes_there(torchrun, tmp_path, layout):
    ranks, parallel = PIPELINES[layout]
    # Without the aux loss, which the pipeline takes per micro-batch and one process per batch.
    four_layers = [*SMALL, "model.n_layers=4", "model.moe.aux_loss_coef=0", f"train.run_dir={tmp_path}"]
    torchrun(ranks, "tiny.yaml", *four_layers[len(SMALL):], f"train.name={layout}", "train.steps=11",
             "train.checkpoint.every=10", *parallel)
    train(load_config(CONFIGS / "tiny.yaml", [*four_layers, "train.name=one", "train.steps=11"]), console=lambda *_: None)
    got, want = records(tmp_path / layout), records(tmp_path / "one")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 12))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), (g, w)
    # The FLOPs counted on a real step, summed over the ranks' unequal stages, are one process's,
    # plus what every tp rank repeats: the router and (etp = 1) the routed experts, ~1.9× in all.
    counted = {name: counted_over_analytic(tmp_path / name) for name in (layout, "one")}
    tp = 2 if "parallel.tp=2" in parallel else 1
    extra = tp_repeated_flops(load_config(CONFIGS / "tiny.yaml", four_layers), tp=tp, etp=1)
    assert counted[layout] == pytest.approx(counted["one"] + extra, rel=1e-3), counted
    ckpt = tmp_path / layout / "checkpoints" / "step-00000010"
    cfg = load_config(CONFIGS / "tiny.yaml", [*four_layers, "train.name=resumed", "train.steps=11"])
    train(cfg, resume=str(ckpt), console=lambda *_: None)
    _next_loss_matches(tmp_path / "resumed", tmp_path / layout)


def counted_over_analytic(run: Path, after: int = 0) -> float:
    """FLOPs counted on the run's counted step over the analytic count (per token), as logged
    after step `after` (a resumed run keeps the records of the run it resumed)."""
    ratios = [r["mfu_measured"] / r["mfu"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "mfu_measured" in r and r["step"] > after]
    assert ratios, run
    return ratios[0]


def tp_repeated_flops(cfg, *, tp: int, etp: int) -> float:
    """FLOPs per token that the tp ranks repeat, over the analytic count: the router (replicated
    under TP) and, with etp = 1, the routed experts, each run tp - 1 extra times."""
    parts = flops_by_component(cfg.model, cfg.train.seq_len)
    repeated = parts["router"] + (parts["experts"] if etp == 1 else 0)
    return (tp - 1) * repeated / flops_per_token(cfg.model, cfg.train.seq_len)


ETP = ("parallel.etp=2",)  # on top of tiny-tp2-ep2.yaml: tp 2, dp 2, ep 2, sequence parallel
FROZEN = ("train.lr=0", "train.min_lr=0")  # AdamW with lr 0 leaves every weight as it is, bit for bit


@pytest.fixture(scope="module")
def etp_runs(torchrun, tmp_path_factory):
    root = tmp_path_factory.mktemp("etp")
    torchrun(4, "tiny-tp2-ep2.yaml", *ETP, f"train.run_dir={root}", "train.name=straight", "train.steps=8")
    torchrun(4, "tiny-tp2-ep2.yaml", *ETP, f"train.run_dir={root}", "train.name=split", "train.steps=8",
             "--exit-after", "4")
    shutil.copytree(root / "split", root / "one")
    torchrun(4, "tiny-tp2-ep2.yaml", *ETP, f"train.run_dir={root}", "train.name=split", "train.steps=8")
    # One process resumes the step-4 checkpoint and takes two frozen steps, saving after each.
    cfg = load_config(CONFIGS / "tiny.yaml", [*SMALL, *FROZEN, f"train.run_dir={root}", "train.name=one",
                                              "train.steps=6", "train.checkpoint.every=1"])
    train(cfg, console=lambda *_: None)
    # And back: the 4-rank layout resumes the one-process step-5 checkpoint for one frozen step.
    torchrun(4, "tiny-tp2-ep2.yaml", *ETP, *FROZEN, f"train.run_dir={root}", "train.name=back", "train.steps=6",
             "--resume", str(root / "one" / "checkpoints" / "step-00000005"))
    return root


def test_tp2_etp2_ep2_resume_is_bit_exact(etp_runs):
    assert records(etp_runs / "split") == records(etp_runs / "straight")
    a = consolidated_model_state(etp_runs / "split" / "checkpoints" / "step-00000008")
    b = consolidated_model_state(etp_runs / "straight" / "checkpoints" / "step-00000008")
    # Saved whole: all 8 experts (not one ep rank's 4), all 64 hidden columns (not one tp rank's 32).
    assert a["layers.0.ffn.experts.w_up_EDF"].shape == (8, 64, 64)
    assert a["layers.0.ffn.experts.w_down_EFD"].shape == (8, 64, 64)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in b)


def test_tp2_etp2_ep2_checkpoint_loads_bit_exactly_on_one_process_and_back(etp_runs):
    saved = consolidated_model_state(etp_runs / "split" / "checkpoints" / "step-00000004")
    for run, step in (("one", 5), ("one", 6), ("back", 6)):
        got = consolidated_model_state(etp_runs / run / "checkpoints" / f"step-{step:08d}")
        assert got.keys() == saved.keys() and all(got[k].equal(saved[k]) for k in saved), (run, step)
    # The losses at those weights: step 5 on one process is the 4-rank run's step 5, and step
    # 6 back on 4 ranks is the one process's step 6 (same weights, same batch).
    want = {r["step"]: r["loss"] for r in records(etp_runs / "straight")}
    one = {r["step"]: r["loss"] for r in records(etp_runs / "one")}
    back = {r["step"]: r["loss"] for r in records(etp_runs / "back")}
    assert one[5] == pytest.approx(want[5], rel=1e-6)
    assert list(back) == [6] and back[6] == pytest.approx(one[6], rel=1e-6)


def test_tp2_etp2_counts_one_process_flops_plus_the_router(etp_runs):
    cfg = load_config(CONFIGS / "tiny.yaml", SMALL)
    extra = tp_repeated_flops(cfg, tp=2, etp=2)
    assert 0 < extra < 0.05  # the router is a small share; with etp = 1 the experts add ~0.9
    got, one = counted_over_analytic(etp_runs / "straight"), counted_over_analytic(etp_runs / "one", after=4)
    assert got == pytest.approx(one + extra, rel=1e-3), (got, one, extra)


def test_cp2_trains_like_one_process_and_its_checkpoint_resumes_there(torchrun, tmp_path):
    """Context parallel (CP2: each sequence's 32 positions split over two ranks, two chunks each)
    trains and evaluates like one process (losses within 1e-5 relative for 11 steps), and its
    step-10 checkpoint, whose weights are only replicated over cp, resumes on one process with
    the next loss within 1e-6. One launch and one process (~20 s)."""
    common = [f"train.run_dir={tmp_path}", "train.steps=11", "train.checkpoint.every=10", "train.eval_every=5"]
    torchrun(2, "tiny.yaml", *common, "train.name=cp2", "parallel.cp=2")
    train(load_config(CONFIGS / "tiny.yaml", [*SMALL, *common, "train.name=one"]), console=lambda *_: None)
    got, want = records(tmp_path / "cp2"), records(tmp_path / "one")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 12))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), (g, w)
        assert (g["val_loss"] is None) == (w["val_loss"] is None), (g, w)
        if w["val_loss"] is not None:
            assert g["val_loss"] == pytest.approx(w["val_loss"], rel=1e-5), (g, w)
    cfg = load_config(CONFIGS / "tiny.yaml", [*SMALL, f"train.run_dir={tmp_path}", "train.name=resumed", "train.steps=11"])
    train(cfg, resume=str(tmp_path / "cp2" / "checkpoints" / "step-00000010"), console=lambda *_: None)
    _next_loss_matches(tmp_path / "resumed", tmp_path / "cp2")


# The aux-loss-free command of the routing docs: sigmoid scores, a bias moved by the global batch's
# loads, no balance loss.
AUX_FREE = ("model.moe.score=sigmoid", "model.moe.bias_update_rate=0.001", "model.moe.aux_loss_coef=0",
            "model.n_layers=4")
AUX_FREE_LAYOUTS = {
    "tp2_ep2": ("parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"),
    "pp2_dp2": ("parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2"),
}


def test_aux_loss_free_routing_trains_alike_on_one_process_and_four_ranks_and_resumes_bit_exactly(torchrun, tmp_path):
    """`moetron train configs/tiny.yaml model.moe.score=sigmoid model.moe.bias_update_rate=0.001
    model.moe.aux_loss_coef=0` on one process, on TP2×EP2 (+SP) and on PP2×DP2: losses within 1e-5
    relative for 6 steps and the same biases after them; PP2×DP2 stopped after step 3 and resumed
    equals its uninterrupted run bit for bit, biases included. Four launches and one process."""
    common = [*AUX_FREE, f"train.run_dir={tmp_path}", "train.steps=6", "train.checkpoint.every=3"]
    train(load_config(CONFIGS / "tiny.yaml", [*SMALL, *common, "train.name=one"]), console=lambda *_: None)
    for name, layout in AUX_FREE_LAYOUTS.items():
        torchrun(4, "tiny.yaml", *common, *layout, f"train.name={name}")
    torchrun(4, "tiny.yaml", *common, *AUX_FREE_LAYOUTS["pp2_dp2"], "train.name=split", "--exit-after", "3")
    torchrun(4, "tiny.yaml", *common, *AUX_FREE_LAYOUTS["pp2_dp2"], "train.name=split")

    def biases(run: str) -> dict:
        state = consolidated_model_state(tmp_path / run / "checkpoints" / "step-00000006")
        return {k: v for k, v in state.items() if k.endswith("router.expert_bias_E")}

    want, want_bias = records(tmp_path / "one"), biases("one")
    assert len(want_bias) == 4 and all(b.abs().max() > 0 for b in want_bias.values())
    for name in AUX_FREE_LAYOUTS:
        got = records(tmp_path / name)
        assert [r["step"] for r in got] == list(range(1, 7))
        for g, w in zip(got, want):
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), (name, g, w)
        got_bias = biases(name)
        assert got_bias.keys() == want_bias.keys()
        assert all(torch.allclose(got_bias[k], want_bias[k], rtol=0, atol=1e-9) for k in want_bias), name
    assert records(tmp_path / "split") == records(tmp_path / "pp2_dp2")
    a = consolidated_model_state(tmp_path / "split" / "checkpoints" / "step-00000006")
    b = consolidated_model_state(tmp_path / "pp2_dp2" / "checkpoints" / "step-00000006")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in b)
    # Expert parallelism logs how far routes travel: some of each token's 2 routes leave the rank.
    ep = [json.loads(line) for line in (tmp_path / "tp2_ep2" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["moe_remote_routes_per_token"] < 2 and 1 <= r["moe_ep_ranks_per_token"] <= 2 for r in ep)

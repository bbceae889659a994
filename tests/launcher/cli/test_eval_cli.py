"""`moetron eval` on real (tiny, two-step) training runs: loss at several lengths on the same
tokens, equal to a loss recomputed here from the checkpoint's weights with F.cross_entropy; RoPE
scaling and YaRN applied as load-time overrides (also to `moetron generate`), their frequency
tables checked against values worked out by hand; one-line refusals with exit status 2, learned
positions past their table first."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from moetron.launcher.checkpoint.weights import resolve_checkpoint
from moetron.launcher.cli.main import main
from moetron.launcher.config import config_from_dict
from moetron.launcher.data.corpus import load_token_data
from moetron.launcher.train.length_eval import eval_spans, evaluate_lengths, position_buckets
from moetron.model.generate import Sampling, generate
from moetron.model.transformer import Decoder, build_model

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=32", "model.max_seq_len=64", "train.seq_len=64", "train.batch_size=2",
         "train.steps=2", "train.warmup_steps=1", "train.eval_batches=1", "train.threads=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    for position in ("rope", "learned", "t5"):
        assert main(["train", str(TINY), *SMALL, f"model.position={position}", f"train.run_dir={root}",
                     f"train.name={position}"]) == 0
    return {p: root / p for p in ("rope", "learned", "t5")}


def reference_model(run: Path, **changes) -> Decoder:
    """The run's newest model rebuilt here: its saved config with `changes`, weights read by DCP's
    own reader (not moetron's loader)."""
    ckpt = resolve_checkpoint(run)
    saved = config_from_dict(json.loads((ckpt / "state.json").read_text())["config"]).model
    model = build_model(saved.replace(**changes))
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    return model.eval()


@torch.no_grad()
def reference_loss(model: Decoder, seq_len: int, longest: int, tokens: int, positions: range | None = None) -> float:
    """Mean next-token loss over the windows `moetron eval` scores at `seq_len`: each stretch of
    longest + 1 validation tokens cut into windows of seq_len + 1; only at `positions` if given."""
    data = load_token_data("stdlib")
    spans = eval_spans(data.val, longest + 1, math.ceil(tokens / longest))
    windows = np.stack([span[i * seq_len : (i + 1) * seq_len + 1] for span in spans for i in range(longest // seq_len)])
    ids_BS1 = torch.from_numpy(windows)
    logits_BSV = model(ids_BS1[:, :-1]).logits_BSV[..., : data.vocab_size]
    ce_BS = F.cross_entropy(logits_BSV.transpose(1, 2), ids_BS1[:, 1:], reduction="none")
    if positions is not None:
        ce_BS = ce_BS[:, positions]
    return ce_BS.double().mean().item()


def test_losses_by_length_and_bucket_equal_a_recomputed_loss(runs, cli_json):
    got = cli_json("eval", runs["t5"], "--seq-len", "32,64,128", "--tokens", 512)
    assert [r["seq_len"] for r in got["results"]] == [32, 64, 128]
    # The same 512 target tokens at every length: the lengths divide the longest.
    assert {r["tokens"] for r in got["results"]} == {512}
    assert [(b["start"], b["end"]) for b in got["results"][2]["buckets"]] == [(0, 64), (64, 128)]
    model = reference_model(runs["t5"])
    # 4 stretches of 129 tokens: 8 windows of 64 targets at length 64.
    assert got["results"][1]["loss"] == pytest.approx(reference_loss(model, 64, 128, 512), rel=1e-5)
    # At length 128 the second bucket holds the targets at positions 64..127 of the 4 windows.
    assert got["results"][2]["buckets"][1]["loss"] == pytest.approx(
        reference_loss(model, 128, 128, 512, positions=range(64, 128)), rel=1e-5)
    for r in got["results"]:
        assert 0 < r["loss"] < 10


def test_the_progress_bar_hears_every_target_token_once(runs):
    """`moetron eval`'s bar (on a terminal): the total it is given up front is what the batches
    report, the target tokens of every length, batched at most --batch-tokens at a time."""
    totals, steps = [], []

    def on_plan(total: int):
        totals.append(total)
        return steps.append

    data = load_token_data("stdlib")
    results = evaluate_lengths(reference_model(runs["t5"]), data.val, [32, 64, 128], tokens=512, batch_tokens=128,
                               vocab_size=data.vocab_size, on_plan=on_plan)
    assert totals == [sum(r.tokens for r in results)] == [3 * 512]
    assert sum(steps) == totals[0] and len(steps) == 3 * 4 and max(steps) <= 128


# Frequencies of the 4 rotated pairs of an 8-wide head, theta 10000: theta^(-2i/8) = 1, 0.1, 0.01,
# 0.001. NTK ×4 raises theta by 4^(8/6), i.e. multiplies pair i by 4^(-i/3). YaRN ×4 over the 64
# positions trained at: pair i turns 64·f_i/2π times there; beta_fast 32 gives the floor of
# 8·ln(64/(32·2π))/(2·ln 10000) = −0.50 → 0 and beta_slow 1 the ceiling of 8·ln(64/2π)/(2·ln 10000)
# = 1.008 → 2, so the ramp over pairs 0..3 is [0, 0.5, 1, 1] and pair i becomes
# f_i·(1 − ramp_i) + f_i/4·ramp_i: 1, 0.1·(0.5 + 0.125) = 0.0625, 0.01/4, 0.001/4.
ROPE_TABLES = {
    "none": [1.0, 0.1, 0.01, 0.001],
    "ntk": [1.0, 0.1 * 4 ** (-1 / 3), 0.01 * 4 ** (-2 / 3), 0.00025],
    "yarn": [1.0, 0.0625, 0.0025, 0.00025],
}


def test_rope_scaling_overrides_apply_at_load_time_after_the_options(runs, cli_json):
    losses = {}
    for scaling, table in ROPE_TABLES.items():
        overrides = [] if scaling == "none" else [f"model.rope_scaling={scaling}", "model.rope_scaling_factor=4"]
        got = cli_json("eval", runs["rope"], "--seq-len", "128", "--tokens", 256, *overrides)
        assert got["overrides"] == overrides
        model = reference_model(runs["rope"], rope_scaling=scaling, rope_scaling_factor=4.0 if overrides else 1.0,
                                rope_original_max_seq_len=64)
        torch.testing.assert_close(model.rope_inv_freq, torch.tensor(table), rtol=1e-6, atol=0)
        losses[scaling] = got["results"][0]["loss"]
        assert losses[scaling] == pytest.approx(reference_loss(model, 128, 128, 256), rel=1e-5), scaling
    assert len(set(losses.values())) == 3


def test_yarn_keeps_the_trained_length_however_far_max_seq_len_is_raised(runs):
    from moetron.launcher.checkpoint.weights import load_model

    _, model = load_model(resolve_checkpoint(runs["rope"]), overrides=["model.rope_scaling=yarn",
                                                                      "model.rope_scaling_factor=4",
                                                                      "model.max_seq_len=4096"])
    assert (model.cfg.rope_original_len, model.cfg.max_seq_len) == (64, 4096)
    # Still the table of YaRN ×4 over the 64 positions trained at. Over 4096 the ramp would run
    # from pair 1 (floor of 8·ln(4096/(32·2π))/(2·ln 10000) = 1.31) to pair 3 (ceiling of 2.81):
    # [0, 0, 0.5, 1], and pair 2 would be 0.01·(0.5 + 0.125) = 0.00625.
    torch.testing.assert_close(model.rope_inv_freq, torch.tensor(ROPE_TABLES["yarn"]), rtol=1e-6, atol=0)


def test_generate_takes_the_same_overrides(runs, capsys):
    """The model `moetron generate` runs, seen by a global forward hook: its config and its table."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    seen = []

    def spy(module, args):
        if isinstance(module, Decoder):
            seen.append((module.cfg.max_seq_len, module.rope_inv_freq.tolist()))

    args = [runs["rope"], "--prompt-ids", "1,2,3", "--max-new-tokens", 90, "--greedy", "--ignore-eos", "--json"]
    handle = register_module_forward_pre_hook(spy)
    try:
        assert main(["generate", *map(str, args), "model.max_seq_len=128", "model.rope_scaling=yarn",
                     "model.rope_scaling_factor=2"]) == 0
    finally:
        handle.remove()
    ids = json.loads(capsys.readouterr().out)["ids"]
    assert len(ids) == 90  # 3 + 90 positions: past the 64 trained at, allowed by the override
    # YaRN ×2 over 64 positions: the same ramp [0, 0.5, 1, 1], pair i → f_i·(1 − ramp_i) + f_i/2·ramp_i.
    table = [1.0, 0.075, 0.005, 0.0005]
    assert len(seen) == 90  # the prompt, then one forward per new token but the last
    for max_seq_len, inv_freq in seen:
        assert max_seq_len == 128 and inv_freq == pytest.approx(table, rel=1e-6)
    yarn = reference_model(runs["rope"], max_seq_len=128, rope_scaling="yarn", rope_scaling_factor=2.0,
                           rope_original_max_seq_len=64)
    vocab = load_token_data("stdlib").vocab_size
    assert ids == generate(yarn, torch.tensor([[1, 2, 3]]), 90, Sampling(greedy=True), vocab_size=vocab)[0].tolist()


def test_table_output_has_one_row_per_length(runs, capsys):
    assert main(["eval", str(runs["learned"]), "--seq-len", "32,64", "--tokens", "128"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "position learned" in lines[0]
    assert [line.split("|")[1].strip() for line in lines[3:]] == ["32", "64"]


def test_learned_positions_past_their_table_are_refused_in_one_line(runs):
    proc = subprocess.run([sys.executable, "-m", "moetron", "eval", str(runs["learned"]), "--seq-len", "64,128"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("moetron eval: --seq-len 128: position 'learned' has a table of "
                                   "max_seq_len = 64 positions and cannot run past it")


@pytest.mark.parametrize("args,needle", [
    (["{rope}", "--seq-len", "64,x"], "comma-separated integers"),
    (["{rope}", "--seq-len", "1"], "--seq-len 1: must be >= 2"),
    (["{rope}", "--seq-len", "64", "train.steps=3"], "only model.* settings apply to a trained model"),
    (["{rope}", "--seq-len", "64", "model.rope_scaling=yarn2"], "must be one of none, linear, ntk, yarn"),
    (["{rope}", "--seq-len", "64", "model.position=t5"], "is of another model"),
    (["{missing}", "--seq-len", "64"], "no such run or checkpoint folder"),
])
def test_bad_input_is_one_line_and_status_2(runs, tmp_path, capsys, args, needle):
    paths = {"rope": runs["rope"], "missing": tmp_path / "nope"}
    assert main(["eval", *(a.format(**paths) for a in args)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moetron eval: ")
    assert needle in err


def test_spans_are_evenly_spaced_inside_shards_and_buckets_are_octaves():
    shards = [torch.arange(100).numpy(), torch.arange(1000, 1010).numpy(), torch.arange(2000, 2300).numpy()]
    spans = eval_spans(shards, 50, 4)
    assert [len(s) for s in spans] == [50] * 4
    assert all(int(s[-1]) - int(s[0]) == 49 for s in spans)  # never across a shard boundary
    assert len({int(s[0]) for s in spans}) == 4
    assert position_buckets(300) == [(0, 64), (64, 128), (128, 256), (256, 300)]
    assert position_buckets(40) == [(0, 40)]

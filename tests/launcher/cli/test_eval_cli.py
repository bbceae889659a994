"""`moetron eval` on real (tiny, two-step) training runs: loss at several lengths on the same
tokens, equal to the library call; RoPE scaling and YaRN applied as load-time overrides (also to
`moetron generate`); one-line refusals with exit status 2, learned positions past their table first."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetron.launcher.checkpoint.weights import load_model, resolve_checkpoint
from moetron.launcher.cli.main import main
from moetron.launcher.data.corpus import load_token_data
from moetron.launcher.train.length_eval import eval_spans, evaluate_lengths, position_buckets

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


def eval_json(capsys, *args) -> dict:
    assert main(["eval", *map(str, args), "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    return json.loads(out)


def test_losses_by_length_and_bucket_equal_the_library_call(runs, capsys):
    got = eval_json(capsys, runs["t5"], "--seq-len", "32,64,128", "--tokens", 512)
    assert [r["seq_len"] for r in got["results"]] == [32, 64, 128]
    # The same 512 target tokens at every length: the lengths divide the longest.
    assert {r["tokens"] for r in got["results"]} == {512}
    assert [(b["start"], b["end"]) for b in got["results"][2]["buckets"]] == [(0, 64), (64, 128)]
    cfg, model = load_model(resolve_checkpoint(runs["t5"]))
    data = load_token_data("stdlib")
    want = evaluate_lengths(model, data.val, [32, 64, 128], tokens=512, vocab_size=data.vocab_size)
    assert got["results"] == [r.to_dict() for r in want]
    for r in got["results"]:
        assert 0 < r["loss"] < 10


def test_rope_scaling_overrides_apply_at_load_time_after_the_options(runs, capsys):
    plain = eval_json(capsys, runs["rope"], "--seq-len", "128", "--tokens", 256)
    ntk = eval_json(capsys, runs["rope"], "--seq-len", "128", "--tokens", 256,
                    "model.rope_scaling=ntk", "model.rope_scaling_factor=4")
    yarn = eval_json(capsys, runs["rope"], "--seq-len", "128", "--tokens", 256,
                     "model.rope_scaling=yarn", "model.rope_scaling_factor=4")
    assert yarn["overrides"] == ["model.rope_scaling=yarn", "model.rope_scaling_factor=4"]
    losses = {plain["results"][0]["loss"], ntk["results"][0]["loss"], yarn["results"][0]["loss"]}
    assert len(losses) == 3
    _, model = load_model(resolve_checkpoint(runs["rope"]), overrides=["model.rope_scaling=yarn",
                                                                      "model.rope_scaling_factor=4",
                                                                      "model.max_seq_len=256"])
    # YaRN's original context stays the one trained at, however far max_seq_len is raised.
    assert (model.cfg.rope_original_len, model.cfg.max_seq_len) == (64, 256)


def test_generate_takes_the_same_overrides(runs, capsys):
    args = [runs["rope"], "--prompt-ids", "1,2,3", "--max-new-tokens", 90, "--greedy", "--json"]
    assert main(["generate", *map(str, args), "model.max_seq_len=128", "model.rope_scaling=yarn",
                 "model.rope_scaling_factor=2"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) <= 90


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

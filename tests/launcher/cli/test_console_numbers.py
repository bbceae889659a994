"""Throughput and MFU read one way on every console: `9,768 tok/s` and `26.0%` — in training
lines, the plan table and generate's speed line — while metrics.jsonl keeps the raw numbers
(tokens/s unrounded, MFU a fraction) that each printed figure is checked against."""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from moetron.launcher.cli.main import main
from moetron.launcher.perf import display
from moetron.launcher.train.progress import Progress

TOK_S = r"\d{1,3}(?:,\d{3})* tok/s"
PERCENT = r"\d+\.\d%"
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=32", "model.max_seq_len=64", "train.seq_len=32", "train.batch_size=2", "train.steps=3",
         "train.warmup_steps=1", "train.eval_batches=1", "train.threads=1", "train.log_every=1",
         "train.eval_every=3", "train.precision=fp32"]


@pytest.mark.parametrize("rate, shown", [(777.2, "777 tok/s"), (9768.4, "9,768 tok/s"), (10220.0, "10,220 tok/s"),
                                         (1234567.8, "1,234,568 tok/s")])
def test_tokens_per_s_is_a_whole_number_with_separators(rate, shown):
    assert display.tokens_per_s(rate) == shown


@pytest.mark.parametrize("fraction, shown", [(0.26, "26.0%"), (0.0031, "0.3%"), (0.5469, "54.7%")])
def test_mfu_is_a_percentage_with_one_decimal(fraction, shown):
    assert display.mfu(fraction) == shown


@pytest.mark.parametrize("value, shown", [(1872.4, "1,872"), (999.6, "1,000"), (183.2, "183"), (24.51, "24.5"),
                                          (0.5, "0.5"), (0.012345, "0.0123"), (1.2345e-5, "0.0000123"), (0.0, "0")])
def test_other_numbers_have_three_significant_digits_and_no_exponent(value, shown):
    """Python's `:.3g` where it prints no exponent (as 1.87e+03 GFLOP/s, an AMX core's bf16 peak)."""
    assert display.significant(value) == shown
    if "e" not in f"{value:.3g}":
        assert shown == f"{value:.3g}"


def test_a_training_log_line_uses_both_formats():
    stream = io.StringIO()
    with Progress(total=10, stream=stream) as progress:
        progress.update(10, {"loss": 2.5, "tokens_per_s": 10220.4, "mfu": 0.26})
    line = stream.getvalue().strip()
    assert "10,220 tok/s" in line and "MFU 26.0%" in line and "1.022e+04" not in line and "0.26" not in line


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    """(run folder, what training printed on the console) of a real 3-step run."""
    runs = tmp_path_factory.mktemp("runs")
    console = io.StringIO()
    with contextlib.redirect_stderr(console), contextlib.redirect_stdout(console):
        assert main(["train", "tiny", *SMALL, f"train.run_dir={runs}", "train.name=tiny"]) == 0
    return runs / "tiny", console.getvalue()


def test_training_prints_what_metrics_jsonl_holds_in_the_console_formats(trained):
    run, console = trained
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"^step (\d+)/3 .*$", console, flags=re.MULTILINE)}
    assert set(lines) == {1, 2, 3}, console
    for step, line in lines.items():
        raw = records[step]
        assert f"{round(raw['tokens_per_s']):,} tok/s" in line and re.search(TOK_S, line), line
        if "mfu" in raw:
            assert 0 < raw["mfu"] < 1  # a fraction in metrics.jsonl ...
            assert f"MFU {100 * raw['mfu']:.1f}%" in line  # ... a percentage on the console
    assert any("mfu" in r for r in records.values())
    assert not re.search(r"tokens_per_s|\d\.\d+e[+-]\d\d|mfu 0\.", console), console


def test_a_peak_over_1000_tflops_prints_without_an_exponent(tmp_path):
    """A B200's bf16 peak, 2,250 TFLOP/s (here as train.peak_tflops): the line naming what MFU is
    measured against says 2,250, not 2.25e+03."""
    console = io.StringIO()
    with contextlib.redirect_stderr(console), contextlib.redirect_stdout(console):
        assert main(["train", "tiny", *SMALL, "train.steps=1", "train.peak_tflops=2250", f"train.run_dir={tmp_path}",
                     "train.name=b200-peak"]) == 0
    assert "MFU is measured against 2,250 TFLOP/s per device: train.peak_tflops = 2250" in console.getvalue()


def test_generate_prints_time_to_first_token_and_tokens_per_s(trained, capsys):
    run, _ = trained
    assert main(["generate", str(run), "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--greedy", "--ignore-eos",
                 "--json"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["ids"]) == 8  # stdout stays the JSON alone
    m = re.fullmatch(rf"8 new tokens in ([\d.]+) s: first after ([\d.]+) s, then ({TOK_S})\n", err)
    assert m, err
    total, first = float(m.group(1)), float(m.group(2))
    assert 0 < first <= total + 0.01


def test_the_plan_table_uses_the_formats_and_matches_its_json(capsys):
    args = ["plan", "tiny", "--gpus", "8", "--gpu", "H100", "--top", "3"]
    assert main([*args, "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"│ \d+ +│", line)]
    assert len(rows) == 3
    for row, pred in zip(rows, ranked):
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert re.fullmatch(TOK_S, cells[3]) and re.fullmatch(PERCENT, cells[4]), cells
        assert int(cells[3].removesuffix(" tok/s").replace(",", "")) == round(pred["tokens_per_s"])
        assert float(cells[4].removesuffix("%")) == pytest.approx(100 * pred["mfu"], abs=0.05)

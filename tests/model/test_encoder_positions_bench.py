"""bench/encoder_positions.py, the reference page's BERT exercise, in its quick form: an encoder
trained with masked-language modelling on the standard library's English sentences ends below
log V (uniform guessing over the byte vocabulary), and the RoPE − learned differential it
reports is the difference of the runs' own losses."""

import math

import pytest


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("encoder_positions")


def test_sentences_are_english_and_distinct(bench):
    found = bench.sentences(500)
    assert len(found) == len(set(found)) == 500
    assert all(s[0].isupper() and 20 <= len(s) <= 300 for s in found)


def test_quick_run_learns_below_log_v_and_reports_its_differentials(bench, tmp_path):
    result = bench.main(["--quick", "--steps", "12", "--seeds", "2", "--sentences", "1500", "--batch", "16",
                         "--eval-batches", "1", "--threads", "1", "--out", str(tmp_path / "curves.png")])
    assert result["log_v"] == pytest.approx(math.log(257))
    for objective in ("mlm", "clm"):
        for position in ("learned", "rope"):
            assert all(v < math.log(257) for v in result["finals"][objective][position])
    diffs = bench.differentials(result["finals"])
    mlm = result["finals"]["mlm"]
    want = [r - le for r, le in zip(mlm["rope"], mlm["learned"])]
    assert diffs["mlm"][0] == pytest.approx(sum(want) / 2)
    assert (tmp_path / "curves.png").stat().st_size > 0

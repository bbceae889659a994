"""bench/convert_speed.py at a small size: it writes a multi-shard Mixtral-family folder, times
`moetron convert` both ways and transformers on it, and the round trip comes back byte for byte."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "convert_speed.py"


@pytest.mark.oracles
@pytest.mark.slow  # four interpreters start (the bench, two conversions, transformers): ~15-30 s
def test_small_run_prints_its_table_and_round_trips(tmp_path):
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, str(BENCH), "--gb", "0.004", "--shards", "2", "--dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["round_trip_identical"] and result["shards"] >= 2
    assert 0.003e9 < result["bytes"] < 0.005e9
    for row in ("from_hf", "to_hf", "transformers"):
        assert result[row]["seconds"] > 0 and result[row]["peak_rss_gb"] > 0
    assert "| moetron convert --from-hf (HF → checkpoint)" in out.stdout
    assert "| transformers from_pretrained + save_pretrained" in out.stdout
    assert list(tmp_path.iterdir()) == []  # its temporary folder is gone

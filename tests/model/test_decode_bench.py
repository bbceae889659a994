"""bench/decode.py, the reference page's KV-cache exercise: its two timed decoding loops produce the
same greedy tokens and logits, and its quick run reports a speedup above 1 at the longer prompt
with a FLOP ratio that matches the count worked out here from the built model's weights."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

BENCH = Path(__file__).resolve().parents[2] / "bench" / "decode.py"


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("decode")


def test_cached_and_recomputed_decoding_agree(bench):
    torch.set_num_threads(1)
    model = bench.build_decoder("quick", max_len=64)
    prompt_1S = torch.randint(0, model.cfg.vocab_size, (1, 23), generator=torch.Generator().manual_seed(3))
    ids_c, logits_c, seconds_c = bench.decode_cached(model, prompt_1S, 12)
    ids_r, logits_r, seconds_r = bench.decode_recompute(model, prompt_1S, 12)
    assert ids_c.shape == (1, 12) and len(seconds_c) == len(seconds_r) == 11
    assert torch.equal(ids_c, ids_r)
    torch.testing.assert_close(logits_c, logits_r, atol=1e-5, rtol=1e-5)


def forward_flops_by_hand(model, queries: int, context: int) -> int:
    """2 FLOPs per weight of every nn.Linear per query; QKᵀ and PV 2·H·Dh each per query-key pair
    per layer; the causal queries are the last `queries` of `context` positions."""
    cfg = model.cfg
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    pairs = sum(context - q for q in range(queries))
    return 2 * weights * queries + 4 * cfg.n_layers * cfg.n_heads * cfg.dim_head * pairs


def test_quick_run_reports_speedup_and_flop_ratio(bench, tmp_path):
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--threads", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {r["n"]: r for r in result["rows"]}
    assert set(rows) == {16, 32}
    assert all(r["same_tokens"] and r["max_logit_diff"] < 1e-4 for r in rows.values())
    assert rows[32]["speedup"] > 1, rows[32]
    model, steps = bench.build_decoder("quick", max_len=64), result["steps"]
    for n, r in rows.items():
        contexts = range(n + 1, n + steps)
        ratio = (sum(forward_flops_by_hand(model, c, c) for c in contexts)
                 / sum(forward_flops_by_hand(model, 1, c) for c in contexts))
        assert r["flop_ratio"] == pytest.approx(ratio, rel=1e-12)
        assert r["page_claim"] == model.cfg.n_layers * n / 2
        # L cancels: between half the context (attention-bound) and the context (weight-bound).
        assert (n + 1) / 2 < r["flop_ratio"] < n + steps
    assert {"decode_quick.md", "decode_quick.png"} <= {p.name for p in tmp_path.iterdir()}

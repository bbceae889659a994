"""bench/moe_tradeoff.py, the reference page's MoE exercise: its quick run trains the five variants,
and the parameters and FLOPs per token its table reads from `moetron flops` equal those counted
here on the built models; the pairs meant to match in active FLOPs or in parameters do, up to the
router."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from moetron.launcher.config import load_config
from moetron.model.experts import GroupedExperts
from moetron.model.transformer import build_model

BENCH = Path(__file__).resolve().parents[3] / "bench" / "moe_tradeoff.py"


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("moe_tradeoff")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_tradeoff")
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--threads", "1", "--out", str(folder)],
                         capture_output=True, text=True, cwd=folder, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), folder


def counted(model) -> tuple[int, int]:
    """(every parameter, the matmul weights one token passes through): every nn.Linear (attention,
    dense FFN, router, LM head) whole, the experts' weights K/E of them."""
    cfg = model.cfg
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    experts = sum(p.numel() for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
    active = linear + (experts * cfg.moe.top_k // cfg.moe.num_experts if cfg.moe.enabled else 0)
    return sum(p.numel() for p in model.parameters()), active


def test_table_matches_counts_on_the_built_models(bench, quick_run, tmp_path):
    result, _ = quick_run
    rows = {r["model"]: r for r in result["rows"]}
    assert list(rows) == list(bench.variants(result["F"]))
    S, tokens = result["seq_len"], result["steps"] * result["batch"] * result["seq_len"]
    for i, (name, ffn) in enumerate(bench.variants(result["F"]).items()):
        cfg = load_config(bench.TINY, bench.overrides("quick", ffn, tmp_path, f"v{i}", 1, 0)).model
        total, active = counted(build_model(cfg))
        # Forward: 2 per active weight + QKᵀ and PV over the full S×S square (2·H·Dh·S each per
        # layer); a training step is forward + two backward matmuls: 3×.
        per_token = 3 * (2 * active + 4 * cfg.n_layers * cfg.n_heads * cfg.dim_head * S)
        r = rows[name]
        assert (r["params_total"], r["params_active"], r["flops_per_token"]) == (total, active, per_token), name
        assert r["train_flops"] == per_token * tokens
        assert 0 < r["final_val_loss"] < math.log(cfg.vocab_size), r  # it learned something in 8 steps
        assert r["curve"][-1][1] == r["train_flops"]


def test_matched_pairs_differ_by_the_router_alone(quick_run):
    result, folder = quick_run
    F = result["F"]
    r = {row["model"]: row for row in result["rows"]}
    dense, top1, top2 = r[f"dense F={F}"], r[f"MoE 4×{F} top-1"], r[f"MoE 4×{F // 2} top-2"]
    dense2, dense4 = r[f"dense 2F={2 * F}"], r[f"dense 4F={4 * F}"]
    L, D, E = 2, 64, 4  # the quick model
    assert top1["flops_per_token"] == top2["flops_per_token"] == dense["flops_per_token"] + 6 * L * D * E
    assert top1["params_total"] == dense4["params_total"] + L * D * E
    assert top2["params_total"] == dense2["params_total"] + L * D * E
    assert {"moe_tradeoff_quick.md", "moe_tradeoff_quick.png"} <= {p.name for p in folder.iterdir()}

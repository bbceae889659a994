"""`moetron flops` and the FLOPs counted on real steps: counted and analytic agree per component,
for dense, Switch (top-1 with capacity drops) and top-2 models with every position encoding."""

import contextlib
import json
from pathlib import Path

import pytest
import torch

from moetron.launcher.cli.main import main
from moetron.launcher.perf import flops
from moetron.launcher.perf.flop_counter import ComponentFlopCounter, measure_flops, single_process_step, worst_mismatch
from moetron.model.config import MLAConfig, ModelConfig, MoEConfig
from moetron.model.transformer import build_model

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=48", "model.max_seq_len=64", "train.seq_len=32", "train.threads=1"]
MOES = {
    "dense": MoEConfig(),
    "switch": MoEConfig(num_experts=4, top_k=1, weighting="softmax", capacity_factor=1.0),
    "top2": MoEConfig(num_experts=4, top_k=2, d_expert=24, shared_expert_d_ff=16),
}


def counted_rows(cfg: ModelConfig, *, seq_len=16, batch=2, bf16=False):
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def step():
        tokens_BS1 = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1))
        return single_process_step(model, optimizer, tokens_BS1, autocast)

    measurement = measure_flops(model, step, 1, batch * seq_len)
    assert measurement.uncounted_ops == []
    return measurement, measurement.rows(flops.flops_by_component(cfg, seq_len))


@pytest.mark.parametrize("position", ["rope", "alibi", "sinusoidal", "learned", "none"])
@pytest.mark.parametrize("moe", MOES.values(), ids=MOES.keys())
def test_counted_matches_analytic_on_real_steps(moe, position):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, position=position,
                      max_seq_len=32, moe=moe)
    measurement, rows = counted_rows(cfg)
    assert worst_mismatch(rows) < 0.01, [(r.component, r.ratio) for r in rows]
    by_name = {r.component: r for r in rows}
    # Attention follows the full-square convention on both sides (the SDPA formula is ours).
    assert by_name["attention_scores"].ratio == pytest.approx(1.0)
    assert by_name["other"].counted == 0
    if moe.capacity_factor is not None:
        assert measurement.kept_fraction < 1.0  # drops happened, and the experts' line still agrees


@pytest.mark.parametrize("attention", ["eager", "triton"])
def test_other_attention_paths_and_bf16_are_counted_the_same(attention):
    """Eager attention (bmm) and the flash op's reference path count like SDPA; autocast changes nothing."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, attention=attention,
                      max_seq_len=32, moe=MOES["top2"])
    _, rows = counted_rows(cfg, bf16=True)
    assert max(abs(r.ratio - 1) for r in rows) < 1e-9


@pytest.mark.parametrize("q_lora_rank,attention", [(0, "sdpa"), (12, "eager")])
def test_mla_is_counted_like_its_formulas(q_lora_rank, attention):
    """MLA's five projections, and scores QKᵀ and PV of different widths (Dq 12, Dv 6)."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, attention=attention, max_seq_len=32,
                      mla=MLAConfig(kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                    v_head_dim=6), moe=MOES["top2"])
    _, rows = counted_rows(cfg)
    assert max(abs(r.ratio - 1) for r in rows) < 1e-9, [(r.component, r.ratio) for r in rows]


def test_json_has_the_issue_fields(capsys):
    assert main(["flops", str(TINY), *SMALL, "--seq-len", "64", "--batch", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = ModelConfig(vocab_size=320, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64,
                      moe=MoEConfig(num_experts=8, top_k=2, d_expert=48))
    assert out["params_total"] == flops.params_total(cfg)
    assert out["params_active"] == flops.params_active(cfg)
    assert out["params_embedding"] == 320 * 32
    assert out["flops_per_token"] == out["flops_per_token_6n"] + out["attention_flops_per_token"]
    assert out["attention_flops_per_token_causal"] * 2 == out["attention_flops_per_token"]
    assert out["kv_cache_bytes"] == out["kv_cache_bytes_per_token"] * 64 * 3
    assert set(out["memory_per_rank"]) == {"weights", "grads", "optimizer", "activations", "total"}
    assert set(out["components"]) == set(flops.COMPONENTS)


def test_table_and_measure(capsys):
    assert main(["flops", str(TINY), *SMALL, "--seq-len", "32", "--measure"]) == 0
    out = capsys.readouterr().out
    for word in ("params_active", "flops_per_token", "kv_cache_bytes", "experts", "counted/analytic", "agree"):
        assert word in out


def test_tables_are_whole_when_piped():
    """Through a pipe (no terminal, COLUMNS unset) every cell prints whole, none cut with '…'."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.run([sys.executable, "-m", "moetron", "flops", str(TINY), *SMALL], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    for word in ("params_active", "FLOP/token", "causal FLOP/token", "kv_cache_bytes"):
        assert word in proc.stdout


def test_measure_fails_when_the_accounting_is_off(capsys, monkeypatch):
    real = flops.flops_by_component

    def off_by_5_percent(cfg, seq_len, **kw):
        out = real(cfg, seq_len, **kw)
        out["experts"] = int(out["experts"] * 1.05)
        return out

    monkeypatch.setattr(flops, "flops_by_component", off_by_5_percent)
    assert main(["flops", str(TINY), *SMALL, "--seq-len", "16", "--measure", "--json"]) == 1
    measured = json.loads(capsys.readouterr().out)["measured"]
    assert not measured["ok"] and measured["worst_mismatch_outside_attention"] > 0.02


def test_bad_flag_is_a_user_error(capsys):
    assert main(["flops", str(TINY), "--seq-len", "0"]) == 2
    assert "--seq-len" in capsys.readouterr().err


@pytest.mark.parametrize("bf16", [False, True])
def test_counting_does_not_change_the_step(bf16):
    """The trainer counts its first real step; the weights after it must be bit for bit the same."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                      moe=MOES["top2"])
    tokens_BS1 = torch.randint(0, 64, (2, 17))

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    models = []
    for counted in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with ComponentFlopCounter(model) if counted else contextlib.nullcontext():
            single_process_step(model, optimizer, tokens_BS1, autocast)
        models.append(model)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


def test_deepseek_v3_preset_counts_the_published_sizes(capsys):
    """DeepSeek-V3 reports 671B parameters and 37B activated per token (MTP module aside): total
    within 1%; the activated count, two digits, is DeepSeek's arithmetic without the embedding
    lookup (36.62B; with it 37.55B would round to 38B), within the figure's rounding interval."""
    assert main(["flops", str(TINY.with_name("deepseek-v3-671b.yaml")), "--json"]) == 0
    acct = json.loads(capsys.readouterr().out)
    assert acct["params_total"] == pytest.approx(671e9, rel=0.01)
    assert 36.5e9 <= acct["params_active"] < 37.5e9
    # MLA's cache: the 512-wide latent and the 64-wide rope key of 61 layers, bf16.
    assert acct["kv_cache_bytes_per_token"] == (512 + 64) * 61 * 2
    assert acct["kv_cache_bytes_per_token_expanded"] == 61 * 128 * (192 + 128) * 2

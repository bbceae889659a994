"""Impossible layouts are refused before any process group starts, naming the rule."""

from __future__ import annotations

import pytest

from moetron.launcher.config import ConfigError, apply_override, config_from_dict, validate_launch
from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.transformer import build_model
from moetron.parallel.config import ParallelConfig
from moetron.parallel.mesh import check_layout, layout_problems
from moetron.parallel.pipeline import split_stage, stages_of_rank

BASE = {
    "model": {"vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64,
              "max_seq_len": 64, "moe": {"num_experts": 4, "top_k": 2}},
    "train": {"batch_size": 8, "seq_len": 16},
}


def cfg_with(*overrides):
    data = {k: dict(v) for k, v in BASE.items()}
    data["model"]["moe"] = dict(BASE["model"]["moe"])
    for item in overrides:
        apply_override(data, item)
    return config_from_dict(data)


@pytest.mark.parametrize("overrides, rule", [
    (["parallel.tp=4"], "must divide the KV heads (2)"),
    (["parallel.tp=3"], "must divide model.n_heads"),
    (["parallel.dp=2", "parallel.ep=3"], "must divide dp"),
    (["parallel.dp=4", "parallel.ep=4", "model.moe.num_experts=6"], "must divide model.moe.num_experts"),
    (["parallel.pp=3", "parallel.microbatches=4"], "must divide model.n_layers"),
    (["parallel.pp=2", "parallel.vpp=4", "parallel.schedule=interleaved_1f1b", "parallel.microbatches=2"],
     "must divide model.n_layers"),
    (["parallel.pp=2", "parallel.microbatches=1"], "must be >= pp"),
    (["parallel.pp=2", "parallel.vpp=2"], "virtual stages need schedule"),
    (["parallel.pp=4", "parallel.microbatches=9", "parallel.schedule=zero_bubble", "train.batch_size=18"],
     "multiple of microbatches // pp"),
    (["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2", "parallel.schedule=zero_bubble"],
     "does not run with data parallelism (dp × cp = 2)"),
    (["parallel.tp=2", "model.vocab_size=63"], "must divide model.vocab_size"),
    (["parallel.pp=2", "parallel.microbatches=2", "model.tie_embeddings=true"], "cannot tie"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=15"], "divisible by parallel.tp"),
    (["model.moe.num_experts=0", "parallel.dp=2", "parallel.ep=2"], "needs an MoE model"),
    (["parallel.cp=3"], "divisible by 2 × parallel.cp (6)"),
    (["model.n_kv_heads=4", "parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true", "train.seq_len=20"],
     "/ parallel.cp (2) must be divisible by parallel.tp (4)"),
    (["parallel.tp=2", "parallel.etp=3"], "must be 1 (experts replicated over tp) or tp (2)"),
    (["parallel.dp=4", "parallel.dp_mode=hsdp", "parallel.dp_shard=3"], "must divide dp (4) for dp_mode=hsdp"),
    (["parallel.dp=4", "parallel.dp_mode=hsdp"], "must divide dp (4) for dp_mode=hsdp"),
    (["parallel.dp=4", "parallel.ep=4", "parallel.dp_mode=hsdp", "parallel.dp_shard=2"], "must be a multiple of ep (4)"),
    (["parallel.dp=2", "parallel.dp_shard=2"], "only applies to dp_mode=hsdp"),
    (["parallel.dp_mode=zero3"], "must be one of"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "train.compile=true"], "not supported with parallel.sequence_parallel"),
])
def test_bad_layouts_name_the_rule(overrides, rule):
    with pytest.raises(ConfigError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        cfg_with(*overrides)


def test_world_size_must_match_the_launch():
    cfg = cfg_with("parallel.tp=2", "parallel.dp=2")
    with pytest.raises(ConfigError, match=r"= 4: must equal the number of launched ranks \(2\)"):
        validate_launch(cfg, 2)
    validate_launch(cfg, 4)
    with pytest.raises(ValueError, match="must equal the number of launched ranks"):
        check_layout(ParallelConfig(pp=2, dp=2, microbatches=2), 8)
    assert layout_problems(ParallelConfig(pp=2, dp=2, tp=2, microbatches=2), 8) == []
    # Context parallelism is a factor of the world: pp × dp × cp × tp.
    assert layout_problems(ParallelConfig(dp=2, cp=2, tp=2), 8) == []
    with pytest.raises(ValueError, match=r"pp × dp × cp × tp = 1 × 2 × 2 × 1 = 4: must equal"):
        check_layout(ParallelConfig(dp=2, cp=2), 2)


def test_stages_are_placed_in_loops_and_keep_full_model_names():
    cfg = ParallelConfig(pp=2, vpp=2, microbatches=2, schedule="interleaved_1f1b")
    assert stages_of_rank(0, cfg) == [0, 2] and stages_of_rank(1, cfg) == [1, 3]
    model = build_model(ModelConfig(n_layers=4, d_model=32, n_heads=4, d_ff=64, vocab_size=64,
                                    moe=MoEConfig(num_experts=4)), device="meta")
    first, last = split_stage(model, 0, 4), split_stage(model, 3, 4)
    assert list(first.layers) == ["0"] and first.embed is not None and first.head is None
    assert list(last.layers) == ["3"] and last.embed is None and last.head is not None
    assert "layers.3.ffn.experts.w_gate_EDF" in dict(last.named_parameters())

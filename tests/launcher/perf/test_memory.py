"""Memory per rank: how each dimension of a layout splits weights, grads, optimizer state and
activations, and what activation checkpointing keeps."""

import dataclasses

import pytest

from moetron.launcher.perf import flops
from moetron.launcher.perf.memory import activation_elements_per_token, memory_per_rank
from moetron.model.config import ModelConfig, MoEConfig
from moetron.parallel.config import ParallelConfig


def test_memory_per_rank_splits_by_layout():
    cfg = ModelConfig(d_model=64, n_layers=4, n_heads=4, d_ff=128, vocab_size=256,
                      moe=MoEConfig(num_experts=8, top_k=2))
    one = memory_per_rank(cfg, seq_len=128, micro_batch=2)
    assert one.weights == flops.params_total(cfg) * 4
    assert one.grads == one.weights and one.optimizer == 2 * one.weights
    assert one.total == one.weights + one.grads + one.optimizer + one.activations
    experts = flops.matmul_params(cfg, active=False)["experts"]
    ep = memory_per_rank(cfg, ParallelConfig(ep=4, dp=4, dp_mode="ddp"), seq_len=128, micro_batch=2)
    assert one.weights - ep.weights == pytest.approx(experts * 4 * 3 / 4, rel=1e-6)
    fsdp = memory_per_rank(cfg, ParallelConfig(dp=4, dp_mode="fsdp"), seq_len=128, micro_batch=2)
    assert fsdp.weights == pytest.approx(one.weights / 4, rel=1e-6) and fsdp.activations == one.activations
    tp = memory_per_rank(cfg, ParallelConfig(tp=2, etp=2), seq_len=128, micro_batch=2)
    assert tp.weights == pytest.approx(one.weights / 2, rel=1e-6) and tp.activations < one.activations
    # etp = 1: routed experts stay whole on every tp rank.
    tp_replicated = memory_per_rank(cfg, ParallelConfig(tp=2), seq_len=128, micro_batch=2)
    assert tp_replicated.weights - tp.weights == pytest.approx(experts * 4 / 2, rel=1e-6)
    eager = memory_per_rank(dataclasses.replace(cfg, attention="eager"), seq_len=128, micro_batch=2)
    assert eager.activations > one.activations
    pp = memory_per_rank(cfg, ParallelConfig(pp=2, microbatches=2), seq_len=128, micro_batch=2)
    assert pp.weights < one.weights


def test_memory_per_rank_by_data_parallel_mode():
    """DP4 on one copy of the weights: FSDP splits all three by 4; HSDP 2 × 2 by 2; ZeRO-1 only
    the optimizer state by 4; replication nothing. Context parallelism adds cp to the split and
    divides the tokens a rank holds."""
    cfg = ModelConfig(d_model=64, n_layers=4, n_heads=4, d_ff=128, vocab_size=256,
                      moe=MoEConfig(num_experts=8, top_k=2))
    kw = dict(seq_len=128, micro_batch=2)
    ddp = memory_per_rank(cfg, ParallelConfig(dp=4, dp_mode="ddp"), **kw)
    fsdp = memory_per_rank(cfg, ParallelConfig(dp=4, dp_mode="fsdp"), **kw)
    hsdp = memory_per_rank(cfg, ParallelConfig(dp=4, dp_mode="hsdp", dp_shard=2), **kw)
    zero1 = memory_per_rank(cfg, ParallelConfig(dp=4, dp_mode="zero1"), **kw)
    assert ddp.weights == flops.params_total(cfg) * 4
    assert fsdp.weights == pytest.approx(ddp.weights / 4, rel=1e-6) and fsdp.optimizer == pytest.approx(ddp.optimizer / 4, rel=1e-6)
    assert hsdp.weights == pytest.approx(ddp.weights / 2, rel=1e-6) and hsdp.grads == pytest.approx(ddp.grads / 2, rel=1e-6)
    assert zero1.weights == ddp.weights and zero1.grads == ddp.grads
    assert zero1.optimizer == pytest.approx(ddp.optimizer / 4, rel=1e-6)
    cp = memory_per_rank(cfg, ParallelConfig(dp=4, dp_mode="fsdp", cp=2), **kw)
    assert cp.weights == pytest.approx(fsdp.weights / 2, rel=1e-6) and cp.activations < fsdp.activations


def test_selective_checkpointing_drops_the_activation_and_router_probabilities():
    """Keeping matmul outputs only: SwiGLU keeps gate and up (not silu(gate) and the product) per
    FFN hidden unit, the router its logits (not its fp32 probabilities); everything else stays."""
    cfg = ModelConfig(d_model=64, n_layers=4, n_heads=4, d_ff=128, vocab_size=256, activation="swiglu",
                      moe=MoEConfig(num_experts=8, top_k=2, d_expert=96))
    none = activation_elements_per_token(cfg)
    selective = activation_elements_per_token(cfg, selective=True)
    assert none["dense_layer"] - selective["dense_layer"] == 2 * 128
    assert none["moe_layer"] - selective["moe_layer"] == (64 + 8) + 2 * (2 * 96)
    by_mode = {mode: memory_per_rank(cfg, seq_len=128, micro_batch=2, activation_checkpoint=mode).activations
               for mode in ("none", "selective", "full")}
    assert by_mode["full"] < by_mode["selective"] < by_mode["none"]
    assert memory_per_rank(cfg, seq_len=128, micro_batch=2, activation_checkpoint=True).activations == by_mode["full"]

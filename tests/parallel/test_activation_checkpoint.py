"""Activation checkpointing replays each router's forward in backward; the routes it counts for the
aux-loss-free bias must be counted once. The parity cases cannot see a double count on that path:
the bias moves by ±rate with the sign of (mean − load), which doubling every count leaves alone."""

import pytest
import torch
import torch.nn.functional as F

from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.transformer import build_model
from moetron.parallel.activation_checkpoint import apply_activation_checkpointing

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                  moe=MoEConfig(num_experts=4, top_k=2, d_expert=32, score="sigmoid", bias_update_rate=0.05))
B, S = 2, 16


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_a_replayed_router_counts_its_routes_once(mode):
    torch.manual_seed(0)
    model = build_model(CFG)
    apply_activation_checkpointing(model, mode)
    ids_BS1 = torch.randint(0, CFG.vocab_size, (B, S + 1))
    out = model(ids_BS1[:, :-1])
    F.cross_entropy(out.logits_BSV.flatten(0, 1), ids_BS1[:, 1:].flatten()).backward()
    routers = {name: block.ffn.router for name, block in model.layers.items()}
    for name, router in routers.items():
        # Every token's top-k routes, once: what the forward itself reported.
        assert len(router.routed_E) == 1, f"layer {name}: {len(router.routed_E)} counts for one forward"
        assert router.tokens_per_expert_E.sum() == B * S * CFG.moe.top_k
        assert torch.equal(router.tokens_per_expert_E, out.moe[int(name)].counts_E.float())
        assert router.hooks.recomputable == (mode != "none")

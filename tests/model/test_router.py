"""Routing against independent implementations: DeepSpeed's top1gating/top2gating (capacity,
kept routes, combine weights), megatron-core's Switch load-balancing loss and z-loss, and a plain
first-come-first-served queue written here.

Legend: T tokens, D model dim, E experts, K top-k, C capacity (places per expert).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from moetron.model.config import MoEConfig
from moetron.model.router import Router, expert_capacity, rank_within_expert, routes_per_expert

T, D, E = 64, 16, 8


def _router(top_k: int, capacity_factor, seed: int, **kwargs) -> tuple[Router, torch.Tensor, torch.Tensor]:
    """A router with sharp-enough logits that capacity bites, its input and its fp32 logits."""
    gen = torch.Generator().manual_seed(seed)
    weighting = "softmax" if top_k == 1 else "renormalize"
    cfg = MoEConfig(num_experts=E, top_k=top_k, capacity_factor=capacity_factor, weighting=weighting, **kwargs)
    router = Router(D, cfg)
    with torch.no_grad():
        router.gate.weight.copy_(torch.randn(E, D, generator=gen) * 0.5)
    x_TD = torch.randn(T, D, generator=gen)
    logits_TE = F.linear(x_TD, router.gate.weight).detach()
    return router, x_TD, logits_TE


def _dense_TE(routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Our (T, K) routing as DeepSpeed's (T, E) picture: combine weight and kept mask."""
    weight_TE = torch.zeros(T, E).scatter_add_(1, routing.expert_TK, routing.weight_TK.detach())
    kept_TE = torch.zeros(T, E, dtype=torch.bool).scatter_(1, routing.expert_TK, routing.kept_TK)
    return weight_TE, kept_TE


def _queue_kept(expert_TK: torch.Tensor, capacity: int) -> torch.Tensor:
    """Plain loop: first choices of all tokens in token order, then second choices, …; a route
    is kept while its expert has a free place."""
    taken = [0] * E
    kept = torch.zeros_like(expert_TK, dtype=torch.bool)
    for k in range(expert_TK.shape[1]):
        for t in range(expert_TK.shape[0]):
            e = int(expert_TK[t, k])
            kept[t, k] = taken[e] < capacity
            taken[e] += 1
    return kept


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_capacity_queue_equals_a_plain_loop(top_k):
    """rank_within_expert + capacity against the first-come-first-served loop above."""
    router, x_TD, _ = _router(top_k, 0.75, seed=top_k)
    routing = router(x_TD)
    capacity = expert_capacity(T, router.cfg)
    assert torch.equal(routing.kept_TK, _queue_kept(routing.expert_TK, capacity))
    assert torch.equal(rank_within_expert(routing.expert_TK, E) < capacity, routing.kept_TK)
    assert 0 < routing.dropped_fraction < 1


@pytest.mark.oracles
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25, 2.0, 8.0])
def test_top2_equals_deepspeed_top2gating(capacity_factor):
    """DeepSpeed top2gating (no 2nd-expert sampling): same capacity, kept routes and renormalized weights."""
    sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")
    router, x_TD, logits_TE = _router(2, capacity_factor, seed=int(capacity_factor * 4))
    routing = router(x_TD)
    # top2gating adds to its logits in place; it gets a copy.
    _, combine_TEC, dispatch_TEC, counts_E = sharded_moe.top2gating(
        logits_TE.clone(), capacity_factor, 0, drop_tokens=True, top2_2nd_expert_sampling=False)
    weight_TE, kept_TE = _dense_TE(routing)
    assert combine_TEC.shape[-1] == expert_capacity(T, router.cfg)
    assert torch.equal(kept_TE, dispatch_TEC.any(-1))
    torch.testing.assert_close(weight_TE, combine_TEC.sum(-1), rtol=1e-6, atol=1e-7)
    assert torch.equal(routing.counts_E, counts_E)
    if capacity_factor < 1.25:
        assert routing.dropped_fraction > 0, "the case meant to drop routes drops none"


@pytest.mark.oracles
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25, 2.0, 8.0])
@pytest.mark.parametrize("min_capacity", [0, 6])
def test_top1_equals_deepspeed_top1gating(capacity_factor, min_capacity):
    """DeepSpeed top1gating (use_rts=False, no noise): same capacity, kept count per expert, raw
    softmax weights, and the same kept tokens whenever no expert overflows.

    With use_rts=False DeepSpeed picks which of an overflowing expert's tokens to keep with
    torch.topk over equal values, an order torch leaves unspecified; our token-order queue is
    checked against DeepSpeed's top-2 (which keeps by position) and the plain loop instead."""
    sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")
    router, x_TD, logits_TE = _router(1, capacity_factor, seed=int(capacity_factor * 4), min_capacity=min_capacity)
    routing = router(x_TD)
    l_aux, combine_TEC, dispatch_TEC, counts_E = sharded_moe.top1gating(
        logits_TE.clone(), capacity_factor, min_capacity, noisy_gate_policy=None, drop_tokens=True, use_rts=False)
    capacity = combine_TEC.shape[-1]
    assert capacity == expert_capacity(T, router.cfg)
    weight_TE, kept_TE = _dense_TE(routing)
    ds_kept_TE = dispatch_TEC.any(-1)
    assert torch.equal(routing.counts_E, counts_E)
    assert torch.equal(kept_TE.sum(0), ds_kept_TE.sum(0))
    assert torch.equal(kept_TE.sum(0), counts_E.clamp(max=capacity))
    routed_TE = torch.zeros(T, E, dtype=torch.bool).scatter_(1, routing.expert_TK, True)
    assert not (ds_kept_TE & ~routed_TE).any()
    if bool((counts_E <= capacity).all()):
        assert torch.equal(kept_TE, ds_kept_TE)
    probs_TE = routing.probs_TE.detach()
    torch.testing.assert_close(weight_TE, probs_TE * kept_TE, rtol=0, atol=0)
    torch.testing.assert_close(combine_TEC.sum(-1), probs_TE * ds_kept_TE, rtol=1e-6, atol=1e-7)
    # Switch's aux loss: DeepSpeed's top-1 l_aux is the same E·Σ f_e·P_e.
    torch.testing.assert_close(routing.aux_loss / router.cfg.aux_loss_coef, l_aux, rtol=1e-5, atol=0)


@pytest.mark.oracles
@pytest.mark.parametrize("top_k,capacity_factor", [(1, None), (1, 1.0), (2, None), (2, 0.5), (4, 1.0)])
def test_aux_loss_equals_megatron_switch_loss(top_k, capacity_factor):
    """megatron-core switch_load_balancing_loss_func on the same probabilities and routes
    (counted before capacity drops, as Megatron's router does)."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    router, x_TD, logits_TE = _router(top_k, capacity_factor, seed=top_k, aux_loss_coef=0.03)
    x_TD.requires_grad_()
    routing = router(x_TD)
    tokens_per_expert_E = torch.zeros(T, E).scatter_(1, routing.expert_TK, 1.0).sum(0)
    expected = moe_utils.switch_load_balancing_loss_func(
        routing.probs_TE, tokens_per_expert_E, total_num_tokens=T, topk=top_k, num_experts=E,
        moe_aux_loss_coeff=0.03)
    torch.testing.assert_close(routing.aux_loss, expected, rtol=1e-5, atol=0)
    # And the gradient into the router input, which is what the loss is for.
    ours = torch.autograd.grad(routing.aux_loss, [x_TD, router.gate.weight], retain_graph=True)
    theirs = torch.autograd.grad(expected, [x_TD, router.gate.weight])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


@pytest.mark.oracles
def test_z_loss_equals_megatron_z_loss():
    """megatron-core z_loss_func on the router's logits, value and gradient."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    router, x_TD, _ = _router(2, None, seed=5, z_loss_coef=1e-3)
    x_TD.requires_grad_()
    routing = router(x_TD)
    expected = moe_utils.z_loss_func(F.linear(x_TD, router.gate.weight), 1e-3)
    torch.testing.assert_close(routing.z_loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.autograd.grad(routing.z_loss, x_TD, retain_graph=True)[0],
                               torch.autograd.grad(expected, x_TD)[0], rtol=1e-5, atol=1e-10)


def test_uniform_routing_has_unit_aux_loss():
    """E·Σ f_e·P_e = 1 for a router that is exactly uniform and balanced (Switch's normalization)."""
    cfg = MoEConfig(num_experts=4, top_k=1, weighting="softmax", aux_loss_coef=1.0)
    router = Router(4, cfg)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4) * 1e-3)
    # Tokens that each prefer a different expert, by a margin too small to move the mean probability.
    x_TD = torch.eye(4).repeat(8, 1)
    routing = router(x_TD)
    assert torch.equal(routing.counts_E, torch.full((4,), 8))
    assert math.isclose(routing.aux_loss.item(), 1.0, rel_tol=1e-5)


def test_routes_per_expert_equals_bincount():
    """The fixed-shape count (no data-dependent length, so compile traces it) equals bincount,
    also when the last experts receive nothing."""
    gen = torch.Generator().manual_seed(0)
    expert_TK = torch.randint(0, 5, (300, 2), generator=gen)
    counts_E = routes_per_expert(expert_TK, 8)
    assert counts_E.shape == (8,) and counts_E.dtype == torch.int64
    assert torch.equal(counts_E, torch.bincount(expert_TK.reshape(-1), minlength=8))

"""Sigmoid scores, aux-loss-free expert bias, group-limited routing and the routed scaling factor,
against megatron-core 0.16's `topk_routing_with_score_function` and `get_updated_expert_bias`.

Legend: T tokens, D model dim, E experts, K top-k, G expert groups.
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from moetron.model.config import MoEConfig
from moetron.model.router import Router, group_limited

T, D, E = 96, 16, 16

CASES = {
    # name: (our MoEConfig fields, megatron keyword arguments)
    "softmax-renormalize": (dict(top_k=2), dict(use_pre_softmax=False)),
    "softmax-raw": (dict(top_k=2, weighting="softmax"), dict(use_pre_softmax=True)),
    # Groups are chosen on the scores (DeepSeek-V2's softmax affinities): megatron's pre-softmax path.
    "softmax-groups": (dict(top_k=4, num_groups=4, topk_groups=2, weighting="softmax"),
                       dict(num_groups=4, group_topk=2, use_pre_softmax=True)),
    "sigmoid": (dict(top_k=4, score="sigmoid"), dict(score_function="sigmoid")),
    "sigmoid-scaled": (dict(top_k=4, score="sigmoid", route_scale=2.5), dict(score_function="sigmoid", scaling_factor=2.5)),
    "sigmoid-bias": (dict(top_k=4, score="sigmoid", bias_update_rate=1e-3), dict(score_function="sigmoid")),
    "sigmoid-bias-groups": (dict(top_k=4, score="sigmoid", bias_update_rate=1e-3, num_groups=4, topk_groups=2,
                                 route_scale=2.5),
                            dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5)),
    "sigmoid-top1": (dict(top_k=1, score="sigmoid", weighting="softmax"), dict(score_function="sigmoid")),
}


def dense(expert_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
    return torch.zeros(expert_TK.shape[0], E, dtype=weight_TK.dtype).scatter(1, expert_TK, weight_TK)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_choices_and_weights_equal_megatron(case, seed):
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    ours, theirs = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    router = Router(D, MoEConfig(num_experts=E, **ours))
    with torch.no_grad():
        router.gate.weight.copy_(torch.randn(E, D, generator=gen))
    bias_E = None
    if router.expert_bias_E is not None:
        # The size of the score gaps, so the bias changes some choices but not all.
        bias_E = torch.randn(E, generator=gen) * 0.2
        router.expert_bias_E.copy_(bias_E)
    x_TD = torch.randn(T, D, generator=gen)
    routing = router(x_TD)
    logits_TE = F.linear(x_TD, router.gate.weight).detach()
    probs_TE, map_TE = moe_utils.topk_routing_with_score_function(logits_TE, ours["top_k"], expert_bias=bias_E,
                                                                   **theirs)
    ours_TE = dense(routing.expert_TK, routing.weight_TK.detach())
    assert torch.equal(ours_TE != 0, map_TE)
    torch.testing.assert_close(ours_TE, probs_TE, rtol=1e-6, atol=1e-7)
    if bias_E is not None:  # the bias decided something: without it some choices differ
        router.expert_bias_E.zero_()
        assert not torch.equal(dense(router(x_TD).expert_TK, torch.ones(T, ours["top_k"])) != 0, map_TE)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bias", [False, True])
def test_sequence_balance_loss_equals_megatron_seq_aux_loss(score, bias):
    """megatron-core's seq_aux_loss: its [S, B] token layout folded into S × (B·E) "experts",
    Switch's loss over that, divided by B. Value and gradient; the bias does not enter it."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    B, S, K, coef = 4, T // 4, 4, 1e-3
    router = Router(D, MoEConfig(num_experts=E, top_k=K, score=score, aux_loss_type="sequence", aux_loss_coef=coef,
                                 weighting="renormalize", bias_update_rate=1e-3 if bias else 0.0))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.gate.weight.copy_(torch.randn(E, D, generator=gen))
        if bias:
            router.expert_bias_E.copy_(torch.randn(E, generator=gen))
    x_TD = torch.randn(T, D, generator=gen)
    ours = router(x_TD, num_sequences=B).aux_loss
    (g_ours,) = torch.autograd.grad(ours, router.gate.weight)

    weight = router.gate.weight.detach().clone().requires_grad_(True)
    logits_TE = F.linear(x_TD, weight)
    map_TE, scores_TE = moe_utils.compute_routing_scores_for_aux_loss(logits_TE, K, score)
    scores_SBE = scores_TE.view(B, S, E).transpose(0, 1).reshape(S, B * E)  # megatron's sequence-first rows
    map_SBE = map_TE.view(B, S, E).transpose(0, 1).reshape(S, B * E)
    theirs = moe_utils.switch_load_balancing_loss_func(scores_SBE, map_SBE.sum(0), S, K, E, coef) / B
    (g_theirs,) = torch.autograd.grad(theirs, weight)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_global_batch_balance_loss_equals_megatron_global_aux_loss(score):
    """megatron-core's global_aux_loss on one rank over three accumulated micro-batches: Switch's loss
    with the running mean of the routes per expert (`global_tokens_per_expert / ga_steps`). Value
    and gradient of each micro-batch; `start_batch` starts the count over as megatron's reset does.
    (Without bias or groups: megatron counts the unbiased top-k there, moetron the routes taken.)"""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    K, coef = 4, 1e-2
    router = Router(D, MoEConfig(num_experts=E, top_k=K, score=score, aux_loss_type="global_batch",
                                 aux_loss_coef=coef))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.gate.weight.copy_(torch.randn(E, D, generator=gen))
    total_E, micro_batch_losses = torch.zeros(E), []
    for step in range(2):
        router.start_batch()
        total_E.zero_()
        for ga_steps in range(1, 4):
            x_TD = torch.randn(T, D, generator=gen) * (1 + ga_steps)  # different loads per micro-batch
            ours = router(x_TD).aux_loss
            (g_ours,) = torch.autograd.grad(ours, router.gate.weight)

            weight = router.gate.weight.detach().clone().requires_grad_(True)
            map_TE, scores_TE = moe_utils.compute_routing_scores_for_aux_loss(F.linear(x_TD, weight), K, score)
            total_E += map_TE.sum(0)
            theirs = moe_utils.switch_load_balancing_loss_func(scores_TE, total_E / ga_steps, T, K, E, coef)
            (g_theirs,) = torch.autograd.grad(theirs, weight)
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
            torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-9)
            micro_batch_losses.append(moe_utils.switch_load_balancing_loss_func(scores_TE, map_TE.sum(0), T, K, E, coef))
        # The last micro-batch's global loss is not its own micro-batch's: the count reached across.
        assert not torch.isclose(ours, micro_batch_losses[-1])


def test_the_bias_never_reaches_the_weights_or_the_gradient():
    router = Router(D, MoEConfig(num_experts=E, top_k=4, score="sigmoid", bias_update_rate=1e-3))
    names = [n for n, _ in router.named_parameters()]
    assert names == ["gate.weight"]  # a buffer: no gradient, no weight decay, not in the optimizer
    assert set(router.state_dict()) == {"gate.weight", "expert_bias_E"}  # checkpointed; the count is not
    x_TD = torch.randn(T, D)
    router.expert_bias_E.copy_(torch.linspace(-1, 1, E))
    routing = router(x_TD)
    scores_TE = F.linear(x_TD, router.gate.weight).sigmoid()
    picked_TK = scores_TE.gather(1, routing.expert_TK)
    torch.testing.assert_close(routing.weight_TK, picked_TK / picked_TK.sum(-1, keepdim=True))
    routing.weight_TK.sum().backward()
    assert router.expert_bias_E.grad is None


def test_group_limited_routing_stays_inside_the_best_groups():
    """A plain loop: score groups by their best top_k/topk_groups experts, keep the best groups."""
    gen = torch.Generator().manual_seed(3)
    choice_TE = torch.rand(T, E, generator=gen)
    masked_TE = group_limited(choice_TE, top_k=4, num_groups=4, topk_groups=2)
    for t in range(T):
        groups = choice_TE[t].view(4, 4)
        group_score = groups.topk(2, dim=-1).values.sum(-1)
        best = set(group_score.topk(2).indices.tolist())
        for g in range(4):
            kept = torch.isfinite(masked_TE[t].view(4, 4)[g]).all().item()
            assert kept == (g in best)
    picks_TK = masked_TE.topk(4, dim=-1).indices
    assert ((picks_TK // 4).unsqueeze(-1) == (picks_TK // 4).unsqueeze(-2)).any(-1).all()
    assert torch.tensor([len(set(row.tolist())) for row in picks_TK // 4]).max() <= 2  # ≤ topk_groups groups


def test_counts_accumulate_only_while_training():
    """Routes are counted per expert by training forwards only, and one update moves each bias by
    the rate toward balance: up where the load is under the mean, down where over, not at all where
    equal. Loads and biases worked out by hand on 4 experts, top-2."""
    router = Router(4, MoEConfig(num_experts=4, top_k=2, score="sigmoid", bias_update_rate=1e-3))
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4))  # the score of expert e is sigmoid(x[e])
    router.expert_bias_E.zero_()
    # Token 0 picks experts {0, 1}, token 1 {0, 2}, token 2 {2, 3}: loads [2, 1, 2, 1] per forward.
    x_TD = torch.tensor([[3.0, 2.0, 0.0, 0.0], [3.0, 0.0, 2.0, 0.0], [0.0, 0.0, 3.0, 2.0]])
    router(x_TD)
    router(x_TD)
    assert router.tokens_per_expert_E.tolist() == [4.0, 2.0, 4.0, 2.0]
    router.eval()
    router(x_TD)
    assert router.tokens_per_expert_E.tolist() == [4.0, 2.0, 4.0, 2.0]  # evaluation counts nothing
    # Mean load 3: experts 0 and 2 are over it (bias −1e-3), 1 and 3 under it (+1e-3).
    router.update_bias(router.tokens_per_expert_E)
    assert router.expert_bias_E.tolist() == pytest.approx([-1e-3, 1e-3, -1e-3, 1e-3], rel=0, abs=1e-10)
    assert router.routed_E == []
    # Loads [6, 0, 3, 3], mean 3: expert 0 down again, 1 up again, 2 and 3 (at the mean) stay.
    router.update_bias(torch.tensor([6.0, 0.0, 3.0, 3.0]))
    assert router.expert_bias_E.tolist() == pytest.approx([-2e-3, 2e-3, -1e-3, 1e-3], rel=0, abs=1e-10)


BIAS_UPDATE = """
import torch, torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias
from moetron.model.router import updated_bias
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
parallel_state.initialize_model_parallel()
gen = torch.Generator().manual_seed(0)
for case in range(6):
    load_E = torch.randint(0, 50, (16,), generator=gen).float()
    if case == 0:
        load_E[:] = 7.0  # balanced: nothing moves
    bias_E = torch.randn(16, generator=gen)
    theirs = get_updated_expert_bias(load_E.clone(), bias_E, 1e-3)
    ours = updated_bias(bias_E, load_E, 1e-3)
    assert torch.equal(ours, theirs), (case, ours - theirs)
dist.destroy_process_group()
print("ok")
"""


def test_bias_update_equals_megatron():
    pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", BIAS_UPDATE.format(port=port)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]

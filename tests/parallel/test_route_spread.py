"""How far routes travel under expert parallelism (`route_spread`, logged as
moe_remote_routes_per_token and moe_ep_ranks_per_token): against a loop over tokens, and the bound
group-limited routing gives with one group per ep rank (DeepSeek-V3's node-limited routing)."""

import pytest
import torch

from moetron.model.config import MoEConfig
from moetron.model.router import Router
from moetron.parallel.expert_parallel import route_spread

E, D, T, K, EP = 16, 16, 256, 4, 4


def spread_by_loop(expert_TK, kept_TK, local_experts, ep_rank):
    remote = reached = 0
    for experts, kept in zip(expert_TK.tolist(), kept_TK.tolist()):
        owners = {e // local_experts for e, k in zip(experts, kept) if k}
        remote += sum(1 for e, k in zip(experts, kept) if k and e // local_experts != ep_rank)
        reached += len(owners)
    return remote / len(expert_TK), reached / len(expert_TK)


@pytest.mark.parametrize("ep_rank", [0, 3])
def test_spread_equals_a_loop_over_tokens(ep_rank):
    gen = torch.Generator().manual_seed(ep_rank)
    expert_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    kept_TK = torch.rand(T, K, generator=gen) > 0.2  # some routes dropped by capacity
    remote, ranks = route_spread(expert_TK, kept_TK, E // EP, EP, ep_rank)
    want_remote, want_ranks = spread_by_loop(expert_TK, kept_TK, E // EP, ep_rank)
    assert float(remote) == pytest.approx(want_remote) and float(ranks) == pytest.approx(want_ranks)


def routed_spread(**moe):
    router = Router(D, MoEConfig(num_experts=E, top_k=K, score="sigmoid", **moe))
    torch.nn.init.normal_(router.gate.weight, generator=torch.Generator().manual_seed(0))
    r = router(torch.randn(T, D, generator=torch.Generator().manual_seed(1)))
    return [float(v) for v in route_spread(r.expert_TK, r.kept_TK, E // EP, EP, ep_rank=0)]


def test_one_group_per_ep_rank_bounds_the_ranks_a_token_reaches():
    free_remote, free_ranks = routed_spread()
    one_remote, one_ranks = routed_spread(num_groups=EP, topk_groups=1)
    two_remote, two_ranks = routed_spread(num_groups=EP, topk_groups=2)
    assert one_ranks == 1.0  # every route of a token lands on one rank
    assert 1.0 < two_ranks <= 2.0 < free_ranks <= EP
    # Routes leaving rank 0: some, and at most the K of each token.
    assert 0 < free_remote < K and 0 < one_remote <= K and 0 < two_remote < K

"""Route: router logits → top-k experts per token, their weights, capacity drops and aux losses.

Legend: T tokens, D model dim, E experts, K top-k choices (K ≤ E), A = K·T routed assignments.

Capacity follows DeepSpeed/GShard: C = max(ceil(K·T/E · capacity_factor), min_capacity). Within an
expert, all first choices take their places before any second choice, each in token order; a
route past place C is dropped and its token rides the residual. Weights are taken after drops:
"softmax" keeps the raw router probability (Switch), "renormalize" rescales the surviving routes
of a token to sum to one (Mixtral; GShard top-2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moetron.model.config import MoEConfig


@dataclass
class Routing:
    """What `route` decided for T tokens; every tensor is (T, K) unless named otherwise."""

    expert_TK: torch.Tensor  # int64 expert id of each choice, best first
    weight_TK: torch.Tensor  # combine weight, 0 where dropped
    kept_TK: torch.Tensor  # bool
    probs_TE: torch.Tensor  # softmax of the router logits, fp32 (fp64 for fp64 inputs)
    aux_loss: torch.Tensor  # scalar, already scaled by aux_loss_coef
    z_loss: torch.Tensor  # scalar, already scaled by z_loss_coef
    counts_E: torch.Tensor  # routes each expert received, before capacity drops
    dropped_fraction: torch.Tensor  # scalar: dropped routes / all routes
    entropy: torch.Tensor  # scalar: mean router entropy per token, in nats


def expert_capacity(num_tokens: int, cfg: MoEConfig) -> int | None:
    """Places per expert, or None for dropless routing."""
    if cfg.capacity_factor is None:
        return None
    return max(math.ceil(cfg.top_k * num_tokens / cfg.num_experts * cfg.capacity_factor), cfg.min_capacity)


def rank_within_expert(expert_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Place of each route in its expert's queue: choice-major, then token order → (T, K)."""
    expert_A = expert_TK.t().reshape(-1)  # all first choices, then all second choices, …
    order_A = torch.argsort(expert_A, stable=True)
    starts_E = torch.cumsum(torch.bincount(expert_A, minlength=num_experts), 0) - torch.bincount(
        expert_A, minlength=num_experts)
    rank_sorted_A = torch.arange(expert_A.numel(), device=expert_A.device) - starts_E[expert_A[order_A]]
    rank_A = torch.empty_like(rank_sorted_A).scatter_(0, order_A, rank_sorted_A)
    return rank_A.view(expert_TK.shape[1], -1).t()


def load_balancing_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer's E · Σ_e f_e · P_e, with f_e the share of the K·T routes sent to e
    and P_e the mean router probability of e (Fedus et al. 2021; Megatron's top-k form). Equals 1
    when routing is perfectly uniform."""
    num_tokens, num_experts = probs_TE.shape
    f_E = counts_E.to(probs_TE.dtype) / (num_tokens * top_k)
    return num_experts * torch.sum(f_E * probs_TE.mean(dim=0))


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: mean over tokens of logsumexp(logits)^2, keeping router logits small."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


class Router(nn.Module):
    """Linear gate D → E, softmax in fp32, top-k, capacity."""

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(d_model, cfg.num_experts, bias=False)

    def forward(self, x_TD: torch.Tensor) -> Routing:
        cfg = self.cfg
        if self.training and cfg.jitter > 0:
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - cfg.jitter, 1.0 + cfg.jitter)
        # Routing decisions are precision-sensitive: logits and softmax in fp32 (as in Switch) or
        # wider, so a float64 layer stays float64 end to end (gradcheck).
        dtype = torch.promote_types(x_TD.dtype, torch.float32)
        logits_TE = nn.functional.linear(x_TD.to(dtype), self.gate.weight.to(dtype))
        probs_TE = logits_TE.softmax(dim=-1)
        top_probs_TK, expert_TK = torch.topk(probs_TE, cfg.top_k, dim=-1)

        counts_E = torch.bincount(expert_TK.reshape(-1), minlength=cfg.num_experts)
        capacity = expert_capacity(x_TD.shape[0], cfg)
        if capacity is None:
            kept_TK = torch.ones_like(expert_TK, dtype=torch.bool)
        else:
            kept_TK = rank_within_expert(expert_TK, cfg.num_experts) < capacity

        weight_TK = top_probs_TK * kept_TK
        if cfg.weighting == "renormalize":
            weight_TK = weight_TK / weight_TK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weight_TK.dtype).eps)

        zero = logits_TE.new_zeros(())
        aux = cfg.aux_loss_coef * load_balancing_loss(probs_TE, counts_E, cfg.top_k) if cfg.aux_loss_coef else zero
        z = cfg.z_loss_coef * router_z_loss(logits_TE) if cfg.z_loss_coef else zero
        with torch.no_grad():
            entropy = -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(-1).mean()
            dropped = 1.0 - kept_TK.float().mean()
        return Routing(expert_TK, weight_TK, kept_TK, probs_TE, aux, z, counts_E.detach(), dropped, entropy)

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.gate.weight, std=std)

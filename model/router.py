"""Route: router logits → top-k experts per token, their weights, capacity drops and aux losses.

Legend: T tokens, D model dim, E experts, K top-k choices (K ≤ E), A = K·T routed assignments,
G expert groups.

Scores are softmax(logits) (Switch, Mixtral) or sigmoid(logits) (DeepSeek-V3); the logits may carry a
learned bias (`router_bias`, GPT-OSS, whose top-k of the logits softmaxed over the kept ones is
softmax + renormalize here: both keep the same experts, and exp(l_k) / Σ_kept exp(l) is the same
ratio of softmax scores). Experts are chosen
by score + expert_bias_E (aux-loss-free balancing; the bias never reaches the combine weights or
the gradient), optionally only inside each token's best `topk_groups` of `num_groups` groups.

Capacity follows DeepSpeed/GShard: C = max(ceil(K·T/E · capacity_factor), min_capacity). Within an
expert, all first choices take their places before any second choice, each in token order; a
route past place C is dropped and its token rides the residual. Weights are taken after drops:
"softmax" keeps the raw router probability (Switch), "renormalize" rescales the surviving routes
of a token to sum to one (Mixtral; GShard top-2), and both are multiplied by `route_scale`.
The expert choice, weights and group rule equal megatron-core's `topk_routing_with_score_function`
(tests/model/test_router_scores.py), whose softmax path ignores a bias; here it applies to both
scores, and groups are always chosen on the scores (megatron's pre-softmax path).

The balance loss is Switch's over the micro-batch's routes, over the global batch's
(`aux_loss_type: global_batch`), or DeepSeek-V3's per sequence (`aux_loss_type: sequence`).
The global batch's loads are not known until its last micro-batch has routed, and a micro-batch's
backward may run before the next forward (accumulation, 1F1B), so, as Megatron-Core's
global_aux_loss does, micro-batch j takes f from the routes of micro-batches 1..j of the step on
every data-parallel rank (the router's `hooks.batch_sum` adds the other ranks'): the last one's f
is the whole global batch's. The probabilities P stay the micro-batch's own. Under context
parallelism a rank holds only some positions of each sequence: the router's `hooks.sequence_sum`
then sums the loss's statistics (routes and score sums per expert, per sequence for the sequence
loss, and token counts) over the ranks holding the rest, so the loss is the one process's; capacity
is still taken on the local tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moetron.model.config import MoEConfig
from moetron.model.parallel_hooks import ParallelHooks, SequenceSum


@dataclass
class Routing:
    """What `route` decided for T tokens; every tensor is (T, K) unless named otherwise."""

    expert_TK: torch.Tensor  # int64 expert id of each choice, best first
    weight_TK: torch.Tensor  # combine weight, 0 where dropped
    kept_TK: torch.Tensor  # bool
    probs_TE: torch.Tensor  # scores (softmax, or sigmoid normalized per token) of the logits, fp32 (fp64 for fp64 inputs)
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


def routes_per_expert(expert_A: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes each expert received → (E,) int64. Unlike `bincount`, whose length depends on the
    values, the shape is known in advance, so torch.compile traces it without a graph break."""
    expert_A = expert_A.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_A.device)
    return counts_E.index_add_(0, expert_A, torch.ones_like(expert_A))


def rank_within_expert(expert_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Place of each route in its expert's queue: choice-major, then token order → (T, K)."""
    expert_A = expert_TK.t().reshape(-1)  # all first choices, then all second choices, …
    order_A = torch.argsort(expert_A, stable=True)
    counts_E = routes_per_expert(expert_A, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_sorted_A = torch.arange(expert_A.numel(), device=expert_A.device) - starts_E[expert_A[order_A]]
    rank_A = torch.empty_like(rank_sorted_A).scatter_(0, order_A, rank_sorted_A)
    return rank_A.view(expert_TK.shape[1], -1).t()


def _mean_probs(probs_TE: torch.Tensor, sequence_sum: SequenceSum | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | int]:
    """(P_E, T): each expert's mean probability over the tokens and their number; with
    `sequence_sum`, both over the whole sequences (summed over the ranks holding the other
    positions, differentiably for P_E)."""
    num_tokens, num_experts = probs_TE.shape
    if sequence_sum is None:
        return probs_TE.mean(dim=0), num_tokens
    sums = sequence_sum(torch.cat([probs_TE.sum(0), probs_TE.new_full((1,), num_tokens)]))
    return sums[:num_experts] / sums[num_experts], sums[num_experts].detach()


def load_balancing_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int,
                        sequence_sum: SequenceSum | None = None) -> torch.Tensor:
    """Switch Transformer's E · Σ_e f_e · P_e, with f_e the share of the K·T routes sent to e
    and P_e the mean router probability of e (Fedus et al. 2021; Megatron's top-k form). Equals 1
    when routing is perfectly uniform.

    With `sequence_sum`, `counts_E` are already the whole sequences' and the probability sums and
    token counts are summed by it over the ranks holding the other positions."""
    P_E, num_tokens = _mean_probs(probs_TE, sequence_sum)
    f_E = counts_E.to(probs_TE.dtype) / (num_tokens * top_k)
    return probs_TE.shape[1] * torch.sum(f_E * P_E)


def global_balancing_loss(probs_TE: torch.Tensor, load_E: torch.Tensor,
                          sequence_sum: SequenceSum | None = None) -> torch.Tensor:
    """Switch's E · Σ_e f_e · P_e with f_e the share of `load_E` (routes per expert counted over more
    than these tokens: the global batch's so far) and P_e these tokens' mean probability of e
    (over the whole sequences, with `sequence_sum`)."""
    f_E = (load_E / load_E.sum().clamp_min(1)).to(probs_TE.dtype)
    return probs_TE.shape[1] * torch.sum(f_E * _mean_probs(probs_TE, sequence_sum)[0])


def group_limited(choice_TE: torch.Tensor, top_k: int, num_groups: int, topk_groups: int,
                  score_top: int = 0) -> torch.Tensor:
    """`choice_TE` with every expert outside each token's `topk_groups` best groups set to -inf; a
    group scores the sum of its best `score_top` experts, 0: top_k // topk_groups (megatron-core's rule)."""
    T, E = choice_TE.shape
    score_top = score_top or top_k // topk_groups
    group_TG = choice_TE.view(T, num_groups, E // num_groups).topk(score_top, dim=-1).values.sum(-1)
    kept_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(
        1, group_TG.topk(topk_groups, dim=-1, sorted=False).indices, True)
    return choice_TE.masked_fill(~kept_TG.repeat_interleave(E // num_groups, dim=1), float("-inf"))


def updated_bias(bias_E: torch.Tensor, load_E: torch.Tensor, rate: float) -> torch.Tensor:
    """Wang et al. 2024's step: each bias moves by `rate` toward balance, bias + rate · sign(mean − load)."""
    load_E = load_E.to(bias_E.dtype)
    return bias_E + rate * torch.sign(load_E.mean() - load_E)


def sequence_balancing_loss(probs_TE: torch.Tensor, num_sequences: int, top_k: int,
                            sequence_sum: SequenceSum | None = None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (eqs. 17–20), averaged over the B sequences of the
    T = B·S tokens (rows sequence-major): per sequence E · Σ_e f_e · P_e, with f_e the share of the
    sequence's K·S top-k routes (of the scores themselves, no bias, no groups) sent to e, and P_e
    its mean score of e. megatron-core's seq_aux_loss (tests/model/test_router_scores.py).

    With `sequence_sum` the S rows of a sequence here are some of its positions: the route counts,
    score sums and S are summed over the ranks holding the others."""
    T, E = probs_TE.shape
    S = T // num_sequences
    top_TK = torch.topk(probs_TE.detach(), top_k, dim=-1).indices
    counts_BE = torch.zeros(num_sequences, E, dtype=probs_TE.dtype, device=probs_TE.device).scatter_add_(
        1, top_TK.view(num_sequences, S * top_k), torch.ones(num_sequences, S * top_k, dtype=probs_TE.dtype,
                                                             device=probs_TE.device))
    if sequence_sum is None:
        f_BE = counts_BE / (S * top_k)
        P_BE = probs_TE.view(num_sequences, S, E).mean(dim=1)
        return E * (f_BE * P_BE).sum(-1).mean()
    # One exchange: per sequence [score sums (E), route counts (E), positions (1)].
    local_B2E1 = torch.cat([probs_TE.view(num_sequences, S, E).sum(dim=1), counts_BE,
                            probs_TE.new_full((num_sequences, 1), S)], dim=1)
    sums_B2E1 = sequence_sum(local_B2E1)
    S_B1 = sums_B2E1[:, 2 * E :].detach()
    P_BE, f_BE = sums_B2E1[:, :E] / S_B1, sums_B2E1[:, E : 2 * E].detach() / (S_B1 * top_k)
    return E * (f_BE * P_BE).sum(-1).mean()


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: mean over tokens of logsumexp(logits)^2, keeping router logits small."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


class Router(nn.Module):
    """Linear gate D → E, scores in fp32, biased (group-limited) top-k, capacity.

    With `bias_update_rate` > 0 it holds `expert_bias_E`, a persistent buffer, not a parameter
    (checkpointed and resharded, never in the optimizer), and `routed_E`, the routes per expert of
    each training forward since the last bias update (one entry per forward); the trainer sums
    them over the global batch and calls `update_bias`.

    With `aux_loss_type: global_batch` it keeps `batch_loads_E`, the global batch's routes per expert
    up to each training micro-batch of the step (a running sum); `start_batch` clears them before a
    step's first micro-batch.
    """

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(d_model, cfg.num_experts, bias=cfg.router_bias)
        self.routed_E: list[torch.Tensor] = []
        if cfg.bias_update_rate > 0:
            self.register_buffer("expert_bias_E", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.expert_bias_E = None
        # sequence_sum (context parallelism): the balance loss and the reported route counts are
        # the whole sequences'; batch_sum (data parallelism): the global-batch loss's loads are.
        self.hooks = ParallelHooks()
        self.batch_loads_E: list[torch.Tensor] = []
        self._replayed = 0  # loads handed back to recomputed forwards this step

    def forward(self, x_TD: torch.Tensor, num_sequences: int = 1) -> Routing:
        """x_TD: the tokens of `num_sequences` sequences, sequence-major (B·S rows)."""
        cfg = self.cfg
        logits_TE, scores_TE, expert_TK = self._choose(x_TD)
        top_scores_TK = scores_TE.gather(1, expert_TK)

        counts_E = routes_per_expert(expert_TK, cfg.num_experts)
        count_bias = self.training and self.expert_bias_E is not None and not x_TD.is_meta
        global_batch = (cfg.aux_loss_type == "global_batch" and cfg.aux_loss_coef and self.training
                        and not x_TD.is_meta)
        # Whether activation checkpointing recomputes this forward inside backward (a graph task
        # is then running): its routes were counted when the forward first ran. Asked only when
        # it matters, since torch.compile cannot trace the question (a graph break).
        recomputed = ((count_bias or global_batch) and self.hooks.recomputable
                      and torch._C._current_graph_task_id() != -1)
        if count_bias and not recomputed:
            self.routed_E.append(counts_E.detach())
        # Before sequence_sum: batch_sum adds every other rank's tokens, cp ranks too.
        load_E = self._batch_load(counts_E, recomputed) if global_batch else None
        if self.hooks.sequence_sum is not None:
            # After the bias's count, which must stay local: update_expert_biases sums over every rank.
            counts_E = self.hooks.sequence_sum(counts_E)
        # Under context parallelism, capacity is taken on the local tokens (as Megatron does).
        capacity = expert_capacity(x_TD.shape[0], cfg)
        if capacity is None:
            kept_TK = torch.ones_like(expert_TK, dtype=torch.bool)
        else:
            kept_TK = rank_within_expert(expert_TK, cfg.num_experts) < capacity

        weight_TK = top_scores_TK * kept_TK
        if cfg.weighting == "renormalize":
            weight_TK = weight_TK / weight_TK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weight_TK.dtype).eps)
        if cfg.route_scale != 1.0:
            weight_TK = weight_TK * cfg.route_scale

        # The balance loss and entropy read a distribution over experts: sigmoid scores are
        # normalized per token for them (megatron-core's compute_routing_scores_for_aux_loss).
        probs_TE = scores_TE if cfg.score == "softmax" else scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)
        zero = logits_TE.new_zeros(())
        aux = (cfg.aux_loss_coef * self._balance_loss(probs_TE, counts_E, load_E, num_sequences)
               if cfg.aux_loss_coef else zero)
        z = cfg.z_loss_coef * router_z_loss(logits_TE) if cfg.z_loss_coef else zero
        with torch.no_grad():
            entropy = -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(-1).mean()
            dropped = 1.0 - kept_TK.float().mean()
        return Routing(expert_TK, weight_TK, kept_TK, probs_TE, aux, z, counts_E.detach(), dropped, entropy)

    def _choose(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """→ (logits_TE, scores_TE, expert_TK): the gate's logits and scores, and each token's
        top-k experts by score + bias, within its best groups."""
        cfg = self.cfg
        if self.training and cfg.jitter > 0:
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - cfg.jitter, 1.0 + cfg.jitter)
        # Routing decisions are precision-sensitive: logits and scores in fp32 (as in Switch) or
        # wider, so a float64 layer stays float64 end to end (gradcheck).
        dtype = torch.promote_types(x_TD.dtype, torch.float32)
        bias_E = self.gate.bias.to(dtype) if self.gate.bias is not None else None
        logits_TE = nn.functional.linear(x_TD.to(dtype), self.gate.weight.to(dtype), bias_E)
        scores_TE = logits_TE.softmax(dim=-1) if cfg.score == "softmax" else logits_TE.sigmoid()
        choice_TE = scores_TE.detach()
        if self.expert_bias_E is not None:
            choice_TE = choice_TE + self.expert_bias_E.to(dtype)
        if cfg.num_groups:
            choice_TE = group_limited(choice_TE, cfg.top_k, cfg.num_groups, cfg.topk_groups, cfg.group_score_top)
        return logits_TE, scores_TE, torch.topk(choice_TE, cfg.top_k, dim=-1).indices

    def _balance_loss(self, probs_TE: torch.Tensor, counts_E: torch.Tensor, load_E: torch.Tensor | None,
                      num_sequences: int) -> torch.Tensor:
        """The configured balance loss, before aux_loss_coef: the global batch's when `load_E`
        (its routes per expert so far) is given, else per sequence or over these routes."""
        cfg, sequence_sum = self.cfg, self.hooks.sequence_sum
        if load_E is not None:
            return global_balancing_loss(probs_TE, load_E, sequence_sum)
        if cfg.aux_loss_type == "sequence":
            return sequence_balancing_loss(probs_TE, num_sequences, cfg.top_k, sequence_sum)
        return load_balancing_loss(probs_TE, counts_E, cfg.top_k, sequence_sum)

    def _batch_load(self, counts_E: torch.Tensor, recomputed: bool) -> torch.Tensor:
        """The global batch's routes per expert up to this micro-batch (float64, exact). A forward
        recomputed in backward gets the load its first run saw: backwards run in forward order."""
        if recomputed:
            self._replayed += 1
            return self.batch_loads_E[self._replayed - 1]
        load_E = counts_E.detach().to(torch.float64)
        if self.hooks.batch_sum is not None:
            load_E = self.hooks.batch_sum(load_E)
        if self.batch_loads_E:
            load_E = load_E + self.batch_loads_E[-1]
        self.batch_loads_E.append(load_E)
        return load_E

    def start_batch(self) -> None:
        """Before a step's first micro-batch: the global-batch loss counts from zero again."""
        self.batch_loads_E.clear()
        self._replayed = 0

    @property
    def tokens_per_expert_E(self) -> torch.Tensor:
        """Routes per expert chosen by this router's training forwards since the last bias update."""
        if not self.routed_E:
            return torch.zeros(self.cfg.num_experts, device=self.gate.weight.device)
        return torch.stack(self.routed_E).sum(0).to(torch.float32)

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """One aux-loss-free step from the global batch's routes per expert; clears the local count."""
        self.expert_bias_E.copy_(updated_bias(self.expert_bias_E, load_E, self.cfg.bias_update_rate))
        self.routed_E.clear()

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.gate.weight, std=std)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)
        if self.expert_bias_E is not None:
            self.expert_bias_E.zero_()
            self.routed_E.clear()

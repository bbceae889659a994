"""The MoE layer in four explicit steps: route → dispatch → experts → combine.

Legend: B batch, S sequence, T = B·S tokens, D model dim, K top-k, A kept routes, E experts.

The dispatcher is a swappable object: `LocalDispatcher` permutes tokens by expert inside one
process; expert parallelism replaces it with one that exchanges tokens by all-to-all. The layer
itself never communicates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetron.model.config import ModelConfig
from moetron.model.experts import GroupedExperts
from moetron.model.layers import FeedForward
from moetron.model.router import Router, Routing, routes_per_expert


@dataclass
class DispatchState:
    """What `combine` needs to undo `dispatch`: each kept route's token and weight, sorted by expert."""

    token_A: torch.Tensor
    weight_A: torch.Tensor
    num_tokens: int


class LocalDispatcher:
    """Permute the kept routes so each expert's tokens are contiguous; no communication."""

    def dispatch(self, x_TD: torch.Tensor, routing: Routing,
                 row_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """→ x_AD sorted by expert, offsets_E (int32 end row per expert), state for combine.

        row_multiple > 1 rounds each expert's group up to a multiple of that many rows (the
        grouped GEMM's preferred sizes, `group_row_multiple`): padding rows copy token 0 with
        weight 0, so they add nothing to the output and get no gradient.
        """
        num_experts = routing.probs_TE.shape[1]
        T, K = routing.expert_TK.shape
        expert_A = routing.expert_TK.reshape(-1)
        token_A = torch.arange(T * K, device=x_TD.device) // K
        weight_A = routing.weight_TK.reshape(-1)
        if not routing.dropless:
            # Dropped routes leave; the row count then depends on the data (under torch.compile,
            # a graph break; on a GPU, a host-device sync). Dropless routing keeps static shapes.
            kept_A = routing.kept_TK.reshape(-1).nonzero().squeeze(1)
            expert_A, token_A, weight_A = expert_A[kept_A], token_A[kept_A], weight_A[kept_A]
        order_A = torch.argsort(expert_A, stable=True)
        counts_E = routes_per_expert(expert_A, num_experts)
        token_A, weight_A = token_A[order_A], weight_A[order_A]
        if row_multiple > 1:
            padded_E = (counts_E + row_multiple - 1) // row_multiple * row_multiple
            pad_E = padded_E - counts_E
            # Route i (in expert order) of expert e moves by the padding of the experts before e.
            shift_E = torch.cumsum(pad_E, 0) - pad_E
            slot_A = torch.arange(len(order_A), device=x_TD.device) + shift_E[expert_A[order_A]]
            # NOTE: host-device sync for the padded row count (CPU only: see group_row_multiple).
            # A routing-independent bound instead (the last group taking the slack) measured no
            # faster compiled and 1% slower eager (bf16 bench step, 10-14 interleaved rounds).
            rows = int(padded_E.sum())
            token_A = token_A.new_zeros(rows).index_put((slot_A,), token_A)
            weight_A = weight_A.new_zeros(rows).index_put((slot_A,), weight_A)
            counts_E = padded_E
        offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
        # index_select, not x_TD[token_A]: its backward is index_add_, ~10× faster on CPU than the
        # accumulating index_put_ that advanced indexing differentiates into.
        return x_TD.index_select(0, token_A), offsets_E, DispatchState(token_A, weight_A, T)

    def spread(self, routing: Routing) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Routes per token leaving the rank and ranks reached per token: nothing leaves here."""
        return None

    def combine(self, y_AD: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Weight each route's output and sum it into its token → y_TD (dropped tokens get 0)."""
        weighted_AD = y_AD * state.weight_A[:, None].to(y_AD.dtype)
        y_TD = weighted_AD.new_zeros(state.num_tokens, y_AD.shape[1])
        return y_TD.index_add_(0, state.token_A, weighted_AD)


@dataclass
class MoEStats:
    """Per-layer numbers for losses and dashboards."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    counts_E: torch.Tensor
    dropped_fraction: torch.Tensor
    entropy: torch.Tensor
    # Under expert parallelism: kept routes per token sent to another ep rank, and ep ranks a
    # token's kept routes reach (its own counted when it keeps a route there). None otherwise.
    remote_routes: torch.Tensor | None = None
    ranks_per_token: torch.Tensor | None = None


class MoELayer(nn.Module):
    """Routed experts plus an optional shared expert, replacing a dense FFN."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.router = Router(cfg.d_model, moe)
        self.experts = GroupedExperts(moe.num_experts, cfg.d_model, cfg.d_expert_ff, cfg.activation, moe.experts_impl)
        self.shared = (FeedForward(cfg.d_model, moe.shared_expert_d_ff, cfg.activation, cfg.bias)
                       if moe.shared_expert_d_ff else None)
        self.dropout = nn.Dropout(cfg.dropout)
        self.dispatcher = LocalDispatcher()

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = self.router(x_TD, num_sequences=x_BSD.shape[0])
        if isinstance(self.dispatcher, LocalDispatcher):
            rows = self.experts.group_row_multiple(x_TD, routing.expert_TK.numel() / routing.probs_TE.shape[1])
            x_AD, offsets_E, state = self.dispatcher.dispatch(x_TD, routing, row_multiple=rows)
        else:
            # Expert parallelism: the received rows' layout is fixed by the exchange.
            x_AD, offsets_E, state = self.dispatcher.dispatch(x_TD, routing)
        y_AD = self.experts(x_AD, offsets_E)
        y_TD = self.dispatcher.combine(y_AD, state).to(x_BSD.dtype)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        spread = self.dispatcher.spread(routing)
        stats = MoEStats(routing.aux_loss, routing.z_loss, routing.counts_E, routing.dropped_fraction,
                         routing.entropy, *(spread or ()))
        return self.dropout(y_TD.view_as(x_BSD)), stats

    def init_weights(self, std: float, out_std: float) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std, out_std)
        if self.shared is not None:
            self.shared.init_weights(std, out_std)

"""The MoE layer in four explicit steps: route → dispatch → experts → combine.

Legend: B batch, S sequence, T = B·S tokens, D model dim, K top-k, A = T·K routes, R rows the
experts receive (A, plus padding rows), E experts.

The dispatcher is a swappable object behind one contract, `Dispatcher`: `LocalDispatcher`
permutes tokens by expert inside one process; expert parallelism puts one that exchanges tokens by
all-to-all in the layer's `hooks` (model/parallel_hooks.py). The layer itself never communicates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from moetron.model.config import ModelConfig
from moetron.model.experts import GroupedExperts
from moetron.model.layers import FeedForward
from moetron.model.parallel_hooks import ParallelHooks
from moetron.model.router import Router, Routing, routes_per_expert

# Rows each expert's group is best padded to, for tokens x_TD whose groups hold `rows_per_group`
# routes on average (GroupedExperts.group_row_multiple).
RowMultiple = Callable[[torch.Tensor, float], int]


class Dispatcher(Protocol):
    """How the routes of this process's tokens reach the experts and their outputs come back.

    Shapes (legend above; El experts computed here: E on one process, E / ep under expert
    parallelism). `dispatch` takes x_TD (T, D) and their `routing` and returns (x_RD, offsets_El,
    state): x_RD (R, D) the rows the experts here compute, grouped by expert; offsets_El (El,)
    int32, the end row of each expert's group (rows past offsets_El[-1] are not computed); state,
    opaque to the layer, what `combine` needs to undo the dispatch. `combine` takes y_RD (R, D),
    the experts' outputs for those rows, and returns y_TD (T, D): each token's routes weighted by
    their combine weights and summed (dropped routes add 0). Both are differentiable.
    """

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y_RD: torch.Tensor, state: Any) -> torch.Tensor: ...

    def spread(self, routing: Routing) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(kept routes per token sent to another process, processes each token's kept routes
        reach), means over the T tokens; None when nothing leaves the process."""
        ...


@dataclass
class DispatchState:
    """What `combine` needs to undo `dispatch`: each row's token and weight (rows sorted by
    expert; padding rows and dropped routes weigh 0) and each route's row."""

    token_R: torch.Tensor
    weight_R: torch.Tensor
    row_TK: torch.Tensor  # row of route k of token t


class _GatherTokens(torch.autograd.Function):
    """x_RD = x_TD[token_R], whose gradient is gathered back through `row_TK` and summed over each
    token's K routes, instead of scatter-added by token: compiled, a scatter-add is a loop of
    atomic adds (`python bench/moe_layer.py --sum-routes`, 2048 tokens × 2 routes × 256 on 2 CPU
    cores: index_add_ 1.6–3.3 ms, gather-and-sum 0.14–0.25 ms; eager 0.18–0.48 vs 0.28–0.76)."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, token_R: torch.Tensor, row_TK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(row_TK)
        return x_TD.index_select(0, token_R)

    @staticmethod
    def backward(ctx, dx_RD: torch.Tensor):
        # Rows no route points to (padding) have no token; rows of dropped routes carry a zero
        # gradient (the grouped GEMM leaves rows past the last group at zero).
        (row_TK,) = ctx.saved_tensors
        T, K = row_TK.shape
        return dx_RD.index_select(0, row_TK.reshape(-1)).view(T, K, -1).sum(1), None, None


class _CombineRoutes(torch.autograd.Function):
    """y_TD[t] = Σ_k weight_R[r] · y_RD[r] over the rows r = row_TK[t, k]; the gradients are
    gathers too (by token_R), never scatter-adds: see _GatherTokens."""

    @staticmethod
    def forward(ctx, y_RD: torch.Tensor, weight_R: torch.Tensor, token_R: torch.Tensor,
                row_TK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y_RD, weight_R, token_R)
        T, K = row_TK.shape
        rows = row_TK.reshape(-1)
        weight_TK1 = weight_R.index_select(0, rows).view(T, K, 1).to(y_RD.dtype)
        return (y_RD.index_select(0, rows).view(T, K, -1) * weight_TK1).sum(1)

    @staticmethod
    def backward(ctx, dy_TD: torch.Tensor):
        y_RD, weight_R, token_R = ctx.saved_tensors
        dy_RD = dy_TD.index_select(0, token_R)
        dweight_R = (dy_RD * y_RD).sum(-1).to(weight_R.dtype) if ctx.needs_input_grad[1] else None
        return dy_RD * weight_R[:, None].to(dy_RD.dtype), dweight_R, None, None


class LocalDispatcher:
    """Permute the routes so each expert's tokens are contiguous; no communication.

    `row_multiple` (the MoE layer gives its experts' `group_row_multiple`) says, from the tokens
    and the mean group size, what each expert's group is padded to; None: exact groups.
    """

    def __init__(self, row_multiple: RowMultiple | None = None):
        self.row_multiple = row_multiple

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """→ x_RD sorted by expert, offsets_E (int32 end row per expert), state for combine.

        Every route keeps a row, so shapes do not depend on the routing: dropped routes (capacity)
        sort after the last expert's group, where the grouped GEMM computes nothing (their rows
        come out zero). A row multiple > 1 rounds each expert's group up to a multiple of that many
        rows (the grouped GEMM's preferred sizes, `group_row_multiple`): padding rows copy token 0
        with weight 0, so they add nothing to the output and get no gradient.
        """
        num_experts = routing.probs_TE.shape[1]
        T, K = routing.expert_TK.shape
        row_multiple = 1 if self.row_multiple is None else self.row_multiple(x_TD, T * K / num_experts)
        # Route a = t·K + k; a dropped route counts as expert E, after every real one.
        expert_A = routing.expert_TK.reshape(-1).masked_fill(~routing.kept_TK.reshape(-1), num_experts)
        order_A = torch.argsort(expert_A, stable=True)  # the route in each row
        counts_E = routes_per_expert(expert_A, num_experts + 1)[:num_experts]
        token_R, weight_R = order_A // K, routing.weight_TK.reshape(-1)[order_A]
        row_A = torch.arange(len(order_A), device=x_TD.device)
        if row_multiple > 1:
            padded_E = (counts_E + row_multiple - 1) // row_multiple * row_multiple
            pad_E = padded_E - counts_E
            # A route of expert e moves by the padding of the experts before e (dropped routes:
            # of all of them).
            shift_E = torch.cumsum(pad_E, 0) - pad_E
            shift_A = torch.cat([shift_E, pad_E.sum()[None]])[expert_A[order_A]]
            row_A = row_A + shift_A
            # NOTE: host-device sync for the padded row count (CPU only: see group_row_multiple).
            # A routing-independent bound instead (the last group taking the slack) measured no
            # faster compiled and 1% slower eager (bf16 bench step, 10-14 interleaved rounds).
            rows = len(order_A) + int(pad_E.sum())
            token_R = token_R.new_zeros(rows).index_put((row_A,), token_R)
            weight_R = weight_R.new_zeros(rows).index_put((row_A,), weight_R)
            counts_E = padded_E
        offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
        row_TK = torch.empty_like(row_A).scatter_(0, order_A, row_A).view(T, K)
        state = DispatchState(token_R, weight_R, row_TK)
        return _GatherTokens.apply(x_TD, token_R, row_TK), offsets_E, state

    def spread(self, routing: Routing) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Routes per token leaving the rank and ranks reached per token: nothing leaves here."""
        return None

    def combine(self, y_RD: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Weight each route's output and sum it into its token → y_TD (dropped routes add 0)."""
        return _CombineRoutes.apply(y_RD, state.weight_R, state.token_R, state.row_TK)


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
    """Routed experts plus an optional shared expert (optionally gated per token), replacing a dense FFN."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.router = Router(cfg.d_model, moe)
        self.experts = GroupedExperts(moe.num_experts, cfg.d_model, cfg.d_expert_ff, cfg.activation, moe.experts_impl,
                                      bias=moe.expert_bias,
                                      swiglu=(moe.swiglu_limit, moe.swiglu_alpha, moe.swiglu_up_offset))
        self.shared = (FeedForward(cfg.d_model, moe.shared_expert_d_ff, cfg.activation, cfg.bias)
                       if moe.shared_expert_d_ff else None)
        # Qwen2-MoE's gate: each token's shared-expert output scaled by sigmoid(x · w), w (1, D).
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if moe.shared_expert_gate else None
        self.dropout = nn.Dropout(cfg.dropout)
        # Groups padded as the experts' multiply prefers; expert parallelism swaps the dispatcher.
        self.hooks = ParallelHooks(dispatcher=LocalDispatcher(self.experts.group_row_multiple))

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = self.router(x_TD, num_sequences=x_BSD.shape[0])
        dispatcher = self.hooks.dispatcher
        x_RD, offsets_E, state = dispatcher.dispatch(x_TD, routing)
        y_RD = self.experts(x_RD, offsets_E)
        y_TD = dispatcher.combine(y_RD, state).to(x_BSD.dtype)
        if self.shared is not None:
            y_TD = y_TD + self._shared(x_TD)
        spread = dispatcher.spread(routing)
        stats = MoEStats(routing.aux_loss, routing.z_loss, routing.counts_E, routing.dropped_fraction,
                         routing.entropy, *(spread or ()))
        return self.dropout(y_TD.view_as(x_BSD)), stats

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The shared expert's output (T, D), gated per token when the layer has a gate."""
        shared_TD = self.shared(x_TD)
        if self.shared_gate is None:
            return shared_TD
        return torch.sigmoid(self.shared_gate(x_TD)) * shared_TD

    def init_weights(self, std: float, out_std: float) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std, out_std)
        if self.shared is not None:
            self.shared.init_weights(std, out_std)
        if self.shared_gate is not None:
            nn.init.normal_(self.shared_gate.weight, std=std)

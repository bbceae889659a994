"""Expert parallelism: experts sharded over the "ep" mesh dim, tokens moved there by all-to-all.

Legend: T tokens on this rank, D model dim, E experts in the model, El = E / ep experts held here,
A routes this rank sends (kept routes of its own tokens), R rows this rank receives, P ep ranks.

Each MoELayer keeps its single-device code; `apply_expert_parallel` only
  1. shrinks `experts.w_*` from (E, ·, ·) to the (El, ·, ·) slice this ep rank owns: rank p holds
     experts [p·El, (p+1)·El), so a checkpoint key names the same rows on every layout;
  2. swaps the layer's `hooks.dispatcher` for an `AllToAllDispatcher` (the same `Dispatcher` contract).

The dispatcher reuses the local permutation (routes sorted by global expert id, which is also
sorted by destination rank), then:
  counts    all_to_all of per-expert route counts (E ints) → how many rows each rank receives;
  dispatch  all_to_all of the rows with uneven splits, then a local regroup from
            (source rank, local expert) order to (local expert, source rank) order;
  combine   the inverse regroup, the reverse all_to_all, then the local weighted sum.
Both row exchanges are `all_to_all_single_autograd`, so the backward pass sends gradients the
opposite way. Capacity drops happen in the router, before dispatch, on this rank's own tokens,
so capacity and dropless routing go through the same path.

Gradient bookkeeping (see mesh.py): an expert's gradient on its owner is the sum over the
tokens of all ep ranks; it is then reduced over "edp" (the ranks holding the same experts) and
divided by dp by the data-parallel wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from moetron.model.moe import DispatchState, LocalDispatcher, MoELayer
from moetron.model.router import Routing
from moetron.parallel.mesh import ParallelMesh

# Every routed-expert parameter, each with the experts on dim 0 (the biases too, when there are some).
EXPERT_WEIGHTS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD", "b_gate_EF", "b_up_EF", "b_down_ED")


@dataclass
class AllToAllState:
    """What `combine` needs to undo `dispatch`."""

    local: DispatchState
    regroup_R: torch.Tensor  # received row order → (local expert, source) order
    send_splits: list[int]  # rows sent to each ep rank
    recv_splits: list[int]  # rows received from each ep rank


class AllToAllDispatcher:
    """Dispatch routes to the ep rank owning their expert and bring the outputs back."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep
        # Exact groups: the rows are sent as they are, with no padding rows among them.
        self.local = LocalDispatcher()
        # The row exchanges run eagerly, also inside a compiled block: their split sizes are data,
        # and compiled they would be guarded on, so their frames would compile three times (static
        # sizes, then dynamic ones, then again for a rank that receives no rows). Outside, the rows
        # are marked unbacked-dynamic, and the graph right after the exchange sees R as a size
        # with no value from its first compile (rows_stay_dynamic does the same across the experts'
        # data-parallel hooks). (Unbound, so that a copy of the dispatcher does not call into this one.)
        self._send_eagerly = torch.compiler.disable(AllToAllDispatcher._send_rows)
        self._return_eagerly = torch.compiler.disable(AllToAllDispatcher._return_rows)

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, AllToAllState]:
        """→ x_RD (this rank's experts' rows, grouped by local expert), offsets_El, state."""
        x_AD, offsets_E, local_state = self.local.dispatch(x_TD, routing)
        counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).to(torch.int64)
        x_RD, offsets_El, regroup_R, send_splits, recv_splits = self._send_eagerly(self, x_AD, counts_E)
        return x_RD, offsets_El, AllToAllState(local_state, regroup_R, send_splits, recv_splits)

    def _send_rows(self, x_AD: torch.Tensor, counts_E: torch.Tensor):
        """→ (x_RD in (local expert, source) order, offsets_El, regroup_R, send_splits, recv_splits)."""
        P, El = self.ep, self.local_experts
        # Counts first: every rank must know how many rows it receives before the rows move.
        recv_counts_PEl = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts_PEl, counts_E, group=self.group)
        recv_counts_PEl = recv_counts_PEl.view(P, El)
        # NOTE: host-device sync: all_to_all split sizes are host integers.
        send_splits = counts_E.view(P, El).sum(1).tolist()
        recv_splits = recv_counts_PEl.sum(1).tolist()
        # Rows of dropped routes (past the last group) stay here: combine adds nothing for them.
        x_RD = all_to_all_single_autograd(x_AD[: sum(send_splits)], recv_splits, send_splits, self.group)
        regroup_R = _source_major_to_expert_major(recv_counts_PEl)
        offsets_El = torch.cumsum(recv_counts_PEl.sum(0), 0).to(torch.int32)
        x_RD = x_RD[regroup_R]
        torch._dynamo.decorators.mark_unbacked(x_RD, 0)
        return x_RD, offsets_El, regroup_R, send_splits, recv_splits

    def spread(self, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept routes per token sent to another ep rank, ep ranks reached per token): `route_spread`."""
        return route_spread(routing.expert_TK, routing.kept_TK, self.local_experts, self.ep, self.ep_rank)

    def combine(self, y_RD: torch.Tensor, state: AllToAllState) -> torch.Tensor:
        """y_RD in (local expert, source) order → y_TD of this rank's tokens."""
        return self.local.combine(self._return_eagerly(self, y_RD, state), state.local)

    def _return_rows(self, y_RD: torch.Tensor, state: AllToAllState) -> torch.Tensor:
        """y_RD → y_AD: the rows back on the rank they came from, in its dispatch order, with zero
        rows for its dropped routes (A is then every route of its tokens, a size known in advance)."""
        y_source_major_RD = torch.empty_like(y_RD).index_copy(0, state.regroup_R, y_RD)
        y_AD = all_to_all_single_autograd(y_source_major_RD, state.send_splits, state.recv_splits, self.group)
        dropped = len(state.local.token_R) - y_AD.shape[0]
        if dropped:
            y_AD = torch.cat([y_AD, y_AD.new_zeros(dropped, y_AD.shape[1])])
        return y_AD


@torch.no_grad()
def route_spread(expert_TK: torch.Tensor, kept_TK: torch.Tensor, local_experts: int, ep: int, ep_rank: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """How far this rank's tokens travel: (kept routes per token whose expert lives on another of
    the `ep` ranks, ep ranks each token's kept routes reach), both means over the T tokens. Rank p
    holds experts [p·El, (p+1)·El). Group-limited routing with one group per ep rank bounds the
    second by topk_groups."""
    owner_TK = expert_TK // local_experts
    remote = (kept_TK & (owner_TK != ep_rank)).sum(1).float().mean()
    routes_TP = torch.zeros(owner_TK.shape[0], ep, dtype=torch.int64, device=owner_TK.device)
    routes_TP.scatter_add_(1, owner_TK, kept_TK.to(torch.int64))
    return remote, (routes_TP > 0).sum(1).float().mean()


def _source_major_to_expert_major(counts_PEl: torch.Tensor) -> torch.Tensor:
    """Row permutation taking rows laid out as blocks (source p, expert e) in p-major order to
    e-major order (all of expert 0 from every source, then expert 1, …)."""
    P, El = counts_PEl.shape
    block_R = torch.repeat_interleave(torch.arange(P * El, device=counts_PEl.device), counts_PEl.reshape(-1))
    source_R, expert_R = block_R // El, block_R % El
    return torch.argsort(expert_R * P + source_R, stable=True)


def shard_experts(moe: MoELayer, ep: int, ep_rank: int) -> None:
    """Replace the (E, ·, ·) expert weights by this rank's (E/ep, ·, ·) rows, on the same device
    (meta before materialization), keeping parameter names."""
    experts = moe.experts
    for name in EXPERT_WEIGHTS:
        w = getattr(experts, name)
        if w is None:
            continue
        rows = w.shape[0] // ep
        local = w.detach()[ep_rank * rows : (ep_rank + 1) * rows].clone()
        setattr(experts, name, nn.Parameter(local, requires_grad=w.requires_grad))


def rows_stay_dynamic(experts: nn.Module) -> None:
    """Keep R, the rows an ep rank receives, a dynamic size in the compiled frames around
    `experts`, a data-parallel unit of its own (data_parallel.py): its FSDP2 hooks run eagerly, so
    a compiled block breaks there, and its forward and the rest of the MoE layer compile as frames
    of their own. Their input rows are new tensors (the pre-forward hook rewraps them) or a compiled
    graph's output, which carry no mark: each such frame would compile for the first R it sees,
    again for a dynamic R, and again for a rank that receives 0 or 1 rows. Marked here, after the
    hooks, each compiles once. Outside torch.compile the marks are unread."""
    experts.register_forward_pre_hook(torch.compiler.disable(_mark_rows_in))
    experts.register_forward_hook(torch.compiler.disable(_mark_rows_out))


def _mark_rows_in(module: nn.Module, args: tuple) -> None:
    torch._dynamo.decorators.mark_unbacked(args[0], 0)  # x_RD


def _mark_rows_out(module: nn.Module, args: tuple, y_RD: torch.Tensor) -> None:
    torch._dynamo.decorators.mark_unbacked(y_RD, 0)


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]


def apply_expert_parallel(model: nn.Module, mesh: ParallelMesh) -> set[str]:
    """Shard every MoELayer's experts over mesh["ep"] and swap in the all-to-all dispatcher.

    Returns the parameter names now holding an E/ep slice (for initialization and grad norms).
    """
    ep = mesh.size("ep")
    sharded: set[str] = set()
    if ep == 1:
        return sharded
    group, ep_rank = mesh.group("ep"), mesh.rank("ep")
    for name, moe in moe_layers(model):
        num_experts = moe.experts.w_gate_EDF.shape[0]
        shard_experts(moe, ep, ep_rank)
        moe.hooks.dispatcher = AllToAllDispatcher(group, num_experts)
        sharded |= {f"{name}.experts.{w}" for w in EXPERT_WEIGHTS if getattr(moe.experts, w) is not None}
    return sharded

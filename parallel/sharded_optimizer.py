"""ZeRO-1 (dp_mode=zero1): weights and gradients replicated over the data-parallel ranks, the AdamW
state and update of each parameter held by one of them, the updated weights broadcast back.

Partition by parameter, greedily by size (as torch's ZeroRedundancyOptimizer): walking the
parameters in model order, each goes to the rank of its replica group holding the fewest elements
so far. A parameter's replica group is the set of ranks holding the same copy of it: "dp_cp" for
dense weights, "edp_cp" for routed experts under expert parallelism (the ep ranks hold different
experts). TP shards are separate parameters of separate groups, so every tp rank makes the same
choice for its own shard.

A step: gradients are all-reduced as under ddp (every rank clips with the same global norm), the
owner of each parameter runs AdamW on it (`foreach=False`, so the arithmetic is exactly the
unsharded optimizer's), then one broadcast per parameter from its owner refreshes the copies.

Why not ZeroRedundancyOptimizer itself: it broadcasts plain tensors (here parameters are DTensors
under FSDP2's replicate and TP) and its state dict is consolidated on one rank, where DCP needs
each rank to write its own entries and to reshard them on load. Here every parameter stays in
`param_groups`, and `optimizer.state` holds only the owned ones; `get_state_dict` then gives each
rank `state.<name>.*` for its own parameters, so a checkpoint written under zero1 loads into any
layout (and any layout's into zero1) by the same parameter names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moetron.parallel.mesh import ParallelMesh


@dataclass(frozen=True)
class Owner:
    """The rank (global) that updates a parameter, and the group of ranks holding copies of it."""

    rank: int
    group: dist.ProcessGroup
    group_size: int


def assign_owners(named_params: Iterable[tuple[str, nn.Parameter]], mesh: ParallelMesh,
                  expert_sharded: set[str]) -> dict[int, Owner]:
    """id(parameter) → its Owner, balancing the elements each rank updates."""
    owners: dict[int, Owner] = {}
    loads: dict[str, list[int]] = {}
    for name, p in named_params:
        dim = "edp_cp" if name in expert_sharded else "dp_cp"
        sub = mesh.sub(dim)
        ranks = sub.mesh.flatten().tolist()
        load = loads.setdefault(dim, [0] * len(ranks))
        i = min(range(len(ranks)), key=lambda r: (load[r], r))
        load[i] += _local(p).numel()
        owners[id(p)] = Owner(ranks[i], sub.get_group(), len(ranks))
    return owners


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedAdamW(torch.optim.AdamW):
    """AdamW that updates only this rank's parameters and then broadcasts every parameter from its
    owner. Built like AdamW, plus `owners` from `assign_owners`."""

    def __init__(self, params, *, owners: dict[int, Owner], **kwargs):
        super().__init__(params, **kwargs)
        self.owners = owners
        self.me = dist.get_rank()

    def owns(self, p: torch.Tensor) -> bool:
        return self.owners[id(p)].rank == self.me

    @torch.no_grad()
    def step(self, closure=None):
        # AdamW skips parameters without a gradient: hide the ones another rank updates.
        hidden = [(p, p.grad) for g in self.param_groups for p in g["params"]
                  if p.grad is not None and not self.owns(p)]
        for p, _ in hidden:
            p.grad = None
        try:
            loss = super().step(closure)
        finally:
            for p, grad in hidden:
                p.grad = grad
        self.broadcast_parameters()
        return loss

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Every copy of every parameter ← its owner's (one broadcast per parameter, all in flight)."""
        works = []
        for group in self.param_groups:
            for p in group["params"]:
                owner = self.owners[id(p)]
                if owner.group_size > 1:
                    works.append(dist.broadcast(_local(p), src=owner.rank, group=owner.group, async_op=True))
        for work in works:
            work.wait()

    def state_elements(self) -> int:
        """Elements of optimizer state this rank holds (for memory reports)."""
        return sum(t.numel() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor) and t.ndim > 0)

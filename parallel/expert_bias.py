"""Aux-loss-free balancing across ranks: every rank moves its routers' biases by the same global loads.

Legend: L layers of the whole model, E experts.

Each Router keeps the routes it chose in each of a step's micro-batches (`tokens_per_expert_E`). The
global batch's load of layer l is the sum of those counts over the ranks that saw distinct tokens:
data- and expert-parallel ranks each route their own slice, pipeline stages hold different
layers, and tensor-parallel ranks route the same tokens (the MoE input is whole, or gathered
under sequence parallel), so only tp rank 0 contributes. One all-reduce of an (L, E) table over
the whole world gives every rank the same loads, hence the same biases as one process.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from moetron.model.router import Router
from moetron.parallel.mesh import ParallelMesh

# A multi-token-prediction block is named by its layer index too: mtp.{n_layers + k − 1}.block.
_LAYER = re.compile(r"(?:^|\.)(?:layers|mtp)\.(\d+)\.")


def biased_routers(modules: Iterable[nn.Module]) -> dict[int, Router]:
    """{layer index in the whole model: its Router} for the routers with an expert bias here."""
    out: dict[int, Router] = {}
    for module in modules:
        for name, sub in module.named_modules():
            if isinstance(sub, Router) and sub.expert_bias_E is not None:
                out[int(_LAYER.search(name + ".").group(1))] = sub
    return out


@torch.no_grad()
def update_expert_biases(modules: Iterable[nn.Module], mesh: ParallelMesh | None, n_layers: int,
                         num_experts: int, device: torch.device) -> torch.Tensor:
    """After an optimizer step: reduce the routers' counts over the global batch and step every bias.
    Returns the global loads (L, E); rows of layers without a biased router are 0. A collective:
    every rank calls it, also one whose pipeline stage holds no MoE layer."""
    routers = biased_routers(modules)
    loads_LE = torch.zeros(n_layers, num_experts, dtype=torch.float64, device=device)
    if mesh is None or mesh.rank("tp") == 0:
        for layer, router in routers.items():
            loads_LE[layer] = router.tokens_per_expert_E.to(torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(loads_LE)
    for layer, router in routers.items():
        router.update_bias(loads_LE[layer])
    return loads_LE


def clear_expert_counts(modules: Iterable[nn.Module]) -> None:
    """Forget the counts of a step that did not update the weights (a skipped, non-finite step)."""
    for router in biased_routers(modules).values():
        router.routed_E.clear()

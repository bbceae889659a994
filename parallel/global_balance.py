"""The global-batch balance loss across ranks (`model.moe.aux_loss_type: global_batch`).

Legend: E experts.

A router's balance loss then reads the routes per expert of the whole global batch so far
(model/router.py): its own micro-batches' plus those of every rank that routes other tokens
through the same layer. Those are the "dp_cp" ranks: data-parallel ranks route other sequences,
context-parallel ranks other positions of the same ones; tensor-parallel ranks route the same
tokens and pipeline stages other layers, so neither joins. One all-reduce of E counts per MoE
layer and micro-batch (Megatron-Core's global_aux_loss reduces over tp × dp × cp and so counts
each token tp times; the shares f are the same).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from moetron.model.router import Router
from moetron.parallel.mesh import ParallelMesh


def _global_routers(module: nn.Module) -> list[Router]:
    return [r for r in module.modules() if isinstance(r, Router) and r.cfg.aux_loss_type == "global_batch"]


def apply_global_batch_balance(model: nn.Module, mesh: ParallelMesh) -> None:
    """Give the global-batch routers of `model` (a Decoder or a stage of it) the sum over dp × cp."""
    if mesh.size("dp_cp") == 1:
        return
    group = mesh.group("dp_cp")

    def batch_sum(load_E: torch.Tensor) -> torch.Tensor:
        load_E = load_E.clone()
        dist.all_reduce(load_E, group=group)
        return load_E

    for router in _global_routers(model):
        router.hooks.batch_sum = batch_sum


def start_global_batch(modules: Iterable[nn.Module]) -> None:
    """Before a step's first micro-batch: every global-batch router counts from zero again."""
    for module in modules:
        for router in _global_routers(module):
            router.start_batch()

"""Data parallelism: FSDP2 (`fully_shard`, ZeRO-3-like), HSDP, replication (DDP semantics) with or
without a sharded optimizer (ZeRO-1), gradient accumulation, and the global gradient norm of a
model split every which way.

How parameters are split across the ranks holding the same weights, mesh "dp_cp" (every data-
parallel rank and every context chunk: cp ranks saw different tokens of the same sequences, so
their gradients are averaged like the dp ranks'):
  dp_mode=fsdp   every parameter Shard(0) over dp_cp (on top of any TP split: a 2-D DTensor);
                 gathered per block for forward and backward, gradients reduce-scattered.
  dp_mode=hsdp   FSDP2 on the 2-D mesh "hsdp" (replicate, shard): sharded as above inside a group
                 of dp_shard × cp ranks, replicated across the dp / dp_shard groups; gradients
                 reduce-scattered inside a group, then all-reduced across groups.
  dp_mode=ddp    every parameter replicated, gradients all-reduced (averaged).
  dp_mode=zero1  replicated as ddp; the optimizer holds only this rank's rows of each parameter
                 (sharded_optimizer.py).
Routed experts under expert parallelism are a separate unit on "edp_cp" (or "ehsdp"), the ranks
holding the same experts: their gradients are summed there and divided by dp × cp, not by the
group's size, because the all-to-all backward has already summed the contributions of the ep
ranks' tokens. Under expert-tensor parallelism (etp = tp) a rank's expert tensors are F slices;
each slice's gradient is complete on its rank, so the reduction is the same.

Wrapping units: each block (attention + FFN/MoE), the experts of each MoE block (when ep > 1),
the embedding, and the final norm with the head; the whole stage module is the root.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from moetron.model.moe import MoELayer
from moetron.model.transformer import Decoder
from moetron.parallel.config import ParallelConfig
from moetron.parallel.expert_parallel import rows_stay_dynamic
from moetron.parallel.mesh import ParallelMesh


def apply_data_parallel(model: Decoder, mesh: ParallelMesh, cfg: ParallelConfig) -> None:
    """Wrap `model` (a Decoder or one pipeline stage of it) for data parallelism, in place."""
    if cfg.dp * cfg.cp == 1:
        return
    hsdp = cfg.dp_mode == "hsdp"
    dp_mesh, edp_mesh = (mesh.sub("hsdp"), mesh.sub("ehsdp")) if hsdp else (mesh.sub("dp_cp"), mesh.sub("edp_cp"))

    def wrap(module, on):
        if cfg.dp_mode in ("fsdp", "hsdp"):
            return fully_shard(module, mesh=on)
        return replicate_fn()(module, mesh=on)

    for block in model.blocks():  # the MTP modules' blocks too: their experts reduce over edp
        if isinstance(block.ffn, MoELayer) and cfg.ep > 1:
            experts = wrap(block.ffn.experts, edp_mesh)
            rows_stay_dynamic(experts)
            experts.set_gradient_divide_factor(float(cfg.dp * cfg.cp))
            shard_ranks = edp_mesh.size(edp_mesh.ndim - 1)  # HSDP: the last dim shards
            if cfg.dp_mode in ("fsdp", "hsdp") and shard_ranks > 1 and _on_gloo(edp_mesh):
                # FSDP reduce-scatters with PREMUL_SUM(1/dp), which Gloo lacks: divide locally and
                # reduce with SUM. Only here: where no reduce-scatter runs (replicate, or one
                # rank per expert shard group) FSDP already divides locally, and forcing SUM would
                # divide twice.
                experts.set_force_sum_reduction_for_comms(True)
        wrap(block, dp_mesh)
    if model.embed is not None:
        wrap(model.embed, dp_mesh)
    tail = [m for m in (model.norm, model.head) if m is not None]
    if tail:
        wrap(tail, dp_mesh)
    wrap(model, dp_mesh)


def replicate_fn():
    """torch's `replicate` built on FSDP2, which dp_mode ddp and zero1 wrap with: a private API,
    kept because torch 2.13 has no public one that does the same. Its parameters become DTensors
    replicated over the dp mesh, composing with fully_shard units (the experts) and TP DTensors as
    FSDP2's do. The public candidates fall short: `fully_shard(..., dp_mesh_dims=
    DataParallelMeshDims(replicate=...))` refuses parameters that are not already DTensors on the
    whole SPMD mesh (ours are plain, or TP DTensors on a sub-mesh); `torch.distributed._composable.
    replicate` is private as well and DDP-based (plain tensors, no FSDP2 composition);
    `DistributedDataParallel` wraps the module, renaming every parameter. Imported when used, so a
    torch without it (2.11) still trains with fsdp; tests/parallel/test_replicate_api.py fails,
    with this message, if it moves."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError as e:
        raise RuntimeError(f"parallel.dp_mode ddp and zero1 need torch.distributed._composable.replicate_with_fsdp"
                           f".replicate, which torch {torch.__version__} does not have ({e}); use "
                           f"parallel.dp_mode=fsdp or hsdp, or a torch that has it (2.13 does)") from None
    return replicate


def _on_gloo(mesh) -> bool:
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    return any(dist.get_backend(g) == "gloo" for g in groups)


def set_gradient_sync(modules: Iterable[nn.Module], enabled: bool, dp_mode: str) -> None:
    """Gradient accumulation: which reductions the coming backward runs (`enabled` on a step's last
    micro-batch only). Replicated weights (ddp, zero1) skip their all-reduce until the last
    micro-batch: their gradients are whole either way. Sharded ones keep their memory sharded, as
    torchtitan and DeepSpeed's ZeRO do: FSDP reduce-scatters every micro-batch's gradients into the
    accumulated shard (skipping it would hold the whole gradient of every unit until the last
    backward); HSDP reduce-scatters every micro-batch too and all-reduces the shards across its
    replica groups once, after the last. (Under pp > 1 torch's schedule decides instead: it
    reduces nothing until the end of its step.)"""
    if dp_mode == "fsdp":
        return
    for root in modules:
        for m in root.modules():
            if not isinstance(m, FSDPModule):
                continue
            if dp_mode == "hsdp":
                m.set_requires_all_reduce(enabled, recurse=False)
            else:
                m.set_requires_gradient_sync(enabled, recurse=False)


def _distinct_shards(name: str, grad: torch.Tensor, expert_sharded: set[str], ep: int,
                     expert_tp_split: Collection[str] = (), tp: int = 1) -> int:
    """Into how many distinct pieces this parameter is split within one pipeline stage."""
    pieces = 1
    if isinstance(grad, DTensor):
        for size, placement in zip(grad.device_mesh.shape, grad.placements):
            # Any split counts, including FSDP-over-TP's _StridedShard (whose is_shard() is False).
            if not (placement.is_replicate() or placement.is_partial()):
                pieces *= size
    if name in expert_sharded:
        pieces *= ep
    if name in expert_tp_split:  # expert-tensor parallel: each tp rank holds a different F slice
        pieces *= tp
    return pieces


@torch.no_grad()
def clip_grad_norm_(named_params: Iterable[tuple[str, nn.Parameter]], max_norm: float, mesh: ParallelMesh,
                    expert_sharded: set[str], *, expert_tp_split: Collection[str] = (),
                    stage_copies: Collection[str] = ()) -> torch.Tensor:
    """Clip the gradients of the whole model (every stage, shard and expert) to `max_norm` in
    global L2 norm; return that norm (before clipping), the same on every rank.

    Each rank sums the squares of its local gradient pieces, each weighted by 1 / (number of
    ranks in its stage holding that same piece), and one all_reduce over the world adds it up:
    replicated copies count once, shards count once each, pipeline stages are disjoint.
    expert_sharded: routed-expert weights split by rows over ep; expert_tp_split: those split by F
    over tp (plain tensors, so neither split shows in a placement). stage_copies: weights that two
    pipeline stages hold equal copies of (the embedding under multi-token prediction), counted once.
    """
    cfg = mesh.cfg
    ranks_per_stage = cfg.dp * cfg.cp * cfg.tp
    grads: list[torch.Tensor] = []
    squares: list[torch.Tensor] = []
    for name, p in named_params:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            # Under sequence parallel a replicated weight (norm gain) gets a Partial gradient
            # (one partial sum per S slice); sum it now so norms and updates see the full one.
            p.grad = p.grad.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in p.grad.placements])
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        copies = ranks_per_stage / _distinct_shards(name, p.grad, expert_sharded, cfg.ep, expert_tp_split, cfg.tp)
        copies *= 2 if name in stage_copies else 1
        # The norm in the gradient's own precision (a float64 copy of every gradient cost as much
        # as the all-reduce on CPU), squared and summed over pieces in float64.
        norm = torch.linalg.vector_norm(local, dtype=torch.promote_types(local.dtype, torch.float32))
        squares.append(norm.double().square() / copies)
        grads.append(local)
    device = grads[0].device if grads else torch.device(mesh.device_type)
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    norm = total.sqrt().float()
    if max_norm > 0 and math.isfinite(max_norm):
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.device, g.dtype))
    return norm

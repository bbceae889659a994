"""Tensor parallelism (Megatron split) and sequence parallelism with DTensor `parallelize_module`.

Legend: B batch, S sequence, D model dim, H heads, G KV heads, F FFN hidden, V vocabulary, tp ranks.

How each weight is split across the tp ranks of mesh["tp"]:
  embed.weight            Shard(0): V/tp rows each (vocab-parallel embedding; masked lookup + all-reduce,
                          or reduce-scatter over S under sequence parallel)
  attn.wq / wk / wv       Shard(0): H/tp query heads and G/tp KV heads each (column parallel), so
                          GQA groups stay whole on one rank; attention runs on local heads only
  attn.wo                 Shard(1): row parallel, all-reduce (or reduce-scatter over S) after
  attn.sinks.weight       Shard(0): each rank holds and uses its H/tp heads' sink logits (GPT-OSS)
  MLA (model/mla.py)      attn.wq or wq_b and wkv_b Shard(0) by heads, wo Shard(1); wq_a, wkv_a,
                          q_norm, kv_norm replicated, the rope key's gradient summed over tp
  dense ffn w_gate / w_up Shard(0) column parallel; w_down Shard(1) row parallel
  head.weight             Shard(0): logits stay split over V; the loss is computed by
                          `loss_parallel` without gathering them
  t5_bias.weight          Shard(1): T5's (buckets, H) bias table as a column-parallel embedding, each
                          rank holding and looking up its H/tp heads' columns (ALiBi's slopes, fixed,
                          are sliced the same way by a hook). Split rather than replicated: a rank
                          only reaches its own columns, so a replicated copy's gradient would need an
                          all-reduce over tp
  mtp.{i}.*               a multi-token-prediction module (model/mtp.py): its block split as a layer,
                          enorm, hnorm, eh_proj and norm replicated (`_parallelize_mtp`)
  norms, router, experts  replicated; under plain TP every tp rank sees the same tokens, so their
                          gradients are already equal and need no reduction. With parallel.etp = tp
                          the routed experts are split by F instead (expert_tensor_parallel.py).

Sequence parallel (cfg.sequence_parallel): between the blocks' matmuls the residual stream is split
over S (Shard(1), B × S/tp × D per rank); norms and dropout run on the local slice, their weight
gradients are summed over tp by DTensor. Entering attention or the dense FFN all-gathers S;
leaving them reduce-scatters. The MoE layer gathers S too and slices its output back: routing,
capacity and the load-balancing loss must see the same tokens as on one process. A pipeline stage
after the first receives the split stream, so it is told (`hooks.sequence_shards`) to take its positions
for S·tp tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from moetron.model.attention import Attention
from moetron.model.layers import FeedForward
from moetron.model.mla import MLAttention
from moetron.model.moe import MoELayer
from moetron.model.transformer import Decoder
from moetron.parallel.config import ParallelConfig
from moetron.parallel.mesh import ParallelMesh


def apply_tensor_parallel(model: Decoder, mesh: ParallelMesh, cfg: ParallelConfig) -> None:
    """Shard `model` (a whole Decoder or one pipeline stage of it) over mesh["tp"] in place."""
    if cfg.tp == 1:
        return
    tp_mesh = mesh.sub("tp")
    sp = cfg.sequence_parallel
    # Between blocks the residual stream is replicated (TP) or split over S (SP).
    residual = Shard(1) if sp else Replicate()
    plan: dict[str, object] = {}
    # Absolute positions (learned, sinusoidal) are added to the embedding's output over all of S,
    # so under sequence parallel the split comes after them, at the first block: a local slice.
    # The first stage takes token ids (the last may hold a copy of the embedding, for MTP).
    first = model.embed is not None and "0" in model.layers
    split_at_first_block = sp and first and model.cfg.position in ("learned", "sinusoidal")
    if model.embed is not None:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(),
                                        output_layouts=Replicate() if split_at_first_block else residual)
    if model.norm is not None and sp:
        plan["norm"] = SequenceParallel()
    if model.head is not None:
        plan["head"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    if model.t5_bias is not None:
        plan["t5_bias"] = ColwiseParallel()  # bucket ids (S, L) in, plain (S, L, H/tp) out
    parallelize_module(model, tp_mesh, plan)
    if sp:
        model.hooks.sequence_shards = cfg.tp
    if model.head is not None and model.embed is not None and model.cfg.tie_embeddings:
        # Both are split by vocabulary rows (Shard(0)), so the tie survives as one DTensor.
        model.head.weight = model.embed.weight
    for block in model.blocks():  # the MTP modules' blocks too
        parallelize_module(block, tp_mesh, _block_plan(block, sp))
        _shard_alibi_slopes(block.attn, tp_mesh.size(), tp_mesh.get_local_rank())
        _sum_rope_key_gradient(block.attn, tp_mesh.get_group())
    if split_at_first_block:
        first = next(iter(model.layers.values()))
        parallelize_module(first, tp_mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                               desired_input_layouts=(Shard(1),),
                                                               use_local_output=True))
    _parallelize_mtp(model, tp_mesh, sp, split_at_first_block)


def _parallelize_mtp(model: Decoder, tp_mesh, sp: bool, embeddings_whole: bool) -> None:
    """An MTP module's own parts (enorm, hnorm, eh_proj, norm) are replicated, like the norms:
    under plain TP every tp rank sees the same tokens and gets the same gradients. Under sequence
    parallel they run on the local S slice, their gradients summed over tp by DTensor, and
    eh_proj hands the block a plain local slice. `embeddings_whole`: the embedding's output is
    not yet split over S (absolute positions, split at the first block): the tokens-ahead
    embeddings are split on the way in."""
    for module in (model.mtp or {}).values():
        if embeddings_whole:
            parallelize_module(module, tp_mesh, PrepareModuleInput(input_layouts=(None, Replicate(), None),
                                                                   desired_input_layouts=(None, Shard(1), None),
                                                                   use_local_output=True))
        if sp:
            parallelize_module(module, tp_mesh, {"enorm": SequenceParallel(), "hnorm": SequenceParallel(),
                                                 "eh_proj": SequenceParallel(use_local_output=True),
                                                 "norm": SequenceParallel()})


def _block_plan(block: nn.Module, sp: bool) -> dict[str, object]:
    residual = Shard(1) if sp else Replicate()
    plan: dict[str, object] = {
        "attn": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=residual),
    }
    if isinstance(block.attn, MLAttention):
        plan = _mla_plan(block.attn, residual)
    if getattr(block.attn, "sinks", None) is not None:
        plan["attn.sinks"] = _HeadShardedVector()
    if sp:
        plan["attn_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    if isinstance(block.ffn, FeedForward):
        plan["ffn"] = PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),))
        plan["ffn.w_gate"] = ColwiseParallel()
        if block.ffn.w_up is not None:
            plan["ffn.w_up"] = ColwiseParallel()
        plan["ffn.w_down"] = RowwiseParallel(output_layouts=residual)
    elif isinstance(block.ffn, MoELayer) and sp:
        # Routing needs every token on every tp rank (experts whole or, etp = tp, split by F):
        # gather S in, slice S back out.
        plan["ffn"] = _SequenceGatheredMoE()
    return plan


class _SequenceGatheredMoE(PrepareModuleInput):
    """MoE under sequence parallel: all-gather the input over S (→ plain replicated tensor) and
    return the local S slice of the output (backward: all-gather of its gradient)."""

    def __init__(self):
        super().__init__(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
        self.output_style = PrepareModuleOutput(output_layouts=(Replicate(), None),
                                                desired_output_layouts=(Shard(1), None))

    def _apply(self, module: nn.Module, device_mesh):
        super()._apply(module, device_mesh)
        return self.output_style._apply(module, device_mesh)


class _HeadShardedVector(ParallelStyle):
    """A module returning one value per query head (the sinks' logits, (H,)): its parameter split
    Shard(0) like the heads of wq, its output this rank's H/tp values as a plain tensor (whose
    gradient comes back as the Shard(0) gradient of the parameter)."""

    def _apply(self, module: nn.Module, device_mesh):
        def shard(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]),
                                                           requires_grad=p.requires_grad))

        return distribute_module(module, device_mesh, shard, output_fn=lambda mod, out, mesh: out.to_local())


def _shard_alibi_slopes(attn: Attention, tp: int, tp_rank: int) -> None:
    """ALiBi slopes are per query head; give each rank the slopes of its H/tp heads."""

    def local_slopes(module, args, kwargs):
        slopes_H = kwargs.get("alibi_slopes_H")
        if slopes_H is not None and slopes_H.shape[0] == module.n_heads:
            kwargs["alibi_slopes_H"] = slopes_H.chunk(tp)[tp_rank]
        return args, kwargs

    attn.register_forward_pre_hook(local_slopes, with_kwargs=True)


def _mla_plan(attn: MLAttention, residual) -> dict[str, object]:
    """MLA by heads: W_q (or W_qb), W_kvb column parallel, W_o row parallel; the down projections
    W_qa and W_kva and their norms replicated, fed the whole (gathered) input as a plain tensor.
    Their gradients come out whole on every rank: the latents reach the heads through W_qb and
    W_kvb, whose inputs' gradients DTensor all-reduces, and the rope key through
    `_sum_rope_key_gradient`."""
    return {
        "attn": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),),
                                   use_local_output=True),
        "attn.wq_b" if attn.q_lora_rank else "attn.wq": ColwiseParallel(),
        "attn.wkv_b": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=residual),
    }


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (Megatron's copy-to-region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_rope_key_gradient(attn: nn.Module, group) -> None:
    """MLA's rope key k_rope (W_kva's last Dr outputs) goes to every head without a column-parallel
    layer between, so each tp rank's gradient of it holds its own heads' share only: sum them."""
    if not isinstance(attn, MLAttention):
        return

    def sum_rope_key(module, args, out_BSX):
        c_BSR, k_rope_BSDr = out_BSX.split([attn.kv_lora_rank, attn.rope_dim], dim=-1)
        return torch.cat([c_BSR, _SumGradient.apply(k_rope_BSDr, group)], dim=-1)

    attn.wkv_a.register_forward_hook(sum_rope_key)

"""Activation checkpointing: `full` keeps only each block's input and recomputes the whole block
in backward; `selective` keeps the outputs of the matmuls (attention projections, attention
itself, router, expert GEMMs) and of functional collectives, and recomputes the cheap ops between
them (rotary, softmax, SwiGLU, top-k) — torchtitan's op-level policy, keeping every matmul.

Selective regions are the attention, the router, the experts and the shared expert (or the dense
FFN) of each block, each checkpointed inside its own module, not the whole block: with expert
parallelism the experts are wrapped by FSDP2/replicate on their own, and their hooks (which run
profiler ops and gathers) must stay outside a region whose ops are replayed in backward.
The norms' outputs, the residual sums and the token permutes are kept as they are without it.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from moetron.model.moe import MoELayer
from moetron.model.transformer import Decoder

MODES = ("none", "full", "selective")

# (namespace, op) pairs whose outputs selective checkpointing keeps; those this torch lacks are skipped.
_SAVED = [
    ("aten", "mm"), ("aten", "addmm"), ("aten", "bmm"), ("aten", "baddbmm"), ("aten", "_grouped_mm"),
    ("aten", "_scaled_dot_product_flash_attention"), ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
    ("aten", "_scaled_dot_product_efficient_attention"), ("aten", "_scaled_dot_product_cudnn_attention"),
    ("moetron", "grouped_mm"), ("moetron", "flash_attention_fwd"),
    ("_c10d_functional", "all_reduce"), ("_c10d_functional", "all_gather_into_tensor"),
    ("_c10d_functional", "reduce_scatter_tensor"), ("_c10d_functional", "all_to_all_single"),
    ("_c10d_functional", "wait_tensor"), ("_c10d_functional_autograd", "all_to_all_single"),
    ("_c10d_functional_autograd", "all_gather_into_tensor"), ("_c10d_functional_autograd", "reduce_scatter_tensor"),
]


@functools.cache
def saved_ops() -> frozenset:
    """The op overload packets selective checkpointing keeps (resolved once, on first use)."""
    import torch.distributed._functional_collectives  # noqa: F401 - registers _c10d_functional

    import moetron.kernels.flash_attention  # noqa: F401 - registers moetron::flash_attention_fwd
    import moetron.kernels.grouped_mm  # noqa: F401 - registers moetron::grouped_mm

    ops = set()
    for namespace, name in _SAVED:
        try:
            packet = getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):
            continue
        ops.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(ops)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def _regions(block: nn.Module) -> list[nn.Module]:
    """The modules of a block that selective checkpointing wraps one by one."""
    ffn = block.ffn
    if isinstance(ffn, MoELayer):
        return [block.attn, *(m for m in (ffn.router, ffn.experts, ffn.shared) if m is not None)]
    return [block.attn, ffn]


def apply_activation_checkpointing(model: Decoder | nn.Module, mode: str = "full") -> None:
    """Checkpoint every block of `model` in `mode` (one of MODES; "none" leaves it as it is).
    Parameter names are unchanged (forwards are wrapped, not modules)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: must be one of {', '.join(MODES)}")
    if mode == "none":
        return
    for block in model.blocks():
        if isinstance(block.ffn, MoELayer):  # both modes replay the router in backward
            block.ffn.router.hooks.recomputable = True
        if mode == "full":
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
            continue
        for module in _regions(block):
            module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False,
                                               context_fn=_selective_contexts)

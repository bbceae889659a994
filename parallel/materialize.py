"""Materialize a parallelized meta-device model with exactly the single-process initial weights.

The canonical initialization of moetron is: `torch.manual_seed(seed)`, then `Decoder.init_weights()`
run with the CPU generator, parameter by parameter, in the model's own order. A sharded model
cannot run that code on its shards (the random draws would differ), and must not hold the whole
model on one rank. So the model's own `init_weights` is *replayed*: it runs on an untouched meta
copy of the full model under a dispatch mode that, for every in-place init op on a meta tensor
(normal_, fill_, zero_, copy_, …), performs the same op on a fresh CPU tensor of that shape —
drawing the same random numbers as one process would, in the same order — then copies the piece
this rank owns into its local shard and drops the rest. At most one full parameter exists at a
time, and the result is bit-identical to the single-process init on every layout and device.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from itertools import chain

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from moetron.model.transformer import Decoder


class _ReplayOnCPU(TorchDispatchMode):
    """Run in-place ops aimed at meta tensors on CPU stand-ins, then hand the result to `sink`."""

    def __init__(self, sink: Callable[[torch.Tensor, torch.Tensor], None]):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if isinstance(target, torch.Tensor) and target.is_meta and func._schema.is_mutable:
            stand_in = torch.empty(target.shape, dtype=target.dtype, device="cpu")
            func(stand_in, *args[1:], **kwargs)
            self.sink(target, stand_in)
            return target
        return func(*args, **kwargs)


def _local_piece(full: torch.Tensor, dest: torch.Tensor, name: str, ep_slice: Callable[[str, torch.Tensor], torch.Tensor]):
    """The part of the full tensor `full` that `dest` (plain, EP/ETP piece, or DTensor) holds here."""
    full = ep_slice(name, full)
    if isinstance(dest, DTensor):
        # src_data_rank=None: every rank slices its own copy, no communication.
        return distribute_tensor(full, dest.device_mesh, dest.placements, src_data_rank=None).to_local()
    return full


@torch.no_grad()
def materialize_and_init(full_meta: Decoder, local_modules: list[nn.Module], *, seed: int,
                         device: torch.device, ep_slice: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    """Allocate `local_modules` on `device` and fill them with the single-process init.

    full_meta: an untouched meta-device copy of the whole model (same parameter names).
    local_modules: this rank's parallelized parts (pipeline stages), still on meta.
    ep_slice(name, full) → the piece of a routed-expert weight this rank owns: its E/ep rows, and
    under expert-tensor parallelism its F/tp slice (identity for every other parameter).
    """
    dests: dict[str, list[torch.Tensor]] = defaultdict(list)
    for module in local_modules:
        module.to_empty(device=device)
        for name, t in chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
            dests[name].append(t)
    names_of: dict[int, list[str]] = defaultdict(list)
    for name, t in chain(full_meta.named_parameters(remove_duplicate=False), full_meta.named_buffers(remove_duplicate=False)):
        names_of[id(t)].append(name)
    written: set[str] = set()

    def sink(meta_target: torch.Tensor, full: torch.Tensor) -> None:
        for name in names_of.get(id(meta_target), ()):
            for dest in dests.get(name, ()):
                local = dest.to_local() if isinstance(dest, DTensor) else dest
                local.copy_(_local_piece(full, dest, name, ep_slice))
            written.add(name)

    torch.manual_seed(seed)
    with _ReplayOnCPU(sink):
        full_meta.init_weights()
    missing = sorted(set(dests) - written)
    if missing:
        raise RuntimeError(f"init_weights left {missing[:4]} uninitialized; the replay covers in-place init ops only")

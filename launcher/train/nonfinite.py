"""The non-finite guard: a step whose loss or global gradient norm is NaN/inf changes nothing.

Both numbers are global (the loss is all-reduced over data-parallel ranks, the norm over every
shard), so every rank sees the same verdict without another collective: a NaN on one rank
reaches all of them through the reduction. A skipped step consumes its batch but neither steps
the optimizer nor moves the learning-rate schedule (Megatron's skipped iterations). After
`train.max_skipped_steps` skips in a row the run stops with one line: the step, what was
non-finite, and the last good checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """Training diverged: too many non-finite steps in a row, or non-finite weights before a save."""


@dataclass
class SkipGuard:
    """Counts skipped steps, in a row and in all, and says when to give up."""

    limit: int
    total: int = 0
    in_a_row: int = 0
    last_reason: str = ""

    def record(self, skipped: bool, reason: str = "") -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        self.last_reason = reason

    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def diagnose(loss: float, grad_norm: float, moe: dict, named_parameters: Iterable) -> str:
    """What was non-finite, as far as this rank can see: the loss, the grad norm, the routers of
    MoE layers whose statistics are non-finite, and the first parameter with a non-finite grad."""
    parts = [f"loss {loss}" if not math.isfinite(loss) else "",
             f"grad norm {grad_norm}" if not math.isfinite(grad_norm) else ""]
    # NOTE: host-device syncs; only on a skipped step.
    routers = [str(layer) for layer, s in sorted(moe.items())
               if not all(torch.isfinite(t.detach()).all() for t in (s.aux_loss, s.z_loss, s.entropy))]
    if routers:
        parts.append(f"router of layer {', '.join(routers)}")
    for name, p in named_parameters:
        grad = getattr(p, "grad", None)
        if grad is not None:
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if not torch.isfinite(local).all():
                parts.append(f"first non-finite gradient: {name}")
                break
    return "; ".join(p for p in parts if p)


def all_finite(params: Iterable[torch.Tensor], device: torch.device) -> bool:
    """Whether every rank's parameters (or optimizer state) are finite; one all-reduce."""
    bad = torch.zeros((), device=device)
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.is_floating_point() and local.numel():
            bad = torch.maximum(bad, (~torch.isfinite(local.detach())).any().to(bad.dtype))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    # NOTE: host-device sync, once per checkpoint.
    return not bool(bad.item())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def stop_message(step: int, reason: str, limit: int, last_ckpt: Path | None) -> str:
    good = f"the last good checkpoint is {last_ckpt}" if last_ckpt else "no checkpoint was written yet"
    return (f"step {step}: {limit} steps in a row were non-finite ({reason}); training stopped, {good} "
            f"(lower train.lr, or raise train.max_skipped_steps)")

"""The loss over given targets (a masked-LM objective) as one process takes it: the mean over every
scored position of the global batch, not a mean of micro-batch means.

Legend: R ranks whose gradients are averaged (dp × cp), A micro-batches accumulated per step on
each rank (grad_accum, times the pipeline's micro-batches), N scored positions of the global batch.

Why. Next-token windows score every position, so all micro-batches weigh the same and the mean of
their means is the global mean. A masked-LM batch scores ~15% of positions, drawn per row: ranks
and micro-batches score different counts, and averaging their means would weigh a position of a
sparse micro-batch more than one of a dense micro-batch, changing the loss with the layout
(Megatron-LM's default; its --calculate-per-token-loss and Hugging Face's `num_items_in_batch`
normalize by the global count, as here). A context-parallel rank whose chunks hold no scored
position would even take a mean of nothing, 0/0, and the step would be skipped as non-finite.

How. Before a step's first forward, `count` sums the scored positions of this rank's part of the
batch over the R ranks (one all-reduce of a scalar). Each micro-batch's loss is then its summed
cross entropy × R·A / N: the caller's 1/A per micro-batch and the gradients' mean over R cancel
the two factors, leaving Σ CE / N, one process's mean. The same number, averaged over the R ranks
(`ParallelModel.global_losses`), is the loss one process reports.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100  # F.cross_entropy's default: a position without a target


class GlobalTokenMean:
    """cross_entropy(logits_BSV, targets_BS, reduction=...) → the same signature, returning this
    micro-batch's share of the global batch's mean (see the module docstring)."""

    def __init__(self, cross_entropy, group: dist.ProcessGroup | None, ranks: int):
        self.cross_entropy, self.group, self.ranks = cross_entropy, group, ranks
        self.scale = torch.ones(())  # R·A / N of the current step

    def count(self, targets_BS: torch.Tensor, chunks: int) -> None:
        """Take N from this rank's targets for the whole step (every micro-batch, this rank's
        positions), of which `chunks` micro-batches are run. Every rank of the group must call it."""
        n = (targets_BS != IGNORE_INDEX).sum().to(torch.float64)
        if self.ranks > 1:
            dist.all_reduce(n, group=self.group)
        # N = 0 (nothing scored anywhere) leaves a zero loss and zero gradients.
        self.scale = (self.ranks * chunks / n.clamp_min(1)).to(torch.float32)

    def __call__(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        ce = self.cross_entropy(logits_BSV, targets_BS, reduction="sum")
        # Under loss_parallel the sum is a DTensor pending its reduction over the vocabulary's ranks.
        ce = ce.full_tensor() if isinstance(ce, DTensor) else ce
        return ce * self.scale.to(ce.device)

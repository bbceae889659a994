"""Context parallelism: each sequence split over the cp ranks of mesh["cp"], attention over all of
it by an all-gather of keys and values (the all-gather flavour of Megatron-Core's and torchtitan's CP).

Legend: B batch, S positions of a whole sequence, Sl = S / cp positions held here, C = S / (2·cp)
positions per chunk, G key/value heads (this rank's, after TP), Dh head dim, P cp ranks.

Load balance. Under the causal mask query i attends to i + 1 keys, so cutting S into cp contiguous
pieces would give the last rank (2·cp − 1)× the attention work of the first. Instead S is cut into
2·cp chunks of C positions and rank r holds chunks r and 2·cp − 1 − r, an early and a late one whose
work adds up to the same on every rank. cp = 2, S = 8: rank 0 holds positions 0 1 6 7, rank 1
holds 2 3 4 5. `ParallelModel` slices inputs and targets this way (`split_sequence`); every
per-token part of the model (embeddings, norms, FFN, MoE, head, cross entropy) then runs on the Sl
local positions unchanged, and the Decoder is told their global positions (`hooks.token_positions`) for
RoPE, absolute position embeddings, the causal mask and ALiBi.

Exchange (`gather_kv`, every attention layer). Each rank all-gathers its K and V, joined into one
tensor along the head dim (so they may differ in width), over the cp group with a differentiable
collective; its backward reduce-scatters (sums) the gradients of the gathered keys and values
back to the rank that owns each position. The pieces arrive rank-major (rank 0's two chunks, then
rank 1's, …) and are put back in global order, so the keys are positions 0..S−1 while the
queries stay local: Attention builds the mask and bias from the queries' global positions (its
explicit-bias path; the fused causal ones need aligned squares). Every rank holds all S keys and
values of its sequences during one layer's attention (2·B·G·S·Dh elements; cheap with GQA,
G ≪ heads; MLA exchanges its latent and rope key instead, B·S·(R + Dr)) and nothing overlaps the
exchange: a ring (send K/V blocks round while computing) would trade that memory and latency for
2·(cp − 1) steps.

MoE. Routing, capacity (taken on the local tokens, as Megatron does) and the expert exchange see
this rank's tokens. The balance losses need whole sequences: the routers' statistics are summed
over the cp group (`sum_over_sequence`, the routers' `hooks.sequence_sum`), differentiably, so every cp rank
holds the one-process aux loss, and its gradient, scattered back through the collective's
backward, reaches every rank's router probabilities (cp copies of it, which the dp_cp gradient
mean divides back). The z-loss is a mean over tokens and the cross entropy one over positions:
their local means average to the sequence's over dp_cp like any other gradient (data_parallel.py)
and in `ParallelModel.global_losses`. The aux-loss-free counts stay local (expert_bias.py sums
them over every rank); the route counts reported per layer are the sequences'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

try:
    from torch.distributed._functional_collectives import all_gather_single_autograd
except ImportError:  # torch 2.11 has only all_gather_tensor_autograd (a deprecated alias in 2.13)
    from torch.distributed._functional_collectives import all_gather_tensor_autograd as all_gather_single_autograd

from moetron.model.moe import MoELayer
from moetron.model.transformer import Decoder
from moetron.parallel.mesh import ParallelMesh


def split_sequence(x_BS: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """This rank's positions of S (dim 1): chunks cp_rank and 2·cp − 1 − cp_rank of 2·cp → (B, S/cp, …)."""
    S = x_BS.shape[1]
    if S % (2 * cp):
        raise ValueError(f"sequence length {S} must be divisible by 2 × parallel.cp ({2 * cp}): each cp rank "
                         f"holds two equal chunks")
    C = S // (2 * cp)
    return torch.cat([x_BS.narrow(1, cp_rank * C, C), x_BS.narrow(1, (2 * cp - 1 - cp_rank) * C, C)], dim=1)


def global_order(gathered_P2BGSDh: torch.Tensor, cp: int) -> torch.Tensor:
    """The all-gather's output, (cp·2, B, G, Sl, Dh) rank-major, → (2, B, G, S, Dh) in position order
    (or any number of stacked tensors in place of the 2)."""
    PN, B, G, Sl, Dh = gathered_P2BGSDh.shape
    N, C = PN // cp, Sl // 2
    kv_P2BG2CDh = gathered_P2BGSDh.view(cp, N, B, G, 2, C, Dh)
    # Rank p sent global chunks p (its first half) and 2·cp − 1 − p (its second): the first halves
    # in rank order, then the second halves in reverse rank order, are chunks 0..2·cp − 1.
    chunks_N2BGCDh = torch.cat([kv_P2BG2CDh[:, :, :, :, 0], kv_P2BG2CDh.flip(0)[:, :, :, :, 1]])
    return chunks_N2BGCDh.permute(1, 2, 3, 0, 4, 5).reshape(N, B, G, 2 * cp * C, Dh)


class ContextShard:
    """This rank's place in its cp group: which positions it holds, and the two exchanges."""

    def __init__(self, group: dist.ProcessGroup, cp: int, cp_rank: int):
        self.group, self.cp, self.cp_rank = group, cp, cp_rank

    def positions(self, local_len: int, device) -> torch.Tensor:
        """Global positions of the `local_len` = 2·C positions held here → (Sl,) int64."""
        C, r, n = local_len // 2, self.cp_rank, 2 * self.cp
        return torch.cat([torch.arange(r * C, (r + 1) * C, device=device),
                          torch.arange((n - 1 - r) * C, (n - r) * C, device=device)])

    def gather_kv(self, k_BGSDh: torch.Tensor, v_BGSDh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Local keys and values (Sl positions) → those of all S positions, in global order. They
        travel as one tensor, joined along the last dim, so k and v may differ in width (MLA
        exchanges its latent, R wide, and its rope key, Dr wide: model/mla.py)."""
        kv_1BGSX = torch.cat([k_BGSDh, v_BGSDh], dim=-1)[None].contiguous()
        kv_BGSX = global_order(all_gather_single_autograd(kv_1BGSX, 0, self.group), self.cp)[0]
        return kv_BGSX.split([k_BGSDh.shape[-1], v_BGSDh.shape[-1]], dim=-1)

    def sum_over_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """Σ over the cp ranks of `t` (same shape on each), differentiable: the backward of the
        all-gather reduce-scatters, so each rank's `t` gets the sum of every rank's gradient."""
        return all_gather_single_autograd(t.unsqueeze(0).contiguous(), 0, self.group).sum(0)


def apply_context_parallel(model: Decoder, mesh: ParallelMesh) -> None:
    """Tell `model` (a Decoder or a pipeline stage of it) that it holds this rank's two chunks of
    each sequence, and install the K/V exchange and the routers' statistics sum in their `hooks`."""
    cp = mesh.size("cp")
    if cp == 1:
        return
    shard = ContextShard(mesh.group("cp"), cp, mesh.rank("cp"))
    model.hooks.token_positions = shard.positions
    for block in model.layers.values():
        block.attn.hooks.kv_exchange = shard
        if isinstance(block.ffn, MoELayer):
            block.ffn.router.hooks.sequence_sum = shard.sum_over_sequence

"""The one surface parallel/ may attach to: every way it changes what a model built here does,
other than splitting or wrapping its weights, is a field of `ParallelHooks`.

Legend: B batch, S positions held here, L positions of the whole sequences, G key/value heads,
Dh head dim, E experts.

Each model object with a seam holds its own instance as `.hooks` and reads only its own fields:

  holder     field            set by                             default (one process)
  Decoder    sequence_shards  parallel/tensor_parallel.py        1: hidden-state input holds all S
             token_positions  parallel/context_parallel.py       None: positions 0..S−1
  Attention  kv_exchange      parallel/context_parallel.py       None: the S positions are the sequence
  Router     sequence_sum     parallel/context_parallel.py       None: the tokens are whole sequences
             batch_sum        parallel/global_balance.py         None: one process routes the global batch
             recomputable     parallel/activation_checkpoint.py  False: no forward runs again in backward
  MoELayer   dispatcher       parallel/expert_parallel.py        its LocalDispatcher (model/moe.py)

Instances are per object, not shared, so a seam may differ per layer (a test hands each layer's
router its own global-batch loads). parallel/ sets these fields and no other attribute of a model
object; the model never asks which implementation it was given (`Dispatcher` and `KVExchange` are
the contracts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:  # annotations only: moe.py imports this module
    from moetron.model.moe import Dispatcher

# The global positions (Sl,) int64 of the `local_len` positions held here, on `device`.
TokenPositions = Callable[[int, torch.device], torch.Tensor]
# A differentiable sum of a tensor over the ranks that hold the other positions of the same sequences.
SequenceSum = Callable[[torch.Tensor], torch.Tensor]
# A sum of routes per expert (E,) over the ranks that route the other micro-batches of the global batch.
BatchSum = Callable[[torch.Tensor], torch.Tensor]


class KVExchange(Protocol):
    """Keys and values of the positions held here → those of every position of the sequences."""

    def gather_kv(self, k_BGSDh: torch.Tensor, v_BGSDh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, G, S, Dh) each, this rank's positions → (B, G, L, Dh) each, all L positions in global order."""
        ...


@dataclass
class ParallelHooks:
    """The seams of one model object; see the module docstring for who reads and who sets each."""

    # Decoder: a hidden-state input (a pipeline stage after the first) holds 1/sequence_shards of
    # the positions (sequence parallelism splits S between blocks; attention sees all of them).
    sequence_shards: int = 1
    # Decoder: the local positions are two chunks of each longer sequence; this maps their number
    # to their global positions, for position encodings, the causal mask and ALiBi.
    token_positions: TokenPositions | None = None
    # Attention: gathers the keys and values of every position of the sequences, in global order.
    kv_exchange: KVExchange | None = None
    # Router: sums the balance loss's statistics and the reported route counts over the ranks
    # holding the other positions of the sequences.
    sequence_sum: SequenceSum | None = None
    # Router (global-batch balance loss): adds the other ranks' routes per expert.
    batch_sum: BatchSum | None = None
    # Router: activation checkpointing may run its forward again inside backward, where the routes
    # it counts were counted already. Only then does it ask autograd whether a backward is running,
    # a question torch.compile cannot trace (a graph break in every compiled block).
    recomputable: bool = False
    # MoELayer: how its routes reach the experts and come back. The layer starts it as its own
    # LocalDispatcher; None only on objects that are not an MoE layer.
    dispatcher: Dispatcher | None = None

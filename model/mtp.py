"""Multi-token prediction (DeepSeek-V3 §2.2): `mtp_depth` sequential modules after the decoder,
module k (1..D) predicting, at every position i, the token k + 1 places ahead (t_{i+k+1}).

Legend: B batch, S sequence, D model dim, V vocabulary, k depth (1..mtp_depth).

Module k keeps the complete causal chain: it reads the previous depth's state h^{k-1} (B, S, D)
and the shared embedding of the token k places ahead,

    h'_i  = eh_proj [enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]      (2D → D, no bias)
    h^k   = norm(TRM_k(h'))                                    (a full decoder block, then its own norm)
    P^k_i = softmax(head(h^k_i))                               (the shared LM head)

and L_MTP = λ / D · Σ_k CE_k, each CE_k the mean over the positions that have a target
(i + k + 1 ≤ S: the first S − k of a window of S inputs), added to the main loss.

Which h^{k-1}: the normalized state. For k = 1 the decoder's output after its final norm (the
tensor the LM head reads), for k > 1 module k − 1's output after its own norm ("shared_head.norm"
in DeepSeek's checkpoints). The paper names it "the representation given by the main model";
Megatron-Core places the final norm inside the decoder and feeds its output on (chaining each MTP
layer's normed output), and transformers' MtpModel drafts from the main model's last hidden state
(after the final norm) and chains each layer's post-norm output. hnorm then only rescales.

Order of the concatenation: the paper writes [h; e], but DeepSeek-V3's published `eh_proj`
applies its first D input columns to the embedding (as Megatron-Core, vLLM, SGLang and
transformers all read it), so we do too: a checkpoint's weight loads unchanged (model/hf_mtp.py).

Positions: at depth k, position i embeds t_{i+k}, i.e. the window's ids shifted left by k; the
last k positions have no such token (`ids_ahead` repeats the last id there) and no target, so the
loss skips them and causal attention keeps them from reaching any position before. The block
attends with the main model's positions and documents: RoPE, ALiBi and T5's bias depend on
distances, which a shift of all positions by k leaves as they are. Emb is the token embedding
alone: absolute positions (learned, sinusoidal) entered h^0 already.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moetron.model.config import ModelConfig
from moetron.model.layers import build_norm


class MTPModule(nn.Module):
    """One depth: enorm, hnorm, eh_proj, a decoder block (`block`, built by the Decoder as its
    own layers, so TP, EP and checkpointing treat it like one), and the norm before the shared head."""

    def __init__(self, cfg: ModelConfig, block: nn.Module):
        super().__init__()
        self.enorm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.hnorm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = block
        self.norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)

    def forward(self, h_BSD: torch.Tensor, e_BSD: torch.Tensor, head: nn.Module, **attn_kwargs):
        """h_BSD: h^{k-1}; e_BSD: the embeddings of the tokens k places ahead; head: the shared LM
        head (the Decoder's, not a submodule here) → (h^k (B, S, D), logits (B, S, V), the
        block's MoEStats or None)."""
        x_BSD = self.eh_proj(torch.cat([self.enorm(e_BSD), self.hnorm(h_BSD)], dim=-1))
        x_BSD, stats = self.block(x_BSD, **attn_kwargs)
        h_BSD = self.norm(x_BSD)
        return h_BSD, head(h_BSD), stats

    def init_weights(self, std: float, out_std: float) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        nn.init.normal_(self.eh_proj.weight, std=std)
        self.block.init_weights(std, out_std)


def ids_ahead(ids_BS: torch.Tensor, k: int) -> torch.Tensor:
    """The token k places ahead of each position (B, S); the last k positions, which have none,
    repeat the window's last id (their predictions have no target and are never scored)."""
    return torch.cat([ids_BS[:, k:], ids_BS[:, -1:].expand(-1, k)], dim=1)[:, :ids_BS.shape[1]]


def mtp_cross_entropy(logits_ahead: list[torch.Tensor], targets_BS: torch.Tensor,
                      cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """(1 / D) Σ_k CE_k: depth k's logits (B, S, V) at positions 0..S−k−1 against targets
    t_{i+k+1}, which are `targets_BS` (t_{i+1}) shifted left by k. The trainer adds λ times it;
    0 (a plain zero) when there are no depths.

    cross_entropy(logits_BSV, targets_BS) → mean over the tokens given (vocabulary-parallel
    logits under TP arrive as DTensors and are sliced along S only)."""
    if not logits_ahead:
        return targets_BS.new_zeros((), dtype=torch.float32)
    S = targets_BS.shape[1]
    losses = [cross_entropy(logits_BSV[:, :S - k], targets_BS[:, k:])
              for k, logits_BSV in enumerate(logits_ahead, start=1)]
    return sum(losses[1:], losses[0]) / len(losses)

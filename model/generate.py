"""Autoregressive generation with a KV cache: one prefill over the prompt, then one token per step.

Legend: B batch, S prompt length, N new tokens, V vocabulary.

Sampling follows the usual order: logits / temperature → keep the top-k → keep the nucleus
(top-p) of what is left → draw. `greedy` (or temperature 0) takes the argmax instead. Every
random draw goes through the caller's `torch.Generator`, so a seed fixes the continuation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetron.model.transformer import Decoder


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen from the logits."""

    greedy: bool = False
    temperature: float = 1.0
    # 0 keeps every token.
    top_k: int = 0
    # Keep the smallest set of most likely tokens whose probability sums to at least top_p.
    top_p: float = 1.0

    def problems(self) -> list[tuple[str, object, str]]:
        out = []
        if self.temperature < 0:
            out.append(("temperature", self.temperature, "must be >= 0 (0 means greedy)"))
        if self.top_k < 0:
            out.append(("top_k", self.top_k, "must be >= 0 (0 keeps every token)"))
        if not 0 < self.top_p <= 1:
            out.append(("top_p", self.top_p, "must be in (0, 1]"))
        return out

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


def allowed_tokens(logits_BV: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Boolean mask (B, V) of the tokens top-k and then top-p leave eligible.

    Top-p is applied to the distribution renormalized over the top-k survivors. The most likely
    token is always kept, so the mask is never empty; ties with the k-th logit are all kept.
    """
    allowed_BV = torch.ones_like(logits_BV, dtype=torch.bool)
    V = logits_BV.shape[-1]
    if 0 < top_k < V:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        allowed_BV &= logits_BV >= kth_B1
    if top_p < 1.0:
        probs_BV = logits_BV.float().masked_fill(~allowed_BV, float("-inf")).softmax(dim=-1)
        sorted_BV, order_BV = torch.sort(probs_BV, dim=-1, descending=True)
        # A token stays if the tokens strictly more likely than it hold less than top_p.
        before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
        keep_sorted_BV = before_BV < top_p
        keep_sorted_BV[:, 0] = True
        allowed_BV &= torch.zeros_like(allowed_BV).scatter_(-1, order_BV, keep_sorted_BV)
    return allowed_BV


def next_token(logits_BV: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """Choose one token per row → ids_B (int64)."""
    if sampling.is_greedy:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV.float() / sampling.temperature
    allowed_BV = allowed_tokens(logits_BV, top_k=sampling.top_k, top_p=sampling.top_p)
    probs_BV = logits_BV.masked_fill(~allowed_BV, float("-inf")).softmax(dim=-1)
    # multinomial draws on the generator's device; probabilities are moved there and back.
    device = generator.device if generator is not None else probs_BV.device
    ids_B1 = torch.multinomial(probs_BV.to(device), 1, generator=generator)
    return ids_B1[:, 0].to(logits_BV.device)


@torch.no_grad()
def generate(
    model: Decoder,
    prompt_BS: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(greedy=True),
    *,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    return_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Continue each prompt by up to `max_new_tokens` tokens → new ids (B, N), N ≤ max_new_tokens,
    and with `return_logits` also the logits each token was chosen from (B, N, V).

    The prompt is run once to fill a KV cache per layer; each later step feeds only the newest
    token. With `eos_id`, a row that has produced it keeps emitting it, and generation stops
    once every row has. With `vocab_size` (the tokenizer's), ids at or past it are never chosen:
    they pad the embedding table to a friendly size and stand for no token. The model is switched
    to eval mode (no dropout, no router jitter).
    """
    for key, value, rule in sampling.problems():
        raise ValueError(f"sampling {key} = {value!r}: {rule}")
    if not model.cfg.causal:
        raise ValueError("generate needs a decoder: this model has model.causal = false (a bidirectional encoder)")
    B, S = prompt_BS.shape
    if S < 1:
        raise ValueError("generate needs a prompt of at least one token")
    total = S + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({S}) + new tokens ({max_new_tokens}) = {total} exceeds the model's "
                         f"max_seq_len ({model.cfg.max_seq_len})")
    model.eval()
    device = model.embed.weight.device
    prompt_BS = prompt_BS.to(device)
    caches = model.new_caches(B, total)
    logits_BV = model(prompt_BS, caches=caches, start_pos=0).logits_BSV[:, -1]
    done_B = torch.zeros(B, dtype=torch.bool, device=device)
    new_ids: list[torch.Tensor] = []
    steps_logits: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        if vocab_size is not None and vocab_size < logits_BV.shape[-1]:
            logits_BV = logits_BV.clone()
            logits_BV[:, vocab_size:] = float("-inf")
        steps_logits.append(logits_BV)
        ids_B = next_token(logits_BV, sampling, generator)
        if eos_id is not None:
            ids_B = ids_B.masked_fill(done_B, eos_id)
            done_B |= ids_B == eos_id
        new_ids.append(ids_B)
        # NOTE: host-device sync to test whether every row has finished.
        if step + 1 == max_new_tokens or (eos_id is not None and bool(done_B.all())):
            break
        logits_BV = model(ids_B[:, None], caches=caches, start_pos=S + step).logits_BSV[:, -1]
    ids_BN = torch.stack(new_ids, dim=1) if new_ids else prompt_BS.new_zeros(B, 0)
    if not return_logits:
        return ids_BN
    V = logits_BV.shape[-1]
    return ids_BN, torch.stack(steps_logits, dim=1) if steps_logits else logits_BV.new_zeros(B, 0, V)


@torch.no_grad()
def generate_without_cache(
    model: Decoder,
    prompt_BS: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(greedy=True),
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference `generate` is checked against: rerun the whole prefix for every new token.
    → (new ids (B, N), the last-position logits of every step (B, N, V))."""
    model.eval()
    ids_BT = prompt_BS.to(model.embed.weight.device)
    steps_logits = []
    for _ in range(max_new_tokens):
        logits_BV = model(ids_BT).logits_BSV[:, -1]
        steps_logits.append(logits_BV)
        ids_BT = torch.cat([ids_BT, next_token(logits_BV, sampling, generator)[:, None]], dim=1)
    return ids_BT[:, prompt_BS.shape[1]:], torch.stack(steps_logits, dim=1)

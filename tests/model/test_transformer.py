"""The decoder as a whole: what holds without position information (permutation symmetry), and
that building is deterministic with the initialization it documents.

Legend: B batch, S sequence, D model dim, V vocabulary, Dh head dim.

Without positions, self-attention without a mask is permutation-equivariant (reference text,
"Forgetting positional encoding"), and so is every token-wise sublayer. Causal attention is not:
the mask itself orders the tokens. The Decoder only has causal attention, so the equivariance
is checked on its own weights run through `eager_attention` with no mask; for the causal model the
property that does hold is checked too: one causal layer sees its prefix as a set.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from moetron.model.attention import eager_attention
from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.transformer import Block, Decoder, build_model


def _config(**changes) -> ModelConfig:
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, position="none",
                max_seq_len=64, moe=MoEConfig(num_experts=4, top_k=2, d_expert=24, every=2))
    return ModelConfig(**{**base, **changes})


def _unmasked_block(block: Block, h_BSD: torch.Tensor) -> torch.Tensor:
    """`block` with its own weights, its attention run by eager_attention without a causal mask."""

    def attend(x_BSD):
        a = block.attn
        B, S, _ = x_BSD.shape
        q_BHSDh = a.wq(x_BSD).view(B, S, -1, a.head_dim).transpose(1, 2)
        k_BGSDh = a.wk(x_BSD).view(B, S, -1, a.head_dim).transpose(1, 2)
        v_BGSDh = a.wv(x_BSD).view(B, S, -1, a.head_dim).transpose(1, 2)
        o_BHSDh = eager_attention(q_BHSDh, k_BGSDh, v_BGSDh, None, a.scale)
        return a.wo(o_BHSDh.transpose(1, 2).reshape(B, S, -1))

    if block.pre_norm:
        h_BSD = h_BSD + attend(block.attn_norm(h_BSD))
        return h_BSD + block._ffn(block.ffn_norm(h_BSD))[0]
    h_BSD = block.attn_norm(h_BSD + attend(h_BSD))
    return block.ffn_norm(h_BSD + block._ffn(h_BSD)[0])


def _unmasked_forward(model: Decoder, ids_BS: torch.Tensor) -> torch.Tensor:
    h_BSD = model.embed(ids_BS)
    for block in model.layers.values():
        h_BSD = _unmasked_block(block, h_BSD)
    if model.norm is not None:
        h_BSD = model.norm(h_BSD)
    return model.head(h_BSD)


@pytest.mark.parametrize("norm_position", ["pre", "post"])
@pytest.mark.parametrize("moe_every", [0, 1, 2])
def test_unmasked_stack_without_positions_is_permutation_equivariant(norm_position, moe_every):
    """f(x[π]) = f(x)[π] for the whole stack (embedding, attention without a mask, dense or
    dropless MoE FFNs, norms, head). A capacity limit would break it: drops depend on token order."""
    moe = MoEConfig(num_experts=4 if moe_every else 0, top_k=2, d_expert=24, every=max(moe_every, 1))
    model = build_model(_config(norm_position=norm_position, moe=moe, n_layers=3))
    ids_BS = torch.randint(0, 64, (2, 16))
    perm_S = torch.randperm(16)
    with torch.no_grad():
        logits_BSV = _unmasked_forward(model, ids_BS)
        permuted_BSV = _unmasked_forward(model, ids_BS[:, perm_S])
    torch.testing.assert_close(permuted_BSV, logits_BSV[:, perm_S], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("position,invariant", [("none", True), ("rope", False), ("learned", False)])
def test_one_causal_layer_sees_its_prefix_as_a_set(position, invariant):
    """With no positions, one causal layer's output at position t depends on tokens 0..t−1 only
    as a multiset: shuffling them leaves logits at t and later unchanged. (From two layers on this
    no longer holds: the shuffled positions' own hidden states change.) With positions it fails."""
    model = build_model(_config(n_layers=1, position=position, moe=MoEConfig()))
    t = 9
    ids_BS = torch.randint(0, 64, (2, 16))
    shuffled_BS = ids_BS.clone()
    shuffled_BS[:, :t] = ids_BS[:, torch.randperm(t)]
    with torch.no_grad():
        logits_BSV = model(ids_BS).logits_BSV
        shuffled_BSV = model(shuffled_BS).logits_BSV
    same = torch.allclose(shuffled_BSV[:, t:], logits_BSV[:, t:], rtol=1e-5, atol=1e-6)
    assert same == invariant


def test_same_seed_builds_identical_parameters():
    """Two builds under the same seed are bit-identical, on CPU and on the meta → to_empty →
    init_weights path; another seed differs in every weight matrix."""
    cfg = _config(tie_embeddings=False)

    def build(seed, meta=False):
        torch.manual_seed(seed)
        if not meta:
            return build_model(cfg)
        model = build_model(cfg, device="meta").to_empty(device="cpu")
        model.init_weights()
        return model

    for meta in (False, True):
        a, b, c = build(0, meta).state_dict(), build(0, meta).state_dict(), build(1, meta).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert all(not torch.equal(a[k], c[k]) for k in a if a[k].dim() >= 2)


def test_residual_projections_are_scaled_with_depth():
    """N(0, init_std) everywhere, N(0, init_std/sqrt(2·n_layers)) for the projections that write
    into the residual stream (attention output, FFN/expert down projections); norms start at 1."""
    n_layers, init_std = 6, 0.02
    cfg = _config(d_model=128, n_heads=4, d_ff=256, n_layers=n_layers, init_std=init_std,
                  moe=MoEConfig(num_experts=4, top_k=2, d_expert=128, every=2, shared_expert_d_ff=128))
    torch.manual_seed(0)
    model = build_model(cfg)
    out_std = init_std / math.sqrt(2 * n_layers)
    residual_outputs = ("attn.wo.weight", "ffn.w_down.weight", "ffn.experts.w_down_EFD", "ffn.shared.w_down.weight")
    seen = set()
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        expected = out_std if name.endswith(residual_outputs) else init_std
        seen.add(name.split(".", 2)[-1] if name.startswith("layers.") else name)
        assert abs(p.std().item() / expected - 1) < 0.05, f"{name}: std {p.std().item():.4g}, expected {expected:.4g}"
        assert abs(p.mean().item()) < 0.1 * expected, name
    assert {"attn.wo.weight", "ffn.w_down.weight", "ffn.experts.w_down_EFD", "ffn.shared.w_down.weight",
            "ffn.router.gate.weight", "embed.weight", "head.weight"} <= seen


def test_tied_embeddings_share_one_matrix():
    """tie_embeddings: the LM head is the embedding matrix (one parameter, one gradient)."""
    model = build_model(_config(tie_embeddings=True))
    assert model.head.weight is model.embed.weight
    ids_BS = torch.randint(0, 64, (2, 8))
    F.cross_entropy(model(ids_BS).logits_BSV.flatten(0, 1), ids_BS.flatten()).backward()
    assert model.embed.weight.grad is not None
    untied = build_model(_config(tie_embeddings=False))
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == sum(p.numel() for p in untied.parameters()) - untied.head.weight.numel()

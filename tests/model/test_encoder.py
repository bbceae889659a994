"""`model.causal: false`: a bidirectional encoder, block for block torch's own TransformerEncoderLayer.

Legend: B batch, S sequence, D model dim.

The reference page's encoder block (multi-head self-attention without a mask, a ReLU FFN, LayerNorm
after each residual sum — or before each sublayer) is built from moetron's parts (Block with
LayerNorm, biases, one KV head per query head) and given `torch.nn.TransformerEncoderLayer`'s
weights; both must give the same output, and the same input gradient, for post- and pre-norm.
"""

import pytest
import torch
from torch import nn

from moetron.model.config import ModelConfig
from moetron.model.transformer import Block, build_model

D, HEADS, FF = 64, 2, 96  # head dim 32: the Triton kernel takes it


def _encoder_config(norm_position: str, attention: str = "sdpa") -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=D, n_layers=1, n_heads=HEADS, d_ff=FF, activation="relu",
                       norm="layernorm", norm_position=norm_position, bias=True, position="none",
                       attention=attention, causal=False, max_seq_len=32)


def _copy_weights(ours: Block, ref: nn.TransformerEncoderLayer) -> None:
    wq, wk, wv = ref.self_attn.in_proj_weight.chunk(3)
    bq, bk, bv = ref.self_attn.in_proj_bias.chunk(3)
    with torch.no_grad():
        for lin, w, b in ((ours.attn.wq, wq, bq), (ours.attn.wk, wk, bk), (ours.attn.wv, wv, bv),
                          (ours.attn.wo, ref.self_attn.out_proj.weight, ref.self_attn.out_proj.bias),
                          (ours.ffn.w_gate, ref.linear1.weight, ref.linear1.bias),
                          (ours.ffn.w_down, ref.linear2.weight, ref.linear2.bias)):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        for norm, r in ((ours.attn_norm, ref.norm1), (ours.ffn_norm, ref.norm2)):
            norm.weight.copy_(r.weight)
            norm.bias.copy_(r.bias)


@pytest.mark.parametrize("attention", ["sdpa", "eager", "triton"])
@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_encoder_block_matches_torch_transformer_encoder_layer(norm_position, attention):
    torch.manual_seed(0)
    # The Triton kernels take fp32 at most (and the interpreter computes it exactly): fp32 there.
    dtype, tol = (torch.float32, 2e-5) if attention == "triton" else (torch.float64, 1e-10)
    ref = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, activation="relu", layer_norm_eps=1e-5,
                                     batch_first=True, norm_first=norm_position == "pre").to(dtype)
    # Non-trivial norm gains and biases, so a swapped or missing norm cannot pass.
    with torch.no_grad():
        for norm in (ref.norm1, ref.norm2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    ours = Block(_encoder_config(norm_position, attention), 0).to(dtype)
    if attention == "triton":
        ours.attn.kernel_backend = "interpret"  # the Triton kernels, run by the interpreter
    _copy_weights(ours, ref)
    x_BSD = torch.randn(3, 40, D, dtype=dtype, requires_grad=True)  # 40: two key tiles, one ragged
    want_BSD = ref(x_BSD)
    got_BSD, _ = ours(x_BSD)
    torch.testing.assert_close(got_BSD, want_BSD, rtol=tol, atol=tol)
    (g_want,) = torch.autograd.grad(want_BSD.square().sum(), x_BSD)
    (g_got,) = torch.autograd.grad(got_BSD.square().sum(), x_BSD)
    torch.testing.assert_close(g_got, g_want, rtol=tol, atol=tol)


def test_an_encoder_sees_later_tokens_and_a_decoder_does_not():
    torch.manual_seed(0)
    enc = build_model(_encoder_config("pre"))
    dec = build_model(_encoder_config("pre").replace(causal=True))
    dec.load_state_dict(enc.state_dict())
    ids_BS = torch.randint(0, 64, (1, 12))
    changed_BS = ids_BS.clone()
    changed_BS[0, -1] = (ids_BS[0, -1] + 1) % 64
    with torch.no_grad():
        enc_moved = (enc(ids_BS).logits_BSV[0, 0] - enc(changed_BS).logits_BSV[0, 0]).abs().max()
        dec_moved = (dec(ids_BS).logits_BSV[0, 0] - dec(changed_BS).logits_BSV[0, 0]).abs().max()
    assert enc_moved > 1e-4 and dec_moved == 0


def test_an_encoder_does_not_generate_and_refuses_one_sided_biases():
    from moetron.model.generate import Sampling, generate

    enc = build_model(_encoder_config("pre"))
    with pytest.raises(ValueError, match="model.causal = false"):
        generate(enc, torch.zeros(1, 3, dtype=torch.long), 2, Sampling(greedy=True))
    bad = {k for k, _, _ in _encoder_config("pre").replace(position="alibi").problems()}
    assert bad == {"position"}

"""Multi-head latent attention: against the formulas written out here (a plain loop over heads) and
against transformers' DeepseekV3Attention; every backend alike; the latent cache holds R + Dr numbers
per position and decoding from it equals recomputing the prefix."""

import math

import pytest
import torch

from moetron.model.config import MLAConfig, ModelConfig, MoEConfig
from moetron.model.generate import generate, generate_without_cache
from moetron.model.mla import LatentCache, MLAttention, mla_softmax_scale
from moetron.model.positions import rope_cos_sin, rope_inv_freq
from moetron.model.transformer import build_model

VOCAB = 48
# Dq = 12 + 8 = 20, Dv = 10: the three widths all differ.
MLA = MLAConfig(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)


def tiny(**changes) -> ModelConfig:
    base = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=32, init_std=0.2,
                mla=MLA, moe=MoEConfig(num_experts=4, top_k=2, d_expert=24))
    return ModelConfig(**{**base, **changes})


def rms(x: torch.Tensor, gain: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def rotate(x: torch.Tensor, pos: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE of one vector (Dr,) at `pos`, pairing i with i + Dr/2 (rotate-half)."""
    half = x.shape[-1] // 2
    a, b = x[:half], x[half:]
    cos, sin = torch.cos(pos * inv_freq), torch.sin(pos * inv_freq)
    return torch.cat([a * cos - b * sin, b * cos + a * sin])


def reference_mla(attn: MLAttention, x_SD: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence, float64, every head and position by hand from the module's weights."""
    m = {k: v.double() for k, v in attn.state_dict().items()}
    x = x_SD.double()
    S, H, Dn, Dr, Dv, R = x.shape[0], attn.n_heads, attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank
    if "wq_a.weight" in m:
        q = rms(x @ m["wq_a.weight"].T, m["q_norm.weight"]) @ m["wq_b.weight"].T
    else:
        q = x @ m["wq.weight"].T
    q = q.view(S, H, Dn + Dr)
    kv_a = x @ m["wkv_a.weight"].T
    c, k_rope = rms(kv_a[:, :R], m["kv_norm.weight"]), kv_a[:, R:]
    kv = (c @ m["wkv_b.weight"].T).view(S, H, Dn + Dv)
    out = torch.zeros(S, H, Dv, dtype=torch.float64)
    for h in range(H):
        for i in range(S):
            qi = torch.cat([q[i, h, :Dn], rotate(q[i, h, Dn:], i, inv_freq.double())])
            logits = torch.stack([qi @ torch.cat([kv[j, h, :Dn], rotate(k_rope[j], j, inv_freq.double())]) * scale
                                  for j in range(i + 1)])
            out[i, h] = logits.softmax(0) @ kv[: i + 1, h, Dn:]
    return out.reshape(S, H * Dv) @ m["wo.weight"].T


@pytest.mark.parametrize("q_lora_rank", [0, 12])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_mla_equals_its_formulas(q_lora_rank, backend):
    cfg = tiny(mla=MLAConfig(**{**MLA.__dict__, "q_lora_rank": q_lora_rank}), attention=backend)
    torch.manual_seed(0)
    attn = MLAttention.from_config(cfg)
    attn.init_weights(0.2, 0.2)
    with torch.no_grad():
        for norm in (attn.kv_norm, getattr(attn, "q_norm", None)):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    x_BSD = torch.randn(2, 7, cfg.d_model)
    inv_freq = rope_inv_freq(8, cfg.rope_theta)
    out = attn(x_BSD, rope=rope_cos_sin(torch.arange(7), inv_freq))
    for b in range(2):
        want = reference_mla(attn, x_BSD[b], inv_freq, 20**-0.5)
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


def test_backends_agree_with_packed_documents_and_the_flash_kernel():
    """Dq = 32 and Dv = 16: the flash kernel takes the two head dims apart."""
    mla = MLAConfig(kv_lora_rank=16, q_lora_rank=0, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16)
    torch.manual_seed(1)
    attn = MLAttention.from_config(tiny(mla=mla))
    attn.init_weights(0.2, 0.2)
    x_BSD = torch.randn(2, 9, 32)
    rope = rope_cos_sin(torch.arange(9), rope_inv_freq(8, 10000.0))
    doc_start_BL = torch.tensor([[0] * 4 + [4] * 5, [0] * 9])
    outs = {}
    for backend in ("eager", "sdpa", "triton"):
        attn.backend, attn.kernel_backend = backend, "interpret"
        outs[backend] = (attn(x_BSD, rope=rope), attn(x_BSD, rope=rope, doc_start_BL=doc_start_BL))
    for backend in ("sdpa", "triton"):
        for got, want in zip(outs[backend], outs["eager"]):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # The first document's positions do not see past it; the second's do not see before it.
    torch.testing.assert_close(outs["eager"][1][0, :4], outs["eager"][0][0, :4])
    assert not torch.allclose(outs["eager"][1][0, 4:], outs["eager"][0][0, 4:])


@pytest.mark.parametrize("nope,rope,v_dim", [(32, 16, 32), (8, 8, 24)])
def test_flash_kernel_takes_v3_head_dims_forward_and_gradients(nope, rope, v_dim):
    """DeepSeek-V3's head dims at a quarter of their width: Dq = 32 + 16 = 48 (not a power of two, as
    V3's 192) beside Dv = 32; and v wider than q/k (Dq = 16, Dv = 24). The triton backend (the flash
    kernel, interpreted) gives eager's and SDPA's output and the gradients of every weight and of x."""
    mla = MLAConfig(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v_dim)
    torch.manual_seed(5)
    attn = MLAttention.from_config(tiny(mla=mla, n_heads=2))
    attn.init_weights(0.2, 0.2)
    x_BSD = torch.randn(2, 9, 32)
    rope_cs = rope_cos_sin(torch.arange(9), rope_inv_freq(rope, 10000.0))
    doc_start_BL = torch.tensor([[0] * 4 + [4] * 5, [0] * 9])
    results = {}
    for backend in ("eager", "sdpa", "triton"):
        attn.backend, attn.kernel_backend = backend, "interpret"
        attn.zero_grad()
        x = x_BSD.clone().requires_grad_()
        outs = (attn(x, rope=rope_cs), attn(x, rope=rope_cs, doc_start_BL=doc_start_BL))
        (outs[0].square().sum() + outs[1].sin().sum()).backward()
        results[backend] = [*outs, x.grad] + [p.grad.clone() for p in attn.parameters()]
    for backend in ("sdpa", "triton"):
        for got, want in zip(results[backend], results["eager"]):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert all(g.abs().sum() > 0 for g in results["triton"][2:])


def test_mla_matches_transformers_deepseek_v3_attention():
    """The same weights in DeepseekV3Attention (rope_interleave false: rotate-half, as here) and
    YaRN with mscale_all_dim: the softmax scale carries the temperature."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    hf_cfg = DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12,
                              kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                              rope_interleave=False, max_position_embeddings=32, rope_parameters=rope_parameters)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(2)
    hf = DeepseekV3Attention(hf_cfg, 0).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    cfg = tiny(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_seq_len=8,
               mla=MLAConfig(**{**MLA.__dict__, "yarn_mscale": 0.707}))
    ours = MLAttention.from_config(cfg)
    names = {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa",
             "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
    ours.load_state_dict({f"{m}.weight": hf.state_dict()[f"{t}.weight"] for m, t in names.items()})
    assert ours.scale == pytest.approx(hf.scaling, rel=1e-12)
    assert mla_softmax_scale(cfg) == pytest.approx(20**-0.5 * (0.1 * 0.707 * math.log(4) + 1) ** 2)
    x_BSD = torch.randn(2, 11, 32)
    positions = torch.arange(11)
    cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(x_BSD, positions[None])
    mask = torch.full((11, 11), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, _ = hf(x_BSD, position_embeddings=(cos, sin), attention_mask=mask)
        inv_freq = rope_inv_freq(8, 10000.0, "yarn", 4.0, 8)
        got = ours(x_BSD, rope=rope_cos_sin(positions, inv_freq))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_cache_holds_the_latent_and_the_rope_key_only():
    model = build_model(tiny())
    caches = model.new_caches(3, 20)
    assert all(isinstance(c, LatentCache) for c in caches)
    # R + Dr = 16 + 8 numbers per position and layer, instead of H·(Dq + Dv) = 4·30.
    assert caches[0].c_B1LR.shape == (3, 1, 20, 16) and caches[0].k_rope_B1LDr.shape == (3, 1, 20, 8)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (3, 6)), caches=caches, start_pos=0)
    assert caches[1].length == 6


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_greedy_decoding_from_the_latent_cache_equals_recomputing(q_lora_rank):
    cfg = tiny(mla=MLAConfig(**{**MLA.__dict__, "q_lora_rank": q_lora_rank}), rope_scaling="yarn",
               rope_scaling_factor=2.0, rope_original_max_seq_len=16)
    torch.manual_seed(3)
    model = build_model(cfg).eval()
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    ids, logits = generate(model, prompt, 16, return_logits=True)
    ref_ids, ref_logits = generate_without_cache(model, prompt, 16)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)


def test_gradients_reach_every_projection():
    model = build_model(tiny())
    out = model(torch.randint(0, VOCAB, (2, 8)))
    out.logits_BSV.square().mean().backward()
    attn = model.layers["0"].attn
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_config_rules_for_mla():
    problems = {k for k, _, _ in tiny(n_kv_heads=2, attention_bias="qkv", position="alibi").problems()}
    assert {"n_kv_heads", "attention_bias", "position"} <= problems
    assert not tiny(head_dim=7).problems()  # the rotated width is qk_rope_head_dim, not head_dim
    odd_rope = tiny(mla=MLAConfig(kv_lora_rank=8, qk_rope_head_dim=5))
    assert "mla.qk_rope_head_dim" in {k for k, _, _ in odd_rope.problems()}

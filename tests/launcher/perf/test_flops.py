"""Analytic accounting: exact parameter counts against built models, and the reference figures of
the transformer-architecture notes (base encoder, Llama-3-70B KV cache, GPT-3 training compute,
the attention/FFN crossover)."""

import itertools

import pytest
import torch

from moetron.launcher.perf import flops
from moetron.launcher.perf.memory import memory_per_rank
from moetron.model.config import MLAConfig, ModelConfig, MoEConfig
from moetron.model.transformer import build_model

MOES = {
    "dense": MoEConfig(),
    "top2_shared_every2": MoEConfig(num_experts=4, top_k=2, d_expert=24, shared_expert_d_ff=16, every=2),
    "switch": MoEConfig(num_experts=4, top_k=1, weighting="softmax", capacity_factor=1.25),
}


@pytest.mark.parametrize("moe", MOES.values(), ids=MOES.keys())
@pytest.mark.parametrize("activation,norm,norm_position,position,bias,tie", [
    ("swiglu", "rmsnorm", "pre", "rope", False, False),
    ("gelu", "layernorm", "post", "learned", True, True),
    ("relu", "layernorm", "pre", "sinusoidal", True, False),
    ("swiglu", "rmsnorm", "post", "alibi", True, True),
    ("swiglu", "rmsnorm", "pre", "t5", False, False),
])
def test_params_total_equals_the_built_model(moe, activation, norm, norm_position, position, bias, tie):
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40, activation=activation,
                      norm=norm, norm_position=norm_position, position=position, bias=bias, tie_embeddings=tie,
                      max_seq_len=64, moe=moe)
    model = build_model(cfg, device="meta")
    assert flops.params_total(cfg) == sum(p.numel() for p in model.parameters())
    assert flops.params_embedding(cfg) == model.embed.weight.numel() + (
        model.pos_embed.weight.numel() if model.pos_embed is not None else 0)
    tables = [m.weight for m in (model.pos_embed, model.t5_bias) if m is not None]
    assert flops.params_position(cfg) == sum(t.numel() for t in tables)


def test_active_params_count_the_matmuls_one_token_passes_through():
    D, L, H, G, Dh, E, K, Fe, Fs, V = 64, 3, 8, 2, 8, 8, 2, 96, 32, 100
    cfg = ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=H, n_kv_heads=G, d_ff=128, moe=MoEConfig(
        num_experts=E, top_k=K, d_expert=Fe, shared_expert_d_ff=Fs), bias=True)
    attention = 2 * D * H * Dh + 2 * D * G * Dh  # W_q, W_o and the GQA-sized W_k, W_v
    per_layer = attention + D * E + K * 3 * D * Fe + 3 * D * Fs  # router, K SwiGLU experts, shared expert
    assert flops.params_active(cfg) == L * per_layer + D * V
    assert flops.flops_per_token_6n(cfg) == 6 * flops.params_active(cfg)
    # All E experts in the total; biases and norms too, but not in the active count.
    assert flops.params_total(cfg) > flops.params_embedding(cfg) + L * (attention + E * 3 * D * Fe)


def test_flops_per_token_is_6n_plus_full_square_attention_and_components_sum_to_it():
    cfg = ModelConfig(d_model=64, n_layers=3, n_heads=4, d_ff=128, moe=MoEConfig(num_experts=4, top_k=2))
    S = 512
    assert flops.attention_flops_per_token(cfg, S) == 12 * 3 * 4 * 16 * S
    assert flops.attention_flops_per_token_causal(cfg, S) * 2 == flops.attention_flops_per_token(cfg, S)
    assert flops.flops_per_token(cfg, S) == flops.flops_per_token_6n(cfg) + flops.attention_flops_per_token(cfg, S)
    assert sum(flops.flops_by_component(cfg, S).values()) == flops.flops_per_token(cfg, S)
    causal = flops.flops_by_component(cfg, S, causal=True)
    assert sum(causal.values()) == flops.flops_per_token_6n(cfg) + flops.attention_flops_per_token_causal(cfg, S)
    assert list(causal) == list(flops.COMPONENTS)


def test_base_encoder_stack_is_12_d2_L_about_19M():
    """d=512, L=6, d_ff=4d: attention 4d² + FFN 8d² per block → ≈ 19M params per stack."""
    d, L = 512, 6
    cfg = ModelConfig(d_model=d, n_layers=L, n_heads=8, d_ff=4 * d, activation="relu", vocab_size=1)
    weights = flops.matmul_params(cfg)
    stack = weights["attention_projections"] + weights["dense_ffn"]
    assert stack == 12 * d * d * L == 18_874_368
    assert round(stack / 1e6) == 19


@pytest.mark.parametrize("kv_heads,gigabytes", [(64, 21.5), (8, 2.7)])
def test_llama3_70b_kv_cache_at_8192_in_bf16(kv_heads, gigabytes):
    cfg = ModelConfig(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=kv_heads, d_ff=28672, vocab_size=128256)
    assert flops.kv_cache_bytes_per_token(cfg) == 2 * 80 * kv_heads * 128 * 2
    assert flops.kv_cache_bytes(cfg, seq_len=8192) / 1e9 == pytest.approx(gigabytes, abs=0.05)
    assert flops.kv_cache_bytes(cfg, seq_len=8192, batch=3) == 3 * flops.kv_cache_bytes(cfg, seq_len=8192)


CACHED = {
    "gqa": ModelConfig(vocab_size=50, d_model=64, n_layers=3, n_heads=8, n_kv_heads=2),
    "sliding and full": ModelConfig(vocab_size=50, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                    sliding_window=24, layer_types=("sliding", "full", "sliding", "full")),
    "mla": ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4,
                       mla=MLAConfig(kv_lora_rank=16, q_lora_rank=0, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                     v_head_dim=16)),
}


@pytest.mark.parametrize("cfg", CACHED.values(), ids=CACHED.keys())
@pytest.mark.parametrize("seq_len", [10, 24, 40])  # shorter than, equal to and longer than the window
def test_kv_cache_bytes_are_what_generation_allocates(cfg, seq_len):
    """kv_cache_bytes against the caches `generate` makes (model.new_caches): every tensor they hold,
    a sliding layer's window capped at the sequence, in bf16 for a batch of 3."""
    model = build_model(cfg, device="meta")
    caches = model.new_caches(3, seq_len, dtype=torch.bfloat16)
    held = sum(t.numel() * t.element_size() for c in caches for t in vars(c).values() if isinstance(t, torch.Tensor))
    assert flops.kv_cache_bytes(cfg, seq_len, batch=3, bytes_per_element=2) == held


def test_gpt3_175b_on_300b_tokens_is_about_3_15e23_flops():
    d = 12288
    cfg = ModelConfig(d_model=d, n_layers=96, n_heads=96, d_ff=4 * d, activation="gelu", vocab_size=50257,
                      max_seq_len=2048, position="learned")
    assert flops.params_total(cfg) / 1e9 == pytest.approx(175, rel=0.01)
    assert flops.training_flops(cfg, 300e9, 2048, with_attention=False) == pytest.approx(3.15e23, rel=0.01)


def test_attention_overtakes_the_ffn_at_8d_causal_and_4d_full_square():
    """The notes' n ≈ 8d holds when causal attention is halved; the full square crosses at 4d."""
    d = 4096
    cfg = ModelConfig(d_model=d, n_layers=2, n_heads=32, d_ff=4 * d, activation="gelu")
    assert flops.attention_crossover_seq_len(cfg, causal=True) == 8 * d
    assert flops.attention_crossover_seq_len(cfg, causal=False) == 4 * d
    at_8d = flops.flops_by_component(cfg, 8 * d, causal=True)
    assert at_8d["attention_scores"] == at_8d["dense_ffn"]
    assert flops.flops_by_component(cfg, 8 * d)["attention_scores"] == 2 * at_8d["dense_ffn"]


def test_accounting_has_the_documented_fields():
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128)
    acct = flops.accounting(cfg, seq_len=256, batch=4, memory=memory_per_rank(cfg, seq_len=256, micro_batch=4).to_dict())
    for key in ("params_total", "params_embedding", "params_active", "flops_per_token_6n", "attention_flops_per_token",
                "attention_flops_per_token_causal", "flops_per_token", "kv_cache_bytes_per_token", "kv_cache_bytes",
                "components", "memory_per_rank", "convention"):
        assert key in acct
    assert acct["kv_cache_bytes"] == acct["kv_cache_bytes_per_token"] * 256 * 4
    assert {f for f, _, _ in flops.summary_rows(acct)} >= {"params_active", "flops_per_token", "kv_cache_bytes"}
    assert list(itertools.islice(acct["components"], 1)) == ["attention_projections"]


@pytest.mark.parametrize("q_lora_rank", [0, 12])
@pytest.mark.parametrize("moe", MOES.values(), ids=MOES.keys())
def test_mla_params_equal_the_built_model_and_its_formulas(moe, q_lora_rank):
    """W_q (or W_qa, W_qb), W_kva, W_kvb, W_o per layer, and the latents' norm gains."""
    D, L, H, R, Dn, Dr, Dv = 32, 2, 4, 16, 8, 4, 6
    mla = MLAConfig(kv_lora_rank=R, q_lora_rank=q_lora_rank, qk_nope_head_dim=Dn, qk_rope_head_dim=Dr, v_head_dim=Dv)
    cfg = ModelConfig(vocab_size=50, d_model=D, n_layers=L, n_heads=H, d_ff=40, max_seq_len=64, mla=mla, moe=moe)
    assert flops.params_total(cfg) == sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    q = (D * q_lora_rank + q_lora_rank * H * (Dn + Dr)) if q_lora_rank else D * H * (Dn + Dr)
    per_layer = q + D * (R + Dr) + R * H * (Dn + Dv) + H * Dv * D
    assert flops.matmul_params(cfg)["attention_projections"] == L * per_layer
    # QKᵀ is Dq = 12 wide, PV Dv = 6: 6·L·H·(Dq + Dv)·S.
    assert flops.attention_flops_per_token(cfg, 64) == 6 * L * H * (Dn + Dr + Dv) * 64


def test_mla_kv_cache_holds_the_latent_and_the_rope_key():
    """DeepSeek-V3: (512 + 64) numbers per layer and token, 61 layers, bf16 — against 128 heads'
    expanded keys (192) and values (128)."""
    mla = MLAConfig(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    cfg = ModelConfig(d_model=7168, n_layers=61, n_heads=128, d_ff=18432, vocab_size=129280, mla=mla)
    assert flops.kv_cache_bytes_per_token(cfg) == (512 + 64) * 61 * 2 == 70272
    assert flops.kv_cache_bytes_per_token_expanded(cfg) == 61 * 128 * (192 + 128) * 2
    assert flops.kv_cache_bytes(cfg, seq_len=4096, batch=2) == 70272 * 4096 * 2
    acct = flops.accounting(cfg, seq_len=4096)
    rows = {f: note for f, _, note in flops.summary_rows(acct)}
    assert "latent" in rows["kv_cache_bytes_per_token"] and "kv_cache_bytes_per_token_expanded" in rows

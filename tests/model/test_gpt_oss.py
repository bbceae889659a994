"""GPT-OSS in moetron: the real GptOssForCausalLM built from tiny random configs (no download) and its
conversion give the same logits and greedy continuation both ways; attention sinks and sliding windows
agree on every attention backend and under a windowed KV cache; the biased router and experts and the
clamped SwiGLU against plain formulas; MXFP4 checkpoints dequantize as transformers does; the presets
hold the published parameter counts.

Legend: B batch, S positions, D model dim, H query heads, G key/value heads, Dh head dim, E experts.
"""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from moetron.launcher.cli.main import main
from moetron.launcher.config import load_config
from moetron.launcher.perf import flops
from moetron.model.attention import Attention, KVCache, WindowKVCache, attention_bias, eager_attention
from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.experts import GroupedExperts
from moetron.model.generate import generate, generate_without_cache
from moetron.model.hf import config_from_hf, config_to_hf, hf_family, hf_problems, load_hf, save_hf
from moetron.model.hf_gpt_oss import dequantize_mxfp4
from moetron.model.positions import rope_cos_sin, rope_inv_freq
from moetron.model.transformer import build_model

VOCAB = 96
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# Window 5 < the 24-token sequences; layers mixing sliding and full; heads wider than D/H; top-3 of
# 6; YaRN as GPT-OSS writes it (truncate false) but with its own numbers; a low clamp (1.0) and a
# non-default alpha, with weights drawn at 0.2 so that the clamp cuts many gate and up values.
HF_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24, num_local_experts=6, num_experts_per_tok=3, sliding_window=5,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=64,
               rms_norm_eps=1e-6, initializer_range=0.2, swiglu_limit=1.0, swiglu_alpha=1.3,
               rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "original_max_position_embeddings": 16, "truncate": False})
VARIANTS = {
    "yarn-sliding": {},
    # No attention biases, tied embeddings, every layer full, plain RoPE, top-2.
    "plain-tied": dict(attention_bias=False, tie_word_embeddings=True, num_experts_per_tok=2,
                       layer_types=["full_attention"] * 3, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}


@pytest.fixture
def hf_gpt_oss(transformers, randomize):
    """→ build(**changes): a random GptOssForCausalLM in eager attention: every bias and sink drawn
    non-zero (transformers starts them at zero), norm gains around 1, so a dropped or misplaced one
    shows."""

    def build(**changes):
        torch.manual_seed(0)
        config = transformers.GptOssConfig(**{**HF_BASE, **changes})
        config._attn_implementation = "eager"
        return randomize(transformers.GptOssForCausalLM(config).eval(), around_zero=("bias", "sinks"))

    return build


@pytest.mark.oracles
@pytest.mark.parametrize("variant", VARIANTS)
def test_from_hf_same_logits_greedy_and_exact_round_trip(hf_gpt_oss, hf_round_trip, tokens, variant):
    hf = hf_gpt_oss(**VARIANTS[variant])
    model = hf_round_trip(hf, tokens(), rtol=1e-4, prompt=4, new=16)
    assert hf_family(model.cfg) == "gpt_oss"
    assert [model.cfg.layer_window(i) for i in range(3)] == ([5, 0, 5] if variant == "yarn-sliding" else [0, 0, 0])


@pytest.mark.oracles
def test_to_hf_writes_absent_biases_as_zeros(transformers, randomize, tokens, relative_error, tmp_path):
    """A moetron model with sinks but q/k/v biases only, no router or expert biases, a window on
    every layer: GPT-OSS holds it exactly (zero biases where moetron has none)."""
    cfg = ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32, max_seq_len=64,
                      rope_theta=500.0, norm_eps=1e-6, init_std=0.2, attention_bias="qkv", attention_sinks=True,
                      sliding_window=6,
                      moe=MoEConfig(num_experts=4, top_k=2, swiglu_limit=2.0, swiglu_alpha=1.702, swiglu_up_offset=1.0))
    torch.manual_seed(3)
    model = randomize(build_model(cfg), around_zero=("bias", "sinks.weight")).eval()
    save_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.layer_types == ["sliding_attention"] * 2 and hf.config.sliding_window == 6
    ids = tokens(seed=2)
    with torch.no_grad():
        assert relative_error(hf(ids).logits, model(ids).logits_BSV) < 1e-4


def _quantized(E, R, G, seed):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, R, G, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 131, (E, R, G), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.oracles
def test_mxfp4_dequantizes_as_transformers_and_loads(hf_gpt_oss, tokens, relative_error, tmp_path):
    """Our dequantization against transformers' `convert_moe_packed_tensors`, bit for bit; then a
    folder with the experts in MXFP4 (as openai/gpt-oss-* ships them) loads to the model whose
    experts hold those dequantized weights."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _quantized(3, 40, 2, 0)
    assert torch.equal(dequantize_mxfp4(blocks, scales), convert_moe_packed_tensors(blocks, scales))
    hf = hf_gpt_oss(num_hidden_layers=1, layer_types=["sliding_attention"])
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for name, (R, G) in (("gate_up_proj", (64, 2)), ("down_proj", (64, 1))):
        blocks, scales = _quantized(6, R, G, 1 + len(name))
        sd.pop(f"model.layers.0.mlp.experts.{name}")
        sd[f"model.layers.0.mlp.experts.{name}_blocks"] = blocks
        sd[f"model.layers.0.mlp.experts.{name}_scales"] = scales
        with torch.no_grad():
            getattr(hf.model.layers[0].mlp.experts, name).copy_(convert_moe_packed_tensors(blocks, scales).float())
    save_file(sd, str(tmp_path / "model.safetensors"))
    config = json.loads(hf.config.to_json_string())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = tokens()
    with torch.no_grad():
        assert relative_error(hf(ids).logits, load_hf(tmp_path)(ids).logits_BSV) < 1e-4
    config["quantization_config"] = {"quant_method": "gptq"}
    with pytest.raises(ValueError, match="quantization 'gptq'"):
        config_from_hf(config)


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.oracles
def test_yarn_matches_transformers_rope_init(transformers):
    """GPT-OSS's YaRN (unrounded ramp) and the usual one (rounded) against transformers' rope init."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for truncate in (False, True):
        rope = {**HF_BASE["rope_parameters"], "truncate": truncate}
        config = transformers.GptOssConfig(**{**HF_BASE, "rope_parameters": rope})
        want, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        cfg = config_from_hf(json.loads(config.to_json_string()))
        assert cfg.rope_yarn_truncate is truncate
        got = rope_inv_freq(cfg.dim_head, cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor,
                            cfg.rope_original_len, truncate=cfg.rope_yarn_truncate)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert factor == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_published_config_maps_and_round_trips():
    """GptOssConfig's defaults are gpt-oss-20b's but for the layers and experts: a config.json
    holding only those maps to the preset's model section, and back."""
    cfg = config_from_hf({"model_type": "gpt_oss", "num_hidden_layers": 24, "num_local_experts": 32})
    assert cfg == load_config(CONFIGS / "gpt-oss-20b.yaml").model
    assert cfg.layer_types[:2] == ("sliding", "full") and cfg.sliding_window == 128
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_len, cfg.rope_yarn_truncate) == (
        "yarn", 32.0, 4096, False)
    assert config_from_hf(config_to_hf(cfg)) == cfg
    # No window, moetron's own original context (null), no router or expert biases (written as zeros).
    windowless = ModelConfig(n_kv_heads=2, attention_sinks=True, rope_scaling="yarn", rope_scaling_factor=4.0,
                             moe=MoEConfig(num_experts=4, top_k=2, swiglu_limit=7.0, swiglu_up_offset=1.0))
    assert config_from_hf(config_to_hf(windowless)) == windowless.replace(
        moe=dataclasses.replace(windowless.moe, router_bias=True, expert_bias=True))
    # transformers 4.x writes rope_scaling and a top-level rope_theta.
    legacy = config_from_hf({"model_type": "gpt_oss", "rope_theta": 1000.0,
                             "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}})
    assert (legacy.rope_theta, legacy.rope_scaling_factor, legacy.rope_yarn_truncate) == (1000.0, 8.0, True)


@pytest.mark.parametrize("hf,needle", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                          "original_max_position_embeddings": 64}}, "yarn beta_fast 16.0"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "rope type 'dynamic'"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok = 1"),
    ({"sliding_window": None}, "sliding_window is null"),
])
def test_config_from_hf_refuses_what_moetron_cannot_express(hf, needle):
    with pytest.raises(ValueError, match=needle):
        config_from_hf({"model_type": "gpt_oss", **hf})


def test_config_to_hf_names_what_gpt_oss_cannot_express():
    cfg = ModelConfig(attention_sinks=True, qk_norm="head", moe=MoEConfig(num_experts=8, top_k=2, swiglu_limit=0.0,
                                                                          shared_expert_d_ff=64))
    assert {k for k, _, _ in hf_problems(cfg)} == {"qk_norm", "moe.swiglu_limit", "moe.swiglu_up_offset",
                                                   "moe.shared_expert_d_ff"}


# ---------------------------------------------------------------------------------------------
# Attention: sinks and windows


def test_eager_with_sinks_and_window_equals_a_per_query_loop():
    """eager_attention against the definition: query i over keys i − W < j ≤ i and one extra logit
    sink_h whose probability is dropped."""
    gen = torch.Generator().manual_seed(4)
    B, H, G, S, Dh, W = 2, 4, 2, 9, 8, 3
    q = torch.randn(B, H, S, Dh, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, G, S, Dh, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks_H = torch.randn(H, generator=gen, dtype=torch.float64)
    bias = attention_bias(S, S, causal=True, slopes_H=None, device="cpu", window=W).double()
    out = eager_attention(q, k, v, bias, Dh**-0.5, sinks_H)
    want = torch.zeros_like(out)
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            for i in range(S):
                keys = range(max(0, i - W + 1), i + 1)
                s = torch.stack([q[b, h, i] @ k[b, g, j] * Dh**-0.5 for j in keys])
                p = s.exp() / (s.exp().sum() + sinks_H[h].exp())
                want[b, h, i] = sum(p_j * v[b, g, j] for p_j, j in zip(p, keys))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("sinks", [True, False])
def test_backends_agree_with_window_and_sinks(window, sinks):
    """eager, sdpa (routed to eager under sinks; masked otherwise) and the flash kernel through the
    Triton interpreter: output and every gradient (the sinks' too), and a decode step from a
    windowed cache."""
    backends = ["eager", "sdpa", "triton"]
    gen = torch.Generator().manual_seed(1)
    x_BSD, dy_BSD = torch.randn(2, 11, 32, generator=gen), torch.randn(2, 11, 32, generator=gen)
    rope = rope_cos_sin(torch.arange(11), rope_inv_freq(32, 500.0))
    results = {}
    for backend in backends:
        torch.manual_seed(0)
        # Head dim 32: the smallest the Triton kernels take.
        attn = Attention(32, 4, 2, 32, backend=backend, proj_bias="all", sinks=sinks, window=window)
        attn.kernel_backend = "interpret"
        attn.init_weights(std=0.3, out_std=0.3)
        with torch.no_grad():
            for name, p in attn.named_parameters():
                if name.endswith("bias") or name.startswith("sinks"):
                    p.normal_(0.0, 1.0)
        x = x_BSD.clone().requires_grad_()
        y_BSD = attn(x, rope=rope)
        (y_BSD * dy_BSD).sum().backward()
        # Decode: prefill 7 positions, then one more, reading the earlier ones from the cache.
        with torch.no_grad():
            cache = (WindowKVCache.empty(2, 2, window, 32, dtype=torch.float32, device="cpu") if window
                     else KVCache.empty(2, 2, 8, 32, dtype=torch.float32, device="cpu"))
            attn(x_BSD[:, :7], cache=cache, rope=tuple(t[:7] for t in rope))
            y_step = attn(x_BSD[:, 7:8], cache=cache, rope=tuple(t[7:8] for t in rope))
        torch.testing.assert_close(y_step, y_BSD.detach()[:, 7:8], rtol=1e-5, atol=1e-5)
        results[backend] = [y_BSD.detach(), x.grad] + [p.grad for p in attn.parameters()]
    names = ["out", "dx"] + [n for n, _ in attn.named_parameters()]
    for backend in backends[1:]:
        for what, a, b in zip(names, results[backend], results["eager"]):
            err, scale = (a - b).abs().max().item(), b.abs().max().item()
            assert err <= 2e-5 * scale, f"{backend} {what}: max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("backend,sinks", [("eager", True), ("sdpa", False)])
def test_window_cache_generation_equals_recomputing_the_prefix(tokens, backend, sinks):
    """Window 3 on two of three layers, 5-token prompts (longer than the window) and 12 new tokens:
    each sliding layer's cache holds 3 positions, and greedy decoding equals rerunning the prefix
    (with sinks every backend runs the eager reference; without, SDPA takes the window as a mask)."""
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=32, max_seq_len=32,
                      attention=backend, attention_sinks=sinks, attention_bias="all", sliding_window=3,
                      layer_types=("sliding", "full", "sliding"), init_std=0.3,
                      moe=MoEConfig(num_experts=4, top_k=2, router_bias=True, expert_bias=True))
    torch.manual_seed(5)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks.weight", "_EF", "_ED")):
                p.normal_(0.0, 0.5)
    caches = model.new_caches(2, 17)
    assert [type(c).__name__ for c in caches] == ["WindowKVCache", "KVCache", "WindowKVCache"]
    assert caches[0].k_BGWDh.shape[2] == 3
    prompt = tokens(length=5, seed=6)
    ids, logits = generate(model, prompt, 12, return_logits=True)
    want_ids, want_logits = generate_without_cache(model, prompt, 12)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)


def test_window_cache_keeps_the_last_positions():
    cache = WindowKVCache.empty(1, 1, 3, 1, dtype=torch.float32, device="cpu")
    k, _ = cache.append(torch.arange(5.0).view(1, 1, 5, 1), torch.zeros(1, 1, 5, 1))
    assert k.flatten().tolist() == [0, 1, 2, 3, 4] and cache.k_BGWDh.flatten().tolist() == [2, 3, 4]
    k, _ = cache.append(torch.full((1, 1, 1, 1), 5.0), torch.zeros(1, 1, 1, 1))
    assert k.flatten().tolist() == [2, 3, 4, 5] and cache.k_BGWDh.flatten().tolist() == [3, 4, 5]
    assert cache.length == 6


# ---------------------------------------------------------------------------------------------
# Router and experts


def test_biased_experts_and_clamped_swiglu_equal_a_per_expert_formula():
    """Rows grouped by expert (the last group empty, two rows past the last group): each row's
    expert's weights and biases, GPT-OSS's clamped SwiGLU; rows past the groups stay zero."""
    gen = torch.Generator().manual_seed(7)
    E, D, F = 4, 8, 6
    experts = GroupedExperts(E, D, F, "swiglu", "loop", bias=True, swiglu=(0.5, 1.702, 1.0))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x_AD = torch.randn(9, D, generator=gen)
    offsets_E = torch.tensor([2, 5, 7, 7], dtype=torch.int32)
    expert_A = [0, 0, 1, 1, 1, 2, 2]
    want = torch.zeros(9, D)
    for a, e in enumerate(expert_A):
        gate = (x_AD[a] @ experts.w_gate_EDF[e] + experts.b_gate_EF[e]).clamp(max=0.5)
        up = (x_AD[a] @ experts.w_up_EDF[e] + experts.b_up_EF[e]).clamp(-0.5, 0.5)
        want[a] = (gate * torch.sigmoid(1.702 * gate) * (up + 1.0)) @ experts.w_down_EFD[e] + experts.b_down_ED[e]
    for impl in ("loop", "grouped"):
        experts.impl = impl
        torch.testing.assert_close(experts(x_AD, offsets_E), want, rtol=1e-5, atol=1e-5)


def test_router_bias_joins_the_logits_and_equals_gpt_oss_top_k_softmax():
    """moetron's softmax + renormalize over biased logits = GPT-OSS's softmax over the top-k logits."""
    cfg = ModelConfig(d_model=16, moe=MoEConfig(num_experts=6, top_k=3, router_bias=True))
    torch.manual_seed(0)
    router = build_model(cfg.replace(n_layers=1, n_heads=2, d_ff=16)).layers["0"].ffn.router
    with torch.no_grad():
        router.gate.bias.normal_(0.0, 1.0)
    x_TD = torch.randn(10, 16)
    routing = router(x_TD)
    logits_TE = x_TD @ router.gate.weight.t() + router.gate.bias
    top_TK, expert_TK = logits_TE.topk(3, dim=-1)
    assert torch.equal(routing.expert_TK, expert_TK)
    torch.testing.assert_close(routing.weight_TK, top_TK.softmax(-1))


# ---------------------------------------------------------------------------------------------
# Presets and the performance model


# openai's model card: gpt-oss-120b 116.83B total, 5.13B active; gpt-oss-20b 20.91B and 3.61B. Their
# active counts hold the unembedding and not the embedding, as moetron's params_active.
@pytest.mark.parametrize("preset,total,active", [("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)])
def test_presets_hold_the_published_parameter_counts(preset, total, active):
    cfg = load_config(CONFIGS / f"{preset}.yaml").model
    assert abs(flops.params_total(cfg) / total - 1) < 0.01
    assert abs(flops.params_active(cfg) / active - 1) < 0.01
    # The formula counts every bias and sink the built model holds (on meta: nothing allocated).
    small = cfg.replace(n_layers=2, layer_types=("sliding", "full"), vocab_size=64,
                        moe=dataclasses.replace(cfg.moe, num_experts=8))
    assert flops.params_total(small) == sum(p.numel() for p in build_model(small, device="meta").parameters())


def test_sliding_layers_count_window_keys_in_flops_and_kv_cache():
    full = ModelConfig(n_layers=4, n_heads=8, d_model=256)
    slid = full.replace(sliding_window=128, layer_types=("sliding", "full", "sliding", "full"))
    S, W = 4096, 128
    per_layer = flops.attention_flops_per_token(full, S) // 4
    assert flops.attention_flops_per_token(slid, S) == 2 * per_layer + 2 * per_layer * W // S
    # Causal: a sliding query sees min(i + 1, W) keys, on average W − W²/(2S) (the band's trapezoid).
    assert flops.attention_flops_per_token_causal(slid, S) == pytest.approx(
        per_layer + 2 * per_layer * (W - W * W / (2 * S)) / S, rel=1e-6)
    # Windows at least as long as the sequence change nothing.
    assert flops.attention_flops_per_token(slid, 64) == flops.attention_flops_per_token(full, 64)
    assert flops.kv_cache_bytes(slid, S) == flops.kv_cache_bytes(full, S) // 2 + flops.kv_cache_bytes(full, W) // 2


def test_plan_answers_for_the_120b_preset_on_one_node(capsys):
    """Training 117B parameters with AdamW needs ~220 GiB per rank on 8 ranks: the planner says so
    in one line (the preset is laid out for 32, where its layout is the planner's first)."""
    assert main(["plan", str(CONFIGS / "gpt-oss-120b.yaml"), "--gpus", "8", "--gpus-per-node", "8",
                 "--gpu", "H100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fits on 8 × H100: needs 219.6 GiB per rank" in err, err

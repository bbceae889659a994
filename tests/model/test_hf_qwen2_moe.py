"""Hugging Face interop for Qwen2-MoE: the real Qwen2MoeForCausalLM built from tiny random configs
(no download) and its conversion give the same logits and greedy continuation, the round trip HF →
moetron → HF is bit-exact on every tensor (the gated shared expert and the q/k/v biases included),
configs map field for field, and the command line streams it both ways."""

import json

import pytest
import torch

from moetron.launcher.cli.main import main
from moetron.launcher.perf import flops
from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.generate import generate
from moetron.model.hf import config_from_hf, config_to_hf, hf_family, hf_problems, load_hf, save_hf
from moetron.model.transformer import build_model

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
            max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})
# Heads wider than D/H, a dense layer in the middle (mlp_only_layers), dense, expert and shared
# widths all different, renormalized top-3; then raw top-2 weights, every other layer an MoE
# (decoder_sparse_step), tied embeddings and no q/k/v biases.
VARIANTS = {
    "renormalized": dict(num_hidden_layers=4, head_dim=24, intermediate_size=72, moe_intermediate_size=40,
                         shared_expert_intermediate_size=56, num_experts_per_tok=3, norm_topk_prob=True,
                         mlp_only_layers=[2]),
    "raw-tied-no-bias": dict(num_hidden_layers=4, intermediate_size=48, moe_intermediate_size=32,
                             shared_expert_intermediate_size=40, num_experts_per_tok=2, norm_topk_prob=False,
                             decoder_sparse_step=2, tie_word_embeddings=True, qkv_bias=False),
}


@pytest.fixture
def hf_model(transformers, randomize):
    """→ build(variant): a randomly initialized Qwen2MoeForCausalLM. transformers starts biases at
    zero and norm gains at one: both are drawn here, so a missing, swapped or misplaced one shows
    far above the tolerance."""

    def build(variant: str):
        torch.manual_seed(0)
        hf = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**BASE, **VARIANTS[variant])).eval()
        return randomize(hf, around_zero=(".bias", "shared_expert_gate.weight"))

    return build


@pytest.mark.oracles
@pytest.mark.parametrize("variant", VARIANTS)
def test_from_hf_same_logits_greedy_and_exact_round_trip(hf_model, hf_greedy, hf_reads_back, tokens, tmp_path,
                                                          variant):
    hf = hf_model(variant)
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf").eval()
    cfg = model.cfg
    assert hf_family(cfg) == "qwen2_moe" and cfg.moe.shared_expert_gate
    assert cfg.attention_bias == ("qkv" if variant == "renormalized" else "none")
    assert [cfg.is_moe_layer(i) for i in range(4)] == ([True, True, False, True] if variant == "renormalized"
                                                       else [False, True, False, True])
    ids = tokens()
    with torch.no_grad():
        want = hf(ids).logits
        assert (want - model(ids).logits_BSV).abs().max() < 1e-4
    prompt = ids[:, :6]
    assert torch.equal(generate(model, prompt, 16), hf_greedy(hf, prompt, 16))
    hf_reads_back(model, hf, ids, want)


@pytest.mark.oracles
def test_to_hf_same_logits(transformers, tokens, tmp_path):
    """A moetron model with a gated shared expert (gate and q/k/v biases drawn non-zero), exported
    and loaded by AutoModelForCausalLM."""
    cfg = ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64,
                      rope_theta=500.0, norm_eps=1e-6, init_std=0.1, attention_bias="qkv",
                      moe=MoEConfig(num_experts=8, top_k=2, d_expert=24, weighting="softmax", first_dense_layers=1,
                                    shared_expert_d_ff=40, shared_expert_gate=True))
    torch.manual_seed(3)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias") or "shared_gate" in name:
                p.normal_(0.5, 0.3)
    save_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.model_type == "qwen2_moe" and hf.config.mlp_only_layers == [0]
    ids = tokens(seed=2)
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits_BSV).abs().max() < 1e-4


@pytest.mark.oracles
def test_from_hf_reads_the_fused_expert_layout(hf_model, fused_layout_logits, tokens):
    """Files written from a fused state dict directly (transformers 5.x) load too."""
    want, got = fused_layout_logits(hf_model("renormalized"), tokens())
    assert (want - got).abs().max() < 1e-4


@pytest.mark.oracles
def test_cli_convert_streams_both_ways(transformers, hf_model, same_tensors, tmp_path):
    """Through `moetron convert`, with the output in several shards: the same tensors come back."""
    hf = hf_model("renormalized")
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf2"),
                 "--max-shard-size", "100KB"]) == 0
    assert len(json.loads((tmp_path / "hf2" / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    assert len(list((tmp_path / "hf2").glob("*.safetensors"))) > 1
    same_tensors(hf, transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2"))


@pytest.mark.parametrize("changes", [
    dict(attention_bias="qkv", head_dim=32, moe=MoEConfig(num_experts=8, top_k=2, d_expert=24, every=2,
                                                         dense_layers=(3,), weighting="softmax",
                                                         shared_expert_d_ff=40, shared_expert_gate=True)),
    dict(tie_embeddings=True, rope_scaling="linear", rope_scaling_factor=2.0,
         moe=MoEConfig(num_experts=4, top_k=1, weighting="softmax", first_dense_layers=2, shared_expert_d_ff=64,
                       shared_expert_gate=True)),
])
def test_config_round_trip(changes):
    cfg = ModelConfig(**{**dict(vocab_size=VOCAB, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=96,
                                max_seq_len=64, norm_eps=1e-6), **changes})
    hf = config_to_hf(cfg)
    assert hf["model_type"] == "qwen2_moe" and hf["architectures"] == ["Qwen2MoeForCausalLM"]
    assert config_from_hf(hf) == cfg


def test_published_config_maps_key_for_key():
    """Qwen1.5-MoE-A2.7B's config.json, as published (written by transformers 4.x: no qkv_bias key,
    whose attention always has q/k/v biases)."""
    published = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
                 "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
                 "num_key_value_heads": 16, "max_position_embeddings": 8192, "rope_theta": 1000000.0,
                 "rms_norm_eps": 1e-06, "use_sliding_window": False, "sliding_window": 32768,
                 "max_window_layers": 21, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
                 "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
                 "norm_topk_prob": False, "tie_word_embeddings": False, "vocab_size": 151936, "torch_dtype": "bfloat16"}
    cfg = config_from_hf(published)
    assert (cfg.attention_bias, cfg.rope_theta, cfg.d_ff, cfg.d_expert_ff) == ("qkv", 1e6, 5632, 1408)
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.weighting, moe.shared_expert_d_ff, moe.shared_expert_gate) == (
        60, 4, "softmax", 5632, True)
    assert all(cfg.is_moe_layer(i) for i in range(24))


@pytest.mark.parametrize("hf,needle", [
    ({"use_sliding_window": True}, "only full attention"),
    ({"num_experts_per_tok": 1, "norm_topk_prob": True}, "renormalized top-1"),
    ({"hidden_act": "gelu"}, "SwiGLU"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size 0"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 4.0}}, "yarn"),
])
def test_config_from_hf_refuses_what_moetron_cannot_express(hf, needle):
    with pytest.raises(ValueError, match=needle):
        config_from_hf({"model_type": "qwen2_moe", **hf})


def test_config_to_hf_names_what_the_family_cannot_express():
    cfg = ModelConfig(attention_bias="all", qk_norm="head",
                      moe=MoEConfig(num_experts=8, score="sigmoid", shared_expert_d_ff=64, shared_expert_gate=True))
    assert {k for k, _, _ in hf_problems(cfg)} == {"attention_bias", "qk_norm", "moe.score"}


def test_the_parameter_formula_counts_the_gate_and_the_biases():
    cfg = config_from_hf({"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 3,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "num_experts": 8,
                          "intermediate_size": 48, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
                          "mlp_only_layers": [1]})
    assert flops.params_total(cfg) == sum(p.numel() for p in build_model(cfg, device="meta").parameters())

"""Hugging Face Mixtral interop: a MixtralForCausalLM built from a small config (no download) and its
conversion give the same logits and greedy continuation, both ways; configs map field for field."""

import json

import pytest
import torch

from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.generate import generate
from moetron.model.hf import config_from_hf, config_to_hf, hf_problems, load_hf, save_hf
from moetron.model.transformer import build_model

VOCAB = 96


def moetron_mixtral(**changes) -> ModelConfig:
    """A Mixtral-shaped moetron config: GQA, RoPE, RMSNorm, SwiGLU, top-2 of 8."""
    base = dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64,
                rope_theta=500.0, norm_eps=1e-6, init_std=0.1,
                moe=MoEConfig(num_experts=8, top_k=2, aux_loss_coef=0.02))
    return ModelConfig(**{**base, **changes})


def hf_mixtral(transformers, randomize, **changes):
    """A randomly initialized MixtralForCausalLM; init_range 0.1 spreads router and attention
    scores out, so a wrong transpose or head layout would show far above the tolerance, and random
    norm gains (`randomize`) a misplaced norm."""
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-6, initializer_range=0.1)
    torch.manual_seed(0)
    return randomize(transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**kwargs, **changes}))).eval()


@pytest.mark.oracles
@pytest.mark.parametrize("variant", [{}, {"tie_word_embeddings": True,
                                          "rope_scaling": {"type": "linear", "factor": 2.0}}],
                         ids=["plain", "tied-linear-rope"])
def test_from_hf_same_logits_and_greedy_continuation(transformers, randomize, tokens, hf_greedy, tmp_path, variant):
    hf = hf_mixtral(transformers, randomize, **variant)
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path).eval()
    assert model.cfg.tie_embeddings == bool(variant) and model.cfg.rope_scaling == ("linear" if variant else "none")
    ids = tokens()
    with torch.no_grad():
        want, got = hf(ids).logits, model(ids).logits_BSV
    assert (want - got).abs().max() < 1e-4
    prompt = ids[:, :6]
    assert torch.equal(generate(model, prompt, 12), hf_greedy(hf, prompt, 12))


@pytest.mark.oracles
def test_from_hf_reads_the_fused_expert_layout(transformers, randomize, fused_layout_logits, tokens):
    """Files written from a fused state dict directly (transformers 5.x) load too."""
    want, got = fused_layout_logits(hf_mixtral(transformers, randomize), tokens())
    assert (want - got).abs().max() < 1e-4


@pytest.mark.oracles
def test_to_hf_same_logits_and_greedy_continuation(transformers, randomize, tokens, hf_greedy, tmp_path):
    torch.manual_seed(3)
    model = randomize(build_model(moetron_mixtral())).eval()
    save_hf(model, tmp_path)
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path).eval()
    ids = tokens(seed=2)
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits_BSV).abs().max() < 1e-4
    prompt = ids[:, :6]
    assert torch.equal(hf_greedy(hf, prompt, 12), generate(model, prompt, 12))


def test_round_trip_is_exact_and_shards(tmp_path):
    torch.manual_seed(4)
    model = build_model(moetron_mixtral(tie_embeddings=True))
    files = save_hf(model, tmp_path, max_shard_bytes=64 * 1024)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    back = load_hf(tmp_path)
    assert back.cfg == model.cfg
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_hf_layout_on_disk(tmp_path):
    """Per-expert Linear weights (out, in): w1 = gate and w3 = up are (F, D), w2 = down is (D, F)."""
    from safetensors import safe_open

    torch.manual_seed(5)
    model = build_model(moetron_mixtral(d_ff=40, moe=MoEConfig(num_experts=8, top_k=2, d_expert=24)))
    save_hf(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["intermediate_size"] == 24 and cfg["num_key_value_heads"] == 2 and cfg["rope_theta"] == 500.0
    experts = model.layers["1"].ffn.experts
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        prefix = "model.layers.1.block_sparse_moe.experts.3."
        assert torch.equal(f.get_tensor(prefix + "w1.weight"), experts.w_gate_EDF[3].detach().t())
        assert torch.equal(f.get_tensor(prefix + "w3.weight"), experts.w_up_EDF[3].detach().t())
        assert torch.equal(f.get_tensor(prefix + "w2.weight"), experts.w_down_EFD[3].detach().t())
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [32, 64]


@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": True, "rope_scaling": "linear", "rope_scaling_factor": 4.0},
                                     {"head_dim": 32, "n_kv_heads": 1, "moe": MoEConfig(num_experts=4, top_k=3)}])
def test_config_round_trip(changes):
    cfg = moetron_mixtral(**changes)
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_config_reads_both_transformers_generations():
    old = {"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": None,
           "rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 2.0}, "sliding_window": 4096,
           "max_position_embeddings": 32768}
    new = {"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": None,
           "rope_parameters": {"rope_type": "linear", "rope_theta": 1234.0, "factor": 2.0},
           "sliding_window": 4096, "max_position_embeddings": 32768}
    for hf in (old, new):
        cfg = config_from_hf(hf)
        assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor) == (1234.0, "linear", 2.0)
        # Within the sliding window, attention is full attention.
        assert cfg.max_seq_len == 4096 and cfg.kv_heads == 4 and cfg.d_ff == 14336


@pytest.mark.parametrize("hf,needle", [({"model_type": "llama"}, "only mixtral, qwen3_moe, olmoe, "),
                                       ({"hidden_act": "gelu"}, "SwiGLU"),
                                       ({"num_experts_per_tok": 1}, "top-1"),
                                       ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "yarn")])
def test_config_from_hf_refuses_what_moetron_cannot_express(hf, needle):
    with pytest.raises(ValueError, match=needle):
        config_from_hf(hf)


def test_config_to_hf_names_what_mixtral_cannot_express():
    cfg = moetron_mixtral(norm_position="post", position="alibi", moe=MoEConfig(num_experts=8, top_k=2, every=2))
    assert {k for k, _, _ in hf_problems(cfg)} == {"norm_position", "position", "moe.every"}
    with pytest.raises(ValueError, match="model.norm_position = 'post'"):
        config_to_hf(cfg)

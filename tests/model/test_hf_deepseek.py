"""Hugging Face interop for DeepSeek-V2 and DeepSeek-V3: transformers' real DeepseekV2ForCausalLM and
DeepseekV3ForCausalLM built from tiny random configs (MLA with and without a query latent, YaRN,
groups, shared experts, leading dense layers, sigmoid scores with a non-zero correction bias) give
the same logits and greedy continuation after `load_hf`, and transformers reads `save_hf`'s folder
back bit for bit; configs map field for field; what cannot be expressed is refused in one line."""

import json
from pathlib import Path

import pytest
import torch

from moetron.launcher.cli.main import main
from moetron.launcher.config import load_config
from moetron.launcher.perf import flops
from moetron.model.config import MLAConfig, ModelConfig, MoEConfig
from moetron.model.hf import config_from_hf, config_to_hf, hf_problems, load_hf, save_hf
from moetron.model.transformer import build_model

VOCAB = 96
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8,
            max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.2,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0}, pad_token_id=None, bos_token_id=None,
            eos_token_id=None)
VARIANTS = {
    # V3 as published in kind: a query latent, 4 groups of 2 (best 2 kept, each scored by its best
    # two, where megatron's default rule would take 3 // 2 = 1), one shared expert, the first layer
    # dense, renormalized sigmoid weights scaled 2.5, a correction bias drawn non-zero.
    "deepseek_v3": dict(num_hidden_layers=3, q_lora_rank=12, num_experts_per_tok=3, n_group=4, topk_group=2,
                        n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                        num_nextn_predict_layers=0),
    # No query latent, raw sigmoid weights, one group, YaRN.
    "deepseek_v3-plain-yarn": dict(num_hidden_layers=2, q_lora_rank=None, num_experts_per_tok=2, n_group=1,
                                   topk_group=1, n_shared_experts=2, first_k_dense_replace=0, norm_topk_prob=False,
                                   routed_scaling_factor=1.5, rope_parameters=YARN, num_nextn_predict_layers=0),
    # V2-Lite in kind: no query latent, greedy top-k of the softmax, two shared experts, first layer dense.
    "deepseek_v2": dict(num_hidden_layers=3, q_lora_rank=None, num_experts_per_tok=3, n_shared_experts=2,
                        first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0),
    # V2 in kind: a query latent, group-limited greedy (a group scores its best expert), scaled, YaRN.
    # top-4 of 2 kept groups: megatron's default rule would score a group by its best 4 // 2 = 2.
    "deepseek_v2-groups-yarn": dict(num_hidden_layers=2, q_lora_rank=12, num_experts_per_tok=4, n_shared_experts=1,
                                    first_k_dense_replace=0, topk_method="group_limited_greedy", n_group=4,
                                    topk_group=2, routed_scaling_factor=16.0, rope_parameters=YARN),
}
LENGTH = 20  # positions of the ids every test here feeds


@pytest.fixture
def hf_model(transformers, randomize):
    """→ build(variant): a random model of `variant`, norm gains around 1 and V3's correction bias
    non-zero (both start as constants, which would hide a misplaced or missing tensor)."""

    def build(variant: str):
        family = variant.split("-")[0]
        config_cls, model_cls = {
            "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
            "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)}[family]
        torch.manual_seed(0)
        hf = model_cls(config_cls(**{**BASE, **VARIANTS[variant]})).eval()
        return randomize(hf, buffers=("e_score_correction_bias",))

    return build


@pytest.mark.oracles
@pytest.mark.parametrize("variant", VARIANTS)
def test_from_hf_same_logits_greedy_and_exact_round_trip(hf_model, hf_round_trip, tokens, variant):
    hf = hf_model(variant)
    model = hf_round_trip(hf, tokens(length=LENGTH), rtol=1e-4, prompt=5, new=16)
    assert model.cfg.mla.enabled and model.cfg.mla.q_lora_rank == (hf.config.q_lora_rank or 0)


@pytest.mark.oracles
@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v2-groups-yarn"])
def test_from_hf_reads_the_fused_expert_layout(hf_model, fused_layout_logits, tokens, relative_error, variant):
    """Files written from transformers 5.x's in-memory state dict (mlp.experts.gate_up_proj) load too."""
    want, got = fused_layout_logits(hf_model(variant), tokens(length=LENGTH))
    assert relative_error(want, got) < 1e-4


@pytest.fixture
def moetron_model(randomize):
    """→ build(**changes): a small MLA model (norm gains and expert biases drawn), in eval mode."""

    def build(**changes):
        cfg = ModelConfig(**{**dict(vocab_size=VOCAB, d_model=48, n_layers=3, n_heads=4, d_ff=64, max_seq_len=64,
                                    rope_theta=500.0, norm_eps=1e-6, init_std=0.1,
                                    mla=MLAConfig(kv_lora_rank=16, q_lora_rank=8, qk_nope_head_dim=8,
                                                  qk_rope_head_dim=8, v_head_dim=12),
                                    moe=MoEConfig(num_experts=8, top_k=2, d_expert=16, shared_expert_d_ff=32,
                                                  first_dense_layers=1)), **changes})
        torch.manual_seed(3)
        return randomize(build_model(cfg).eval(), buffers=("expert_bias_E",))

    return build


@pytest.mark.oracles
@pytest.mark.parametrize("moe,family", [
    (MoEConfig(num_experts=8, top_k=2, d_expert=16, shared_expert_d_ff=32, first_dense_layers=1, weighting="softmax",
               route_scale=2.0), "deepseek_v2"),
    (MoEConfig(num_experts=8, top_k=4, d_expert=16, shared_expert_d_ff=16, score="sigmoid", num_groups=4,
               topk_groups=2, route_scale=2.5), "deepseek_v3"),
])
def test_to_hf_same_logits(transformers, moetron_model, tokens, relative_error, tmp_path, moe, family):
    """A moetron MLA model exported and loaded by AutoModelForCausalLM: the family follows the score
    (a sigmoid router without aux-loss-free balancing writes a zero correction bias)."""
    model = moetron_model(moe=moe)
    save_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.model_type == family
    ids = tokens(length=LENGTH, seed=2)
    with torch.no_grad():
        assert relative_error(hf(ids).logits, model(ids).logits_BSV) < 1e-4


@pytest.mark.parametrize("changes", [
    dict(moe=MoEConfig(num_experts=8, top_k=2, d_expert=16, shared_expert_d_ff=32, first_dense_layers=1,
                       weighting="softmax", num_groups=4, topk_groups=2, group_score_top=1, aux_loss_coef=0.003,
                       aux_loss_type="sequence")),
    dict(rope_scaling="yarn", rope_scaling_factor=8.0, rope_original_max_seq_len=16,
         mla=MLAConfig(kv_lora_rank=16, q_lora_rank=0, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                       yarn_mscale=0.707),
         moe=MoEConfig(num_experts=8, top_k=4, d_expert=16, score="sigmoid", num_groups=2, topk_groups=2,
                       group_score_top=2, bias_update_rate=0.001, route_scale=2.5, first_dense_layers=1,
                       dense_layers=(1, 3))),
])
def test_config_round_trip(moetron_model, changes):
    cfg = moetron_model(n_layers=4, **changes).cfg
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_moe_layer_freq_maps_to_dense_layers_and_back():
    """DeepSeek's rule: layer i is MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    cfg = config_from_hf({"model_type": "deepseek_v2", "num_hidden_layers": 7, "first_k_dense_replace": 1,
                          "moe_layer_freq": 2, "num_experts_per_tok": 6})
    assert [cfg.is_moe_layer(i) for i in range(7)] == [False, False, True, False, True, False, True]
    assert config_to_hf(cfg)["moe_layer_freq"] == 2
    # Published defaults fill what a config.json leaves out (transformers' DeepseekV3Config).
    v3 = config_from_hf({"model_type": "deepseek_v3", "num_nextn_predict_layers": 0})
    assert (v3.n_layers, v3.mla.q_lora_rank, v3.moe.num_groups, v3.moe.route_scale, v3.moe.score) == (
        61, 1536, 8, 2.5, "sigmoid")


@pytest.mark.parametrize("hf,needle", [
    ({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"model_type": "deepseek_v3", "rope_interleave": False}, "rope_interleave"),
    ({"model_type": "deepseek_v2", "norm_topk_prob": True, "num_experts_per_tok": 6}, "norm_topk_prob"),
    ({"model_type": "deepseek_v2", "topk_method": "noaux_tc", "num_experts_per_tok": 6}, "topk_method 'noaux_tc'"),
    ({"model_type": "deepseek_v2", "attention_bias": True, "num_experts_per_tok": 6}, "attention_bias"),
    ({"model_type": "deepseek_v3", "num_key_value_heads": 8}, "num_key_value_heads 8"),
    ({"model_type": "deepseek_v3", "rope_parameters": {**YARN, "mscale": 1.0}}, "mscale_all_dim"),
    ({"model_type": "deepseek_v3", "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ({"model_type": "deepseek_v3", "rope_parameters": {**YARN, "beta_fast": 16}}, "yarn beta_fast 16"),
    ({"model_type": "deepseek_v2"}, "num_experts_per_tok None"),
])
def test_config_from_hf_refuses_what_moetron_cannot_express(hf, needle):
    with pytest.raises(ValueError, match=needle) as err:
        config_from_hf(hf)
    assert "\n" not in str(err.value)


def test_config_to_hf_names_what_the_family_cannot_express(moetron_model):
    v2 = moetron_model(moe=MoEConfig(num_experts=8, top_k=2, d_expert=16, shared_expert_d_ff=24, every=2,
                                     weighting="renormalize", num_groups=2, topk_groups=1)).cfg
    assert {k for k, _, _ in hf_problems(v2)} == {"moe.shared_expert_d_ff", "moe.weighting", "moe.group_score_top",
                                                  "moe.every"}
    v3 = moetron_model(moe=MoEConfig(num_experts=8, top_k=2, score="sigmoid", num_groups=2, topk_groups=2,
                                     group_score_top=1, shared_expert_gate=True, shared_expert_d_ff=64)).cfg
    assert {k for k, _, _ in hf_problems(v3)} == {"moe.group_score_top", "moe.shared_expert_gate"}


@pytest.mark.oracles
def test_cli_convert_both_ways_and_v3_tensors_past_the_last_layer(transformers, hf_model, tmp_path, capsys):
    """`moetron convert` round trip; a V3 folder holding the multi-token-prediction layer
    (model.layers.{num_hidden_layers}.*) converts without it when num_nextn_predict_layers is 0."""
    from safetensors.torch import load_file, save_file

    hf = hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(48, 96)
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf2")]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["rope_interleave"] is True


# Published: DeepSeek-V3 671B total, 37B activated; DeepSeek-V2-Lite 15.7B and 2.4B. The activated
# figures are DeepSeek's arithmetic without the embedding lookup (36.62B and 2.45B here; with it
# 37.55B and 2.66B, as DeepSeek-V2 issue 73 also finds), given to two digits.
@pytest.mark.parametrize("preset,family,total,active", [("deepseek-v3-671b", "deepseek_v3", 671e9, 37e9),
                                                        ("deepseek-v2-lite", "deepseek_v2", 15.7e9, 2.4e9)])
def test_presets_hold_the_published_sizes_and_export_as_their_family(preset, family, total, active):
    cfg = load_config(CONFIGS / f"{preset}.yaml").model
    assert abs(flops.params_total(cfg) / total - 1) < 0.01
    assert abs(flops.params_active(cfg) / active - 1) < 0.025
    assert hf_problems(cfg) == []
    assert config_to_hf(cfg)["model_type"] == family
    assert config_from_hf(config_to_hf(cfg)) == cfg


@pytest.mark.oracles
def test_multi_token_prediction_layers_round_trip(transformers, moetron_model, tokens, relative_error, tmp_path):
    """mtp_depth 1 → num_nextn_predict_layers 1 and model.layers.{L}.* (model/hf_mtp.py), read back
    bit for bit; transformers reads the folder for the main model. A folder without those tensors
    (as save_pretrained writes) with num_nextn_predict_layers 1 converts as the main model alone."""
    model = moetron_model(mtp_depth=1, moe=MoEConfig(num_experts=8, top_k=2, d_expert=16, score="sigmoid",
                                                     shared_expert_d_ff=16, bias_update_rate=0.001,
                                                     first_dense_layers=1))
    save_hf(model, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    again = load_hf(tmp_path / "hf")
    assert again.cfg == model.cfg
    theirs = again.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = tokens(length=LENGTH, seed=4)
    with torch.no_grad():
        assert relative_error(hf(ids).logits, model.eval()(ids).logits_BSV) < 1e-4
    hf.save_pretrained(tmp_path / "dropped")  # transformers keeps no MTP layer...
    assert json.loads((tmp_path / "dropped" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    dropped = load_hf(tmp_path / "dropped")  # ...so the folder converts as the main model alone
    assert dropped.cfg == model.cfg.replace(mtp_depth=0)
    with torch.no_grad():
        assert torch.equal(dropped.eval()(ids).logits_BSV, model(ids).logits_BSV)

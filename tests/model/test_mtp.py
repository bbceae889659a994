"""Multi-token prediction (model/mtp.py): the loss against DeepSeek-V3's equations written out by
hand, the logits against transformers' own MtpModel reading our exported weights, gradients into
the shared embedding and head, eval and decoding without it, Hugging Face names (layer 61 of V3)
and an exact round trip, a short training run logging mtp_loss, and the FLOPs accounting."""

import contextlib
import json
import math

import pytest
import torch
import torch.nn.functional as F

from moetron.launcher.cli.main import main
from moetron.launcher.config import ConfigError, load_config
from moetron.launcher.perf import flops
from moetron.launcher.perf.flop_counter import measure_flops, single_process_step
from moetron.model.config import MLAConfig, ModelConfig, MoEConfig
from moetron.model.generate import generate
from moetron.model.hf import load_hf, save_hf
from moetron.model.hf_mtp import mtp_tensors_to_hf
from moetron.model.mtp import mtp_cross_entropy
from moetron.model.transformer import Decoder, build_model
from moetron.parallel.expert_bias import biased_routers

VOCAB = 96
TINY = "configs/tiny.yaml"
SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "model.moe.d_expert=64", "train.seq_len=32", "train.batch_size=4", "train.warmup_steps=2", "train.threads=1"]


@pytest.fixture
def model_of(randomize):
    """→ build(depth, **changes): a small MoE model (the first layer dense, so the MTP blocks are MoE
    like DeepSeek's) with norm gains drawn around 1: a constant gain would hide a norm applied to
    the wrong tensor."""

    def build(depth: int, **changes) -> Decoder:
        cfg = ModelConfig(**{**dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                                    max_seq_len=64, norm_eps=1e-6, init_std=0.1, mtp_depth=depth, mtp_loss_weight=0.3,
                                    moe=MoEConfig(num_experts=4, top_k=2, d_expert=24, first_dense_layers=1)),
                             **changes})
        torch.manual_seed(0)
        return randomize(build_model(cfg))

    return build


def window(batch=3, length=17, seed=1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def rmsnorm(x: torch.Tensor, norm) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def ce(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    return -torch.log_softmax(logits_NV.double(), -1).gather(-1, targets_N[:, None]).mean()


def reference_loss(model: Decoder, window_BS1: torch.Tensor) -> torch.Tensor:
    """L = CE_main + λ/D Σ_k CE_k (arXiv 2412.19437 eqs. 21-25), each depth on the positions that
    have a target, without padding: h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)], h^k =
    TRM_k(h'), P^k = OutHead(RMSNorm(h^k)); h^0 is what the main model's head reads."""
    cfg, ids = model.cfg, window_BS1
    S = ids.shape[1] - 1  # inputs t_0..t_{S-1}; the window's last token is only a target
    seen = {}
    handle = model.norm.register_forward_hook(lambda m, a, out: seen.setdefault("h0", out))
    main_logits = model(ids[:, :-1]).logits_BSV
    handle.remove()
    loss = ce(main_logits.flatten(0, 1), ids[:, 1:].flatten())
    h = seen["h0"]
    W_emb, W_head = model.embed.weight, model.head.weight
    mtp_losses = []
    for k, module in enumerate(model.mtp.values(), start=1):
        n = S - k  # positions 0..S-k-1 see t_{i+k} and have the target t_{i+k+1}
        e = W_emb[ids[:, k:k + n]]
        cat = torch.cat([rmsnorm(e, module.enorm), rmsnorm(h[:, :n], module.hnorm)], dim=-1)
        x, _ = module.block(cat @ module.eh_proj.weight.T, **model._position_kwargs(torch.arange(n)))
        h = rmsnorm(x, module.norm)
        mtp_losses.append(ce((h @ W_head.T).flatten(0, 1), ids[:, k + 1:k + 1 + n].flatten()))
    return loss + cfg.mtp_loss_weight / cfg.mtp_depth * sum(mtp_losses)


@pytest.mark.parametrize("depth", [1, 2])
def test_loss_matches_the_papers_equations(model_of, depth):
    model = model_of(depth)
    ids = window()
    out = model(ids[:, :-1])
    assert len(out.mtp_logits) == depth
    targets = ids[:, 1:]
    main = F.cross_entropy(out.logits_BSV.flatten(0, 1), targets.flatten())
    got = main + model.cfg.mtp_loss_weight * mtp_cross_entropy(out.mtp_logits, targets, lambda a, b: F.cross_entropy(
        a.flatten(0, 1), b.flatten()))
    want = reference_loss(model, ids)
    assert abs(got.item() - want.item()) < 1e-5 * want.item()
    # The MTP blocks route like the decoder's MoE layers: their stats and aux losses join.
    assert set(out.moe) == {1, *range(2, 2 + depth)}


def test_gradient_reaches_the_shared_embedding_head_and_decoder(model_of):
    """The MTP loss alone: its gradient flows into the shared embedding (rows of the tokens ahead)
    and head, and back through h^0 into the decoder (the causal chain is kept, not detached)."""
    model = model_of(2)
    ids = window()
    out = model(ids[:, :-1])
    mtp_cross_entropy(out.mtp_logits, ids[:, 1:], lambda a, b: F.cross_entropy(a.flatten(0, 1), b.flatten())).backward()
    for name in ("embed.weight", "head.weight", "layers.0.attn.wq.weight", "mtp.3.eh_proj.weight",
                 "mtp.2.block.ffn.experts.w_up_EDF"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    # Depth 1 and 2 embed t_{i+1} and t_{i+2} of the inputs only: the first input token never.
    rows = model.embed.weight.grad.abs().sum(-1) > 0
    assert rows[ids[:, 1:-1].unique()].all()


def test_eval_and_decoding_use_the_main_head_only(model_of):
    """Without MTP modules (their weights aside) the same seed gives the same decoder, and eval,
    KV-cache decoding and the main logits ignore the modules."""
    with_mtp, without = model_of(2), model_of(0)
    missing = without.load_state_dict(with_mtp.state_dict(), strict=False)
    assert not missing.missing_keys and all(k.startswith("mtp.") for k in missing.unexpected_keys)
    ids = window(batch=2, length=9)
    with torch.no_grad():
        train_out = with_mtp(ids)
        with_mtp.eval()
        assert with_mtp(ids).mtp_logits == []
        torch.testing.assert_close(train_out.logits_BSV, without.eval()(ids).logits_BSV, rtol=0, atol=0)
        assert torch.equal(generate(with_mtp, ids[:, :4], 8), generate(without, ids[:, :4], 8))


def test_expert_bias_rows_of_the_mtp_blocks(model_of):
    """Aux-loss-free routing: the MTP blocks' routers are named by their layer (n_layers + k − 1)."""
    model = model_of(2, moe=MoEConfig(num_experts=4, top_k=2, d_expert=24, score="sigmoid", bias_update_rate=0.01))
    assert sorted(biased_routers([model])) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# Hugging Face: DeepSeek-V3 stores depth k as layer num_hidden_layers + k − 1


@pytest.fixture
def deepseek_v3(randomize):
    """→ build(depth, n_layers=2, device="cpu", **changes): a small DeepSeek-V3-like model (MLA,
    sigmoid scores in groups, aux-loss-free balancing) with norm gains and expert biases drawn."""

    def build(depth: int, n_layers: int = 2, device: str = "cpu", **changes) -> Decoder:
        cfg = ModelConfig(**{**dict(vocab_size=VOCAB, d_model=48, n_layers=n_layers, n_heads=4, d_ff=64,
                                    max_seq_len=64, rope_theta=500.0, norm_eps=1e-6, init_std=0.1, mtp_depth=depth,
                                    mla=MLAConfig(kv_lora_rank=16, q_lora_rank=8, qk_nope_head_dim=8,
                                                  qk_rope_head_dim=8, v_head_dim=12),
                                    moe=MoEConfig(num_experts=8, top_k=4, d_expert=16, shared_expert_d_ff=16,
                                                  score="sigmoid", num_groups=4, topk_groups=2, bias_update_rate=0.01,
                                                  route_scale=2.5, first_dense_layers=1)), **changes})
        torch.manual_seed(3)
        return randomize(build_model(cfg, device=device), buffers=("expert_bias_E",))

    return build


@pytest.mark.oracles
def test_logits_match_transformers_mtp_model_and_round_trip_is_exact(deepseek_v3, tmp_path):
    """save_hf writes model.layers.{2,3}.*; transformers' MtpModel (its own renaming of those
    tensors, its own layer) drafts from the main model's last hidden state: its logits at depth
    1 and 2 equal ours. load_hf of the folder gives back every tensor bit for bit."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_layers import MtpModel

    model = deepseek_v3(depth=2)
    save_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 2
    again = load_hf(tmp_path)
    assert again.cfg.mtp_depth == 2
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    # transformers finds V3's MTP tensors by the pattern model.layers.61.*; this model has 2 layers.
    hf._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*", r"model\.layers\.3\..*"]
    mtp = MtpModel.from_pretrained(hf).eval()
    ids = window(batch=2, length=12)
    S = ids.shape[1]
    with torch.no_grad():
        ours = model.train()(ids)
        h = hf(ids, output_hidden_states=True).hidden_states[-1]
        for k in range(2):
            # Layer k drafts t_{i+k+2} from h^k_i and the token t_{i+k+1}: inputs shifted by k + 1.
            h = mtp.forward_layer(k, h[:, :-1], torch.arange(k + 1, S)[None].expand(2, -1), None,
                                  input_ids=ids[:, k + 1:])
            want = mtp._project_to_logits(h)
            got = ours.mtp_logits[k][:, :S - k - 1]
            assert ((want - got).abs().max() / want.abs().max()).item() < 1e-5


def test_names_are_deepseek_v3s_layer_61(deepseek_v3):
    """The published V3 index names layer 61 so (bf16 names; its FP8 release adds weight_scale_inv
    beside the quantized matrices, which are a storage format and not read here)."""
    moe = MoEConfig(num_experts=256, top_k=8, d_expert=8, shared_expert_d_ff=8, score="sigmoid", num_groups=8,
                    topk_groups=4, bias_update_rate=0.001, route_scale=2.5, first_dense_layers=3)
    model = deepseek_v3(depth=1, n_layers=61, vocab_size=64, d_model=16, n_heads=2, d_ff=32, moe=moe, device="meta")
    prefix = "model.layers.61."
    want = [f"{prefix}{n}" for n in (
        "embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
        "shared_head.head.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
        "mlp.shared_experts.down_proj.weight")]
    want += [f"{prefix}mlp.experts.{e}.{p}_proj.weight" for e in range(256) for p in ("gate", "up", "down")]
    got = dict(mtp_tensors_to_hf(model))
    assert sorted(got) == sorted(want)
    assert tuple(got[f"{prefix}eh_proj.weight"].shape) == (16, 32)  # (D, 2D): V3's [7168, 14336]


# ---------------------------------------------------------------------------------------------
# Training, logging, FLOPs


def test_training_logs_mtp_loss_and_resumes_bit_exactly(tmp_run_dir, capsys):
    """`moetron train` with mtp_depth=1: mtp_loss in metrics.jsonl and on the console, near the
    main loss of an untrained model (both ≈ ln 320); 2 + resume + 2 steps equal 4 straight, so the
    checkpoint holds the modules (weights and AdamW state)."""
    args = ["train", TINY, *SMALL, "model.mtp_depth=1", "train.steps=4", "train.log_every=1", "train.eval_every=4",
            "train.eval_batches=1", "train.precision=fp32", "train.checkpoint.every=2", f"train.run_dir={tmp_run_dir}"]
    assert main([*args, "train.name=straight"]) == 0
    assert "mtp_loss" in capsys.readouterr().err
    assert main([*args, "train.name=split", "--exit-after", "2"]) == 0
    assert main([*args, "train.name=split"]) == 0

    def records(name: str) -> list[dict]:
        lines = (tmp_run_dir / name / "metrics.jsonl").read_text().splitlines()
        keys = ("step", "loss", "mtp_loss", "grad_norm", "val_loss")
        return [{k: r.get(k) for k in keys} for r in map(json.loads, lines)]

    straight = records("straight")
    assert len(straight) == 4 and all(abs(r["mtp_loss"] - math.log(320)) < 1.0 for r in straight)
    assert records("split") == straight


def test_flops_count_the_modules(capsys):
    assert main(["flops", TINY, *SMALL, "model.mtp_depth=2", "--json"]) == 0
    acct = json.loads(capsys.readouterr().out)
    cfg = load_config(TINY, [*SMALL, "model.mtp_depth=2"]).model
    model = build_model(cfg, device="meta")
    assert acct["params_total"] == sum(p.numel() for p in model.parameters())
    assert acct["params_mtp"] == sum(p.numel() for p in model.mtp.parameters()) > 0
    D, V = cfg.d_model, cfg.vocab_size
    one_block = flops.flops_by_component(cfg.replace(n_layers=1, mtp_depth=0), 32)
    block = sum(v for name, v in one_block.items() if name not in ("lm_head", "mtp"))
    assert acct["components"]["mtp"]["flops_per_token"] == 2 * (block + 6 * (2 * D * D + D * V))
    assert acct["flops_per_token"] == sum(c["flops_per_token"] for c in acct["components"].values())
    assert acct["params_active"] == flops.params_active(cfg.replace(mtp_depth=0))


def test_counted_flops_agree_with_the_mtp_component(model_of):
    """A real step counted op by op: everything the modules run (their blocks, eh_proj, the shared
    head's extra pass) lands in "mtp", and matches the analytic count."""
    model = model_of(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tokens = window(batch=2, length=17)
    measured = measure_flops(model, lambda: single_process_step(model, optimizer, tokens, contextlib.nullcontext),
                             1, 2 * 16)
    rows = {r.component: r for r in measured.rows(flops.flops_by_component(model.cfg, 16))}
    assert rows["mtp"].counted > 0 and rows["other"].counted == 0
    for name in ("mtp", "lm_head", "experts", "attention_projections", "total"):
        assert abs(rows[name].ratio - 1) < 1e-9, name


def test_deepseek_v3_sizes_with_its_mtp_module():
    """DeepSeek-V3: 671B main model (published without the MTP module) and 685B on Hugging Face,
    whose layer 61 also stores copies of the embedding and head (2·V·D). Approximate attention
    aside (the preset's comment), both within 1%."""
    cfg = load_config("configs/deepseek-v3-671b.yaml", ["model.mtp_depth=1"]).model
    main_model = flops.params_total(cfg) - flops.params_mtp(cfg)
    assert main_model == flops.params_total(cfg.replace(mtp_depth=0))
    assert main_model == pytest.approx(671e9, rel=0.01)
    assert flops.params_total(cfg) + 2 * cfg.vocab_size * cfg.d_model == pytest.approx(685e9, rel=0.01)


@pytest.mark.parametrize("overrides,needle", [
    (["model.mtp_depth=1", "parallel.cp=2"], "parallel.cp = 2"),
    (["model.mtp_depth=32"], "must be below train.seq_len"),
])
def test_layouts_that_cannot_predict_ahead_are_refused(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(TINY, [*SMALL, *overrides])

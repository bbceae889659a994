"""`moetron convert` both ways through the command line: a Hugging Face Mixtral folder becomes a
checkpoint that `moetron generate` continues exactly as transformers does, and a training
checkpoint becomes a folder `MixtralForCausalLM.from_pretrained` loads with the same logits."""

import json
from pathlib import Path

import pytest
import torch

from moetron.launcher.checkpoint.store import load_checkpoint, save_checkpoint
from moetron.launcher.checkpoint.weights import load_model, save_weights
from moetron.launcher.cli.main import main
from moetron.launcher.config import Config, TrainConfig
from moetron.launcher.train.optim import build_optimizer
from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.transformer import build_model

VOCAB = 96
MIXTRAL = ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64,
                      rope_theta=500.0, init_std=0.1, moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.25))


def tokens(seed=0, length=20):
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def trainer_checkpoint(root: Path, cfg: ModelConfig) -> Path:
    """A checkpoint as the trainer writes it (optimizer, sampler, RNG) around a random model."""
    torch.manual_seed(1)
    model = build_model(cfg)
    full = Config(model=cfg, train=TrainConfig(seq_len=32))
    state = {"step": 7, "tokens": 0, "sampler": {}, "config": full.to_dict(), "layout": {"world_size": 1}}
    return save_checkpoint(root / "checkpoints", 7, model, build_optimizer(model, full.train), state)


@pytest.mark.oracles
def test_from_hf_then_generate_matches_transformers(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=0.1)).eval()
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    prompt = tokens(length=5)[:1]
    want = hf.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                       attention_mask=torch.ones_like(prompt), pad_token_id=0)[0, 5:].tolist()
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt-ids", ",".join(map(str, prompt[0].tolist())),
                 "--max-new-tokens", "10", "--greedy", "--ignore-eos", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ids": want, "text": None}
    # A converted checkpoint has no run, so no tokenizer unless the source folder had one.
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "x"]) == 2
    assert "pass --prompt-ids" in capsys.readouterr().err

    # And back out: the same tensors as the original folder held.
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf2")]) == 0
    again = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    for (name, a), (_, b) in zip(hf.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.oracles
def test_training_checkpoint_to_hf_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    ckpt = trainer_checkpoint(tmp_path / "run", MIXTRAL)
    # The run folder stands for its newest checkpoint.
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    # The run trained on bytes: Hugging Face's generate should stop at the byte tokenizer's end of text.
    assert hf.config.eos_token_id == 256
    _, model = load_model(ckpt)
    ids = tokens(seed=3)
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits_BSV).abs().max() < 1e-4


@pytest.mark.oracles
def test_tokenizer_json_travels_both_ways(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from moetron.launcher.data.tokenizer import train_bpe

    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=320, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "hf")
    tok = train_bpe(["def f(x):\n    return x\n"] * 20, 300, tmp_path / "hf" / "tokenizer.json")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "def f", "--max-new-tokens", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["text"] == tok.decode(got["ids"]) and max(got["ids"]) < tok.vocab_size
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf2")]) == 0
    assert (tmp_path / "hf2" / "tokenizer.json").read_text() == (tmp_path / "hf" / "tokenizer.json").read_text()
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["eos_token_id"] == tok.eos_id


def test_weights_only_checkpoint_loads_with_the_checkpoint_loader(tmp_path):
    torch.manual_seed(2)
    model = build_model(MIXTRAL).to(torch.bfloat16)
    out = save_weights(model, tmp_path / "ckpt", source="test")
    assert {"COMPLETE", "state.json", ".metadata"} <= {p.name for p in out.iterdir()}
    state = json.loads((out / "state.json").read_text())
    assert state["config"]["model"]["d_model"] == 64 and state["dtype"] == "bfloat16"
    fresh = build_model(MIXTRAL, dtype=torch.bfloat16)
    load_checkpoint(out, fresh, None)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    _, loaded = load_model(out)
    assert loaded.embed.weight.dtype == torch.bfloat16 and loaded.cfg.moe.capacity_factor is None


def test_refusals_are_one_line_and_status_2(tmp_path, capsys):
    ckpt = trainer_checkpoint(tmp_path / "run", MIXTRAL.replace(norm_position="post"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    (tmp_path / "nohf").mkdir()
    cases = [
        (["--to-hf", str(ckpt), "--out", str(tmp_path / "o1")], "model.norm_position = 'post': must be 'pre'"),
        (["--to-hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")], "no such run or checkpoint"),
        (["--from-hf", str(tmp_path / "nohf"), "--out", str(tmp_path / "o3")], "no config.json"),
        (["--from-hf", str(tmp_path / "nohf"), "--out", str(tmp_path / "taken")], "already exists"),
    ]
    for args, needle in cases:
        assert main(["convert", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("moetron convert: ") and needle in err, err
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))

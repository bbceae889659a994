"""`moetron convert` both ways through the command line: a Hugging Face Mixtral folder becomes a
checkpoint that `moetron generate` continues exactly as transformers does, and a training
checkpoint becomes a folder `MixtralForCausalLM.from_pretrained` loads with the same logits."""

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetron.launcher.checkpoint.store import load_checkpoint, save_checkpoint
from moetron.launcher.checkpoint.weights import load_model, save_weights
from moetron.launcher.cli.main import main
from moetron.launcher.config import Config, TrainConfig
from moetron.launcher.train.optim import build_optimizer
from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.hf import save_hf
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


# One process converts a tiny folder both ways first (imports and one-time set-up done), then a big
# one: what each big conversion adds is its peak resident set (the kernel's VmHWM, reset through
# /proc/self/clear_refs just before it; ru_maxrss cannot be reset) above the resident set it started
# from. The files are read with plain reads into fresh tensors, not memory-mapped, so file pages
# touched on the way do not count.
MEASURE = """
import json, sys
from moetron.launcher.cli.main import main

def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

for argv in json.loads(sys.argv[1]):
    open("/proc/self/clear_refs", "w").write("5")
    resting = kib("VmRSS")
    assert main(["convert", *argv]) == 0
    print(kib("VmHWM") - resting)
"""


def peak_growths(*runs: list[str]) -> list[int]:
    """Bytes by which each `moetron convert *run`, in turn in one fresh process, raised the
    resident set above where it started."""
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(runs)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return [int(line) * 1024 for line in out.stdout.splitlines() if line.isdigit()]


def test_conversion_streams_in_bounded_memory(tmp_path):
    """A 240 MB Mixtral in 8 shards of 30 MB, both ways: the resident set grows by less than two
    shards (after a warm-up on a tiny model), where holding the model would take eight."""
    torch.manual_seed(0)
    save_hf(build_model(MIXTRAL.replace(n_layers=1, vocab_size=VOCAB)), tmp_path / "small")
    big = MIXTRAL.replace(vocab_size=4096, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=512, max_seq_len=256)
    files = save_hf(build_model(big), tmp_path / "big", max_shard_bytes=30 * 10**6)
    largest = max(f.stat().st_size for f in files)
    assert sum(f.stat().st_size for f in files) > 7 * largest
    *_, from_hf, to_hf = peak_growths(
        ["--from-hf", str(tmp_path / "small"), "--out", str(tmp_path / "c_small")],
        ["--to-hf", str(tmp_path / "c_small"), "--out", str(tmp_path / "h_small")],
        ["--from-hf", str(tmp_path / "big"), "--out", str(tmp_path / "c_big")],
        ["--to-hf", str(tmp_path / "c_big"), "--out", str(tmp_path / "h_big"), "--max-shard-size", "30MB"])
    assert from_hf < 2 * largest, f"from Hugging Face: {from_hf / 1e6:.0f} MB more for the big model"
    assert to_hf < 2 * largest, f"to Hugging Face: {to_hf / 1e6:.0f} MB more for the big model"
    # And back byte for byte: the same tensors, in the same order and shards.
    assert sorted(p.name for p in (tmp_path / "h_big").iterdir()) == sorted(p.name for p in (tmp_path / "big").iterdir())
    for f in files:
        assert filecmp.cmp(f, tmp_path / "h_big" / f.name, shallow=False), f.name


def test_a_stack_of_experts_larger_than_a_shard_is_exported_an_expert_at_a_time(tmp_path):
    """128 experts of 128 × 512 (a 34 MB stack in fp32) out to shards of 8 MB: the resident set
    grows by less than 2.5 of the largest shard written, where holding one stack would take four."""
    torch.manual_seed(0)
    save_hf(build_model(MIXTRAL.replace(n_layers=1)), tmp_path / "small")
    many = MIXTRAL.replace(d_model=128, d_ff=512, n_layers=1, moe=MoEConfig(num_experts=128, top_k=2))
    save_weights(build_model(many), tmp_path / "ckpt", source="test")
    *_, to_hf = peak_growths(
        ["--from-hf", str(tmp_path / "small"), "--out", str(tmp_path / "c_small")],
        ["--to-hf", str(tmp_path / "c_small"), "--out", str(tmp_path / "h_small")],
        ["--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--max-shard-size", "8MB"])
    largest = max(f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors"))
    stack = 128 * 128 * 512 * 4
    assert stack > 4 * largest
    assert to_hf < 2.5 * largest, f"{to_hf / 1e6:.0f} MB more for a model whose largest shard is {largest / 1e6:.0f} MB"


def test_an_unexpected_tensor_is_refused_before_anything_is_written(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    save_hf(build_model(MIXTRAL.replace(n_layers=1)), tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({**tensors, "model.layers.0.mlp.router_bias": torch.zeros(8)}, str(weights), metadata={"format": "pt"})
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tensor model.layers.0.mlp.router_bias is not one the mixtral conversion expects" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # The same when the folder exists (empty) already: left as it was.
    (tmp_path / "ckpt").mkdir()
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 2
    assert not any((tmp_path / "ckpt").iterdir())
    capsys.readouterr()
    # The other way: a checkpoint tensor the family's folder has no place for would be lost.
    model = build_model(MIXTRAL.replace(n_layers=1))
    model.register_parameter("extra_gain", torch.nn.Parameter(torch.ones(4)))
    save_weights(model, tmp_path / "odd", source="test")
    assert main(["convert", "--to-hf", str(tmp_path / "odd"), "--out", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tensor extra_gain has no place in a mixtral folder" in err, err
    assert not (tmp_path / "hf2").exists() and not (tmp_path / ".tmp-hf2").exists()

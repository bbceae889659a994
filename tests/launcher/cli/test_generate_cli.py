"""`moetron generate` on a real (tiny, two-step) training run: JSON output, the same tokens as the
library call, run folder or checkpoint folder, and one-line refusals with exit status 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetron.launcher.checkpoint.weights import load_model, resolve_checkpoint
from moetron.launcher.cli.main import main
from moetron.launcher.data.tokenizer import ByteTokenizer
from moetron.model.generate import Sampling, generate

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=32", "model.max_seq_len=64", "model.moe.capacity_factor=1.0", "train.seq_len=32",
         "train.batch_size=2", "train.steps=2", "train.warmup_steps=1", "train.eval_batches=1", "train.threads=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    assert main(["train", str(TINY), *SMALL, f"train.run_dir={runs}", "train.name=tiny"]) == 0
    return runs / "tiny"


def test_json_holds_the_new_tokens_and_their_text(run, cli_json):
    got = cli_json("generate", run, "--prompt", "def ", "--max-new-tokens", 12, "--greedy")
    assert list(got) == ["ids", "text"]
    _, model = load_model(resolve_checkpoint(run))
    tok = ByteTokenizer()
    want = generate(model, torch.tensor([tok.encode("def ")]), 12, Sampling(greedy=True), eos_id=tok.eos_id,
                    vocab_size=tok.vocab_size)[0].tolist()
    assert got == {"ids": want, "text": tok.decode(want)}
    assert 1 <= len(want) <= 12 and max(want) < tok.vocab_size


def test_run_folder_and_checkpoint_folder_agree_and_the_seed_fixes_samples(run, cli_json):
    ckpt = next((run / "checkpoints").glob("step-*"))
    sample = ["--prompt-ids", "100,101,102", "--max-new-tokens", 10, "--top-k", 20, "--top-p", 0.95,
              "--temperature", 1.3, "--ignore-eos"]
    a = cli_json("generate", run, *sample, "--seed", 1)
    b = cli_json("generate", ckpt, *sample, "--seed", 1)
    c = cli_json("generate", run, *sample, "--seed", 2)
    assert a == b and len(a["ids"]) == 10 and a != c


def test_plain_output_prints_prompt_and_continuation(run, capsys):
    assert main(["generate", str(run), "--prompt", "import", "--max-new-tokens", "5", "--greedy"]) == 0
    assert capsys.readouterr().out.startswith("import")


def test_the_installed_command_prints_only_json(run):
    out = subprocess.run([sys.executable, "-m", "moetron", "generate", str(run), "--prompt-ids", "1,2,3",
                          "--max-new-tokens", "4", "--greedy", "--json"], capture_output=True, text=True, check=True)
    assert set(json.loads(out.stdout)) == {"ids", "text"}


@pytest.mark.parametrize("args,needle", [
    (["{missing}", "--prompt", "x"], "no such run or checkpoint folder"),
    (["{empty}", "--prompt", "x"], "neither a complete checkpoint nor a run folder"),
    (["{run}", "--prompt", "x", "--prompt-ids", "1"], "exactly one of --prompt"),
    (["{run}"], "exactly one of --prompt"),
    (["{run}", "--prompt-ids", "1,x"], "comma-separated integers"),
    (["{run}", "--prompt-ids", "1,999"], "999 is outside the vocabulary"),
    (["{run}", "--prompt", ""], "the prompt is empty"),
    (["{run}", "--prompt", "x", "--max-new-tokens", "100"],
     "prompt (1 token) + --max-new-tokens (100) = 101: exceeds the model's max_seq_len (64)"),
    (["{run}", "--prompt", "xy", "--max-new-tokens", "100"], "prompt (2 tokens) + --max-new-tokens (100) = 102"),
    (["{run}", "--prompt", "x", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
])
def test_bad_input_is_one_line_and_status_2(run, tmp_path, capsys, args, needle):
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "run": run}
    assert main(["generate", *(a.format(**paths) for a in args)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moetron generate: ") and needle in err


def _damaged_copy(run: Path, where: Path, damage: str) -> tuple[Path, Path]:
    """A copy of the run with its checkpoint damaged: state.json cut short (the manifest sees its
    size), or a shard cut short with the manifest removed (its .metadata records what was written);
    returns (the copy, the damaged file)."""
    import shutil

    copy = Path(shutil.copytree(run, where / "damaged"))
    ckpt = next((copy / "checkpoints").glob("step-*"))
    if damage == "state":
        bad = ckpt / "state.json"
    else:
        bad = next(ckpt.glob("*.distcp"))
        (ckpt / "manifest.json").unlink()
    bad.write_bytes(bad.read_bytes()[:100])
    return copy, bad


@pytest.mark.parametrize("damage", ["state", "shard_without_manifest"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(run, tmp_path, capsys, damage):
    """The check train and export make first: eval and generate name the checkpoint and the file
    instead of a JSONDecodeError or DCP's "CheckpointException ranks:dict_keys([0])"."""
    copy, bad = _damaged_copy(run, tmp_path, damage)
    ckpt = bad.parent
    for command in (["generate", str(copy), "--prompt-ids", "1,2", "--max-new-tokens", "2"],
                    ["eval", str(copy), "--seq-len", "32", "--tokens", "64"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"moetron {command[0]}: checkpoint {ckpt} is damaged: {bad}: ")
        assert ("truncated or overwritten: 100 bytes, the manifest says" if damage == "state"
                else "truncated: 100 bytes, its .metadata records") in err
        assert err.endswith("no earlier complete checkpoint exists (nothing was deleted)\n")

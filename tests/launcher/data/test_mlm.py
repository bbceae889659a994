"""BERT's masked-language-model corruption: the shares it promises, the targets it leaves, and the
same draws for a row whichever rank corrupts it."""

import math

import pytest
import torch

from moetron.launcher.data.mlm import IGNORE, MaskedLM


def _windows(B: int, S: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S + 1), generator=torch.Generator().manual_seed(seed))


def test_shares_are_bert_s_15_percent_and_80_10_10():
    mlm = MaskedLM(vocab=1000, seed=3)
    windows = _windows(256, 256, 1000)
    pairs = mlm.pairs(windows, draw=5)
    ids, inputs, targets = windows[:, :-1], pairs[:, 0], pairs[:, 1]
    chosen = targets != IGNORE
    n = chosen.sum().item()
    # Binomial(65,536, 0.15) has a standard deviation of ~91 positions: 6 sigma is ~0.8%.
    assert abs(n / chosen.numel() - 0.15) < 0.01
    assert torch.equal(targets[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])
    masked = (inputs == mlm.mask_id) & chosen
    kept = (inputs == ids) & chosen
    # Kept: the 10% that stay, plus the random replacements that drew the same id (1 in 1000).
    for got, want in ((masked.sum().item() / n, 0.8), (kept.sum().item() / n, 0.1 + 0.1 / 1000)):
        assert abs(got - want) < 6 * math.sqrt(want * (1 - want) / n)
    assert not (inputs[~masked] == mlm.mask_id).any()  # the mask id is past the tokenizer's ids
    assert chosen.any(dim=1).all()


def test_a_row_is_corrupted_alike_by_any_rank_and_again_on_resume():
    mlm = MaskedLM(vocab=50, seed=1)
    windows = _windows(8, 16, 50)
    whole = mlm.pairs(windows, draw=7)
    for rows in (slice(0, 4), slice(4, 8), slice(2, 3)):
        assert torch.equal(mlm.pairs(windows[rows], 7, rows, batch=8), whole[rows])
    assert torch.equal(mlm.pairs(windows, draw=7), whole)
    assert not torch.equal(mlm.pairs(windows, draw=8), whole)


def test_an_encoder_learns_the_masked_tokens(tmp_path, capsys):
    """train.objective mlm end to end on the embedded corpus: the scored positions' loss falls from
    about log V at initialization; `moetron eval` (next-token loss) refuses the encoder in one line."""
    import json
    from pathlib import Path

    from moetron.launcher.cli.main import main
    from moetron.launcher.config import load_config
    from moetron.launcher.train.trainer import train

    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
    cfg = load_config(tiny, ["model.causal=false", "train.objective=mlm", "model.position=learned",
                             "model.moe.num_experts=0", "model.d_model=64", "model.n_layers=2", "model.n_heads=2",
                             "model.n_kv_heads=2", "model.d_ff=128", "train.seq_len=64", "train.batch_size=8",
                             "train.steps=40", "train.log_every=1", "train.eval_every=40", "train.eval_batches=1",
                             "train.warmup_steps=5", "train.threads=1", "train.checkpoint.every=0",
                             "train.precision=fp32", f"train.run_dir={tmp_path}"])
    run = train(cfg, console=lambda *_: None)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert abs(records[0]["loss"] - math.log(320)) < 0.5
    assert records[-1]["val_loss"] < records[0]["loss"] - 1.0
    capsys.readouterr()
    assert main(["eval", str(run), "--seq-len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "encoder (model.causal false)" in err and len(err.splitlines()) == 1


def test_accumulation_leaves_the_loss_of_one_batch(tmp_path):
    """Micro-batches of one step score different numbers of positions; the step's loss (and so its
    update) is the mean over all of them, as one batch takes it, not the mean of the micro-batches'
    means: a dense encoder trained with grad_accum 2 logs the losses of grad_accum 1 (parallel
    layouts: tests/parallel, the *_mlm cases)."""
    import json
    from pathlib import Path

    from moetron.launcher.config import load_config
    from moetron.launcher.train.trainer import train

    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
    losses = {}
    for accum in (1, 2):
        cfg = load_config(tiny, ["model.causal=false", "train.objective=mlm", "model.moe.num_experts=0",
                                 "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2",
                                 "model.d_ff=64", "train.seq_len=32", "train.batch_size=4", f"train.grad_accum={accum}",
                                 "train.steps=3", "train.log_every=1", "train.eval_every=3", "train.eval_batches=1",
                                 "train.threads=1", "train.checkpoint.every=0", "train.precision=fp32",
                                 f"train.run_dir={tmp_path / str(accum)}"])
        run = train(cfg, console=lambda *_: None)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[accum] = [r["loss"] for r in records] + [r["val_loss"] for r in records if "val_loss" in r]
    assert len(losses[1]) == 4
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)

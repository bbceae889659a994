"""The reference page's encoder exercises, measured: a tiny BERT learning masked-language modelling,
and RoPE against learned absolute positions over several seeds, for that encoder and for the
causal decoder.

The page (../shared/reference/transformer-architecture.txt, "Build it yourself") asks for a
4-layer BERT (d 128, 2 heads) trained with MLM on about 10⁴ Wikipedia sentences until its loss
falls below log V, then retrained with RoPE ("RoPE typically wins by a small but consistent
margin"). There is no download here, so the sentences come from the Python standard library's
own English: the documentation topics of `pydoc_data` and the docstrings of the stdlib's modules,
split into sentences (20–300 characters, deduplicated), the first 10⁴ by a hash of their text.
Each sentence is one document closed by the end-of-text byte; windows of 64 bytes pack them.

Models: post-norm LayerNorm, GELU FFN with biases, dense (BERT's block); `train.objective mlm`
with `model.causal false` for the encoder, next-token loss with a causal mask for the decoder,
the same sizes, data, steps and seeds. Reported: the validation loss (nats per scored byte) of
each run at its last step, and per seed the RoPE − learned differential, with mean and spread.

    python bench/encoder_positions.py --quick   # ~1 min on 2 cores: 2 × 64 models, 40 steps, 2 seeds
    python bench/encoder_positions.py           # ~4 min on 2 cores: the page's 4 × 128, 2 heads, 3 seeds, 300 steps
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import math
import re
import statistics
import sys
import tempfile
import zlib
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
SEQ_LEN = 64
BYTE_VOCAB = 257  # 256 bytes and the end-of-text id: the MLM mask token is id 257
SIZES = {
    "quick": ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=256"],
    "full": ["model.d_model=128", "model.n_layers=4", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=512"],
}
BERT_BLOCK = ["model.moe.num_experts=0", "model.norm=layernorm", "model.norm_position=post", "model.activation=gelu",
              "model.bias=true", f"model.max_seq_len={SEQ_LEN}"]


def sentences(n: int) -> list[str]:
    """`n` English sentences of the standard library's documentation topics and docstrings."""
    import pydoc_data.topics
    import sysconfig

    texts = list(pydoc_data.topics.topics.values())
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        with contextlib.suppress(SyntaxError, UnicodeDecodeError, ValueError):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            texts += [ast.get_docstring(node) or "" for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    found = set()
    for text in texts:
        for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", text)):
            if 20 <= len(s) <= 300 and s[0].isupper() and s.isascii():
                found.add(s.strip())
    return sorted(found, key=lambda s: zlib.crc32(s.encode()))[:n]


def write_corpus(root: Path, n: int) -> tuple[str, int]:
    """The sentences as a Megatron indexed corpus (byte tokens) → (its prefix, sentences written)."""
    from moetron.launcher.data.prepare import write_corpus as write
    from moetron.launcher.data.tokenizer import ByteTokenizer

    docs = sentences(n)
    write(root / "sentences", ((f"s{i}", s) for i, s in enumerate(docs)), ByteTokenizer(), val_fraction=0.05)
    return str(root / "sentences"), len(docs)


def train_run(objective: str, position: str, seed: int, corpus: str, args, root: Path) -> list[dict]:
    """One training run → its metrics.jsonl records."""
    from moetron.launcher.config import load_config
    from moetron.launcher.train.trainer import train

    cfg = load_config(TINY, [*SIZES[args.size], *BERT_BLOCK, f"model.position={position}",
                             f"model.causal={'false' if objective == 'mlm' else 'true'}", f"train.objective={objective}",
                             f"data.source={corpus}", f"train.seq_len={SEQ_LEN}", f"train.steps={args.steps}",
                             f"train.batch_size={args.batch}", f"train.seed={seed}", "train.log_every=5",
                             f"train.eval_every={args.steps}", f"train.eval_batches={args.eval_batches}",
                             "train.checkpoint.every=0", f"train.run_dir={root}",
                             f"train.name={objective}-{position}-{seed}", f"train.threads={args.threads}",
                             f"train.warmup_steps={max(args.steps // 10, 1)}", "train.lr=1e-3", "train.min_lr=1e-4",
                             "train.precision=fp32"])
    with contextlib.redirect_stderr(io.StringIO()):  # the trainer's per-step log lines
        run = train(cfg, console=lambda *_: None)
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def measure(args) -> dict:
    """Every run: {objective: {position: [final val loss per seed]}}, curves of the first seed."""
    finals: dict = {}
    curves: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpus, n = write_corpus(Path(tmp), args.sentences)
        for objective in ("mlm", "clm"):
            for position in ("learned", "rope"):
                for seed in range(args.seeds):
                    recs = train_run(objective, position, seed, corpus, args, Path(tmp))
                    finals.setdefault(objective, {}).setdefault(position, []).append(recs[-1]["val_loss"])
                    if seed == 0:
                        curves[f"{objective}-{position}"] = [(r["step"], r["loss"]) for r in recs]
                    print(f"{objective} {position} seed {seed}: val {recs[-1]['val_loss']:.4f}", file=sys.stderr)
    return {"sentences": n, "log_v": math.log(BYTE_VOCAB), "finals": finals, "curves": curves}


def differentials(finals: dict) -> dict[str, tuple[float, float]]:
    """Per objective: mean and sample spread (stdev) over seeds of val(rope) − val(learned)."""
    out = {}
    for objective, by_pos in finals.items():
        diffs = [r - le for r, le in zip(by_pos["rope"], by_pos["learned"])]
        out[objective] = (statistics.fmean(diffs), statistics.stdev(diffs) if len(diffs) > 1 else 0.0)
    return out


def table(result: dict) -> str:
    lines = ["| objective | position | val loss per seed | mean | RoPE − learned (mean ± stdev) |",
             "| --- | --- | --- | --- | --- |"]
    diffs = differentials(result["finals"])
    for objective, by_pos in result["finals"].items():
        for position, losses in by_pos.items():
            diff = f"{diffs[objective][0]:+.4f} ± {diffs[objective][1]:.4f}" if position == "rope" else ""
            lines.append(f"| {objective} | {position} | {', '.join(f'{v:.4f}' for v in losses)} | "
                         f"{statistics.fmean(losses):.4f} | {diff} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    for name, curve in result["curves"].items():
        ax.plot(*zip(*curve), label=name)
    ax.axhline(result["log_v"], color="grey", linestyle=":", label=f"log V = ln {BYTE_VOCAB}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per scored byte)")
    ax.set_title("tiny BERT (MLM) and its causal twin, learned vs RoPE positions (seed 0)", fontsize=9)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small models, few steps, 2 seeds")
    p.add_argument("--steps", type=int, default=None, help="steps per run (quick 40, full 300)")
    p.add_argument("--batch", type=int, default=16, help="windows of 64 bytes per step")
    p.add_argument("--seeds", type=int, default=None, help="seeds per (objective, position) (quick 2, full 3)")
    p.add_argument("--sentences", type=int, default=10_000)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="PNG path (default bench/out/encoder_positions[_quick].png)")
    args = p.parse_args(argv)
    args.size = "quick" if args.quick else "full"
    args.steps = args.steps or (40 if args.quick else 300)
    args.seeds = args.seeds or (2 if args.quick else 3)
    args.out = args.out or Path(__file__).parent / "out" / f"encoder_positions{'_quick' if args.quick else ''}.png"
    return args


def main(argv: list[str] | None = None) -> dict:
    import torch

    args = parse(argv)
    torch.set_num_threads(args.threads)
    result = measure(args)
    print(f"{result['sentences']:,} sentences; log V = {result['log_v']:.3f}")
    print(table(result))
    plot(result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "curves"} | {"differentials": differentials(result["finals"])}))
    return result


if __name__ == "__main__":
    main()

"""Position encodings compared on length extrapolation, parameters and inference cost.

Trains the tiny MoE (configs/tiny.yaml, shrunk) once per encoding — sinusoidal, learned, RoPE,
ALiBi, T5's relative bias — at S = 256 on the stdlib corpus, equal steps, batch and seed, then
scores each on the same validation tokens at 256, 512, …, 4096 (launcher/train/length_eval.py; learned
positions refuse lengths past their 256-row table). The RoPE model is also scored with NTK-aware
and YaRN scaling set at evaluation time only, each length with factor = length / 256 (the usual
choice: scale to the target context). Reports, beside the reference page's own columns
(../shared/reference/transformer-architecture.txt, "Encoding … Length extrapolation"):

  params added    what the encoding learns (n_max·D for learned, buckets·H for T5, 0 otherwise)
  loss @ S        validation loss (nats/byte) at evaluation length S
  train tok/s     training throughput at S = 256, this machine
  decode tok/s    one token a step from the KV cache at a context of --decode-context positions

Prints the markdown table and one JSON line; writes one PNG (loss vs evaluation length).

    python bench/positions.py --quick     # ~2.5 min on 2 cores (one thread): 2 × 64 model, 150 steps × 8
    python bench/positions.py             # ~20 min on 2 cores (estimated): 4 × 128 model, 200 steps × 16
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
TRAIN_LEN = 256
ENCODINGS = ["sinusoidal", "learned", "rope", "alibi", "t5"]
# Rows of the table: (name, trained encoding, RoPE scaling applied at evaluation).
ROWS = [("sinusoidal", "sinusoidal", None), ("learned", "learned", None), ("rope", "rope", None),
        ("rope + ntk", "rope", "ntk"), ("rope + yarn", "rope", "yarn"), ("alibi", "alibi", None), ("t5", "t5", None)]
# The reference page's columns for each trained encoding: parameters, length extrapolation.
REFERENCE = {
    "sinusoidal": ("0", "Modest (degrades past 2x training length)"),
    "learned": ("n_max * d", "None (hard limit at n_max)"),
    "rope": ("0", "Good with NTK/YaRN scaling tricks"),
    "alibi": ("0 (per-head fixed slope)", "Excellent out of the box"),
    "t5": ("O(num_buckets * h)", "Good"),
}
SIZES = {
    "quick": ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
              "model.moe.num_experts=4", "model.moe.d_expert=64"],
    "full": ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=256",
             "model.moe.num_experts=8", "model.moe.d_expert=128"],
}


def train_encoding(position: str, args, root: Path) -> tuple[Path, float]:
    """Train one model; → (its run folder, training tokens/s after the first logged window)."""
    from moetron.launcher.config import load_config
    from moetron.launcher.train.trainer import train

    cfg = load_config(TINY, [*SIZES[args.size], f"model.position={position}", f"model.max_seq_len={TRAIN_LEN}",
                             f"train.seq_len={TRAIN_LEN}", f"train.steps={args.steps}",
                             f"train.batch_size={args.batch}", f"train.seed={args.seed}", "train.log_every=5",
                             f"train.eval_every={args.steps}", "train.eval_batches=2", "train.checkpoint.every=0",
                             f"train.run_dir={root}", f"train.name={position}", f"train.threads={args.threads}",
                             f"train.warmup_steps={max(args.steps // 10, 1)}", "train.precision=fp32"])
    with contextlib.redirect_stderr(io.StringIO()):  # the trainer's per-step log lines
        run = train(cfg, console=lambda *_: None)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in recs if "tokens_per_s" in r]
    return run, statistics.fmean(speeds[1:] or speeds)


def losses_by_length(run: Path, scaling: str | None, lengths: list[int], data, args) -> dict[int, float]:
    """Validation loss at each length the encoding can run; with `scaling`, RoPE rescaled at load
    time with factor length / TRAIN_LEN, one load per length, every length on the same tokens."""
    from moetron.launcher.checkpoint.weights import load_model, resolve_checkpoint
    from moetron.launcher.train.length_eval import evaluate_lengths, length_problems

    ckpt = resolve_checkpoint(run)
    kw = dict(tokens=args.tokens, batch_tokens=args.batch_tokens, vocab_size=data.vocab_size, longest=max(lengths))
    if scaling is None:
        _, model = load_model(ckpt)
        runnable = [s for s in lengths if not length_problems(model.cfg, [s])]
        return {r.seq_len: r.loss for r in evaluate_lengths(model, data.val, runnable, **kw)}
    out = {}
    for s in lengths:
        _, model = load_model(ckpt, overrides=[f"model.rope_scaling={scaling}",
                                               f"model.rope_scaling_factor={max(s / TRAIN_LEN, 1.0)}"])
        out[s] = evaluate_lengths(model, data.val, [s], **kw)[0].loss
    return out


def decode_tokens_per_s(run: Path, context: int, steps: int) -> float | None:
    """Tokens per second of KV-cache decoding (batch 1) after a prefill of `context` − `steps`
    positions, so the last steps attend to `context` keys; the best of three passes over the same
    steps (the cache rewound), as one pass is noisy. None where the encoding cannot run there."""
    import torch

    from moetron.launcher.checkpoint.weights import load_model, resolve_checkpoint
    from moetron.launcher.train.length_eval import length_problems

    _, model = load_model(resolve_checkpoint(run))
    if length_problems(model.cfg, [context]):
        return None
    ids_1C = torch.randint(0, 256, (1, context), generator=torch.Generator().manual_seed(0))
    prefill = context - steps
    with torch.no_grad():
        caches = model.new_caches(1, context)
        model(ids_1C[:, :prefill], caches=caches, start_pos=0)
        best = float("inf")
        for _ in range(3):
            for cache in caches:
                cache.length = prefill
            t0 = time.perf_counter()
            for i in range(prefill, context):
                model(ids_1C[:, i : i + 1], caches=caches, start_pos=i)
            best = min(best, time.perf_counter() - t0)
        return steps / best


def plot(rows: list[dict], lengths: list[int], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    for r in rows:
        xs = [s for s in lengths if s in r["loss"]]
        ax.plot(xs, [r["loss"][s] for s in xs], marker="o", label=r["encoding"],
                linestyle="--" if r["scaling"] else "-")
    ax.axvline(TRAIN_LEN, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(s) for s in lengths])
    ax.set_xlabel("evaluation length (trained at 256)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path)


def table(rows: list[dict], lengths: list[int], decode_context: int) -> str:
    head = (["encoding", "params added", "reference: parameters", "reference: length extrapolation"]
            + [f"loss @ {s}" for s in lengths] + ["train tok/s", f"decode tok/s @ {decode_context}"])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        ref_params, ref_extrapolation = REFERENCE[r["trained"]]
        losses = [f"{r['loss'][s]:.3f}" if s in r["loss"] else "refused" for s in lengths]
        decode = f"{r['decode_tok_s']:.0f}" if r["decode_tok_s"] is not None else f"— (n_max {TRAIN_LEN})"
        lines.append("| " + " | ".join([r["encoding"], f"{r['params_added']:,}", ref_params, ref_extrapolation,
                                         *losses, f"{r['train_tok_s']:,.0f}", decode]) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, few steps and tokens: a few minutes")
    p.add_argument("--steps", type=int, default=None, help="training steps per encoding (quick 150, full 200)")
    p.add_argument("--batch", type=int, default=None, help="sequences of 256 bytes per step (quick 8, full 16)")
    p.add_argument("--tokens", type=int, default=None, help="validation tokens per length (quick 8192, full 16384)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per evaluation forward pass")
    p.add_argument("--max-len", type=int, default=4096, help="longest evaluation length (a power of two)")
    p.add_argument("--decode-context", type=int, default=None, help="KV-cache length for decode speed (quick 1024, full 4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="intra-op CPU threads")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default bench/out/positions[_quick].png)")
    p.add_argument("--encodings", nargs="+", choices=ENCODINGS, default=ENCODINGS, help="train and evaluate only these")
    args = p.parse_args()
    args.size = "quick" if args.quick else "full"
    quick = args.quick
    args.steps = args.steps or (150 if quick else 200)
    args.batch = args.batch or (8 if quick else 16)
    args.tokens = args.tokens or (8192 if quick else 16384)
    args.decode_context = args.decode_context or (1024 if quick else 4096)
    args.out = args.out or Path(__file__).parent / "out" / ("positions_quick.png" if quick else "positions.png")

    import torch

    from moetron.launcher.checkpoint.weights import checkpoint_config, resolve_checkpoint
    from moetron.launcher.data.corpus import load_token_data
    from moetron.launcher.perf.flops import params_position

    torch.set_num_threads(args.threads)
    lengths = [TRAIN_LEN * 2**i for i in range((args.max_len // TRAIN_LEN).bit_length())]
    data = load_token_data("stdlib")
    t_start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        runs, speeds, params = {}, {}, {}
        for position in args.encodings:
            t0 = time.perf_counter()
            runs[position], speeds[position] = train_encoding(position, args, Path(root))
            params[position] = params_position(checkpoint_config(resolve_checkpoint(runs[position])).model)
            print(f"trained {position}: {speeds[position]:,.0f} tokens/s ({time.perf_counter() - t0:.0f} s)", flush=True)
        for name, trained, scaling in (row for row in ROWS if row[1] in args.encodings):
            t0 = time.perf_counter()
            loss = losses_by_length(runs[trained], scaling, lengths, data, args)
            decode = decode_tokens_per_s(runs[trained], args.decode_context, 32 if quick else 64) if not scaling else None
            if scaling:  # the same weights and kernels as plain RoPE: its decode speed
                decode = next(r["decode_tok_s"] for r in rows if r["encoding"] == trained)
            rows.append({"encoding": name, "trained": trained, "scaling": scaling, "params_added": params[trained],
                         "loss": loss, "train_tok_s": speeds[trained], "decode_tok_s": decode})
            print(f"evaluated {name}: " + ", ".join(f"{s}: {v:.3f}" for s, v in loss.items())
                  + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    title = (f"{args.size} model, {args.steps} steps × {args.batch} × {TRAIN_LEN} bytes, seed {args.seed}; "
             f"{args.tokens} validation bytes per length")
    print(f"\n{title}; {args.threads} threads, fp32, {time.perf_counter() - t_start:.0f} s in all\n")
    print(table(rows, lengths, args.decode_context))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, lengths, args.out, title)
    print(f"\nplot: {args.out}")
    print(json.dumps({"bench": "positions", "size": args.size, "steps": args.steps, "batch": args.batch,
                      "seed": args.seed, "tokens": args.tokens, "decode_context": args.decode_context,
                      "rows": [{**r, "loss": {str(k): v for k, v in r["loss"].items()}} for r in rows]}))


if __name__ == "__main__":
    main()

"""The MoE trade-off, trained: a dense FFN against 4 experts, at equal active FLOPs and at equal parameters.

The reference page's stretch exercise (../shared/reference/transformer-architecture.txt, "Build it
yourself": "replace the FFN with a 4-expert MoE, train, and observe the parameter / flop trade-off
in practice"). Five variants of one small decoder (configs/tiny.yaml, shrunk), differing only in
the FFN of every layer, with expert width F:

  dense F             the baseline
  MoE 4×F top-1       same active FLOPs as dense F (one expert of F a token), parameters of dense 4F
  MoE 4×F/2 top-2     same active FLOPs as dense F (two experts of F/2), parameters of dense 2F
  dense 2F, dense 4F  the dense models with the parameters of the two MoEs

("same" up to the router, D·E weights a layer.) Each is trained by moetron's own trainer
(launcher/train/trainer.py `train`, what `moetron train` runs) with the same steps, batch, seed
and data (the embedded stdlib corpus, bytes as tokens); parameters and FLOPs per token come from
`moetron flops --json` on the same config (launcher/perf/flops.py: 6 FLOPs per active weight per
token + full-square attention 12·L·H·Dh·S), the losses from the run folder's metrics.jsonl.

    python bench/moe_tradeoff.py --quick   # 2 × 64 model, 8 steps × 4 × 64 bytes each: ~10 s
    python bench/moe_tradeoff.py           # 4 × 128 model, 250 steps × 8 × 256 bytes each: ~8 min, one thread

Prints the table and one JSON line; writes DIR/moe_tradeoff[_quick].md and .png (validation loss
against cumulative training FLOPs).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
SIZES = {
    # (model overrides, expert width F, steps, batch, seq_len, eval_every, eval_batches)
    "quick": (["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"], 64, 8, 4, 64, 4, 1),
    "full": (["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2"], 256, 250, 8, 256,
             25, 4),
}


def variants(F: int) -> dict[str, list[str]]:
    """Model name → the FFN overrides that make it (every layer dense, or every layer 4 experts)."""
    dense = ["model.moe.num_experts=0"]
    moe = ["model.moe.num_experts=4", "model.moe.capacity_factor=null"]
    return {
        f"dense F={F}": [*dense, f"model.d_ff={F}"],
        f"MoE 4×{F} top-1": [*moe, "model.moe.top_k=1", f"model.moe.d_expert={F}",
                             "model.moe.weighting=softmax"],  # Switch: one renormalized score would always be 1
        f"MoE 4×{F // 2} top-2": [*moe, "model.moe.top_k=2", f"model.moe.d_expert={F // 2}",
                                  "model.moe.weighting=renormalize"],
        f"dense 2F={2 * F}": [*dense, f"model.d_ff={2 * F}"],
        f"dense 4F={4 * F}": [*dense, f"model.d_ff={4 * F}"],
    }


def overrides(size: str, ffn: list[str], root: Path, name: str, threads: int, seed: int,
              extra: list[str] = ()) -> list[str]:
    """The whole config of one variant as overrides of configs/tiny.yaml; `extra` (--set) last, so it wins."""
    model, _, steps, batch, seq_len, eval_every, eval_batches = SIZES[size]
    return [*model, *ffn, f"model.max_seq_len={seq_len}", f"train.seq_len={seq_len}", f"train.steps={steps}",
            f"train.batch_size={batch}", f"train.seed={seed}", f"train.log_every={eval_every}",
            f"train.eval_every={eval_every}", f"train.eval_batches={eval_batches}", "train.checkpoint.every=0",
            f"train.warmup_steps={max(steps // 10, 1)}", "train.precision=fp32", f"train.threads={threads}",
            f"train.run_dir={root}", f"train.name={name}", *extra]


def accounting(sets: list[str]) -> dict:
    """`moetron flops configs/tiny.yaml SETS --json`, run in this process."""
    from moetron.launcher.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["flops", str(TINY), *sets, "--json"])
    if status:
        raise RuntimeError(f"moetron flops exited {status}: {out.getvalue()[-500:]}")
    return json.loads(out.getvalue())


def train_one(sets: list[str]) -> tuple[Path, float]:
    """Train with moetron's trainer → (the run folder, wall seconds)."""
    from moetron.launcher.config import load_config
    from moetron.launcher.train.trainer import train

    cfg = load_config(TINY, sets)
    start = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):  # the trainer's per-step log lines
        run = train(cfg, console=lambda *_: None)
    return run, time.perf_counter() - start


def val_curve(run: Path, tokens_per_step: int) -> list[tuple[int, int, float]]:
    """(step, tokens trained, validation loss) of every evaluation in metrics.jsonl."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["step"] * tokens_per_step, r["val_loss"]) for r in records if "val_loss" in r]


def measure(size: str, root: Path, threads: int, seed: int, extra: list[str]) -> list[dict]:
    """Train every variant and read its accounting → one row each."""
    _, F, steps, batch, seq_len, *_ = SIZES[size]
    rows = []
    for i, (name, ffn) in enumerate(variants(F).items()):
        sets = overrides(size, ffn, root, f"v{i}", threads, seed, extra)
        acct = accounting(sets)
        run, seconds = train_one(sets)
        curve = val_curve(run, batch * seq_len)
        per_token = acct["flops_per_token"]
        rows.append({"model": name, "params_total": acct["params_total"], "params_active": acct["params_active"],
                     "flops_per_token": per_token, "train_flops": per_token * steps * batch * seq_len,
                     "final_val_loss": curve[-1][2], "wall_s": seconds,
                     "curve": [(step, tokens * per_token, loss) for step, tokens, loss in curve]})
        print(f"{name}: val loss {curve[-1][2]:.3f} ({seconds:.0f} s)", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = ["model", "params total", "params active", "FLOPs/token", "train FLOPs", "final val loss", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params_total']:,} | {r['params_active']:,} | {r['flops_per_token']:,} "
                     f"| {r['train_flops']:.3g} | {r['final_val_loss']:.3f} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    for r in rows:
        _, flops, losses = zip(*r["curve"])
        ax.plot(flops, losses, marker="o", markersize=3, label=r["model"],
                linestyle="-" if r["model"].startswith("MoE") else "--")
    ax.set_xscale("log")
    ax.set_xlabel("cumulative training FLOPs (moetron flops: 6·N_active + attention, per token)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(title.replace("; ", "\n", 1), fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 × 64 model, 8 steps each: seconds")
    # One: on a 2-core machine shared with other work, two threads ran 5-10× slower than one.
    p.add_argument("--threads", type=int, default=1, help="intra-op CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", nargs="+", default=[], metavar="key=value",
                   help="overrides for every variant, e.g. train.lr=1.0e-3 train.min_lr=1.0e-4")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out", help="folder for the .md and .png")
    args = p.parse_args()
    size = "quick" if args.quick else "full"
    model, F, steps, batch, seq_len, *_ = SIZES[size]

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        rows = measure(size, Path(root), args.threads, args.seed, args.set)
    title = (f"{' '.join(s.split('.')[-1] for s in model)}, F={F}; {steps} steps × {batch} × {seq_len} bytes, "
             f"seed {args.seed}, fp32, threads {args.threads}" + "".join(f", {o}" for o in args.set))
    text = f"{title}; {time.perf_counter() - start:.0f} s in all\n\n{table(rows)}\n"
    print(f"\n{text}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "moe_tradeoff_quick" if args.quick else "moe_tradeoff"
    (args.out / f"{stem}.md").write_text(text)
    plot(rows, args.out / f"{stem}.png", title)
    print(f"wrote {args.out / stem}.md, .png")
    print(json.dumps({"bench": "moe_tradeoff", "size": size, "F": F, "steps": steps, "batch": batch,
                      "seq_len": seq_len, "seed": args.seed, "set": args.set, "rows": rows}))


if __name__ == "__main__":
    main()

"""Load balancing on real text: aux loss vs aux-loss-free bias vs nothing (Wang et al. 2024).

Trains the tiny config (8 experts, top-2) on the stdlib corpus once per variant, equal steps,
batch and seed, and reports the final validation loss and MaxVio — max expert load / mean load
− 1, layer-averaged, per logged step — averaged over the second half of training:

  softmax+aux      softmax scores, Switch aux loss 0.01 (moetron's default)
  sigmoid+bias     sigmoid scores, expert bias moved by rate·sign(mean − load), no aux loss
                   (rate 0.001, DeepSeek-V3's; and 0.01, and 0.01 with a 1e-4 sequence loss)
  softmax-none     softmax scores, no balancing at all
  sigmoid-none     sigmoid scores, no balancing (what the bias alone changes)

Prints a markdown table and one JSON line, and writes a PNG of MaxVio over steps.

    python bench/routing_balance.py                       # 200 steps of 8 × 256 each; bench/out/routing_balance.png
    python bench/routing_balance.py --steps 500 --batch 16 --out /tmp/balance.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
VARIANTS = {
    "softmax+aux": ["model.moe.score=softmax", "model.moe.aux_loss_coef=0.01"],
    "sigmoid+bias": ["model.moe.score=sigmoid", "model.moe.aux_loss_coef=0", "model.moe.bias_update_rate=0.001"],
    # DeepSeek-V3's rate suits its 10^5 steps; a short run needs the bias to move faster.
    "sigmoid+bias-0.01": ["model.moe.score=sigmoid", "model.moe.aux_loss_coef=0", "model.moe.bias_update_rate=0.01"],
    "sigmoid+bias+seq": ["model.moe.score=sigmoid", "model.moe.bias_update_rate=0.01",
                         "model.moe.aux_loss_type=sequence", "model.moe.aux_loss_coef=0.0001"],
    "softmax-none": ["model.moe.score=softmax", "model.moe.aux_loss_coef=0"],
    "sigmoid-none": ["model.moe.score=sigmoid", "model.moe.aux_loss_coef=0"],
}


def run_variant(name: str, overrides: list[str], args, root: Path) -> dict:
    from moetron.launcher.config import load_config
    from moetron.launcher.train.trainer import train

    cfg = load_config(TINY, [*overrides, f"train.steps={args.steps}", f"train.batch_size={args.batch}",
                             f"train.seed={args.seed}", "train.log_every=5", f"train.eval_every={args.steps}",
                             "train.checkpoint.every=0", f"train.run_dir={root}", f"train.name={name}",
                             f"train.warmup_steps={max(args.steps // 10, 1)}", "train.precision=fp32"])
    t0 = time.perf_counter()
    run = train(cfg, console=lambda *_: None)
    seconds = time.perf_counter() - t0
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["moe_max_vio"]) for r in recs if r.get("moe_max_vio") is not None]
    second_half = [v for s, v in curve if s > args.steps // 2]
    return {"variant": name, "val_loss": recs[-1]["val_loss"], "max_vio_2nd_half": statistics.fmean(second_half),
            "final_loss": recs[-1]["loss"], "seconds": round(seconds, 1), "curve": curve}


def plot(results: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    for r in results:
        steps, vio = zip(*r["curve"])
        ax.plot(steps, vio, label=f"{r['variant']} (val {r['val_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("MaxVio = max load / mean load − 1")
    ax.set_yscale("log")
    ax.set_title("expert load imbalance, tiny MoE (8 experts, top-2) on the stdlib corpus", fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="sequences of 256 bytes per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="+", default=["softmax+aux", "sigmoid+bias", "softmax-none", "sigmoid-none"],
                   choices=list(VARIANTS))
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "routing_balance.png")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.variants:
            results.append(run_variant(name, VARIANTS[name], args, Path(root)))
            r = results[-1]
            print(f"{name}: val {r['val_loss']:.4f}, MaxVio {r['max_vio_2nd_half']:.3f} ({r['seconds']} s)", flush=True)
    print(f"\n{args.steps} steps × {args.batch} × 256 bytes, seed {args.seed}, fp32\n")
    print("| variant | validation loss (nats/byte) | mean MaxVio, 2nd half | seconds |")
    print("| --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['variant']} | {r['val_loss']:.4f} | {r['max_vio_2nd_half']:.3f} | {r['seconds']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(results, args.out)
    print(f"\nplot: {args.out}")
    print(json.dumps({"bench": "routing_balance", "steps": args.steps, "batch": args.batch, "seed": args.seed,
                      "results": [{k: v for k, v in r.items() if k != "curve"} for r in results]}))


if __name__ == "__main__":
    main()

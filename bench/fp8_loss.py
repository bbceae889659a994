"""FP8 against bf16 on the same data: train one config twice from the same seed, once per
precision, and compare the training losses they log (bench/gpu_check.sh's fp8_loss section; the
goal: after 100 steps FP8's loss within 1% of bf16's).

    python bench/fp8_loss.py configs/mixtral-h200.yaml model.n_layers=4 --steps 100
    python bench/fp8_loss.py configs/tiny.yaml --steps 4 --precisions fp32 bf16   # the plumbing, on CPU

Each run is a real `moetron train` (embedded corpus unless the config names one), in a fresh
folder under --out, saving no checkpoint but the last; one JSON line on stdout (and in --json).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from moetron.launcher.config import ConfigError, load_config
from moetron.launcher.train.trainer import train

GOAL = 0.01  # relative difference of the last logged loss


def logged_losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def compare(losses: dict[str, dict[int, float]], base: str, other: str) -> dict:
    """The last step both logged, each one's loss there and the relative difference; the largest
    difference over every step both logged."""
    steps = sorted(set(losses[base]) & set(losses[other]))
    rel = {s: abs(losses[other][s] - losses[base][s]) / abs(losses[base][s]) for s in steps}
    last = steps[-1]
    return {"step": last, f"loss_{base}": losses[base][last], f"loss_{other}": losses[other][last],
            "rel_diff_last": rel[last], "rel_diff_max": max(rel.values()), "goal": GOAL, "met": rel[last] <= GOAL}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--precisions", nargs=2, default=["bf16", "fp8"], metavar=("BASE", "OTHER"))
    parser.add_argument("--out", type=Path, help="run folders go here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the JSON result here")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="fp8_loss-"))
    losses = {}
    for precision in args.precisions:
        try:
            cfg = load_config(args.config, [*args.overrides, f"train.precision={precision}", f"train.steps={args.steps}",
                                            f"train.run_dir={out}", f"train.name={precision}",
                                            f"train.eval_every={args.steps}"])
            losses[precision] = logged_losses(train(cfg, resume="none", console=lambda *_: None))
        except ConfigError as e:  # a precision this machine cannot run (fp8 on a CPU): one line
            raise SystemExit(f"fp8_loss.py: {e}") from None
    result = {"bench": "fp8_loss", "config": args.config, "overrides": args.overrides, "steps": args.steps,
              **compare(losses, *args.precisions)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

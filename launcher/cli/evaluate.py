"""`moetron eval RUN_OR_CHECKPOINT --seq-len 256,512,1024 [model.key=value ...]`: validation loss
at each length and per position bucket (launcher/train/length_eval.py)."""

from __future__ import annotations

from moetron.launcher.cli.args import add_checkpoint_arguments, add_device_argument, device_of
from moetron.launcher.cli.help import HelpFormatter
from moetron.launcher.cli.progress_bar import progress_bar


def register(sub) -> None:
    p = sub.add_parser(
        "eval", help="validation loss of a trained model at several sequence lengths",
        description="Score a checkpoint's model on its run's validation split at each --seq-len, on the "
                    "same tokens at every length, overall and per position bucket ([0, 64), [64, 128), "
                    "…): how far past the training length its position encoding carries it. "
                    "RUN_OR_CHECKPOINT is a run folder (newest complete checkpoint) or a checkpoint "
                    "folder. model.key=value overrides change settings that hold no weights, e.g. "
                    "`model.rope_scaling=yarn model.rope_scaling_factor=4` (linear, ntk, yarn) on a "
                    "model trained without scaling; YaRN's original context is the checkpoint's "
                    "max_seq_len unless model.rope_original_max_seq_len says otherwise. Learned "
                    "positions cannot run past max_seq_len: such a length is refused before anything runs.",
        formatter_class=HelpFormatter)
    add_checkpoint_arguments(p)
    p.add_argument("--seq-len", required=True, metavar="S,S,…", help="lengths to evaluate at, e.g. 256,512,1024")
    p.add_argument("--tokens", type=int, default=32768, metavar="N",
                   help="target tokens scored at each length (rounded up to whole longest windows)")
    p.add_argument("--batch-tokens", type=int, default=8192, metavar="N",
                   help="tokens per forward pass (at least one window); bounds memory at long lengths")
    add_device_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    p.set_defaults(run=run)


def run(args) -> int:
    import json

    from moetron.launcher.checkpoint.weights import (
        checkpoint_config,
        load_model,
        resolve_checkpoint,
        with_model_overrides,
    )
    from moetron.launcher.config import ConfigError
    from moetron.launcher.data.corpus import load_token_data
    from moetron.launcher.train.length_eval import evaluate_lengths, length_problems, position_buckets

    lengths = _parse_lengths(args.seq_len)
    if args.tokens < 1 or args.batch_tokens < 1:
        raise ConfigError(f"--tokens {args.tokens}, --batch-tokens {args.batch_tokens}: must be >= 1")
    device = device_of(args)
    ckpt = resolve_checkpoint(args.path)
    # Refuse impossible lengths from the config alone, before weights or data are read.
    cfg = with_model_overrides(checkpoint_config(ckpt), args.overrides)
    if not cfg.model.causal:
        raise ConfigError("moetron eval scores next-token loss by length, which needs a decoder: this checkpoint is "
                          "an encoder (model.causal false); its masked-token val_loss is in the run's metrics.jsonl")
    for problem in length_problems(cfg.model, lengths):
        raise ConfigError(problem)

    cfg, model = load_model(ckpt, device=device, overrides=args.overrides)
    data = load_token_data(cfg.data.source, cfg.data.tokenizer, cfg.data.val_fraction, cfg.data.blend_pairs())
    if data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data {cfg.data.blend or cfg.data.source!r}: its tokenizer has {data.vocab_size} ids, "
                          f"more than the model's vocabulary ({cfg.model.vocab_size})")
    try:
        with progress_bar("eval") as on_plan:  # target tokens scored, over all lengths
            results = evaluate_lengths(model, data.val, lengths, tokens=args.tokens, batch_tokens=args.batch_tokens,
                                       vocab_size=data.vocab_size, device=device, on_plan=on_plan)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.json:
        print(json.dumps({"checkpoint": str(ckpt), "position": cfg.model.position, "overrides": args.overrides,
                          "results": [r.to_dict() for r in results]}))
        return 0
    m = cfg.model
    scaling = f", rope_scaling {m.rope_scaling} ×{m.rope_scaling_factor:g}" if m.position == "rope" else ""
    print(f"{ckpt}: position {m.position}{scaling}; validation loss in nats/token, "
          f"{results[0].tokens} target tokens at {lengths[0]}")
    columns = position_buckets(max(lengths))
    print("| seq_len | loss | " + " | ".join(f"pos {a}–{b - 1}" for a, b in columns) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in columns) + " |")
    for r in results:
        by_start = {a: loss for a, _, loss in r.buckets}
        cells = [f"{by_start[a]:.4f}" if a in by_start else "" for a, _ in columns]
        print(f"| {r.seq_len} | {r.loss:.4f} | " + " | ".join(cells) + " |")
    return 0


def _parse_lengths(raw: str) -> list[int]:
    from moetron.launcher.config import ConfigError

    try:
        lengths = [int(x) for x in raw.replace(" ", "").split(",") if x]
    except ValueError:
        raise ConfigError(f"--seq-len {raw!r}: expected comma-separated integers, e.g. 256,512,1024") from None
    if not lengths:
        raise ConfigError("--seq-len: give at least one length")
    return lengths

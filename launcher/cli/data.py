"""`moetron data prepare INPUTS... --out PREFIX`: tokenize text/jsonl into memory-mapped token shards."""

from __future__ import annotations

from moetron.launcher.cli.help import HelpFormatter


def register(sub) -> None:
    p = sub.add_parser("data", help="prepare token shards", description="Data preparation.")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = dsub.add_parser(
        "prepare", help="tokenize text or jsonl files into token shards",
        description="Tokenize INPUTS (text files: one document each; .jsonl: one document per line, "
                    "field --text-key) into PREFIX.json + PREFIX.{train,val}-NNNNN.bin, the format "
                    "data.source=PREFIX reads. `stdlib` as an input means the Python standard "
                    "library's own source.",
        formatter_class=HelpFormatter)
    prep.add_argument("inputs", nargs="+", help="text or .jsonl files, or 'stdlib'")
    prep.add_argument("--out", required=True, metavar="PREFIX", help="output prefix, e.g. data/corpus")
    prep.add_argument("--tokenizer", default="byte",
                      help="'byte', 'bpe' (train a byte-level BPE on the inputs), or a tokenizer.json")
    prep.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of a trained BPE")
    prep.add_argument("--val-fraction", type=float, default=0.02, help="share of documents held out")
    prep.add_argument("--text-key", default="text", help="field of a .jsonl record holding the text")
    prep.set_defaults(run=run_prepare)


def run_prepare(args) -> int:
    import sys
    from pathlib import Path

    from moetron.launcher.config import ConfigError, TrainConfig
    from moetron.launcher.data.corpus import (
        is_validation,
        read_documents,
        stdlib_documents,
        tokenize_split,
        window_shortage,
        write_shards,
    )
    from moetron.launcher.data.tokenizer import load_tokenizer, train_bpe

    for item in args.inputs:
        if item != "stdlib" and not Path(item).is_file():
            raise FileNotFoundError(f"input {item}: no such file")
    if not 0 < args.val_fraction < 1:
        raise ConfigError(f"--val-fraction {args.val_fraction}: must be in (0, 1)")
    docs = [doc for item in args.inputs
            for doc in (stdlib_documents() if item == "stdlib" else read_documents([item], args.text_key))]
    # Before anything is written: a split without documents cannot feed a run.
    held_out = sum(is_validation(name, args.val_fraction) for name, _ in docs)
    problem = _split_problem(len(docs), held_out, args.val_fraction)
    if problem:
        raise ConfigError(problem)
    if args.tokenizer == "bpe":
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tok = train_bpe((text for _, text in docs), args.vocab_size, out.with_name(out.name + ".tokenizer.json"))
    else:
        tok = load_tokenizer(args.tokenizer)
    splits = tokenize_split(docs, tok, args.val_fraction)
    header = write_shards(args.out, splits, tok)
    print(f"{_count(len(docs), 'document')} → {len(splits['train']):,} train and {len(splits['val']):,} validation "
          f"tokens (vocabulary {tok.vocab_size}); header {header}")
    # A split shorter than a window at the default train.seq_len still trains at a shorter one.
    seq_len = TrainConfig().seq_len
    for split, tokens in (("train", splits["train"]), ("validation", splits["val"])):
        shortage = window_shortage(split, [len(tokens)], seq_len)
        if shortage:
            print(f"warning: at train.seq_len = {seq_len} (the default), {shortage}", file=sys.stderr)
    return 0


def _split_problem(documents: int, held_out: int, val_fraction: float) -> str | None:
    """Why the documents cannot make both splits, as one line, or None. A document goes whole to
    one split, picked by a hash of its name, so a few documents may all land on one side."""
    if documents == 0:
        return "the inputs hold no documents"
    if 0 < held_out < documents:
        return None
    went = "the only document went" if documents == 1 else f"all {documents:,} documents went"
    side, other, fix = ("validation", "training", "a smaller") if held_out else ("training", "validation", "a larger")
    return (f"{went} to {side}, none to {other} (--val-fraction {val_fraction:g} picks documents by a hash of "
            f"their names); each split needs at least one: give more documents (a .jsonl holds one per line) "
            f"or {fix} --val-fraction")


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"

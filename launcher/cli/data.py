"""`moetron data prepare INPUTS... --out PREFIX`: tokenize text/jsonl into a Megatron indexed corpus."""

from __future__ import annotations

import contextlib

from moetron.launcher.cli.help import HelpFormatter


def register(sub) -> None:
    p = sub.add_parser("data", help="prepare a tokenized corpus", description="Data preparation.")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = dsub.add_parser(
        "prepare", help="tokenize text or jsonl files into a Megatron indexed corpus",
        description="Tokenize INPUTS (text files: one document each; .jsonl: one document per line, "
                    "field --json-key) into PREFIX.bin + PREFIX.idx, Megatron's indexed format (what "
                    "data.source=PREFIX and data.blend read, and Megatron-LM too), held-out documents "
                    "last, and PREFIX.json (tokenizer, split, largest id). `stdlib` as an input means "
                    "the Python standard library's own source.",
        formatter_class=HelpFormatter)
    prep.add_argument("inputs", nargs="+", help="text or .jsonl files, or 'stdlib'")
    prep.add_argument("--out", required=True, metavar="PREFIX", help="output prefix, e.g. data/corpus")
    prep.add_argument("--tokenizer", default="byte",
                      help="'byte', 'bpe' (train a byte-level BPE on the inputs), or a tokenizer.json")
    prep.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of a trained BPE")
    prep.add_argument("--val-fraction", type=float, default=0.02, help="share of documents held out")
    prep.add_argument("--json-key", "--text-key", dest="text_key", default="text",
                      help="field of a .jsonl record holding the text")
    prep.set_defaults(run=run_prepare)


def run_prepare(args) -> int:
    import sys
    from pathlib import Path

    from moetron.launcher.config import ConfigError, TrainConfig
    from moetron.launcher.data.corpus import is_validation, read_documents, stdlib_documents, window_shortage
    from moetron.launcher.data.prepare import write_corpus
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
    with _progress(sum(len(text) for _, text in docs)) as advance:
        written = write_corpus(args.out, docs, tok, args.val_fraction, advance)
    train, val = written.tokens["train"], written.tokens["val"]
    print(f"{_count(len(docs), 'document')} → {train:,} train and {val:,} validation tokens "
          f"(vocabulary {tok.vocab_size}, largest id {written.max_id}); index {written.index}")
    # A split shorter than a window at the default train.seq_len still trains at a shorter one.
    seq_len = TrainConfig().seq_len
    for split, tokens in (("train", train), ("validation", val)):
        shortage = window_shortage(split, [tokens], seq_len)
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


@contextlib.contextmanager
def _progress(total_chars: int):
    """A rich progress bar of characters tokenized, on a terminal's stderr (none elsewhere:
    logs and pipes get the summary line only); yields advance(chars)."""
    import sys

    if not sys.stderr.isatty():
        yield lambda chars: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TimeRemainingColumn

    with Progress("[bold]tokenize", BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("tokenize", total=total_chars)
        yield lambda chars: bar.advance(task, chars)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"

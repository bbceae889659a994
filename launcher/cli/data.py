"""`moetron data prepare INPUTS... --out PREFIX`: tokenize text, jsonl, parquet or saved `datasets`
into a Megatron indexed corpus."""

from __future__ import annotations

import contextlib

from moetron.launcher.cli.help import HelpFormatter
from moetron.launcher.cli.progress_bar import progress_bar


def register(sub) -> None:
    p = sub.add_parser("data", help="prepare a tokenized corpus", description="Data preparation.")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = dsub.add_parser(
        "prepare", help="tokenize text, jsonl, parquet or saved `datasets` into a Megatron indexed corpus",
        description="Tokenize INPUTS into PREFIX.bin + PREFIX.idx, Megatron's indexed format (what "
                    "data.source=PREFIX and data.blend read, and Megatron-LM too), held-out documents "
                    "last, and PREFIX.json (tokenizer, split, largest id). An input is a text file (one "
                    "document), a .jsonl (one document per line, field --text-key), a .parquet (one per "
                    "row, column --text-key, read a batch of rows at a time), a folder written by "
                    "`datasets`' save_to_disk (one per row; a DatasetDict's splits, or --split), or "
                    "`stdlib`: the Python standard library's own source. Parquet and datasets need "
                    "pip install 'moetron[data]'. --workers processes tokenize; the output is the same "
                    "bytes for any number of them.",
        formatter_class=HelpFormatter)
    prep.add_argument("inputs", nargs="+", metavar="INPUT",
                      help="text, .jsonl or .parquet files, save_to_disk folders, or 'stdlib'")
    prep.add_argument("--out", required=True, metavar="PREFIX", help="output prefix, e.g. data/corpus")
    prep.add_argument("--tokenizer", default="byte",
                      help="'byte', 'bpe' (train a byte-level BPE on the inputs), or a tokenizer.json")
    prep.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of a trained BPE")
    prep.add_argument("--val-fraction", type=float, default=0.02, help="share of documents held out")
    prep.add_argument("--json-key", "--text-key", dest="text_key", default="text", metavar="KEY",
                      help="field of a .jsonl record, or column of a .parquet or dataset, holding the text")
    prep.add_argument("--split", metavar="NAME",
                      help="the split to take from a DatasetDict folder (default: all of its splits)")
    prep.add_argument("--workers", type=int, metavar="N",
                      help="tokenizing processes (default: the CPUs this process may use)")
    prep.set_defaults(run=run_prepare)


def run_prepare(args) -> int:
    import sys
    from pathlib import Path

    from moetron.launcher.config import ConfigError, TrainConfig
    from moetron.launcher.data.corpus import window_shortage
    from moetron.launcher.data.encode_pool import available_cpus
    from moetron.launcher.data.inputs import open_input
    from moetron.launcher.data.prepare import write_corpus

    workers = available_cpus() if args.workers is None else args.workers
    if workers < 1:
        raise ConfigError(f"--workers {workers}: must be at least 1")
    if not 0 < args.val_fraction < 1:
        raise ConfigError(f"--val-fraction {args.val_fraction}: must be in (0, 1)")
    sources = [open_input(item, args.text_key, args.split) for item in args.inputs]
    documents = _check_split(sources, args.val_fraction)  # before anything is written

    def docs():
        return (doc for source in sources for doc in source.documents())

    out = Path(args.out)
    with _nothing_left_on_failure(out):
        tok = _tokenizer(args, out, docs)
        with progress_bar("tokenize") as on_plan:
            written = write_corpus(out, docs(), tok, args.val_fraction, on_plan(documents), workers)
    train, val = written.tokens["train"], written.tokens["val"]
    print(f"{_count(documents, 'document')} → {train:,} train and {val:,} validation tokens "
          f"(vocabulary {tok.vocab_size}, largest id {written.max_id}); index {written.index}")
    # A split shorter than a window at the default train.seq_len still trains at a shorter one.
    seq_len = TrainConfig().seq_len
    for split, tokens in (("train", train), ("validation", val)):
        shortage = window_shortage(split, [tokens], seq_len)
        if shortage:
            print(f"warning: at train.seq_len = {seq_len} (the default), {shortage}", file=sys.stderr)
    return 0


def _check_split(sources, val_fraction: float) -> int:
    """The number of documents, read by name only; ConfigError when they cannot make both splits
    (a split without documents cannot feed a run)."""
    from moetron.launcher.config import ConfigError
    from moetron.launcher.data.corpus import is_validation

    documents = held_out = 0
    for source in sources:
        for name in source.names():
            documents += 1
            held_out += is_validation(name, val_fraction)
    problem = _split_problem(documents, held_out, val_fraction)
    if problem:
        raise ConfigError(problem)
    return documents


def _tokenizer(args, out, docs):
    """The tokenizer --tokenizer names; 'bpe' trains one on the texts (a pass of its own) and
    saves it as PREFIX.tokenizer.json."""
    from moetron.launcher.data.tokenizer import load_tokenizer, train_bpe

    if args.tokenizer != "bpe":
        return load_tokenizer(args.tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    return train_bpe((text for _, text in docs()), args.vocab_size, out.with_name(out.name + ".tokenizer.json"))


@contextlib.contextmanager
def _nothing_left_on_failure(out):
    """A prepare that fails (a bad record met halfway, an interrupt) leaves none of the folders it
    made and no tokenizer it trained; the writer removes its own files."""
    made = [d for d in (out.parent, *out.parent.parents) if not d.exists()]  # deepest first
    tokenizer = out.with_name(out.name + ".tokenizer.json")
    had_tokenizer = tokenizer.exists()
    try:
        yield
    except BaseException:
        if not had_tokenizer:
            tokenizer.unlink(missing_ok=True)
        for folder in made:
            with contextlib.suppress(OSError):  # not empty: something else wrote there meanwhile
                folder.rmdir()
        raise


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
            f"their names); each split needs at least one: give more documents (a .jsonl holds one per line, "
            f"a .parquet one per row) or {fix} --val-fraction")


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"

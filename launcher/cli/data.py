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
    from pathlib import Path

    from moetron.launcher.data.corpus import read_documents, stdlib_documents, tokenize_split, write_shards
    from moetron.launcher.data.tokenizer import load_tokenizer, train_bpe

    for item in args.inputs:
        if item != "stdlib" and not Path(item).is_file():
            raise FileNotFoundError(f"input {item}: no such file")
    if not 0 < args.val_fraction < 1:
        raise FileNotFoundError(f"--val-fraction {args.val_fraction}: must be in (0, 1)")

    def documents():
        for item in args.inputs:
            yield from stdlib_documents() if item == "stdlib" else read_documents([item], args.text_key)

    if args.tokenizer == "bpe":
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tok = train_bpe((text for _, text in documents()), args.vocab_size, out.with_name(out.name + ".tokenizer.json"))
    else:
        tok = load_tokenizer(args.tokenizer)
    docs = list(documents())
    splits = tokenize_split(docs, tok, args.val_fraction)
    header = write_shards(args.out, splits, tok)
    print(f"{len(docs)} documents → {len(splits['train']):,} train and {len(splits['val']):,} validation "
          f"tokens (vocabulary {tok.vocab_size}); header {header}")
    return 0

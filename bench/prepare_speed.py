"""Tokens per second of `moetron data prepare`, with one worker process and with all of them,
beside Megatron-LM's `tools/preprocess_data.py` on the same input where a checkout is given.

    python bench/prepare_speed.py                     # 8 MB of jsonl, byte and BPE tokenizers, ~20 s on 2 cores
    python bench/prepare_speed.py --mb 64 --workers 1 4 16
    python bench/prepare_speed.py --megatron-lm ~/Megatron-LM   # adds preprocess_data.py (BPE only)

A synthetic .jsonl corpus (Zipf-distributed pseudo-words, documents of 50 to 1,500 words, seeded)
is written once; a byte-level BPE (--vocab-size) is trained once on its first documents and saved
as tokenizer.json, untimed. Each run is the whole command in a fresh process, as a user runs it
(interpreter start and imports included: about a second, which a small corpus makes visible),
timed by the wall clock, best of --repeat, beside the CPU seconds of the command and its workers
(more workers should add little: the work is split, not redone); tokens are those the written .idx
holds. The byte tokenizer costs next to nothing (its runs time the start-up and the reading); the
BPE shows the workers. Every moetron run of a tokenizer must write the same bytes whatever its
workers: the bench checks it.

Megatron-LM's script needs `megatron.training` (a Megatron-LM checkout: megatron-core's wheel ships
neither it nor tools/); it runs with the BPE saved as a Hugging Face tokenizer folder
(`--tokenizer-type HuggingFaceTokenizer`), `--append-eod`, and the same worker counts. It has no
byte tokenizer. Megatron-LM's main branch (and core_v0.17) needs Python 3.12; under 3.11 check out
the tag core_v0.16.1. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moetron.launcher.data.encode_pool import available_cpus
from moetron.launcher.data.indexed import read_indexed


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """A jsonl file of about `megabytes` MB of pseudo-text (one {"text": ...} per line) → documents."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, size=rng.integers(1, 11))) for _ in range(5000)]
    zipf = 1 / np.arange(1, len(words) + 1)
    zipf /= zipf.sum()
    written, docs = 0, 0
    with path.open("w") as f:
        while written < megabytes * 1e6:
            picks = rng.choice(len(words), size=int(rng.integers(50, 1500)), p=zipf)
            text = " ".join(words[i] + (".\n" if j % 17 == 16 else "") for j, i in enumerate(picks))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line.encode())
            docs += 1
    return docs


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float, str | None]:
    """Wall seconds of `cmd`, CPU seconds of it and every process it waited for (its workers), and
    None, or its last line of stderr when it failed."""
    cpu_before = _children_cpu()
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    cpu = _children_cpu() - cpu_before
    if proc.returncode != 0:
        return seconds, cpu, (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return seconds, cpu, None


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def moetron_run(corpus: Path, out: Path, tokenizer: str, workers: int, repeat: int) -> dict:
    cmd = [sys.executable, "-m", "moetron", "data", "prepare", str(corpus), "--out", str(out),
           "--tokenizer", tokenizer, "--workers", str(workers)]
    best, cpu, error = min(timed(cmd) for _ in range(repeat))
    if error:
        return {"tool": "moetron", "workers": workers, "error": error}
    tokens = int(read_indexed(str(out)).tokens.size)
    return {"tool": "moetron", "workers": workers, "seconds": best, "cpu_seconds": cpu, "tokens": tokens,
            "bytes": {ext: (out.parent / f"{out.name}{ext}").read_bytes() for ext in (".bin", ".idx")}}


def megatron_run(checkout: Path, corpus: Path, out: Path, hf_folder: Path, workers: int, repeat: int) -> dict:
    cmd = [sys.executable, str(checkout / "tools" / "preprocess_data.py"), "--input", str(corpus),
           "--json-keys", "text", "--output-prefix", str(out), "--tokenizer-type", "HuggingFaceTokenizer",
           "--tokenizer-model", str(hf_folder), "--append-eod", "--workers", str(workers)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    best, cpu, error = min(timed(cmd, env) for _ in range(repeat))
    if error:
        return {"tool": "megatron", "workers": workers, "error": error}
    tokens = int(read_indexed(f"{out}_text_document").tokens.size)
    return {"tool": "megatron", "workers": workers, "seconds": best, "cpu_seconds": cpu, "tokens": tokens}


def hf_tokenizer_folder(tokenizer_json: Path, folder: Path) -> Path:
    """The BPE as a transformers tokenizer folder, what Megatron's HuggingFaceTokenizer loads."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def measure(args, root: Path) -> dict:
    from moetron.launcher.data.tokenizer import train_bpe

    corpus = root / "corpus.jsonl"
    documents = write_corpus(corpus, args.mb)
    with corpus.open() as f:
        sample = [json.loads(next(f))["text"] for _ in range(min(documents, 200))]
    bpe = root / "bpe.tokenizer.json"
    train_bpe(sample, args.vocab_size, bpe)
    rows = []
    for name, tokenizer in (("byte", "byte"), (f"bpe {args.vocab_size}", str(bpe))):
        runs = [moetron_run(corpus, root / f"m-{name[:3]}-{w}", tokenizer, w, args.repeat) for w in args.workers]
        written = [r.pop("bytes") for r in runs if "bytes" in r]
        assert all(w == written[0] for w in written), f"{name}: the workers changed the bytes written"
        rows += [{"tokenizer": name, **r} for r in runs]
        if args.megatron_lm and tokenizer != "byte":
            hf = hf_tokenizer_folder(bpe, root / "hf-bpe")
            rows += [{"tokenizer": name, **megatron_run(Path(args.megatron_lm).expanduser(), corpus,
                                                        root / f"meg-{w}", hf, w, args.repeat)}
                     for w in args.workers]
    return {"corpus_bytes": corpus.stat().st_size, "documents": documents, "rows": rows}


def loaded(result: dict) -> str | None:
    """A note when other work shared the CPUs: more workers then cannot run faster."""
    busiest = max(result["load_average_before_after"])
    if busiest <= 0.5 * available_cpus():
        return None
    return (f"note: load average up to {busiest:.1f} on {available_cpus()} CPUs: other work shared them, so the "
            f"workers' speed-up is understated")


def print_table(result: dict, args) -> None:
    mb = result["corpus_bytes"] / 1e6
    print(f"{mb:.1f} MB of jsonl, {result['documents']:,} documents; {available_cpus()} CPUs; best of "
          f"{args.repeat}; whole commands, start-up included")
    print(f"{'tool':<10}{'tokenizer':<11}{'workers':>8}{'seconds':>9}{'CPU s':>7}{'tokens':>13}{'tokens/s':>12}"
          f"{'MB/s':>7}{'vs 1 worker':>13}")
    single = {(r["tool"], r["tokenizer"]): r["seconds"] for r in result["rows"]
              if r.get("workers") == 1 and "seconds" in r}
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['tool']:<10}{r['tokenizer']:<11}{r['workers']:>8}  failed: {r['error']}")
            continue
        base = single.get((r["tool"], r["tokenizer"]))
        speedup = f"{base / r['seconds']:.2f}x" if base else "-"
        print(f"{r['tool']:<10}{r['tokenizer']:<11}{r['workers']:>8}{r['seconds']:>9.2f}{r['cpu_seconds']:>7.2f}"
              f"{r['tokens']:>13,}{r['tokens'] / r['seconds']:>12,.0f}{mb / r['seconds']:>7.1f}{speedup:>13}")
    if not args.megatron_lm:
        print("megatron  preprocess_data.py not run: give --megatron-lm DIR, a Megatron-LM checkout "
              "(megatron-core's wheel ships neither megatron.training nor tools/)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=8, help="size of the synthetic jsonl corpus, MB (default 8)")
    p.add_argument("--workers", type=int, nargs="+", default=sorted({1, available_cpus()}),
                   help="worker counts to run (default: 1 and every CPU)")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of the BPE (default 4096)")
    p.add_argument("--repeat", type=int, default=1, help="runs per row, the fastest kept (default 1)")
    p.add_argument("--megatron-lm", metavar="DIR", help="a Megatron-LM checkout, to run its preprocess_data.py too")
    p.add_argument("--dir", help="where to write (default: a temporary folder)")
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="moetron-prepare-bench-", dir=args.dir) as tmp:
        result = measure(args, Path(tmp))
    result["load_average_before_after"] = [load_before, os.getloadavg()[0]]
    print_table(result, args)
    if loaded(result):
        print(loaded(result))
    print(json.dumps({"bench": "prepare_speed", "cpus": available_cpus(), **result}))


if __name__ == "__main__":
    main()

"""`moetron convert --from-hf HF_DIR --out CKPT` and `moetron convert --to-hf CKPT --out HF_DIR`,
streamed tensor by tensor (launcher/checkpoint/hf_convert.py; the families: model/hf.py)."""

from __future__ import annotations

import contextlib
import re

from moetron.launcher.cli.args import respect_umask
from moetron.launcher.cli.help import HelpFormatter
from moetron.launcher.cli.progress_bar import progress_bar

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def register(sub) -> None:
    p = sub.add_parser(
        "convert", help="move weights to and from Hugging Face (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...)",
        description="Convert between a Hugging Face folder (config.json + safetensors) and a moetron "
                    "checkpoint folder, one tensor at a time: memory stays near the largest tensor, "
                    "whatever the model's size. --from-hf writes a weights-only checkpoint that "
                    "`moetron generate` reads; --to-hf takes a checkpoint or a run folder (its newest "
                    "checkpoint) and writes a folder AutoModelForCausalLM.from_pretrained loads, of the "
                    "family the model's config makes it (README: the model table). A tokenizer.json "
                    "travels along when there is one. A folder that cannot convert (an unknown "
                    "model_type, a tensor the mapping does not expect) is refused before anything is "
                    "written.",
        formatter_class=HelpFormatter)
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="HF_DIR", help="Hugging Face folder to read")
    direction.add_argument("--to-hf", metavar="RUN_OR_CHECKPOINT", help="moetron checkpoint or run folder to read")
    p.add_argument("--out", required=True, help="folder to write; must not exist yet (or be empty)")
    p.add_argument("--dtype", choices=("keep", "float32", "bfloat16", "float16"), default="keep",
                   help="weight dtype of the output")
    p.add_argument("--max-shard-size", default="5GiB", metavar="SIZE",
                   help="--to-hf: largest safetensors file, e.g. 5GiB, 500MB")
    p.set_defaults(run=run)


def shard_bytes(size: str) -> int:
    """'5GiB' → 5·2³⁰, '500MB' → 5·10⁸, '1024' → 1024 bytes."""
    from moetron.launcher.config import ConfigError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]i?[bB]|[bB])?\s*", size)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size {size!r}: a size such as 5GiB or 500MB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def run(args) -> int:
    from pathlib import Path

    import torch

    from moetron.launcher.checkpoint import hf_convert
    from moetron.launcher.checkpoint.weights import resolve_checkpoint
    from moetron.launcher.config import ConfigError
    from moetron.launcher.run_dir import RunError

    dtype = None if args.dtype == "keep" else getattr(torch, args.dtype)
    max_shard = shard_bytes(args.max_shard_size)
    _return_freed_memory()
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunError(f"--out {out}: already exists; choose a new folder")
    source = Path(args.from_hf) if args.from_hf is not None else resolve_checkpoint(args.to_hf)
    with progress_bar("convert", unit="bytes") as on_plan:
        try:
            if args.from_hf is not None:
                n_params, dtype = hf_convert.from_hf(source, out, dtype=dtype, on_plan=on_plan)
            else:
                n_params, dtype = hf_convert.to_hf(source, out, dtype=dtype, max_shard_bytes=max_shard,
                                                   on_plan=on_plan)
        except (ValueError, KeyError) as e:  # what the folder or checkpoint holds cannot convert
            flag = "--from-hf" if args.from_hf is not None else "--to-hf"
            raise ConfigError(f"{flag} {source}: {e.args[0] if e.args else e}") from None
    respect_umask(p for p in out.rglob("*") if p.is_file())  # all written just now: `out` was new or empty
    print(f"{n_params:,} parameters ({dtype}) → {out}")
    return 0


def _return_freed_memory() -> None:
    """Have glibc hand every freed block of 1 MiB or more back to the OS at once. A conversion
    allocates and frees one tensor after another; under glibc's default, whose threshold for
    that rises to each freed block's size (up to 32 MiB), blocks below it stay in the heap, and
    its fragments grew the resident set by a quarter of a 450 MB model converted tensor by
    tensor. Elsewhere (no glibc) nothing changes."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD; setting it also stops the rise

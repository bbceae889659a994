"""`moetron convert --from-hf HF_DIR --out CKPT` and `moetron convert --to-hf CKPT --out HF_DIR`
(Mixtral, Qwen3-MoE, OLMoE: model/hf.py)."""

from __future__ import annotations

from moetron.launcher.cli.args import respect_umask
from moetron.launcher.cli.help import HelpFormatter


def register(sub) -> None:
    p = sub.add_parser(
        "convert", help="move weights to and from Hugging Face (Mixtral, Qwen3-MoE, OLMoE)",
        description="Convert between a Hugging Face folder (config.json + safetensors; model_type "
                    "mixtral, qwen3_moe or olmoe) and a moetron checkpoint folder. --from-hf writes a "
                    "weights-only checkpoint that `moetron generate` reads; --to-hf takes a checkpoint "
                    "or a run folder (its newest checkpoint) and writes a folder "
                    "AutoModelForCausalLM.from_pretrained loads: Mixtral for model.qk_norm none, "
                    "Qwen3-MoE for head, OLMoE for projection. A tokenizer.json travels along when "
                    "there is one.",
        formatter_class=HelpFormatter)
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="HF_DIR", help="Hugging Face folder to read")
    direction.add_argument("--to-hf", metavar="RUN_OR_CHECKPOINT", help="moetron checkpoint or run folder to read")
    p.add_argument("--out", required=True, help="folder to write; must not exist yet (or be empty)")
    p.add_argument("--dtype", choices=("keep", "float32", "bfloat16", "float16"), default="keep",
                   help="weight dtype of the output")
    p.set_defaults(run=run)


def run(args) -> int:
    import shutil
    from pathlib import Path

    import torch

    from moetron.launcher.checkpoint.weights import (
        TOKENIZER_FILE,
        checkpoint_config,
        checkpoint_tokenizer,
        load_model,
        resolve_checkpoint,
        save_weights,
    )
    from moetron.launcher.config import ConfigError
    from moetron.launcher.run_dir import RunError
    from moetron.model.hf import CONFIG_FILE, hf_problems, load_hf, save_hf

    dtype = None if args.dtype == "keep" else getattr(torch, args.dtype)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunError(f"--out {out}: already exists; choose a new folder")

    if args.from_hf is not None:
        src = Path(args.from_hf)
        if not (src / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"--from-hf {src}: no {CONFIG_FILE} there")
        try:
            model = load_hf(src, dtype=dtype)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"--from-hf {src}: {e}") from None
        tokenizer = src / TOKENIZER_FILE
        save_weights(model, out, source=f"huggingface:{src.resolve()}",
                     extra_files=(tokenizer,) if tokenizer.is_file() else ())
    else:
        ckpt = resolve_checkpoint(args.to_hf)
        cfg = checkpoint_config(ckpt)
        for key, value, rule in hf_problems(cfg.model):
            raise ConfigError(f"--to-hf {ckpt}: model.{key} = {value!r}: {rule}")
        try:
            eos_id = checkpoint_tokenizer(ckpt, cfg).eos_id
        except FileNotFoundError:
            eos_id = None
        # The stored weights as trained: no dropless switch needed, nothing is run.
        _, model = load_model(ckpt, dropless=False)
        if dtype is not None:
            model = model.to(dtype)
        save_hf(model, out, eos_id=eos_id)
        if (ckpt / TOKENIZER_FILE).is_file():
            shutil.copyfile(ckpt / TOKENIZER_FILE, out / TOKENIZER_FILE)
    respect_umask(p for p in out.rglob("*") if p.is_file())  # all written just now: `out` was new or empty
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params:,} parameters ({model.embed.weight.dtype}) → {out}")
    return 0

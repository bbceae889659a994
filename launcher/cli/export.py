"""`moetron export RUN_OR_CHECKPOINT --out model.safetensors`: one consolidated weights file."""

from __future__ import annotations

from pathlib import Path

from moetron.launcher.cli.args import respect_umask
from moetron.launcher.cli.help import HelpFormatter


def register(sub) -> None:
    p = sub.add_parser(
        "export", help="write a checkpoint's model as one safetensors file",
        description="Gather the model tensors of a sharded checkpoint (written on any parallel layout) "
                    "into one safetensors file, keyed by moetron parameter names, full shapes, saved "
                    "dtypes; the resolved model config goes beside it: --out NAME.safetensors also writes "
                    "NAME.config.json. "
                    "RUN_OR_CHECKPOINT is a run folder (its newest complete checkpoint is used) or a "
                    "checkpoint folder. Optimizer state is not exported. Every shard is verified "
                    "against the checkpoint's manifest first.",
        formatter_class=HelpFormatter)
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help="run folder or checkpoint folder")
    p.add_argument("--out", required=True, metavar="FILE", help="the .safetensors file to write (must not exist)")
    p.add_argument("--dtype", choices=("saved", "float32", "bfloat16", "float16"), default="saved",
                   help="cast floating-point tensors to this dtype")
    p.set_defaults(run=run)


def config_path(out: Path) -> Path:
    """The config JSON written beside an exported file: model.safetensors → model.config.json."""
    return out.with_name(out.name.removesuffix(".safetensors") + ".config.json")


def run(args) -> int:
    import json
    import os

    import torch
    from safetensors.torch import save_file

    from moetron.launcher.checkpoint.store import consolidated_model_state
    from moetron.launcher.checkpoint.weights import resolve_checkpoint
    from moetron.launcher.run_dir import RunError

    out = Path(args.out)
    if out.suffix != ".safetensors":
        raise RunError(f"--out {out}: must end in .safetensors")
    if out.exists():
        raise RunError(f"--out {out}: already exists; choose a new file name")
    ckpt = resolve_checkpoint(args.path)
    tensors = consolidated_model_state(ckpt)
    if args.dtype != "saved":
        dtype = getattr(torch, args.dtype)
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    state = json.loads((ckpt / "state.json").read_text()) if (ckpt / "state.json").is_file() else {}
    config = {"model": state.get("config", {}).get("model"), "step": state.get("step"), "source": str(ckpt)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={"format": "pt", "moetron_step": str(state.get("step"))})
    config_path(out).write_text(json.dumps(config, indent=1) + "\n")
    respect_umask([tmp])
    os.replace(tmp, out)
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    print(f"wrote {out} ({len(tensors)} tensors, {total / 2**20:.1f} MiB) from {ckpt}")
    print(f"config: {config_path(out)}")
    return 0

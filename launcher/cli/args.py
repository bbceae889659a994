"""What several subcommands share: the arguments of the commands that run a trained model (eval,
generate), and the mode of the files the commands that write weights (export, convert) leave."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def add_checkpoint_arguments(p) -> None:
    """RUN_OR_CHECKPOINT and the model.key=value overrides that follow it."""
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help="run folder or checkpoint folder")
    p.add_argument("overrides", nargs="*", default=[], metavar="model.key=value", help="model settings to change")


def add_device_argument(p) -> None:
    """--device; `device_of` resolves it."""
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when visible, else CPU")


def device_of(args):
    """The torch.device of --device (torch is imported only here, when a command runs)."""
    from moetron.launcher.train.device import pick_device

    return pick_device(args.device, "--device cuda: no CUDA device is visible")


def respect_umask(paths: Iterable[Path]) -> None:
    """Give `paths` the mode a file created with `open()` gets, 0666 less the umask. safetensors
    creates its files private (0600) whatever the umask, which locks exported weights away from
    the group a shared cluster folder is meant for."""
    umask = os.umask(0)  # the only portable way to read it: set, then put it back at once
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)

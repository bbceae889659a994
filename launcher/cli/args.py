"""Arguments shared by the commands that run a trained model (eval, generate)."""

from __future__ import annotations


def add_checkpoint_arguments(p) -> None:
    """RUN_OR_CHECKPOINT and the model.key=value overrides that follow it."""
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help="run folder or checkpoint folder")
    p.add_argument("overrides", nargs="*", metavar="model.key=value", help="model settings to change")


def add_device_argument(p) -> None:
    """--device; `device_of` resolves it."""
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when visible, else CPU")


def device_of(args):
    """The torch.device of --device (torch is imported only here, when a command runs)."""
    from moetron.launcher.train.device import pick_device

    return pick_device(args.device, "--device cuda: no CUDA device is visible")

"""Subcommands of `moetron`. Each module has `register(subparsers)`, which adds its parser and sets
`run(args) -> int` as the handler; imports of heavy modules happen inside `run`."""

from __future__ import annotations

from moetron.launcher.commands import convert, data, export, flops, generate, jobs, submit, train
from moetron.launcher.config import ConfigError
from moetron.launcher.run_dir import RunError
from moetron.launcher.submit import SlurmError
from moetron.parallel.checkpoint_io import CheckpointError

COMMANDS = [train, data, generate, convert, flops, submit, jobs, export]

# Problems with what the user asked for: reported as one line, exit status 2.
UserError = (ConfigError, RunError, CheckpointError, SlurmError, FileNotFoundError)

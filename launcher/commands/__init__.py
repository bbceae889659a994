"""Subcommands of `moetron`. Each module has `register(subparsers)`, which adds its parser and sets
`run(args) -> int` as the handler; imports of heavy modules happen inside `run`."""

from __future__ import annotations

from moetron.launcher.commands import data, train
from moetron.launcher.config import ConfigError
from moetron.launcher.run_dir import RunError

COMMANDS = [train, data]

# Problems with what the user asked for: reported as one line, exit status 2.
UserError = (ConfigError, RunError, FileNotFoundError)

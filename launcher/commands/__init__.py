"""Subcommands of `moetron`. Each module has `register(subparsers)`, which adds its parser and sets
`run(args) -> int` as the handler; imports of heavy modules happen inside `run`."""

from __future__ import annotations

from moetron.launcher.commands import convert, data, evaluate, export, flops, generate, jobs, plan, submit, train

COMMANDS = [train, data, generate, evaluate, convert, flops, plan, submit, jobs, export]


def user_errors() -> tuple[type[Exception], ...]:
    """Problems with what the user asked for: reported as one line, exit status 2. Imported only
    when something failed, so quick commands (status, logs, --help) never load torch."""
    from moetron.launcher.config import ConfigError
    from moetron.launcher.nonfinite import NonFiniteError
    from moetron.launcher.run_dir import RunError
    from moetron.launcher.submit import SlurmError
    from moetron.parallel.checkpoint_io import CheckpointError

    return (ConfigError, RunError, CheckpointError, SlurmError, NonFiniteError, FileNotFoundError)

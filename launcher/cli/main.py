"""The `moetron` command: one subcommand per user task, each implemented in its own module.

Errors the user can fix (config, run folder, input files) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from moetron.launcher.cli import convert, data, evaluate, export, flops, generate, jobs, plan, submit, train

COMMANDS = [train, data, generate, evaluate, convert, flops, plan, submit, jobs, export]


def user_errors() -> tuple[type[Exception], ...]:
    """Problems with what the user asked for: reported as one line, exit status 2. Imported only
    when something failed, so quick commands (status, logs, --help) never load torch."""
    from moetron.launcher.checkpoint.io import CheckpointError
    from moetron.launcher.cluster.submit import SlurmError
    from moetron.launcher.config import ConfigError
    from moetron.launcher.run_dir import RunError
    from moetron.launcher.train.nonfinite import NonFiniteError

    return (ConfigError, RunError, CheckpointError, SlurmError, NonFiniteError, FileNotFoundError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moetron",
        description="Train sparse Mixture-of-Experts decoder language models, from one CPU process "
                    "to a Slurm cluster. Run `moetron COMMAND --help` for each command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Commands that take key=value overrides take them after their options too
    # (`moetron eval RUN --seq-len 512 model.rope_scaling=yarn`), which argparse alone refuses.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not isinstance(getattr(args, "overrides", None), list) or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"moetron {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not isinstance(e, user_errors()):
            raise
        print(f"moetron {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

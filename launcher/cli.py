"""The `moetron` command: one subcommand per user task, each implemented in its own module.

Errors the user can fix (config, run folder, input files) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from moetron.launcher.commands import COMMANDS, user_errors


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
    args = parser.parse_args(argv)
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

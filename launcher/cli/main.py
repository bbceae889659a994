"""The `moetron` command: one subcommand per user task, each implemented in its own module.

Errors the user can fix (config, run folder, input files) print one line and exit with status 2.
Under a multi-rank launch every rank exits 2 but only rank 0 prints, so a bad config reads once.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time

from moetron.launcher.cli import convert, data, evaluate, export, flops, generate, jobs, plan, submit, train

COMMANDS = [train, data, generate, evaluate, convert, flops, plan, submit, jobs, export]


# Problems with what the user asked for, reported as one line with exit status 2: (module, class).
USER_ERRORS = (
    ("moetron.launcher.config", "ConfigError"),
    ("moetron.launcher.run_dir", "RunError"),
    ("moetron.launcher.checkpoint.io", "CheckpointError"),
    ("moetron.launcher.cluster.submit", "SlurmError"),
    ("moetron.launcher.train.nonfinite", "NonFiniteError"),
)
# Where each launcher puts a process's rank; the first one set wins (torchrun's RANK first, as in
# launcher/cluster/bootstrap.py, which is not asked here: it may call mpi4py or scontrol).
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
# Seconds a rank other than 0 waits before exiting on a user error, so that rank 0 can print it.
USER_ERROR_GRACE_S = 5.0


def is_user_error(e: BaseException) -> bool:
    """Whether `e` is a user error. Its class can only have been raised if its module is loaded, so
    nothing is imported here: a config error is reported without loading torch."""
    if isinstance(e, FileNotFoundError):
        return True
    return any(isinstance(e, getattr(sys.modules[module], name))
               for module, name in USER_ERRORS if module in sys.modules)


def is_rank_zero(env=os.environ) -> bool:
    """Rank 0 of a multi-process launch, or a single process."""
    rank = next((env[v] for v in RANK_VARIABLES if env.get(v, "").strip()), "0")
    return rank.strip() == "0"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moetron",
        description="Train sparse Mixture-of-Experts decoder language models, from one CPU process "
                    "to a Slurm cluster. Run `moetron COMMAND --help` for each command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def unknown_command(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """One line for a first word that names no command (with the closest one), else None."""
    if not argv or argv[0].startswith("-"):
        return None
    commands = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if argv[0] in commands:
        return None
    guess = difflib.get_close_matches(argv[0], list(commands), n=1)
    hint = f"did you mean `moetron {guess[0]}`? " if guess else ""
    return f"moetron: unknown command {argv[0]!r}; {hint}commands: {', '.join(commands)}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    problem = unknown_command(parser, argv)
    if problem:
        print(problem, file=sys.stderr)
        return 2
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
        if not is_user_error(e):
            raise
        if is_rank_zero():
            print(f"moetron {args.command}: {e}", file=sys.stderr)
        else:
            # Under torchrun or mpirun the first rank to exit brings the others down, rank 0 too,
            # which may not have said why yet (every rank meets the same error at about the same time).
            time.sleep(USER_ERROR_GRACE_S)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

"""Start the ranks of `moetron train` launches by forking one process that imported the training
stack once, instead of a fresh interpreter per rank and launch (torchrun's way): a 4-rank launch
otherwise spends ~20 s of CPU importing torch, DCP and moetron five times over.

    python tests/launcher/checkpoint/forked_ranks.py        # then, on stdin, one JSON line per launch:
    {"ranks": 4, "argv": ["train", "configs/tiny.yaml", ...], "cwd": "/path"}

For each line it forks `ranks` processes with the environment torchrun gives its workers (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each running the `moetron`
command `argv`, waits for all, and answers one JSON line: every rank's exit status and the end of
the output of rank 0 and of any rank that failed. The driver itself runs no tensor operation, so
the children start from a clean torch (no thread pools, no process group).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path


def import_the_training_stack() -> None:
    """What `moetron train` imports on its way, lazily included (see crash_harness.py)."""
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    import yaml  # noqa: F401

    import moetron.launcher.cli.main  # noqa: F401
    import moetron.launcher.perf.mfu  # noqa: F401
    import moetron.launcher.train.trainer  # noqa: F401


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, ranks: int, port: int, argv: list[str], log: Path) -> int:
    """In a forked child: become rank `rank` and run the command; → its exit status."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from moetron.launcher.cli.main import main

    try:
        return main(argv) or 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the rank's output, as a crashed rank would
        traceback.print_exc()
        return 1


def launch(request: dict) -> dict:
    ranks, argv = request["ranks"], request["argv"]
    logs = Path(tempfile.mkdtemp(prefix="forked-ranks-"))
    port, pids = free_port(), []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.chdir(request.get("cwd", os.getcwd()))
                code = run_rank(rank, ranks, port, argv, logs / f"{rank}.log")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    shown = [r for r, c in enumerate(codes) if c != 0] or [0]
    output = {r: (logs / f"{r}.log").read_text(errors="replace")[-3000:] for r in shown}
    return {"codes": codes, "output": output}


def main() -> int:
    import_the_training_stack()
    for line in sys.stdin:
        print(json.dumps(launch(json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

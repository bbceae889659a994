"""Start the ranks of multi-rank launches by forking one process that imported the training stack
once, instead of a fresh interpreter per rank and launch (torchrun's way): a 4-rank launch
otherwise spends ~20 s of CPU importing torch, DCP and moetron five times over.

    python tests/forked_ranks.py        # then, on stdin, one JSON line per launch:
    {"ranks": 4, "argv": ["train", "configs/tiny.yaml", ...], "cwd": "/path"}
    {"ranks": 4, "script": "tests/.../reshard_worker.py", "args": ["OUT", "layouts", ...]}
    {"ranks": 1, "argv": ["train", ...], "torchrun": false, "env": {"XDG_CACHE_HOME": "/x"}, "stderr": true}

For each line it forks `ranks` processes with the environment torchrun gives its workers (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each running the `moetron`
command `argv`, or the Python file `script` as `python script args...` would (its folder first on
sys.path, `__name__` "__main__"). It waits for all and answers one JSON line: every rank's exit
status and the last `tail` characters (default 3,000) of the output of rank 0 and of any rank
that failed (with `"stderr": true`, each rank's stderr comes apart, under "stderr"). `env` adds to
the ranks' environment; `"torchrun": false` starts one process as `python -m moetron` would, without
torchrun's variables. As under torchrun, the first rank to fail brings the others down (a survivor would
wait in a collective for a rank that is gone), and so does `timeout` (seconds, optional). The
driver itself runs no tensor operation, so the children start from a clean torch (no thread
pools, no process group).
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def import_the_training_stack() -> None:
    """What `moetron train` imports on its way, lazily included (see crash_harness.py)."""
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    import yaml  # noqa: F401

    import moetron.launcher.checkpoint.store  # noqa: F401
    import moetron.launcher.cli.main  # noqa: F401
    import moetron.launcher.perf.mfu  # noqa: F401
    import moetron.launcher.train.trainer  # noqa: F401
    import moetron.parallel.parallelize  # noqa: F401


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_request(request: dict) -> int:
    """In a forked rank: the request's `moetron` command or script; → its exit status."""
    if "script" in request:
        script = str(Path(request["script"]).resolve())
        sys.argv = [script, *request.get("args", [])]
        sys.path.insert(0, str(Path(script).parent))
        runpy.run_path(script, run_name="__main__")
        return 0
    from moetron.launcher.cli.main import main

    return main(request["argv"]) or 0


def run_rank(rank: int, ranks: int, port: int, request: dict, logs: Path) -> int:
    """In a forked child: become rank `rank` and run the request; → its exit status."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(logs / f"{rank}.log", flags)
    os.dup2(fd, 1)
    os.dup2(os.open(logs / f"{rank}.err", flags) if request.get("stderr") else fd, 2)
    os.environ.update(request.get("env", {}))
    if request.get("torchrun", True):
        torchrun_env(rank, ranks, port)
    try:
        return run_request(request)
    except SystemExit as e:  # as the interpreter reads it: None is success, a message is 1
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001 - reported in the rank's output, as a crashed rank would
        traceback.print_exc()
        return 1


def wait_ranks(pids: list[int], timeout: float | None) -> list[int]:
    """Every rank's exit status; the first failure, or the timeout, SIGKILLs those still running."""
    deadline = None if timeout is None else time.monotonic() + timeout
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in pids:
            codes[pid] = os.waitstatus_to_exitcode(status)
        failed = any(c != 0 for c in codes.values())
        if failed or (deadline is not None and time.monotonic() > deadline):
            for other in set(pids) - set(codes):
                os.kill(other, signal.SIGKILL)
        if pid == 0:
            time.sleep(0.02)
    return [codes[p] for p in pids]


def fork(body: Callable[[], int]) -> int:
    """Fork a child that runs `body` and leaves with its status (1 if it raised); → the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = body()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def torchrun_env(rank: int, ranks: int, port: int) -> None:
    """The environment torchrun gives rank `rank` of `ranks` on this host."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def launch(request: dict) -> dict:
    ranks, cwd = request["ranks"], request.get("cwd", os.getcwd())
    assert ranks == 1 or request.get("torchrun", True), "only one process starts without torchrun's variables"
    logs = Path(tempfile.mkdtemp(prefix="forked-ranks-"))
    port = free_port()

    def rank_body(rank: int) -> Callable[[], int]:
        def body() -> int:
            os.chdir(cwd)
            return run_rank(rank, ranks, port, request, logs)

        return body

    pids = [fork(rank_body(rank)) for rank in range(ranks)]
    codes = wait_ranks(pids, request.get("timeout"))
    shown = [r for r, c in enumerate(codes) if c != 0] or [0]
    shown = sorted({0, *shown})
    tail = request.get("tail", 3000)
    answer = {"codes": codes}
    for key, suffix in [("output", "log"), *([("stderr", "err")] if request.get("stderr") else [])]:
        answer[key] = {r: (logs / f"{r}.{suffix}").read_text(errors="replace")[-tail:] for r in shown}
    shutil.rmtree(logs, ignore_errors=True)
    return answer


def main() -> int:
    import_the_training_stack()
    for line in sys.stdin:
        print(json.dumps(launch(json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

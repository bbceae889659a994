"""`moetron train …` for test_run_fence.py, held at a chosen moment until the test lets it go.

    FENCE_HOLD=after:5 FENCE_MARKS=DIR FENCE_NAME=a python fence_worker.py train CONFIG key=value …

FENCE_HOLD is WHERE:STEP:
  after  after step STEP (its metrics record and its checkpoint, if one was due);
  save   inside the save of STEP, its shards written, the checkpoint not yet published.
The process writes DIR/NAME.held there and waits (alive, its lease's heartbeat beating) until
DIR/NAME.go exists. The patches wrap functions in this process only: production code holds no
test seam.
"""

import os
import sys
import time
from pathlib import Path

from moetron.launcher.checkpoint.store import Checkpointer
from moetron.launcher.cli.main import main
from moetron.launcher.train.checkpointer import CheckpointManager


def hold() -> None:
    marks, name = Path(os.environ["FENCE_MARKS"]), os.environ["FENCE_NAME"]
    (marks / f"{name}.held").touch()
    deadline = time.time() + 300
    while not (marks / f"{name}.go").exists() and time.time() < deadline:
        time.sleep(0.05)


def install(where: str, at: int) -> None:
    """Hold this rank once it has finished step `at` ("after") or written its part of the save of
    step `at` ("save")."""
    cls, name = (CheckpointManager, "after_step") if where == "after" else (Checkpointer, "_finish_rank")
    original = getattr(cls, name)

    def held(self, step, *args):
        original(self, step, *args)
        if step == at:
            hold()

    setattr(cls, name, held)


if __name__ == "__main__":
    where, at = os.environ["FENCE_HOLD"].split(":")
    install(where, int(at))
    raise SystemExit(main(sys.argv[1:]))

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
    if where == "after":
        after_step = CheckpointManager.after_step

        def held_after_step(self, step, skipped):
            after_step(self, step, skipped)
            if step == at:
                hold()

        CheckpointManager.after_step = held_after_step
    else:
        finish_rank = Checkpointer._finish_rank

        def held_finish_rank(self, step, tmp):
            finish_rank(self, step, tmp)
            if step == at:
                hold()

        Checkpointer._finish_rank = held_finish_rank


if __name__ == "__main__":
    where, at = os.environ["FENCE_HOLD"].split(":")
    install(where, int(at))
    raise SystemExit(main(sys.argv[1:]))

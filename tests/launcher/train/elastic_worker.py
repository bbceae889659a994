"""A rank of an elastic run in test_elastic.py: `moetron train …` as torchrun starts it, with pauses
that hold a node at a chosen moment so the test can kill it exactly there.

    ELASTIC_NODE=b ELASTIC_PAUSES=b:4:after:2 ELASTIC_MARKS=DIR \\
        torchrun --nnodes=1:2 … tests/launcher/train/elastic_worker.py train CONFIG key=value … --layout auto

ELASTIC_NODE names the node (the agent) this rank runs on; ELASTIC_PAUSES lists NODE:WORLD:WHERE:STEP
(comma-separated): on NODE, in a world of WORLD ranks, this rank stops
  after  after step STEP (and its checkpoint, if one is due): until the agent tells it to stop
         (SIGTERM: the node is to be killed, or a node joined and the agent restarts the ranks);
  save   inside the save of STEP, its shards written, the checkpoint not yet published: for good;
  load   before it loads the checkpoint of STEP, resuming: for good.
and first writes DIR/NODE-WORLD-WHERE-STEP.rank<RANK>, so the test knows the moment has come. The
patches wrap functions in this process only: production code holds no test seam.
"""

import os
import signal
import sys
import time
from pathlib import Path

from moetron.launcher.cli.main import main


def pauses_here() -> dict[str, int]:
    """WHERE → STEP for this node and world size."""
    node, world = os.environ["ELASTIC_NODE"], os.environ.get("WORLD_SIZE", "1")
    plans = [p.split(":") for p in os.environ.get("ELASTIC_PAUSES", "").split(",") if p]
    return {where: int(step) for n, w, where, step in plans if (n, w) == (node, world)}


def hold(where: str, step: int, until_signalled: bool) -> None:
    mark = f"{os.environ['ELASTIC_NODE']}-{os.environ.get('WORLD_SIZE', '1')}-{where}-{step}.rank{os.environ['RANK']}"
    Path(os.environ["ELASTIC_MARKS"], mark).touch()
    deadline = time.time() + 300
    while time.time() < deadline:
        # The training loop's StopFlag is the SIGTERM handler while it runs; a signal sets it.
        handler = signal.getsignal(signal.SIGTERM)
        if until_signalled and getattr(getattr(handler, "__self__", None), "signum", None) is not None:
            return
        time.sleep(0.05)


def hold_after(cls, name: str, where: str, at: int, until_signalled: bool) -> None:
    """Wrap the method `cls.name(self, step, ...)` to hold once it has run for step `at`."""
    original = getattr(cls, name)

    def held(self, step, *args):
        original(self, step, *args)
        if step == at:
            hold(where, step, until_signalled)

    setattr(cls, name, held)


def install(pauses: dict[str, int]) -> None:
    """Wrap the functions `pauses` holds in. Imported here, not at the top: a rank with no pause,
    or one refused at the start, loads the training stack only when `moetron train` does (a
    restart's ranks are new processes, and the stack takes seconds of CPU to import)."""
    if not pauses:
        return
    from moetron.launcher.checkpoint.store import Checkpointer
    from moetron.launcher.run_dir import checkpoint_step
    from moetron.launcher.train import trainer
    from moetron.launcher.train.checkpointer import CheckpointManager

    if "after" in pauses:
        hold_after(CheckpointManager, "after_step", "after", pauses["after"], until_signalled=True)
    if "save" in pauses:
        hold_after(Checkpointer, "_finish_rank", "save", pauses["save"], until_signalled=False)
    if "load" in pauses:
        load_checkpoint = trainer.load_checkpoint

        def paused_load(path, *args, **kwargs):
            if checkpoint_step(path) == pauses["load"]:
                hold("load", pauses["load"], until_signalled=False)
            return load_checkpoint(path, *args, **kwargs)

        trainer.load_checkpoint = paused_load


if __name__ == "__main__":
    # As `python -m moetron` does: Slurm's checkpoint signal waits for the training loop's handler.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    install(pauses_here())
    raise SystemExit(main(sys.argv[1:]))

"""Poisons one rank of a real multi-rank run; test_nonfinite.py forks its 2 ranks as torchrun
would start them (tests/forked_ranks.py), or by hand:

    torchrun --standalone --nproc-per-node 2 tests/launcher/train/nonfinite_worker.py RUN_DIR

Three runs of the same config (dp 2 × ep 2): clean; one rank's gradient poisoned at steps 3 and 6;
one rank's batch poisoned (its embedding output NaN) from step 2 on. Each run's outcome (finished,
or the NonFiniteError line) goes to RUN_DIR/<name>.outcome.json for the test to read.
"""

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moetron.launcher.cluster.bootstrap import detect_rank, init_distributed, shutdown
from moetron.launcher.config import load_config
from moetron.launcher.train import trainer
from moetron.launcher.train.nonfinite import NonFiniteError
from moetron.launcher.train.trainer import train

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "model.moe.d_expert=64", "train.seq_len=32", "train.batch_size=4", "train.log_every=1", "train.eval_every=100",
         "train.eval_batches=1", "train.warmup_steps=2", "train.threads=1", "train.precision=fp32", "train.steps=6",
         "train.checkpoint.every=1", "train.checkpoint.keep=100", "train.max_skipped_steps=3",
         "parallel.dp=2", "parallel.ep=2"]


class StepHooks:
    """Calls into one run around each step; `step` is the 1-based number of the step running."""

    def before_step(self, step, pm):
        """Before the forward passes of `step`."""

    def after_backward(self, step, pm):
        """After the backward passes of `step`, before the gradients are reduced, clipped and applied."""


@contextlib.contextmanager
def hooked(hooks: StepHooks | None):
    """The trainer's train_step, wrapped to call `hooks`, for the runs inside (fresh runs: the
    calls count the steps)."""
    if hooks is None:
        yield
        return
    original, steps = trainer.train_step, [0]

    def train_step(pm, optimizer, batch, **kwargs):
        steps[0] += 1
        step = steps[0]
        hooks.before_step(step, pm)
        return original(pm, optimizer, batch, **kwargs, after_backward=lambda: hooks.after_backward(step, pm))

    trainer.train_step = train_step
    try:
        yield
    finally:
        trainer.train_step = original


class PoisonGradient(StepHooks):
    """NaN in one element of one gradient of `rank`, after its backward pass, at `steps`."""

    def __init__(self, rank: int, steps: set[int]):
        self.rank, self.steps = rank, steps

    def after_backward(self, step, pm):
        if dist.get_rank() == self.rank and step in self.steps:
            grad = next(p.grad for _, p in pm.named_parameters() if p.grad is not None)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("nan")


class PoisonBatch(StepHooks):
    """`rank`'s token embeddings come out NaN from step `first` on, as a corrupted batch would."""

    def __init__(self, rank: int, first: int):
        self.rank, self.first, self.handle = rank, first, None

    def before_step(self, step, pm):
        if dist.get_rank() == self.rank and step >= self.first and self.handle is None:
            embed = pm.modules[0].embed
            self.handle = embed.register_forward_hook(lambda mod, args, out: out * float("nan"))


def run(run_dir: Path, name: str, hooks: StepHooks | None) -> None:
    cfg = load_config(TINY, [*SMALL, f"train.run_dir={run_dir}", f"train.name={name}"])
    try:
        with hooked(hooks):
            train(cfg, console=lambda *_: None)
        outcome = {"finished": True}
    except NonFiniteError as e:
        outcome = {"finished": False, "error": str(e)}
    outcome["rank"] = dist.get_rank()
    (run_dir / f"{name}.rank{dist.get_rank()}.outcome.json").write_text(json.dumps(outcome))


def main() -> None:
    run_dir = Path(sys.argv[1])
    init_distributed(detect_rank())
    try:
        run(run_dir, "clean", None)
        run(run_dir, "grad", PoisonGradient(rank=1, steps={3, 6}))
        run(run_dir, "batch", PoisonBatch(rank=0, first=2))
        dist.barrier()
    finally:
        shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()

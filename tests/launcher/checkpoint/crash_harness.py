"""SIGKILL a training run at random moments while it writes checkpoints, resume, and compare.

    python tests/launcher/checkpoint/crash_harness.py OUT_DIR [--trials-per-mode N] [--modes sync-1 async-4 ...]

One driver process imports torch and moetron once, runs no tensor op itself, and forks every
rank of every run from there (a fork costs milliseconds; an import costs seconds). For each mode
(sync or async saves, 1 or 4 ranks) it trains one uninterrupted reference run, then N trials:
start the same run, SIGKILL every rank at a random moment of its training (after its first logged
step), read what the kill left on disk (the phase of the save it interrupted), resume with
`--resume auto` semantics to the last step, and compare every logged loss with the reference. A
checkpoint every step keeps a save in flight most of the time. Random kills land almost always in
the shard writes, the longest phase; so each mode also has one trial per phase in which the save
of a random step stops there (`stall_saves` patches the checkpoint writer in the forked ranks) and
the kill comes once the disk shows it. The ranks leave out what no save touches (the MoE dashboard
images, the FLOP-counted step). One JSON line per trial and a summary go to stdout.

Kill points, read off the disk after the kill (the save at the newest step being written):
  shards    a .tmp-step-* folder without this save's manifest (shards, rng, state being written)
  manifest  the merged manifest.json written, COMPLETE not yet
  rename    COMPLETE written, the folder not yet renamed
  latest    renamed, the `latest` pointer not yet moved
  between   no save in flight (training, or pruning an old checkpoint)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np

from moetron.launcher.checkpoint.folders import COMPLETE, complete_checkpoints, step_of
from moetron.launcher.checkpoint.store import Checkpointer
from moetron.launcher.config import load_config
from moetron.launcher.data.corpus import write_shards
from moetron.launcher.data.tokenizer import ByteTokenizer

# Run as a script; tests/forked_ranks.py starts the ranks of the test's other multi-rank launches.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from forked_ranks import fork, free_port, import_the_training_stack, torchrun_env  # noqa: E402

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
STEPS = 5
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=32", "model.moe.num_experts=4", "train.seq_len=16", "train.batch_size=8",
         "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1", "train.warmup_steps=2",
         "train.threads=1", "train.precision=fp32", f"train.steps={STEPS}", "train.checkpoint.every=1",
         "train.checkpoint.keep=2"]
MODES = {  # name → (ranks, overrides)
    "sync-1": (1, []),
    "async-1": (1, ["train.checkpoint.async=true"]),
    "sync-4": (4, ["parallel.dp=4", "parallel.ep=2"]),
    "async-4": (4, ["parallel.dp=4", "parallel.ep=2", "train.checkpoint.async=true"]),
}


PHASES = ("shards", "manifest", "rename", "latest")
# The Checkpointer method that starts each phase after the first (Checkpointer._publish).
PHASE_STARTS = {"manifest": "_mark_complete", "rename": "_move_into_place", "latest": "_point_latest"}


def stall_saves(plan: str) -> None:
    """Make this process's save of STEP stop for an hour at PHASE ("STEP:PHASE"; "STEP" alone means
    STEP:shards), so a kill lands there deterministically: "shards" (each rank, its shards and
    manifest part written), "manifest" (rank 0, merged manifest written, no COMPLETE), "rename"
    (COMPLETE written, folder not renamed), "latest" (renamed, pointer not moved)."""
    step_text, _, phase = plan.partition(":")
    step, phase = int(step_text), phase or "shards"
    if phase == "shards":
        finish_rank = Checkpointer._finish_rank

        def stalled_finish_rank(self, at: int, tmp: Path) -> None:
            finish_rank(self, at, tmp)
            if at == step:
                time.sleep(3600)

        Checkpointer._finish_rank = stalled_finish_rank
        return
    name = PHASE_STARTS[phase]
    start_phase = getattr(Checkpointer, name)

    def stalled(self, *args) -> None:  # the last argument is the final checkpoint folder
        if step_of(args[-1]) == step:
            time.sleep(3600)
        start_phase(self, *args)

    setattr(Checkpointer, name, stalled)


def skip_what_saves_do_not_touch() -> None:
    """In a forked rank: no MoE dashboard images and no FLOP-counted first step. Neither reads or
    writes a checkpoint, and they are a third of a 1-rank run's CPU (matplotlib) and a fifth of a
    4-rank one's (the counted step); the losses logged, and everything saved, stay the same."""
    from moetron.launcher.perf.mfu import MfuMeter
    from moetron.launcher.train.dashboards import Dashboards

    Dashboards._image = lambda *args, **kwargs: None
    MfuMeter.step = lambda self, model, tokens: contextlib.nullcontext()


def start(cfg_overrides: list[str], ranks: int, stall: str | None = None) -> list[int]:
    """Fork `ranks` processes that train the config (resuming what the run folder holds)."""
    port = free_port()

    def train_rank(rank: int) -> int:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        skip_what_saves_do_not_touch()
        if stall:
            stall_saves(stall)
        if ranks > 1:
            torchrun_env(rank, ranks, port)
        from moetron.launcher.train.trainer import train

        train(load_config(TINY, cfg_overrides), console=lambda *_: None)
        return 0

    return [fork(lambda rank=rank: train_rank(rank)) for rank in range(ranks)]


def wait_all(pids: list[int], timeout: float = 300) -> list[int]:
    deadline, codes = time.time() + timeout, {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if time.time() > deadline:
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
            raise TimeoutError("a run did not finish")
        time.sleep(0.02)
    return [codes[p] for p in pids]


def kill_point(ckpts: Path) -> tuple[str, int | None]:
    """Which phase of which save the kill interrupted, from what is on disk."""
    tmps = sorted(ckpts.glob(".tmp-step-*"))
    done = complete_checkpoints(ckpts)
    pointer = (ckpts / "latest").read_text().strip() if (ckpts / "latest").is_file() else None
    if tmps:
        tmp = tmps[-1]
        step = int(tmp.name.split("-")[-1])
        if (tmp / COMPLETE).is_file():
            return "rename", step
        if (tmp / "manifest.json").is_file():
            return "manifest", step
        return "shards", step
    if done and done[-1].name != pointer:
        return "latest", int(done[-1].name.split("-")[-1])
    return "between", None


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def prepare_data(folder: Path) -> str:
    rng = np.random.default_rng(0)
    text = " ".join("".join(rng.choice(list("abcdefgh "), size=40)) for _ in range(400))
    tok = ByteTokenizer()
    ids = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16)
    write_shards(folder / "corpus", {"train": ids, "val": ids[:2000]}, tok)
    return str(folder / "corpus")


def poll(done, timeout: float = 120) -> None:
    """Wait until `done()` (checked every 10 ms), or the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done():
        time.sleep(0.01)


def first_step_logged(run: Path) -> bool:
    """Start-up is over: the first step's line is in metrics.jsonl (its save comes right after)."""
    metrics = run / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def reference_run(base: list[str], ranks: int, run: Path) -> tuple[dict[int, float], float]:
    """The uninterrupted run → its losses, and the seconds from its first logged step to its end."""
    pids = start([*base, f"train.name={run.name}"], ranks)
    poll(lambda: first_step_logged(run))
    t0 = time.perf_counter()
    assert wait_all(pids) == [0] * ranks, f"{run.parent.name}: reference failed"
    return losses(run), time.perf_counter() - t0


def trial(base: list[str], ranks: int, run: Path, plan: tuple[int, str] | None, rng: random.Random,
          training_s: float) -> dict:
    """Start the run, SIGKILL every rank (at a random moment of its training, or where `plan`
    stalls a save), read what the kill left on disk, and resume it to the end."""
    ckpts = run / "checkpoints"
    pids = start([*base, f"train.name={run.name}"], ranks, stall=plan and f"{plan[0]}:{plan[1]}")
    if plan is None:
        # From the first logged step on (start-up, a third of a run, killed nothing), anywhere
        # until the reference's end: timed from the run's own start-up, as load on the machine
        # stretches one run's and not another's.
        poll(lambda: first_step_logged(run))
        time.sleep(rng.uniform(0.0, 1.0) * training_s)
    else:
        poll(lambda: ckpts.is_dir() and kill_point(ckpts) == plan[::-1])
    for pid in pids:
        with_suppressed(lambda: os.kill(pid, signal.SIGKILL))
    wait_all(pids)
    point, writing = kill_point(ckpts) if ckpts.is_dir() else ("before the first save", None)
    done = complete_checkpoints(ckpts) if ckpts.is_dir() else []
    newest = int(done[-1].name.split("-")[-1]) if done else 0
    # Saves are every step: every step before the one being written must be on disk.
    expected = (writing - 1) if writing is not None else newest
    lost = max(expected - newest, 0) if point != "before the first save" else 0
    codes = wait_all(start([*base, f"train.name={run.name}"], ranks))
    return {"planned": plan and list(plan), "kill_point": point, "writing_step": writing, "resumed_from": newest,
            "checkpoints_lost": lost, "resume_exit": codes,
            "losses": losses(run) if codes == [0] * ranks else {}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--trials-per-mode", type=int, default=6,
                   help="random kills per 1-rank mode (a quarter of it, at least 1, per 4-rank mode)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = p.parse_args()
    rng = random.Random(args.seed)
    import_the_training_stack()
    data = prepare_data(args.out)
    summary = {"trials": 0, "points": {}, "lost": 0, "mismatched": 0}
    for mode in args.modes:
        ranks, extra = MODES[mode]
        base = [*SMALL, *extra, f"data.source={data}", f"train.run_dir={args.out / mode}"]
        reference, training_s = reference_run(base, ranks, args.out / mode / "reference")
        # 4-rank runs cost ~4× a 1-rank run on 2 cores: fewer random kills there.
        random_kills = args.trials_per_mode if ranks == 1 else max(args.trials_per_mode // 4, 1)
        plans = [None] * random_kills + [(rng.randint(2, STEPS - 1), phase) for phase in PHASES]
        for number, plan in enumerate(plans):
            result = trial(base, ranks, args.out / mode / f"trial{number}", plan, rng, training_s)
            same = result.pop("losses") == reference
            summary["trials"] += 1
            summary["points"][result["kill_point"]] = summary["points"].get(result["kill_point"], 0) + 1
            summary["lost"] += result["checkpoints_lost"]
            summary["mismatched"] += not same
            print(json.dumps({"mode": mode, "trial": number, **result, "losses_equal": same}), flush=True)
    print(json.dumps({"summary": summary}), flush=True)
    return 0 if summary["lost"] == 0 and summary["mismatched"] == 0 else 1


def with_suppressed(fn) -> None:
    try:
        fn()
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())

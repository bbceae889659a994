"""Losing half the ranks mid-run: what it costs, and whether the loss curve continues.

Two torchrun agents on this machine, each a "node" of 2 ranks, train configs/tiny.yaml (shrunk)
with `--layout auto` in one c10d rendezvous (`--nnodes=1:2 --max-restarts=3`). When rank 0 prints
step K, one agent and its ranks are killed (SIGKILL). The other agent restarts its ranks on the
smaller world: they plan a layout for 2 ranks, reshard the newest checkpoint into it and train to
the last step. The same config is also trained uninterrupted on 4 ranks (the same global batch).

    python bench/elastic_recovery.py                       # 60 steps, killed at 35, checkpoints every 10
    python bench/elastic_recovery.py --png loss.png        # and both loss curves
    python bench/elastic_recovery.py --set model.moe.aux_loss_coef=0   # with config overrides

Prints a table and one JSON line: the steps trained again (those after the checkpoint resumed from),
seconds from the kill to each stage of the recovery (from the arrival of the console lines: the new
world's layout planned, the checkpoint loaded, the next optimizer step done), and the largest
relative difference of a step's loss from the uninterrupted run's, in the 10 steps after the
resume and in all, and for how many steps after the resume it stays within 1e-4. Two more runs
separate the recovery from the change of layout: 2 ranks started by hand from the checkpoint the
recovery resumed from, with the same micro-batches (the recovered steps must equal its), and 2
ranks trained uninterrupted from step 0 in micro-batches of 8 sequences rather than 4 (what the
recovery would drift by if it did not keep the micro-batch size). The balance loss
(model.moe.aux_loss_type micro_batch, Switch's) and the router capacity are per micro-batch:
`--layout auto` keeps a resumed run's micro-batch size (dp2 accumulates 2 micro-batches of the 4
sequences each of the 4 ranks had), so the objective stays the same and only the order of the
gradient sums differs. Other micro-batches train a slightly different objective, whose differences
the routers' top-k and AdamW carry on step by step (README, Losing nodes).

The recovery is restart-from-checkpoint: no state survives in memory. The planner sees a fixed cpu
profile (in a private cache), so every machine plans dp4 → dp2; the rendezvous store is hosted by
this script (as a login node would), with the settings in RDZV_CONF.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "model.moe.d_expert=64", "model.moe.num_experts=4", "train.seq_len=64", "train.batch_size=16",
         "train.log_every=1", "train.eval_every=100000", "train.eval_batches=1", "train.warmup_steps=5",
         "train.threads=1", "train.peak_tflops=1", "train.precision=fp32"]
# A dead node is noticed after 5 missed 1-s heartbeats; a smaller world forms 3 s after its first node.
RDZV_CONF = "join_timeout=120,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=5,is_host=false"
STEP_LINE = re.compile(r"^step (\d+)/\d+ ")


class Agents:
    """torchrun agents of one run; every line they print is kept with its arrival time."""

    def __init__(self, run_dir: Path, name: str, port: int, overrides: list[str], env: dict, nodes: int = 2):
        self.run_dir, self.name, self.port, self.overrides, self.env = run_dir, name, port, overrides, env
        self.nodes = nodes
        self.procs: dict[str, subprocess.Popen] = {}
        self.lines: list[tuple[float, str, str]] = []  # (time, agent, line)

    def start(self, agent: str, *train_args: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{self.nodes}", "--nproc-per-node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.name}",
               f"--rdzv-conf={RDZV_CONF}", "--max-restarts=3", "-m", "moetron", "train", "configs/tiny.yaml",
               *self.overrides, f"train.run_dir={self.run_dir}", f"train.name={self.name}", "--layout", "auto",
               *train_args]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        self.procs[agent] = proc
        threading.Thread(target=self._read, args=(agent, proc), daemon=True).start()

    def _read(self, agent: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append((time.perf_counter(), agent, line.rstrip("\n")))

    def first(self, pattern: str, after: float = 0.0, timeout: float = 300) -> tuple[float, str]:
        """(arrival time, line) of the first line after `after` that matches `pattern`."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            for t, _, line in list(self.lines):
                if t >= after and re.search(pattern, line):
                    return t, line
            if all(p.poll() is not None for p in self.procs.values()):
                break
            time.sleep(0.01)
        tail = "\n".join(line for _, _, line in self.lines[-40:])
        raise RuntimeError(f"{self.name}: no line matching {pattern!r}; last lines:\n{tail}")

    def kill(self, agent: str) -> None:
        """The node dies: its agent and every process under it."""
        kill_tree(self.procs.pop(agent))

    def wait(self, timeout: float = 600) -> None:
        for agent, proc in self.procs.items():
            if proc.wait(timeout=timeout) != 0:
                tail = "\n".join(line for _, _, line in self.lines[-40:])
                raise RuntimeError(f"{self.name}: agent {agent} exited {proc.returncode}; last lines:\n{tail}")


def descendants(pid: int) -> list[int]:
    """Every live process under `pid` (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and every process under it at once, as when their node dies; then reap `proc`."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def losses(run: Path) -> dict[int, float]:
    """Each step's loss as last logged (steps trained again overwrite the first try)."""
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def uninterrupted(root: Path, port: int, overrides: list[str], env: dict) -> tuple[dict[int, float], float]:
    agents = Agents(root, "straight", port, overrides, env)
    t0 = time.perf_counter()
    agents.start("a")
    agents.start("b")
    agents.wait()
    starts = (root / "straight" / "layouts.jsonl").read_text().splitlines()
    if len(starts) != 1:  # the agents must meet within last_call_timeout, or the run starts smaller
        raise RuntimeError(f"the uninterrupted run restarted: {starts}")
    return losses(root / "straight"), time.perf_counter() - t0


def uninterrupted_small(root: Path, port: int, overrides: list[str], env: dict) -> dict[int, float]:
    """The same config trained by 2 ranks from step 0, without a failure, in the micro-batches the
    planner picks for 2 ranks (8 sequences, not 4): the drift of other micro-batches."""
    agents = Agents(root, "straight2", port, overrides, env, nodes=1)
    agents.start("a")
    agents.wait()
    return losses(root / "straight2")


def resumed_by_hand(root: Path, port: int, overrides: list[str], env: dict, checkpoint: Path) -> dict[int, float]:
    """The steps after `checkpoint` trained by 2 ranks started for it: what the recovery should equal."""
    agents = Agents(root, "by_hand", port, overrides, env, nodes=1)
    agents.start("a", "--resume", str(checkpoint))
    agents.wait()
    return losses(root / "by_hand")


def interrupted(root: Path, port: int, overrides: list[str], env: dict, fail_at: int) -> dict:
    """The run that loses agent b once rank 0 printed step `fail_at`; the recovery's timeline."""
    agents = Agents(root, "elastic", port, overrides, env)
    t0 = time.perf_counter()
    agents.start("a")
    agents.start("b")
    agents.first(rf"^step {fail_at}/")
    agents.kill("b")
    killed = time.perf_counter()
    trained = max(int(m.group(1)) for t, _, line in agents.lines if t <= killed and (m := STEP_LINE.match(line)))
    planned, _ = agents.first(r"^--layout auto on 2 ", after=killed)
    loaded, line = agents.first(r"^resumed from .* at step \d+", after=killed)
    resumed = int(line.rsplit(" ", 1)[1])
    stepped, _ = agents.first(rf"^step {resumed + 1}/", after=killed)
    agents.wait()
    return {"losses": losses(root / "elastic"), "wall_s": time.perf_counter() - t0, "trained_before_kill": trained,
            "resumed_from": resumed, "redone": trained - resumed, "to_layout_s": planned - killed,
            "to_loaded_s": loaded - killed, "to_next_step_s": stepped - killed,
            "starts": [json.loads(s) for s in (root / "elastic" / "layouts.jsonl").read_text().splitlines()]}


def control_drift(small: dict[int, float], want: dict[int, float]) -> dict:
    """2 ranks against 4, both uninterrupted: the largest relative difference in the first 10 steps
    and in all, and for how many steps from the first it stays within 1e-4."""
    rel = [abs(small[s] - want[s]) / abs(want[s]) for s in sorted(want)]
    return {"control_max_10": max(rel[:10]), "control_max": max(rel),
            "control_within_1e-4": next((i for i, d in enumerate(rel) if d > 1e-4), len(rel))}


def environment(cache: Path) -> dict:
    """A private cache holding a fixed cpu profile, one thread a rank, a store per world."""
    from moetron.launcher.perf.device_profiles import DeviceProfile, save_profile

    save_profile(DeviceProfile("cpu", 1e10, 8e9, 0.8, 1e9, 1e-4, 1e9, 1e-4, hbm_bw=1e10, dp_overlap=0.0),
                 cache / "moetron" / "plan_profile.json")
    return {**os.environ, "XDG_CACHE_HOME": str(cache), "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def table(r: dict) -> str:
    head = ["ranks", "killed after step", "resumed from", "steps re-done", "kill → layout planned (s)",
            "kill → checkpoint loaded (s)", "kill → next optimizer step (s)",
            "max rel. loss diff, 10 steps after / all (vs uninterrupted)", "steps after within 1e-4",
            "vs the same resume by hand",
            "2 ranks in micro-batches of 8, no failure: max rel. diff 10 first / all, steps within 1e-4",
            "wall s (uninterrupted)"]
    worlds = " → ".join(str(s["world_size"]) for s in r["starts"])
    row = [worlds, r["trained_before_kill"], r["resumed_from"], r["redone"], f"{r['to_layout_s']:.1f}",
           f"{r['to_loaded_s']:.1f}", f"{r['to_next_step_s']:.1f}",
           f"{r['max_rel_diff_10']:.1e} / {r['max_rel_diff']:.1e}", r["steps_within_1e-4"],
           f"{r['max_rel_diff_by_hand']:.1e}",
           f"{r['control_max_10']:.1e} / {r['control_max']:.1e}, {r['control_within_1e-4']}",
           f"{r['wall_s']:.0f} ({r['straight_wall_s']:.0f})"]
    return "\n".join(["| " + " | ".join(head) + " |", "| ---" + " | ---:" * (len(head) - 1) + " |",
                      "| " + " | ".join(map(str, row)) + " |"])


def plot(want: dict[int, float], got: dict[int, float], r: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(list(want), list(want.values()), label="uninterrupted, 4 ranks", linewidth=3, alpha=0.4)
    ax.plot(list(got), list(got.values()), label="4 ranks, 2 killed → 2 ranks", linestyle="--", marker=".")
    killed, resumed = r["trained_before_kill"], r["resumed_from"]
    ax.axvline(killed, color="red", linewidth=1, label=f"kill (after step {killed})")
    ax.axvline(resumed, color="grey", linewidth=1, linestyle=":", label=f"resumed from step {resumed}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"losing half the ranks at step {killed}: largest relative loss difference "
                 f"{r['max_rel_diff_10']:.1e} in the 10 steps after the resume, {r['max_rel_diff']:.1e} in all",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="steps of the run")
    p.add_argument("--fail-at", type=int, default=35, help="kill the second node once rank 0 printed this step")
    p.add_argument("--checkpoint-every", type=int, default=10, help="train.checkpoint.every")
    p.add_argument("--png", type=Path, help="write both loss curves here")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    p.add_argument("--keep", type=Path, help="keep the run folders and logs in this folder (default: a temporary one)")
    args = p.parse_args()
    import torch.distributed as dist

    # Every checkpoint kept: the one the recovery resumed from is trained again by hand.
    overrides = [*MODEL, *args.set, f"train.steps={args.steps}", f"train.checkpoint.every={args.checkpoint_every}",
                 "train.checkpoint.keep=1000"]
    # The rendezvous store outlives the agents, whichever is killed.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        env = environment(root / "cache")
        want, straight_s = uninterrupted(root, store.port, overrides, env)
        r = interrupted(root, store.port, overrides, env, args.fail_at)
        checkpoint = root / "elastic" / "checkpoints" / f"step-{r['resumed_from']:08d}"
        kept = f"train.micro_batch_size={r['starts'][0]['micro_batch']}"  # as the recovery kept it
        control = resumed_by_hand(root, store.port, [*overrides, kept], env, checkpoint)
        small = uninterrupted_small(root, store.port, overrides, env)
    got = r.pop("losses")
    assert sorted(got) == sorted(want) == list(range(1, args.steps + 1)), (sorted(got), sorted(want))
    after = [s for s in want if s > r["resumed_from"]]
    r["rel_diff"] = {s: abs(got[s] - want[s]) / abs(want[s]) for s in want}
    r["max_rel_diff_10"] = max(r["rel_diff"][s] for s in after[:10])
    r["max_rel_diff"] = max(r["rel_diff"].values())
    r["max_rel_diff_by_hand"] = max(abs(got[s] - control[s]) / abs(control[s]) for s in after)
    r["steps_within_1e-4"] = next((i for i, s in enumerate(after) if r["rel_diff"][s] > 1e-4), len(after))
    r.update(control_drift(small, want))
    r["straight_wall_s"] = straight_s
    print(f"rendezvous: {RDZV_CONF}; {args.steps} steps, checkpoint every {args.checkpoint_every}\n")
    print(table(r))
    if args.png:
        plot(want, got, r, args.png)
        print(f"wrote {args.png}")
    print(json.dumps({"bench": "elastic_recovery", "steps": args.steps, "fail_at": args.fail_at, "set": args.set,
                      "checkpoint_every": args.checkpoint_every, "rdzv_conf": RDZV_CONF,
                      **{k: v for k, v in r.items() if k not in ("starts", "rel_diff")},
                      "layouts": [s["label"] for s in r["starts"]]}))


if __name__ == "__main__":
    main()

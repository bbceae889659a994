"""Losing nodes under torchrun: several agents on this machine, each a "node", all in one c10d
rendezvous (`--nnodes=1:N --max-restarts=3`), train with `--layout auto`. A node is killed (its agent
and its ranks, SIGKILL) at a moment elastic_worker.py holds it at; the agents left restart their
ranks on the smaller world, which plans its layout, reshards the newest complete checkpoint and
trains to the last step with the losses of an uninterrupted one-process run (same global batch).

The rendezvous store is hosted by the test (as by a login node), so whichever agent is killed,
the others can meet again. The rendezvous settings make a restart take seconds instead of
torchrun's defaults (a dead node is noticed after 15 s of missed heartbeats, and a smaller world
is formed 30 s after the first node arrives), and the agents give every world a store of its own
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, launcher/cluster/elastic.py). torchrun starts its ranks in
sessions of their own: killing the agent's process group would leave them training.
"""

import hashlib
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from moetron.launcher.cluster.elastic import restart_problem, stop_agent_at_exit
from moetron.launcher.perf.device_profiles import DeviceProfile, save_profile

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

from elastic_recovery import kill_tree, losses  # noqa: E402  (the bench kills and reads runs the same way)

WORKER = Path(__file__).with_name("elastic_worker.py")
STEPS = 10
# A global batch of 12 rows divides among 1, 2, 3 and 4 ranks; a checkpoint every 2 steps.
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=32", "model.moe.num_experts=4", "train.seq_len=32", "train.batch_size=12",
         "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1", "train.warmup_steps=1",
         "train.threads=1", "train.peak_tflops=1", "train.checkpoint.every=2", "train.precision=fp32",
         f"train.steps={STEPS}"]
# A dead node is noticed after 3 missed 1-s heartbeats (each one the wait of a restart after a kill);
# a smaller world forms 3 s after its first node (agents started together must all arrive within it).
RDZV_CONF = "join_timeout=120,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3,is_host=false"


def profile_env(folder: Path, memory_bytes: float) -> dict:
    """What every process adds to its environment: a cpu profile with `memory_bytes` per rank, one thread."""
    save_profile(DeviceProfile("cpu", 1e10, memory_bytes, 0.8, 1e9, 1e-4, 1e9, 1e-4, hbm_bw=1e10, dp_overlap=0.0),
                 folder / "moetron" / "plan_profile.json")
    return {"XDG_CACHE_HOME": str(folder), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def rendezvous():
    """The port of a rendezvous store that outlives every agent."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    yield store.port
    del store


@pytest.fixture
def reference(forked_moetron):
    """reference(folder, grad_accum) → per-step losses of the same config trained by one process,
    uninterrupted, in `grad_accum` micro-batches: those of the elastic run's first world, which its
    later worlds keep (the process forked as `python -m moetron train` would run: forked_moetron)."""

    def train(folder: Path, grad_accum: int) -> dict[int, float]:
        out = forked_moetron(1, ["train", "configs/tiny.yaml", *SMALL, f"train.grad_accum={grad_accum}",
                                 f"train.run_dir={folder}", "train.name=straight"],
                             profile_env(folder / "cache", 8e9), timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return losses(folder / "straight")

    return train


class Nodes:
    """Agents of one run, each a node named by a letter; its output goes to <folder>/<name>.log."""

    def __init__(self, folder: Path, port: int, nodes: int, per_node: int, pauses: str, env: dict,
                 own_stores: bool = True):
        self.folder, self.port, self.nodes, self.per_node = folder, port, nodes, per_node
        self.marks = folder / "marks"
        self.marks.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **env, "ELASTIC_PAUSES": pauses, "ELASTIC_MARKS": str(self.marks)}
        if own_stores:  # every world its own store: torchrun's shared one breaks restarts (cluster/elastic.py)
            self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.agents: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *train_args: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{self.nodes}",
               f"--nproc-per-node={self.per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
               f"--rdzv-id={self.folder.name}", f"--rdzv-conf={RDZV_CONF}", "--max-restarts=3",
               str(WORKER), "train", "configs/tiny.yaml", *SMALL, f"train.run_dir={self.folder}",
               "train.name=run", "--layout", "auto", *train_args]
        log = (self.folder / f"{name}.log").open("a")
        self.agents[name] = subprocess.Popen(cmd, cwd=ROOT, env={**self.env, "ELASTIC_NODE": name}, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        return self.agents[name]

    def wait_mark(self, mark: str, count: int, timeout: float = 120) -> None:
        """Until `count` ranks have reached the pause `mark` (NODE-WORLD-WHERE-STEP)."""
        deadline = time.time() + timeout
        while len(list(self.marks.glob(f"{mark}.rank*"))) < count:
            if time.time() > deadline or any(a.poll() is not None for a in self.agents.values()):
                self.fail(f"no pause {mark} on {count} ranks")
            time.sleep(0.1)

    def kill(self, name: str) -> None:
        """The node dies: its agent and every process under it, at once."""
        kill_tree(self.agents.pop(name))

    def finish(self, timeout: float = 180) -> dict[str, int]:
        try:
            return {name: agent.wait(timeout=max(timeout, 1)) for name, agent in self.agents.items()}
        except subprocess.TimeoutExpired:
            self.fail("the run did not finish")

    def fail(self, why: str):
        for name in list(self.agents):
            self.kill(name)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.folder.glob("*.log")))
        pytest.fail(f"{why}\n{logs}", pytrace=False)


def starts(run: Path) -> list[tuple[int, int]]:
    """(step, world size) of each start in layouts.jsonl."""
    return [(s["step"], s["world_size"]) for s in map(json.loads, (run / "layouts.jsonl").read_text().splitlines())]


def assert_same_curve(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    # The same global batch in the same micro-batches on other layouts: equal up to the order of sums
    # (README, Losing nodes; bench/elastic_recovery.py).
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got[step], want[step])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_lost_node_shrinks_the_world_and_a_new_one_grows_it_back(tmp_path, rendezvous, reference):
    """4 ranks on 2 nodes; node b dies after step 2 (a checkpoint) → 2 ranks resume at step 2;
    after step 6 node b starts again → the next restart trains steps 7… on 4 ranks."""
    started = time.time()
    nodes = Nodes(tmp_path, rendezvous, 2, 2, "b:4:after:2,a:2:after:6", profile_env(tmp_path / "cache", 8e9))
    nodes.start("a")
    nodes.start("b")
    nodes.wait_mark("b-4-after-2", 2)
    nodes.kill("b")
    nodes.wait_mark("a-2-after-6", 2)
    nodes.start("b")
    assert nodes.finish() == {"a": 0, "b": 0}

    run = tmp_path / "run"
    assert starts(run) == [(0, 4), (2, 2), (6, 4)]
    layouts = [json.loads(line) for line in (run / "layouts.jsonl").read_text().splitlines()]
    # 2 ranks accumulate 2 micro-batches of the 3 sequences each of 4 ranks had (the run's micro-batch kept).
    assert [(s["label"], s["micro_batch"]) for s in layouts] == [("dp4 ddp", 3), ("dp2 ddp ga2", 3), ("dp4 ddp", 3)]
    assert_same_curve(losses(run), reference(tmp_path / "reference", grad_accum=4))
    # Rank 0 says it, on whichever node the rendezvous gave rank 0: node b's agent may hold it in the last world.
    log = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    assert "layout changed at step 2: 4 ranks (dp4 ddp) → 2 ranks (dp2 ddp ga2)" in log
    assert "layout changed at step 6: 2 ranks (dp2 ddp ga2) → 4 ranks (dp4 ddp)" in log
    print(f"elastic 4 → 2 → 4 ranks: {time.time() - started:.1f} s")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_node_lost_while_saving_and_another_while_resharding(tmp_path, rendezvous, reference):
    """3 nodes of one rank: node c dies inside the save of step 4 → the 2 ranks left resume from
    step 2, the newest complete checkpoint; node b dies while they load it → node a alone resumes
    from step 2 again and trains to the end."""
    nodes = Nodes(tmp_path, rendezvous, 3, 1, "c:3:save:4,b:2:load:2", profile_env(tmp_path / "cache", 8e9))
    for name in "abc":
        nodes.start(name)
    nodes.wait_mark("c-3-save-4", 1)
    nodes.kill("c")
    nodes.wait_mark("b-2-load-2", 1)
    nodes.kill("b")
    assert nodes.finish() == {"a": 0}

    run = tmp_path / "run"
    # The 2-rank world never finished loading, so it never started: the record says so.
    assert starts(run) == [(0, 3), (2, 1)]
    assert "resumed from" in (tmp_path / "a.log").read_text()
    assert_same_curve(losses(run), reference(tmp_path / "reference", grad_accum=3))


@pytest.mark.distributed
def test_a_world_too_small_for_any_layout_stops_every_agent_and_leaves_the_checkpoint(tmp_path, rendezvous,
                                                                                     forked_moetron):
    """A run with a checkpoint, started again by two torchrun agents (restarts left) on ranks where
    no layout fits: one line, and both agents stop instead of restarting into the same refusal."""
    env = profile_env(tmp_path / "cache", 8e9)
    first = forked_moetron(1, ["train", "configs/tiny.yaml", *SMALL, f"train.run_dir={tmp_path}", "train.name=run",
                               "--exit-after", "2"], env, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    before = tree_digest(tmp_path / "run")

    nodes = Nodes(tmp_path, rendezvous, 2, 1, "", profile_env(tmp_path / "small-cache", 1e5))
    nodes.start("a")
    nodes.start("b")
    assert all(code != 0 for code in nodes.finish(timeout=120).values())
    logs = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    refusals = [line for line in logs.splitlines() if "--layout auto: no layout of configs/tiny.yaml fits" in line]
    assert len(refusals) == 1, logs[-3000:]  # rank 0 said it once: no restart met it again
    assert tree_digest(tmp_path / "run") == before

    # Restarts on the store torchrun's agents share with the ranks are refused the same way, at once.
    shared = Nodes(tmp_path / "shared", rendezvous, 1, 2, "", env, own_stores=False)
    shared.start("a")
    assert shared.finish(timeout=120)["a"] != 0
    log = (tmp_path / "shared" / "a.log").read_text()
    assert log.count("export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before every torchrun") == 1, log[-3000:]
    assert tree_digest(tmp_path / "run") == before


def test_what_torchrun_restarts_need(monkeypatch):
    """The refusal of restarts on the agents' shared store, and who asks the agent to stop."""
    torchrun = {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "LOCAL_RANK": "0"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_problem(torchrun)
    assert restart_problem({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert restart_problem({**torchrun, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # never restarts
    assert restart_problem({}) is None
    # Only local rank 0 of a torchrun rank with restarts left asks, and only a torchrun parent:
    # pytest is not one.
    assert not stop_agent_at_exit({**torchrun, "LOCAL_RANK": "1"})
    assert not stop_agent_at_exit({**torchrun, "TORCHELASTIC_RESTART_COUNT": "3"})
    assert not stop_agent_at_exit({})
    assert not stop_agent_at_exit(torchrun)


def tree_digest(folder: Path) -> str:
    """One hash of every file's path and bytes under `folder`."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()

"""Checkpoints move between layouts: a state saved under any layout resumes under any other with the
losses of the run that never stopped. Run by every rank of one launch:

    torchrun --nproc-per-node 1 tests/launcher/checkpoint/reshard_worker.py OUT reference
    torchrun --nproc-per-node 4 tests/launcher/checkpoint/reshard_worker.py OUT layouts NAME ... [+ NAME ...]
    torchrun --nproc-per-node 1 tests/launcher/checkpoint/reshard_worker.py OUT plain NAME ...

`reference` (one process): AdamW for SAVE_AT steps, a checkpoint at OUT/plain, then NEXT more steps;
their losses go to OUT/reference.json. `layouts`: each named layout loads OUT/plain, writes its own
checkpoint of that state to OUT/NAME (sharded as it holds it), and trains NEXT steps; then each
layout before the "+" loads every other such layout's checkpoint and trains NEXT steps (the
matrix); those after it only go plain → layout (and, in `plain`, back). A control resumes the
weights without the optimizer state and must miss the losses, or the check could not fail. `plain`: one process loads each
layout's checkpoint and trains NEXT steps. Every resumed run must repeat the reference's NEXT losses
within LOSS_RTOL: weights and both AdamW moments (and its step count) survive every reshard.
Rank 0 prints one JSON line per (source, destination) pair.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetron.launcher.checkpoint.store import load_checkpoint, save_checkpoint
from moetron.launcher.config import TrainConfig
from moetron.launcher.train.optim import optimizer_for
from moetron.launcher.train.trainer import train_step
from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.transformer import build_model
from moetron.parallel.config import ParallelConfig
from moetron.parallel.mesh import ParallelMesh, build_mesh
from moetron.parallel.parallelize import parallelize

LOSS_RTOL = 1e-5
SAVE_AT, NEXT, SEED = 2, 3, 7
BATCH, SEQ = 8, 16
TRAIN = TrainConfig(lr=0.01, weight_decay=0.1)
# No balance loss: it is taken per micro-batch, and the layouts cut the batch differently (the
# parity tests check it against references cut the same way); the z-loss is a mean, so it stays.
MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                    attention="eager",
                    moe=MoEConfig(num_experts=4, top_k=2, d_expert=32, every=2, aux_loss_coef=0.0, z_loss_coef=0.001))

# Four-rank layouts; "plain" is one process.
LAYOUTS = {
    "tp2_ep2": dict(dp=2, tp=2, ep=2),
    "pp2_dp2_1f1b": dict(pp=2, dp=2, microbatches=2, schedule="1f1b"),
    "pp2_vpp2_dp2": dict(pp=2, dp=2, vpp=2, microbatches=2, schedule="interleaved_1f1b"),
    "dp4_fsdp": dict(dp=4),
    "dp4_ddp": dict(dp=4, dp_mode="ddp"),
    "hsdp2x2_ep2": dict(dp=4, ep=2, dp_mode="hsdp", dp_shard=2),
    "zero1_dp4_ep2": dict(dp=4, ep=2, dp_mode="zero1"),
    "cp2_dp2": dict(dp=2, cp=2),
    "tp2_etp2_ep2": dict(dp=2, tp=2, ep=2, etp=2, sequence_parallel=True),
}


def cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, MODEL.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(SAVE_AT + NEXT)]


class Run:
    """One layout's model, optimizer and checkpoint plumbing on this launch's ranks."""

    def __init__(self, mesh: ParallelMesh):
        cfg = mesh.cfg
        self.pm = parallelize(build_model(MODEL, device="meta"), mesh, cfg, seed=SEED, device=torch.device("cpu"),
                              cross_entropy=cross_entropy, microbatch_BS=(BATCH // (cfg.dp * cfg.microbatches), SEQ))
        self.opt = optimizer_for(self.pm, TRAIN)
        self.shards = self.pm.expert_shards()

    def steps(self, data: list[torch.Tensor]) -> list[float]:
        return [train_step(self.pm, self.opt, b, grad_accum=1, grad_clip=1.0,
                           autocast=contextlib.nullcontext).loss for b in data]

    def save(self, root: Path) -> None:
        save_checkpoint(root, SAVE_AT, self.pm.module, self.opt, {"step": SAVE_AT}, expert_shards=self.shards)

    def load(self, root: Path) -> None:
        load_checkpoint(root / f"step-{SAVE_AT:08d}", self.pm.module, self.opt, expert_shards=self.shards)


class Runs:
    """Fresh runs of the named layouts ("plain": one process). Each layout's mesh is built once
    per launch and serves all its runs: its ~25 process groups would otherwise be made again for
    each of the ~40 runs, while the model, optimizer and checkpoint state are new in every run."""

    def __init__(self):
        self.meshes: dict[str, ParallelMesh] = {}

    def __call__(self, name: str) -> Run:
        if name not in self.meshes:
            self.meshes[name] = build_mesh(ParallelConfig(**LAYOUTS.get(name, {})), dist.get_world_size())
        return Run(self.meshes[name])


def relative_error(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def report(source: str, dest: str, losses: list[float], want: list[float], t0: float) -> bool:
    err = relative_error(losses, want)
    ok = err <= LOSS_RTOL
    if dist.get_rank() == 0:
        print(json.dumps({"from": source, "to": dest, "ok": ok, "loss_rel": err,
                          "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
    return ok


def main(out: Path, mode: str, names: list[str]) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    data, runs = batches(), Runs()
    failures = 0
    try:
        if mode == "reference":
            run = runs("plain")
            run.steps(data[:SAVE_AT])
            run.save(out / "plain")
            (out / "reference.json").write_text(json.dumps(run.steps(data[SAVE_AT:])))
            return 0
        want = json.loads((out / "reference.json").read_text())
        if mode == "layouts":
            matrix = names[:names.index("+")] if "+" in names else names
            names = [n for n in names if n != "+"]
            for name in names:  # plain → layout, and the layout's own checkpoint of that state
                t0 = time.perf_counter()
                run = runs(name)
                run.load(out / "plain")
                run.save(out / name)
                failures += not report("plain", name, run.steps(data[SAVE_AT:]), want, t0)
            t0 = time.perf_counter()
            control = runs(names[0])
            load_checkpoint(out / "plain" / f"step-{SAVE_AT:08d}", control.pm.module, None,
                            expert_shards=control.shards)
            err = relative_error(control.steps(data[SAVE_AT:]), want)
            if dist.get_rank() == 0:
                print(json.dumps({"from": "plain weights only", "to": names[0], "ok": err > LOSS_RTOL,
                                  "loss_rel": err, "control": True}), flush=True)
            failures += err <= LOSS_RTOL
            for dest in matrix:  # layout → layout
                for source in matrix:
                    if source != dest:
                        t0 = time.perf_counter()
                        run = runs(dest)
                        run.load(out / source)
                        failures += not report(source, dest, run.steps(data[SAVE_AT:]), want, t0)
        elif mode == "plain":
            for source in names:  # layout → one process
                t0 = time.perf_counter()
                run = runs("plain")
                run.load(out / source)
                failures += not report(source, "plain", run.steps(data[SAVE_AT:]), want, t0)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:]))

"""Communication volume of one training step by kind, predicted from the config and measured on a
real run, side by side.

    python bench/comm_volume.py                      # every layout below, 2 ranks, ~10 s
    python bench/comm_volume.py --layouts tp2 pp2

Predicted: `moetron.launcher.perf.comm_volume.predict_step` from the model and parallel configs, the
batch and the sequence length (its docstring lists what each dimension sends and the byte
convention: nccl-tests' "size", summed over every rank, 1-rank groups left out).

Measured: one `torchrun --nproc-per-node 2` launch runs every layout in turn with the trainer's
own pieces (`build_parallel_model`, AdamW, `train_step`, the per-step stop agreement) on a tiny
MoE model. After one warm-up step (FSDP's lazy init, the pipeline's first handshake) the next
step runs under a `TorchDispatchMode` installed by this bench that records every operator of the
`c10d` namespace (what `torch.distributed`'s process groups dispatch: FSDP2's gathers and
scatters, the pipeline's sends, plain all_reduce/all_to_all) and of the functional-collective
namespaces (DTensor redistributions, loss_parallel, the autograd all-to-all of expert parallel),
letting DTensor desugar first as `CommDebugMode` does. Receives, waits and barriers are not
counted. Each rank's counts are summed on rank 0.

Where they differ, and why: on these layouts calls and bytes agree exactly, the tiny control
all-reduces included, except `ep2_capacity`, whose all-to-all moves less than predicted: routes
over an expert's capacity are dropped before dispatch, and the prediction is the dropless upper
bound (how many are dropped depends on the data). Not measured here, so taken on trust from the
predictor's docstring: 4- and 8-rank mixes, bf16 activations. FSDP under pipeline parallelism
needs 4 ranks: bench/plan_check.py's pp2_dp2 layouts check its total bytes.
A kind whose calls differ but bytes agree would mean torch coalesced or split a collective.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetron.launcher.config import Config, load_config
from moetron.launcher.perf.comm_volume import KINDS, by_kind, predict_step

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "model.moe.d_expert=64", "train.seq_len=32", "train.batch_size=8", "train.threads=1",
         "train.peak_tflops=1", "train.precision=fp32"]
MLA = ["model.n_kv_heads=null", "model.mla.kv_lora_rank=32", "model.mla.q_lora_rank=24",
       "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16"]
LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp2_etp2": ["parallel.tp=2", "parallel.etp=2"],
    "tp2_sp_etp2": ["parallel.tp=2", "parallel.etp=2", "parallel.sequence_parallel=true"],
    "ep2": ["parallel.dp=2", "parallel.ep=2"],
    "dp2_fsdp": ["parallel.dp=2"],
    "dp2_ddp": ["parallel.dp=2", "parallel.dp_mode=ddp"],
    "dp2_accum2": ["parallel.dp=2", "train.grad_accum=2"],
    "ep2_capacity": ["parallel.dp=2", "parallel.ep=2", "model.moe.capacity_factor=1.0"],
    "pp2": ["parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=1f1b"],
    "cp2": ["parallel.cp=2"],
    "dp2_hsdp_shard1": ["parallel.dp=2", "parallel.dp_mode=hsdp", "parallel.dp_shard=1"],
    # Accumulation: HSDP reduce-scatters (here within one rank) every micro-batch, all-reduces once.
    "dp2_hsdp_shard1_accum2": ["parallel.dp=2", "parallel.dp_mode=hsdp", "parallel.dp_shard=1", "train.grad_accum=2"],
    "dp2_zero1": ["parallel.dp=2", "parallel.dp_mode=zero1"],
    "ep2_zero1": ["parallel.dp=2", "parallel.ep=2", "parallel.dp_mode=zero1"],
    "ep2_ddp": ["parallel.dp=2", "parallel.ep=2", "parallel.dp_mode=ddp"],
    "cp2_sequence_loss": ["parallel.cp=2", "model.moe.aux_loss_type=sequence"],
    "dp2_accum2_global_loss": ["parallel.dp=2", "train.grad_accum=2", "model.moe.aux_loss_type=global_batch"],
    # Multi-head latent attention: its weights (down projections whole on each tp rank) and, under
    # cp, the latent and rope key gathered instead of keys and values.
    "dp2_ddp_mla": ["parallel.dp=2", "parallel.dp_mode=ddp", *MLA],
    "tp2_mla": ["parallel.tp=2", *MLA],
    "tp2_sp_mla": ["parallel.tp=2", "parallel.sequence_parallel=true", *MLA],
    "tp2_mla_no_q_latent": ["parallel.tp=2", *MLA, "model.mla.q_lora_rank=0"],
    "cp2_mla": ["parallel.cp=2", *MLA],
    # Multi-token prediction: one more block, its projection and norms, and the head once more.
    "tp2_mtp": ["parallel.tp=2", "model.mtp_depth=1"],
    "tp2_sp_mtp": ["parallel.tp=2", "parallel.sequence_parallel=true", "model.mtp_depth=1"],
    "dp2_ddp_mtp": ["parallel.dp=2", "parallel.dp_mode=ddp", "model.mtp_depth=1"],
    "ep2_mtp": ["parallel.dp=2", "parallel.ep=2", "model.mtp_depth=1"],
    "dp2_accum2_mtp": ["parallel.dp=2", "train.grad_accum=2", "model.mtp_depth=1"],
    "dp2_ddp_accum2_mtp": ["parallel.dp=2", "parallel.dp_mode=ddp", "train.grad_accum=2", "model.mtp_depth=1"],
    "pp2_mtp": ["parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=1f1b", "model.mtp_depth=1"],
}
COUNTED_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def layout_config(name: str) -> Config:
    return load_config(TINY, [*SMALL, *LAYOUTS[name]])


# -- measuring (runs on every rank of the launch) --------------------------------------------


def _kind(op_name: str) -> str | None:
    """The table's kind of a collective operator; None for what is not counted."""
    name = op_name.strip("_")
    if "alltoall" in name or "all_to_all" in name:
        return "all_to_all"
    if "allreduce" in name or "all_reduce" in name:
        return "all_reduce"
    if "allgather" in name or "all_gather" in name:
        return "all_gather"
    if "reduce_scatter" in name:
        return "reduce_scatter"
    if name == "send":
        return "p2p"
    if "broadcast" in name:
        return "broadcast"
    if "scatter" in name or "gather" in name or name == "reduce":
        return "other"
    return None  # recv, wait_tensor, barrier: the other side of a counted call, or no data


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _group_size(args) -> int:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, str):
            try:
                return _resolve_process_group(a).size()
            except (KeyError, RuntimeError, ValueError):
                continue
        if isinstance(a, torch.ScriptObject):  # c10d ops carry the group boxed
            try:
                return dist.ProcessGroup.unbox(a).size()
            except (RuntimeError, TypeError):
                continue
        size = getattr(a, "size", None)
        if callable(size) and not isinstance(a, torch.Tensor):
            return int(size())
    return 0


class CollectiveCounter(TorchDispatchMode):
    """Counts calls and bytes (nccl-tests' size convention) of every collective operator seen."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.local_calls = 0  # collectives on 1-rank groups: no communication
        self.ops: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn itself into collectives, then count those
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", None) in COUNTED_NAMESPACES:
            self._record(func, args)
        return out

    def _record(self, func, args) -> None:
        name = func._overloadpacket.__name__
        kind = _kind(name)
        if kind is None:
            return
        group = _group_size(args)
        if group == 1:
            self.local_calls += 1
            return
        functional = func.namespace != "c10d"
        tensors = _tensors(args)
        if kind == "all_gather":
            size = tensors[0].nbytes * group if functional else max(t.nbytes for t in tensors)
        elif kind in ("reduce_scatter", "other"):
            size = max(t.nbytes for t in tensors)
        elif kind == "all_to_all":
            size = (tensors[0] if functional else tensors[1]).nbytes  # the input: rows sent
        else:
            size = sum(t.nbytes for t in _tensors(args[0]))
        self.calls[kind] += 1
        self.bytes[kind] += size
        self.ops[f"{func.namespace}.{name}"] += 1


def measure(name: str) -> dict:
    """One warm-up step, then one counted step of layout `name`; the counts summed over ranks, and
    the seconds both took."""
    import torch.distributed as dist

    from moetron.launcher.train.optim import optimizer_for
    from moetron.launcher.train.trainer import StopFlag, build_parallel_model, train_step

    t0 = time.perf_counter()
    cfg = layout_config(name)
    t = cfg.train
    device = torch.device("cpu")
    torch.manual_seed(t.seed)
    pm = build_parallel_model(cfg, device)
    optimizer = optimizer_for(pm, t)
    stop = StopFlag()  # never entered: no signal handlers, only the per-step agreement
    g = torch.Generator().manual_seed(t.seed)
    counter = CollectiveCounter()
    for i in range(2):
        batch = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=g)
        with counter if i == 1 else contextlib.nullcontext():
            train_step(pm, optimizer, batch, grad_accum=t.grad_accum, grad_clip=t.grad_clip,
                       autocast=contextlib.nullcontext)
            stop.agreed(device)
    mine = {"calls": dict(counter.calls), "bytes": dict(counter.bytes), "local_calls": counter.local_calls,
            "ops": dict(counter.ops)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    total = {k: {"calls": sum(e["calls"].get(k, 0) for e in everyone),
                 "bytes": sum(e["bytes"].get(k, 0) for e in everyone)} for k in (*KINDS, "other")}
    ops: dict[str, int] = defaultdict(int)
    for e in everyone:
        for op, n in e["ops"].items():
            ops[op] += n
    return {"layout": name, "measured": total, "local_calls": sum(e["local_calls"] for e in everyone),
            "ops": dict(ops), "seconds": round(time.perf_counter() - t0, 2)}


# -- driving and reporting (one process) -----------------------------------------------------


def launch(names: list[str], nproc: int = 2) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), "--worker", *names]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(results) != len(names):
        raise SystemExit(f"the measuring launch failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return results


def predicted(name: str) -> dict[str, dict[str, int]]:
    cfg = layout_config(name)
    t = cfg.train
    return by_kind(predict_step(cfg.model, cfg.parallel, batch=t.batch_size, seq_len=t.seq_len,
                                grad_accum=t.grad_accum))


def _ratio(measured: int, predicted: int) -> str:
    if predicted == 0:
        return "-" if measured == 0 else "inf"
    return f"{measured / predicted:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        from gloo_ranks import each_on_gloo  # bench/gloo_ranks.py, beside this script

        raise SystemExit(each_on_gloo(measure, args.worker))
    t0 = time.perf_counter()
    runs = launch(args.layouts)
    wall = time.perf_counter() - t0
    cfg = layout_config(args.layouts[0])
    m, t = cfg.model, cfg.train
    print(f"one step of {t.batch_size}×{t.seq_len} tokens, d_model {m.d_model}, {m.n_layers} layers, "
          f"{m.moe.num_experts} experts top-{m.moe.top_k}, fp32; bytes summed over 2 ranks (nccl-tests size); "
          f"torch {torch.__version__}, gloo, {wall:.0f} s")
    print(f"{'layout':<24}{'kind':<16}{'pred calls':>11}{'meas calls':>11}{'pred bytes':>13}{'meas bytes':>13}"
          f"{'ratio':>8}")
    report = []
    for run in runs:
        pred = predicted(run["layout"])
        rows = {}
        for kind in (*KINDS, "other"):
            pk = pred.get(kind, {"calls": 0, "bytes": 0})
            mk = run["measured"][kind]
            if not (pk["calls"] or mk["calls"]):
                continue
            rows[kind] = {"predicted": pk, "measured": mk,
                          "ratio": mk["bytes"] / pk["bytes"] if pk["bytes"] else None}
            print(f"{run['layout']:<24}{kind:<16}{pk['calls']:>11}{mk['calls']:>11}{pk['bytes']:>13}"
                  f"{mk['bytes']:>13}{_ratio(mk['bytes'], pk['bytes']):>8}")
        report.append({"layout": run["layout"], "overrides": LAYOUTS[run["layout"]], "kinds": rows,
                       "one_rank_group_calls": run["local_calls"], "ops": run["ops"], "seconds": run["seconds"]})
    print(json.dumps({"bench": "comm_volume", "world_size": 2, "wall_s": round(wall, 1), "layouts": report}))


if __name__ == "__main__":
    main()

"""Find out how this process was launched, and join the process group.

Every rank calls `detect_rank()` once; it reads the environment the launcher left and returns a
`RankInfo`. Launchers are recognised in this order, the first that applies wins:

1. torchrun (`TORCHELASTIC_RUN_ID` with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
   `MASTER_PORT`). torchrun is an agent that spawns the ranks itself, so its numbering is the one
   the ranks share even when the agents were started by `srun` or `mpirun`, whose own variables
   (one task per agent) are then ignored.
2. mpirun: Open MPI's `OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK`, MPICH/Intel MPI's
   `PMI_RANK/PMI_SIZE/MPI_LOCALRANKID`, or a bare `PMIX_RANK` (size then from mpi4py). Inside a
   Slurm allocation `mpirun` inherits `SLURM_PROCID` of the batch script or of its per-node daemon,
   which numbers nodes, not ranks: Open MPI's variables always win (srun never sets them), the
   others when they describe a different world size; with the same size they must agree with
   Slurm's (that is `srun --mpi=pmi2|pmix`), or the launch is refused.
   The rendezvous address is `MASTER_ADDR`/`MASTER_PORT` when both are exported, otherwise rank 0
   picks its host name and a free port and broadcasts them through mpi4py.
3. srun: a job step (`SLURM_STEP_ID`) with `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (or
   `SLURM_NTASKS`) and `SLURM_LOCALID`. The master is the first host of the step's node list
   (expanded by `scontrol show hostnames`), the port `15000 + SLURM_JOB_ID % 20000`, so every rank
   computes the same pair without talking; `MASTER_ADDR`/`MASTER_PORT` override either.
   `srun --mpi=pmix` also sets `PMIX_RANK`, which must then equal `SLURM_PROCID`.
4. Plain `env://` variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, optional
   `LOCAL_RANK`) exported by a hand-written wrapper. Under srun or mpirun they must agree with the
   launcher's numbering.
5. One process. The batch script of a multi-task Slurm job is refused rather than run as one rank
   of many: ranks are started with `srun`.

Contradictions (a rank at or above the world size, a half-set group of variables, `RANK` that
disagrees with `SLURM_PROCID`, ...) raise `LaunchError` with one line naming the variables.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import NamedTuple, Optional

# Slurm ports are derived from the job id so that every rank finds the same one with no
# communication; the range stays below Linux's ephemeral ports (32768+).
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 20000

_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(RuntimeError):
    """The launch environment is missing or contradicts itself; the message names the variables."""


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job. `master_port` is 0 for a single process, which needs
    no rendezvous; `launcher` is one of "torchrun", "mpi", "slurm", "env", "single"."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise LaunchError(f"{self.launcher}: world size {self.world_size} must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise LaunchError(f"{self.launcher}: rank {self.rank} must be in [0, {self.world_size}) (the world size)")
        if not 0 <= self.local_rank < self.world_size:
            raise LaunchError(f"{self.launcher}: local rank {self.local_rank} must be in [0, {self.world_size}) (the world size)")
        if self.world_size > 1 and (not self.master_addr or not 0 < self.master_port < 65536):
            raise LaunchError(
                f"{self.launcher}: master address {self.master_addr!r}:{self.master_port} is not a host and a port in 1..65535"
            )

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class _Numbering(NamedTuple):
    """One launcher's claim about this process."""

    rank: int
    size: int
    local_rank: int


# What `detect_rank` needs from the outside world, injectable so tests run on plain dictionaries.
Hostnames = Callable[[str], list[str]]  # Slurm host list expression -> host names
MpiWorld = Callable[[], "MpiView"]  # -> this rank's view of MPI_COMM_WORLD


@dataclass(frozen=True)
class MpiView:
    rank: int
    size: int
    local_rank: int
    # Runs on every rank; rank 0's value is returned everywhere.
    broadcast: Callable[[object], object]


def detect_rank(
    env: Optional[Mapping[str, str]] = None,
    *,
    hostnames: Optional[Hostnames] = None,
    mpi_world: Optional[MpiWorld] = None,
) -> RankInfo:
    """Read the launch environment (default `os.environ`) and return this process's `RankInfo`."""
    env = dict(os.environ if env is None else env)
    hostnames = hostnames or slurm_hostnames
    # Asked at most once: for mpi4py each question is a collective every rank must join.
    mpi_world = functools.cache(mpi_world or mpi4py_world)

    if env.get("TORCHELASTIC_RUN_ID"):
        return _from_torchrun(env)

    manual = _manual_env(env)
    mpi = _mpi_env(env, mpi_world)
    slurm = _slurm_env(env)
    if mpi is not None and slurm is not None:
        if "OMPI_COMM_WORLD_RANK" in env or mpi.size != slurm.size:
            # Open MPI's mpirun, or any mpirun whose per-node daemons srun started: the step's
            # SLURM_PROCID numbers daemons, not ranks.
            slurm = None
        elif mpi.rank != slurm.rank:
            raise LaunchError(
                f"MPI rank {mpi.rank} ({_mpi_rank_var(env)}) disagrees with SLURM_PROCID={slurm.rank} in a step of "
                f"the same size {mpi.size}; launch with either srun or mpirun, not both"
            )
        else:
            mpi = None  # srun --mpi=pmix|pmi2: Slurm's numbering, the same ranks

    outer, outer_name = (mpi, "mpi") if mpi is not None else (slurm, "slurm") if slurm is not None else (None, "")
    if manual is not None:
        rank, size, local_rank, addr, port = manual
        if outer is not None and (outer.rank, outer.size) != (rank, size):
            names = f"{_mpi_rank_var(env)}/size" if outer_name == "mpi" else "SLURM_PROCID/SLURM_STEP_NUM_TASKS"
            raise LaunchError(
                f"RANK={rank} WORLD_SIZE={size} (set without torchrun) disagree with {names}={outer.rank}/{outer.size} "
                f"from {outer_name}; unset RANK and WORLD_SIZE or make them match"
            )
        if outer is not None and "LOCAL_RANK" not in env:
            local_rank = outer.local_rank
        return RankInfo(rank, size, local_rank, addr, port, outer_name or "env")

    if mpi is not None:
        addr, port = _mpi_master(env, mpi.rank, mpi.size, mpi_world)
        return RankInfo(mpi.rank, mpi.size, mpi.local_rank, addr, port, "mpi")

    if slurm is not None:
        addr, port = _slurm_master(env, hostnames)
        return RankInfo(slurm.rank, slurm.size, slurm.local_rank, addr, port, "slurm")

    if env.get("SLURM_JOB_ID") and _int(env, "SLURM_NTASKS", default=1) > 1:
        raise LaunchError(
            f"running in the batch script of Slurm job {env['SLURM_JOB_ID']} with SLURM_NTASKS={env['SLURM_NTASKS']} "
            "but outside a job step (no SLURM_STEP_ID); start the ranks with `srun`"
        )
    return RankInfo(0, 1, 0, "127.0.0.1", 0, "single")


# --- one function per launcher ------------------------------------------------------------------


def _from_torchrun(env: dict) -> RankInfo:
    missing = [name for name in _TORCHRUN if not env.get(name)]
    if missing:
        raise LaunchError(f"TORCHELASTIC_RUN_ID is set (torchrun) but {', '.join(missing)} is not; is this process a torchrun worker?")
    rank, size, local_rank = _env_numbering(env, "torchrun")
    return RankInfo(rank, size, local_rank, env["MASTER_ADDR"], _int(env, "MASTER_PORT"), "torchrun")


def _manual_env(env: dict) -> Optional[tuple[int, int, int, str, int]]:
    """RANK/WORLD_SIZE/MASTER_* set by hand (no torchrun): all four, or none of RANK/WORLD_SIZE."""
    if not env.get("RANK") and not env.get("WORLD_SIZE"):
        return None
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise LaunchError(
            f"RANK/WORLD_SIZE are set without torchrun (no TORCHELASTIC_RUN_ID) but {', '.join(missing)} is not; "
            "set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT or none"
        )
    return (*_env_numbering(env, "env://"), env["MASTER_ADDR"], _int(env, "MASTER_PORT"))


def _env_numbering(env: dict, source: str) -> _Numbering:
    rank, size, local_rank = _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK", default=0)
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
        if not 0 <= value < size:
            raise LaunchError(f"{name}={value} from {source} is not in [0, WORLD_SIZE={size})")
    return _Numbering(rank, size, local_rank)


def _mpi_rank_var(env: dict) -> str:
    return next(name for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK") if env.get(name))


def _mpi_env(env: dict, mpi_world: MpiWorld) -> Optional[_Numbering]:
    """What an MPI launcher's variables say, or None when there are none."""
    if env.get("OMPI_COMM_WORLD_RANK"):
        if not env.get("OMPI_COMM_WORLD_SIZE"):
            raise LaunchError("OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not; was this started by Open MPI's mpirun?")
        rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=None)
    elif env.get("PMI_RANK") and env.get("PMI_SIZE"):
        rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local = _int(env, "MPI_LOCALRANKID", default=None)
    elif env.get("PMIX_RANK"):
        if _in_step(env):
            # srun --mpi=pmix: the size is the step's; checked against SLURM_PROCID by the caller.
            return _Numbering(_int(env, "PMIX_RANK"), _slurm_size(env), _int(env, "SLURM_LOCALID", default=0))
        world = mpi_world()
        rank, size, local = _int(env, "PMIX_RANK"), world.size, world.local_rank
        if world.rank != rank:
            raise LaunchError(f"PMIX_RANK={rank} but MPI_COMM_WORLD says rank {world.rank}; the environment is stale")
    else:
        return None
    if local is None:
        local = mpi_world().local_rank if size > 1 else 0
    if not 0 <= rank < size:
        raise LaunchError(f"MPI rank {rank} ({_mpi_rank_var(env)}) is not below the MPI world size {size}")
    return _Numbering(rank, size, local)


def _in_step(env: dict) -> bool:
    # Only srun sets a step id; the batch script has SLURM_PROCID=0 without one.
    return env.get("SLURM_STEP_ID", env.get("SLURM_STEPID")) is not None and bool(env.get("SLURM_PROCID"))


def _slurm_size(env: dict) -> int:
    # SLURM_NTASKS is the job's task count; a step may run fewer (`srun -n 2` in a 4-task job).
    if env.get("SLURM_STEP_NUM_TASKS"):
        return _int(env, "SLURM_STEP_NUM_TASKS")
    if env.get("SLURM_NTASKS"):
        return _int(env, "SLURM_NTASKS")
    raise LaunchError("SLURM_PROCID is set in a job step but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is")


def _slurm_env(env: dict) -> Optional[_Numbering]:
    """What Slurm's variables say inside an srun job step, or None outside one."""
    if not _in_step(env):
        return None
    rank, size = _int(env, "SLURM_PROCID"), _slurm_size(env)
    if not 0 <= rank < size:
        raise LaunchError(f"SLURM_PROCID={rank} is not below the step's task count {size} (SLURM_STEP_NUM_TASKS/SLURM_NTASKS)")
    return _Numbering(rank, size, _int(env, "SLURM_LOCALID", default=0))


def _slurm_master(env: dict, hostnames: Hostnames) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise LaunchError("srun job step without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST; set MASTER_ADDR to rank 0's host")
        # A plain host name (one node) needs no expansion.
        hosts = hostnames(nodelist) if any(c in nodelist for c in "[],") else [nodelist]
        if not hosts:
            raise LaunchError(f"the Slurm node list {nodelist!r} names no host; set MASTER_ADDR to rank 0's host")
        addr = hosts[0]
    if env.get("MASTER_PORT"):
        return addr, _int(env, "MASTER_PORT")
    if not env.get("SLURM_JOB_ID"):
        raise LaunchError("srun job step without SLURM_JOB_ID to derive a port from; set MASTER_PORT")
    return addr, SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % SLURM_PORT_SPAN


def _mpi_master(env: dict, rank: int, size: int, mpi_world: MpiWorld) -> tuple[str, int]:
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return env["MASTER_ADDR"], _int(env, "MASTER_PORT")
    if size == 1:
        return "127.0.0.1", 0
    world = mpi_world()
    if (world.rank, world.size) != (rank, size):
        raise LaunchError(f"MPI environment says rank {rank} of {size} but MPI_COMM_WORLD says {world.rank} of {world.size}")
    mine = (socket.gethostname(), _free_port()) if rank == 0 else None
    addr, port = world.broadcast(mine)
    return addr, port


def _int(env: Mapping[str, str], name: str, default=...):
    value = env.get(name)
    if value is None or value == "":
        if default is ...:
            raise LaunchError(f"{name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


# --- the outside world: scontrol and mpi4py -----------------------------------------------------


def slurm_hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm host list ("gpu[01-04],cpu7") with `scontrol show hostnames`."""
    if shutil.which("scontrol") is None:
        raise LaunchError(f"scontrol is not on PATH to expand SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        reason = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise LaunchError(f"`scontrol show hostnames {nodelist}` failed ({reason}); set MASTER_ADDR to rank 0's host")
    return out.stdout.split()


def mpi4py_world() -> MpiView:
    """This rank's view of MPI_COMM_WORLD through mpi4py (which initializes MPI on import)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise LaunchError(
            "launched by MPI without MASTER_ADDR/MASTER_PORT; install mpi4py so rank 0 can broadcast them, "
            "or export both with mpirun -x"
        ) from None
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank = local.Get_rank()
    finally:
        local.Free()
    return MpiView(comm.Get_rank(), comm.Get_size(), local_rank, lambda value: comm.bcast(value, root=0))


def _free_port() -> int:
    # NOTE: the port is free now; another process could take it before the store binds it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# --- the process group --------------------------------------------------------------------------


def init_distributed(info: RankInfo, backend: Optional[str] = None, timeout: timedelta = timedelta(minutes=10)):
    """Join the default process group described by `info`; return this rank's torch.device.

    backend: "nccl" when CUDA is available, else "gloo". A single process joins a group of one
    through an in-memory store, so code after this call needs no special case for one rank.
    `timeout` bounds the rendezvous and every collective: a missing peer fails instead of hanging.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise LaunchError("torch.distributed is already initialized; call init_distributed once per process")
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    kwargs = {}
    if cuda and "nccl" in backend:
        if info.local_rank >= torch.cuda.device_count():
            raise LaunchError(
                f"local rank {info.local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                "start at most one rank per GPU on each node"
            )
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # binds NCCL to this GPU now rather than at the first collective
    if info.world_size == 1:
        kwargs["store"] = dist.HashStore()
    else:
        host = f"[{info.master_addr}]" if ":" in info.master_addr else info.master_addr
        kwargs["init_method"] = f"tcp://{host}:{info.master_port}"
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=timeout, **kwargs)
    return device


def shutdown() -> None:
    """Leave the process group: wait for every rank, then tear it down (gloo can abort a rank that
    exits while others still talk to it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --- `python -m moetron.launcher.cluster.bootstrap`: check a launch before spending a job on it ----------


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moetron.launcher.cluster.bootstrap",
        description="Print how each rank was launched and check that all ranks can all_reduce.",
    )
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the other ranks")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    try:
        info = detect_rank()
    except LaunchError as err:
        print(f"moetron bootstrap: {err}", file=sys.stderr, flush=True)
        return 2
    device = init_distributed(info, args.backend, timedelta(seconds=args.timeout))
    try:
        total = torch.tensor([float(info.rank)], device=device)
        dist.all_reduce(total)
        # NOTE: .item() waits for the device; fine in a one-off check.
        expected = info.world_size * (info.world_size - 1) / 2
        report = {**asdict(info), "host": socket.gethostname(), "all_reduce": total.item(), "ok": total.item() == expected}
        # One write per report, so the lines of ranks sharing a stdout cannot interleave.
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()
    finally:
        shutdown()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

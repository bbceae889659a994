"""detect_rank on the environments real launchers leave, and the refusals of contradictory ones.

The dictionaries below were copied from processes started by torchrun 2.13, Slurm 22.05 (`srun`,
`srun --mpi=pmix`, a batch script) and Open MPI 4.1 (`mpirun` inside a Slurm allocation).
"""

import socket
import sys
from dataclasses import FrozenInstanceError
from datetime import timedelta

import pytest

from moetron.launcher.cluster.bootstrap import (
    SLURM_PORT_BASE,
    LaunchError,
    MpiView,
    RankInfo,
    detect_rank,
    init_distributed,
    shutdown,
)

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
    "ROLE_RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "43349", "OMP_NUM_THREADS": "1",
}
BATCH = {
    "SLURM_JOB_ID": "2", "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
}
SRUN_RANK1 = {
    **BATCH, "SLURM_LOCALID": "1", "SLURM_PROCID": "1", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "vm", "SLURM_STEP_NUM_TASKS": "2",
}
SRUN_PMIX_RANK1 = {**SRUN_RANK1, "PMIX_RANK": "1", "SLURM_STEPID": "1", "SLURM_STEP_ID": "1"}
MPIRUN_RANK1 = {
    **BATCH, "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "1",
}
MPICH_RANK2 = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "PMI_FD": "5"}


def no_mpi():
    raise AssertionError("MPI_COMM_WORLD must not be consulted here")


def no_scontrol(nodelist):
    raise AssertionError(f"scontrol must not be consulted for {nodelist!r}")


def fake_mpi(rank, size, local_rank=0, root_value=None):
    """An MPI world in which rank 0 broadcasts `root_value` (or what this rank passes, if it is 0)."""
    return lambda: MpiView(rank, size, local_rank, lambda value: value if rank == 0 else root_value)


def detect(env, **kwargs):
    kwargs.setdefault("hostnames", no_scontrol)
    kwargs.setdefault("mpi_world", no_mpi)
    return detect_rank(env, **kwargs)


def refused(env, *names, **kwargs) -> str:
    with pytest.raises(LaunchError) as err:
        detect(env, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"
    return message


# --- each launcher --------------------------------------------------------------------------------


def test_single_process_needs_no_rendezvous():
    assert detect({"PATH": "/usr/bin", "HOME": "/root"}) == RankInfo(0, 1, 0, "127.0.0.1", 0, "single")


def test_torchrun():
    assert detect(TORCHRUN) == RankInfo(1, 2, 1, "localhost", 43349, "torchrun")


def test_torchrun_under_srun_wins_over_slurm_numbering():
    # One torchrun agent per node started by srun: SLURM_PROCID numbers agents, RANK the workers.
    env = {**SRUN_RANK1, **TORCHRUN, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu01"}
    assert detect(env) == RankInfo(3, 4, 1, "gpu01", 43349, "torchrun")


def test_srun():
    info = detect(SRUN_RANK1)
    assert info == RankInfo(1, 2, 1, "vm", SLURM_PORT_BASE + 2, "slurm")


def test_srun_master_is_first_host_of_the_step():
    env = {**SRUN_RANK1, "SLURM_JOB_ID": "123456", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[01-08]"}
    info = detect(env, hostnames=lambda nodelist: {"gpu[07-08]": ["gpu07", "gpu08"]}[nodelist])
    assert (info.master_addr, info.master_port) == ("gpu07", SLURM_PORT_BASE + 123456 % 20000)


def test_srun_exported_master_overrides_the_derived_one():
    info = detect({**SRUN_RANK1, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"})
    assert (info.master_addr, info.master_port, info.launcher) == ("10.0.0.5", 29500, "slurm")


def test_srun_step_smaller_than_the_job():
    info = detect({**SRUN_RANK1, "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2"})
    assert info.world_size == 2


def test_srun_with_pmix_is_slurm():
    assert detect(SRUN_PMIX_RANK1).launcher == "slurm"


def test_mpirun_inside_a_slurm_allocation_is_mpi():
    # Rank 1 receives rank 0's host and port; SLURM_PROCID=0 belongs to the batch script.
    info = detect(MPIRUN_RANK1, mpi_world=fake_mpi(1, 2, 1, root_value=("node0", 41000)))
    assert info == RankInfo(1, 2, 1, "node0", 41000, "mpi")


def test_mpirun_rank0_broadcasts_its_own_host():
    env = {**MPIRUN_RANK1, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "PMIX_RANK": "0"}
    info = detect(env, mpi_world=fake_mpi(0, 2))
    assert info.master_addr == socket.gethostname() and 0 < info.master_port < 65536


def test_mpirun_with_exported_master_needs_no_mpi4py():
    info = detect({**MPIRUN_RANK1, "MASTER_ADDR": "node0", "MASTER_PORT": "29500"})
    assert (info.rank, info.master_addr, info.master_port, info.launcher) == (1, "node0", 29500, "mpi")


def test_mpich_hydra():
    info = detect(MPICH_RANK2, mpi_world=fake_mpi(2, 4, 0, root_value=("node0", 41000)))
    assert info == RankInfo(2, 4, 0, "node0", 41000, "mpi")


def test_bare_pmix_takes_the_size_from_mpi():
    info = detect({"PMIX_RANK": "1"}, mpi_world=fake_mpi(1, 3, 1, root_value=("node0", 41000)))
    assert (info.rank, info.world_size, info.local_rank) == (1, 3, 1)


def test_hand_exported_env_vars():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert detect(env) == RankInfo(0, 2, 0, "node0", 29500, "env")


def test_hand_exported_env_vars_that_match_slurm_are_slurm():
    env = {**SRUN_RANK1, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert detect(env) == RankInfo(1, 2, 1, "node0", 29500, "slurm")


def test_batch_script_of_a_one_task_job_is_a_single_process():
    assert detect({**BATCH, "SLURM_NTASKS": "1", "SLURM_NPROCS": "1"}).launcher == "single"


# --- refusals -------------------------------------------------------------------------------------


def test_refuses_incomplete_torchrun():
    refused({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "TORCHELASTIC_RUN_ID", "MASTER_PORT")


def test_refuses_rank_at_world_size():
    refused({**TORCHRUN, "RANK": "2"}, "RANK=2", "WORLD_SIZE=2", "torchrun")
    refused({**SRUN_RANK1, "SLURM_PROCID": "2"}, "SLURM_PROCID=2", "SLURM_STEP_NUM_TASKS")
    refused({**MPIRUN_RANK1, "OMPI_COMM_WORLD_RANK": "2"}, "OMPI_COMM_WORLD_RANK", "world size 2")


def test_refuses_local_rank_outside_the_world():
    refused({**TORCHRUN, "LOCAL_RANK": "5"}, "LOCAL_RANK=5", "WORLD_SIZE=2")


def test_refuses_non_integers():
    refused({**SRUN_RANK1, "SLURM_PROCID": "one"}, "SLURM_PROCID='one' is not an integer")


def test_refuses_hand_exported_rank_that_contradicts_slurm():
    env = {**SRUN_RANK1, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    refused(env, "RANK=0", "SLURM_PROCID", "without torchrun")


def test_refuses_half_exported_env_vars():
    refused({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "MASTER_ADDR", "TORCHELASTIC_RUN_ID")


def test_refuses_pmix_rank_that_contradicts_srun():
    refused({**SRUN_PMIX_RANK1, "PMIX_RANK": "0"}, "PMIX_RANK", "SLURM_PROCID=1")


def test_refuses_half_set_open_mpi():
    refused({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE")


def test_refuses_mpi_without_mpi4py_or_master(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `from mpi4py import MPI` fail
    with pytest.raises(LaunchError, match="mpi4py.*MASTER_ADDR|MASTER_ADDR.*mpi4py"):
        detect_rank(MPIRUN_RANK1, hostnames=no_scontrol)


def test_refuses_multi_task_batch_script():
    refused(BATCH, "SLURM_NTASKS=2", "SLURM_STEP_ID", "srun")


def test_refuses_step_without_master_host():
    env = {k: v for k, v in SRUN_RANK1.items() if not k.endswith("NODELIST")}
    refused(env, "SLURM_JOB_NODELIST", "MASTER_ADDR")


def test_rank_info_is_frozen_and_checked():
    info = RankInfo(0, 2, 0, "node0", 29500, "env")
    with pytest.raises(FrozenInstanceError):
        info.rank = 1
    with pytest.raises(LaunchError, match="port"):
        RankInfo(0, 2, 0, "node0", 0, "env")


# --- the outside world ----------------------------------------------------------------------------


def test_init_distributed_single_process_and_shutdown():
    import torch
    import torch.distributed as dist

    info = detect({})
    device = init_distributed(info, "gloo", timedelta(seconds=30))
    try:
        with pytest.raises(LaunchError, match="already initialized"):
            init_distributed(info, "gloo")
        x = torch.ones(3, device=device)
        dist.all_reduce(x)
        assert dist.get_world_size() == 1 and x.tolist() == [1.0, 1.0, 1.0]
    finally:
        shutdown()
    assert not dist.is_initialized()

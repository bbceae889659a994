"""Ranks started by torchrun's elastic agent, which restarts them all on whatever nodes are left.

A run launched as `torchrun --nnodes=MIN:MAX --rdzv-backend=c10d --max-restarts=R … moetron train
… --layout auto` survives a lost node by restarting from its newest checkpoint: when a node dies,
the other ranks' collectives fail, every agent stops its ranks, the agents meet again without the
dead node, and the new ranks plan a layout for the smaller world and reshard the checkpoint into
it. There is no in-memory snapshot: the steps since the last checkpoint are trained again. Two
things about the agent are checked here:

- The store the ranks meet in. By default in recent torch the agent of node 0 hosts one store for
  the ranks of every restart (`TORCHELASTIC_USE_AGENT_STORE=True`), and restarts break on it (seen
  with torch 2.13): the keys a world's process groups leave behind stay, so a restarted rank can
  read a dead rank's address and hang connecting to it (pytorch/pytorch#135712); an agent that
  keeps rank 0 never publishes the store's address again, so a node that joins later waits for it
  until the rendezvous times out; and (by its code) the other agents keep the address of a rank-0
  agent that died. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every world gets a store of its own.
  `restart_problem` refuses, at the start, a launch that may restart on the shared store.
- A refused start. An error the user must fix (a config, a world with too few ranks for any
  layout) is refused in one line with exit status 2, and would be refused again on every
  restart: `stop_agent_at_exit` asks this node's agent to stop instead of restarting its ranks.
  Every rank of a world decides alike, so every node's agent stops.

A restart is a new world in the same run folder, which takes the folder over from the world before
it (launcher/train/run_lease.py); `job_identity` says what the worlds of one job share, so that a
restart may take the folder at once while another job is refused.
"""

from __future__ import annotations

import atexit
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Optional


def restart_problem(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why this torchrun launch cannot restart its ranks safely, as one line, or None."""
    env = os.environ if env is None else env
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    if not env.get("TORCHELASTIC_RUN_ID") or restarts == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (f"torchrun --max-restarts={restarts} with the store its agents share with the ranks: a restart may hang "
            f"on the previous world's keys (pytorch/pytorch#135712) and a node that joins later waits forever; "
            f"export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before every torchrun of the job")


def job_identity(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """What every restart of this job shares, as words, or None for a start that is a job of its
    own: the Slurm job id (a requeue, or the ranks started again in the allocation, keep it) and
    torchrun's rendezvous id (every restart of its agents' ranks keeps it). torchrun's default id,
    "none", names no job: two launches left at the default would count as one."""
    env = os.environ if env is None else env
    parts = []
    if env.get("SLURM_JOB_ID"):
        parts.append(f"Slurm job {env['SLURM_JOB_ID']}")
    if env.get("TORCHELASTIC_RUN_ID") and env["TORCHELASTIC_RUN_ID"] != "none":
        parts.append(f"torchrun rdzv id {env['TORCHELASTIC_RUN_ID']}")
    return ", ".join(parts) or None


def stop_agent_at_exit(env: Optional[Mapping[str, str]] = None) -> bool:
    """Under torchrun with restarts left, ask this node's agent (this process's parent) to stop
    once this process has said why it exits, rather than start the same refused ranks again.
    Local rank 0 asks, once per node. Returns whether it will ask."""
    env = os.environ if env is None else env
    if not env.get("TORCHELASTIC_RUN_ID") or env.get("LOCAL_RANK", "0") != "0":
        return False
    restarts_left = int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0) - int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
    agent = os.getppid()
    if restarts_left <= 0 or not _is_torchrun(agent):
        return False
    # At exit, after the error line is written. The agent's SIGTERM handler stops this node's
    # ranks and torchrun exits; the rendezvous stays open (a later node may still join it).
    atexit.register(os.kill, agent, signal.SIGTERM)
    return True


def _is_torchrun(pid: int) -> bool:
    """Whether `pid` runs torchrun (`torchrun` or `python -m torch.distributed.run`), by its command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(b"torchrun") or a == b"torch.distributed.run" for a in argv)

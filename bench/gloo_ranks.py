"""The rank side of the multi-rank benches (comm_volume, dp_memory, plan_check): each launches
itself under `torch.distributed.run --worker ...`, and every rank then measures the same items in
turn here, rank 0 printing one JSON line per item for the launching process to read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import torch


def each_on_gloo(measure: Callable[[str], dict], items: Iterable[str]) -> int:
    """Join the gloo group torch.distributed.run set up, run `measure(item)` on every rank for each
    item (a collective: every rank must take part), print rank 0's results; the exit status."""
    import torch.distributed as dist

    # The ranks share the machine's cores: one intra-op thread each keeps them from oversubscribing it.
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for item in items:
            result = measure(item)
            if dist.get_rank() == 0:
                print(json.dumps(result), flush=True)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard, a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t

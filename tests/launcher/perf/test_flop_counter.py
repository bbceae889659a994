"""The FLOP counter under tensor parallelism counts what one rank runs: a column- then row-parallel
pair of DTensor linears on 2 ranks counts half the single-process matmuls on each rank, not the
global matmul (DTensor's own ops) and not the fake-tensor ops its sharding propagation runs to
learn shapes. Rank 0 of a 2-rank fake process group, in a subprocess (~5 s)."""

import subprocess
import sys

SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from moetron.launcher.perf.flop_counter import ComponentFlopCounter

def counted(model):
    with ComponentFlopCounter(model) as counter:
        model(torch.randn(8, 16)).sum().backward()
    return counter.total

def pair():
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 16, bias=False))

one = counted(pair())
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
model = parallelize_module(pair(), init_device_mesh("cpu", (2,)), {"0": ColwiseParallel(), "1": RowwiseParallel()})
first, again = counted(model), counted(model)  # the first step also propagates shardings
dist.destroy_process_group()
# forward and weight gradients of both, the input gradient of the second only (x needs none)
assert one == 2 * 2 * 8 * (16 * 32 + 32 * 16) + 2 * 8 * 32 * 16, one
assert first == again == one // 2, (first, again, one)
print("ok")
"""


def test_tensor_parallel_rank_counts_its_share_of_the_matmuls():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]

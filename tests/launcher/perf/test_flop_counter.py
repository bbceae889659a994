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


def test_the_fp8_experts_grouped_gemm_counts_like_the_bf16_one():
    """train.precision fp8 runs the experts through torch._scaled_grouped_mm (torchao): counted as
    _grouped_mm is, 2 FLOPs per row, K and N (meta tensors: shapes only, as on a GPU)."""
    import torch
    from torch import nn

    from moetron.launcher.perf.flop_counter import ComponentFlopCounter

    rows, k, n, experts = 64, 32, 48, 4
    a = torch.empty(rows, k, device="meta", dtype=torch.float8_e4m3fn)
    b = torch.empty(experts, n, k, device="meta", dtype=torch.float8_e4m3fn).mT  # column-major per expert
    scales = torch.empty(rows, device="meta"), torch.empty(experts, n, device="meta")
    offsets = torch.empty(experts, device="meta", dtype=torch.int32)
    with ComponentFlopCounter(nn.Identity()) as counter:
        torch._scaled_grouped_mm(a, b, *scales, offs=offsets, out_dtype=torch.bfloat16)
        torch._grouped_mm(a.to(torch.bfloat16), b.to(torch.bfloat16), offs=offsets)
    assert counter.total == 2 * (2 * rows * k * n) and not counter.uncounted

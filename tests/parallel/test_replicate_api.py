"""dp_mode ddp and zero1 stand on a private torch API, `replicate_with_fsdp.replicate`
(parallel/data_parallel.py says why no public one does the same in torch 2.13). If a torch
release moves or changes it, these fail first, and the run itself fails in one clear line."""

import subprocess
import sys

import pytest

from moetron.parallel.data_parallel import replicate_fn

MODULE = "torch.distributed._composable.replicate_with_fsdp"

# One gloo rank: replicate a Linear over a 1-rank mesh, run forward and backward.
ONE_RANK = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from moetron.parallel.data_parallel import replicate_fn
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
layer = torch.nn.Linear(3, 2)
replicate_fn()(layer, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
assert isinstance(layer, FSDPModule), type(layer).__mro__
assert all(isinstance(p, DTensor) and p.placements == (Replicate(),) for p in layer.parameters())
layer(torch.ones(4, 3)).sum().backward()
assert torch.equal(layer.bias.grad.full_tensor(), torch.full((2,), 4.0))
dist.destroy_process_group()
print("ok")
"""


def test_replicate_is_where_data_parallel_expects_it_and_replicates():
    replicate = replicate_fn()
    assert replicate.__module__ == MODULE
    run = subprocess.run([sys.executable, "-c", ONE_RANK], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (
        f"torch's {MODULE}.replicate no longer behaves as parallel/data_parallel.py expects "
        f"(FSDP2-managed, Replicate() DTensor parameters):\n{run.stderr[-3000:]}")


def test_a_torch_without_it_gets_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, MODULE, None)  # what Python does for a module that is not there
    with pytest.raises(RuntimeError) as e:
        replicate_fn()
    message = str(e.value)
    assert "\n" not in message
    assert f"need {MODULE}.replicate, which torch" in message and "use parallel.dp_mode=fsdp or hsdp" in message

"""What a checkpoint holds and how it maps onto the live, possibly sharded, objects of one rank.

Keys are layout-independent: parameter names (as `get_state_dict` gives them, FSDP/TP/PP
wrappers removed) and, for the optimizer, `state.<param name>.<field>` and
`param_groups.<param name>.<hyper-parameter>` (`flatten_optimizer_state_dict`), so a pipeline
stage, a TP shard or a DP shard each write and read only their own entries. DTensors (TP, FSDP)
carry their global shape and offsets already. Routed experts under expert parallelism are plain
tensors holding rows [i·El, (i+1)·El) of the full (E, ·, ·) weight; `global_views` presents them
to DCP as DTensors over the ep mesh, so their key names the full tensor on every layout instead
of E/ep different tensors colliding under one name.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


@dataclass(frozen=True)
class ExpertShards:
    """Parameters split into equal row blocks (dim 0) over a 1-D mesh, block i on mesh rank i.

    names: parameter names (e.g. ParallelModel.expert_sharded); mesh: the "ep" sub-mesh.
    """

    names: frozenset[str]
    mesh: DeviceMesh


@dataclass
class LiveState:
    """This rank's state dicts, one pair per model part (pipeline stage) it holds."""

    parts: list[tuple[nn.Module, torch.optim.Optimizer | None]]
    model: list[dict[str, Any]]
    optim: list[dict[str, Any]] | None

    def merged(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": {k: v for sd in self.model for k, v in sd.items()}}
        if self.optim is not None:
            out["optim"] = {k: v for sd in self.optim for k, v in sd.items()}
        return out


def live_state(model: nn.Module | Sequence[nn.Module],
               optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
               options: StateDictOptions) -> LiveState:
    """State dicts of every part; with several parts (interleaved pipeline stages) each needs its
    own optimizer, as its flattened keys then stay disjoint."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if optimizer is None:
        return LiveState([(m, None) for m in models], [get_model_state_dict(m, options=options) for m in models], None)
    optims = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if len(optims) != len(models):
        raise ValueError(f"{len(models)} model parts but {len(optims)} optimizers; give one optimizer per part")
    pairs = [get_state_dict(m, o, options=options) for m, o in zip(models, optims)]
    return LiveState(list(zip(models, optims)), [p[0] for p in pairs], [p[1] for p in pairs])


def restore_live_state(live: LiveState, options: StateDictOptions) -> None:
    """Push the (now loaded) state dicts back into the modules and optimizers."""
    for i, (m, o) in enumerate(live.parts):
        if o is None:
            set_model_state_dict(m, live.model[i], options=options)
        else:
            set_state_dict(m, o, model_state_dict=live.model[i], optim_state_dict=live.optim[i], options=options)


def global_views(model, optimizer, expert_shards: ExpertShards | None, options: StateDictOptions) -> dict[str, Any]:
    """{"model": …, "optim": …} ready for dcp.save: the live tensors, expert blocks as DTensors."""
    return views_of(live_state(model, optimizer, options).merged(), expert_shards)


def views_of(state: dict[str, Any], expert_shards: ExpertShards | None) -> dict[str, Any]:
    """`state` with expert-sharded tensors (and their optimizer moments) viewed as global DTensors;
    the views share storage, so DCP loads into them in place."""
    if expert_shards is None:
        return state
    names, mesh = expert_shards.names, expert_shards.mesh
    out = {"model": {k: _rows_over(v, mesh) if k in names else v for k, v in state["model"].items()}}
    if "optim" in state:
        out["optim"] = {k: _rows_over(v, mesh) if _is_moment_of(k, v, names) else v
                        for k, v in state["optim"].items()}
    return out


def _is_moment_of(key: str, value: Any, names: frozenset[str]) -> bool:
    """An optimizer tensor shaped like an expert-sharded parameter (exp_avg, not the scalar step)."""
    if not key.startswith("state.") or not isinstance(value, torch.Tensor) or value.ndim == 0:
        return False
    return key[len("state."):].rsplit(".", 1)[0] in names


def _rows_over(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """View this rank's row block of a tensor split over `mesh` (block i on mesh rank i) as a
    DTensor of the full shape. If the block is itself a DTensor on a 1-D mesh (FSDP over the
    ranks holding the same experts; 2-D under HSDP), the view lives on the (ep, that mesh) grid: rows split
    over ep first, then each block as FSDP split it."""
    ep = mesh.size()
    if isinstance(t, DTensor):
        inner = t.device_mesh
        # The job's mesh is a regular grid of ranks, so rank offsets along ep and along the inner
        # dims (FSDP's 1-D, HSDP's 2-D) add up: grid[i, j…] = ep_rank_i + inner_rank_j… - this rank.
        me = dist.get_rank()
        grid = mesh.mesh.reshape(-1, *([1] * inner.ndim)) + inner.mesh.unsqueeze(0) - me
        grid_mesh = DeviceMesh(mesh.device_type, grid, _init_backend=False)
        placements, local, block_shape = (Shard(0), *t.placements), t.to_local(), t.shape
    else:
        grid_mesh, placements, local, block_shape = mesh, (Shard(0),), t, t.shape
    shape = torch.Size((block_shape[0] * ep, *block_shape[1:]))
    return DTensor.from_local(local, grid_mesh, placements, run_check=False, shape=shape,
                              stride=_contiguous_stride(shape))


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, as plain JSON-able data."""
    state = {
        "torch": torch.get_rng_state().tolist(),
        "python": _to_lists(random.getstate()),
        "numpy": _to_lists(np.random.get_state(legacy=False)),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _to_lists(obj: Any) -> Any:
    if isinstance(obj, (tuple, list)):
        return [_to_lists(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_lists(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def dcp_call(fn, *args, **kwargs):
    """Call a DCP function without its warning about running without a process group: one
    process is a supported layout here, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*no_dist.*")
        return fn(*args, **kwargs)

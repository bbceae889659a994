"""How routed experts held by one rank are pieces of the full weights.

Under expert parallelism a rank holds rows [i·El, (i+1)·El) of each full (E, ·, ·) expert weight,
and under expert-tensor parallelism (etp = tp) also the F range [k·F/tp, (k+1)·F/tp) on tp rank k.
`ExpertShards.view` presents such a piece as a DTensor of the full shape over the (ep, tp) grid, so
that checkpoints name the full tensor on every layout (launcher/checkpoint/state.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


@dataclass(frozen=True)
class ExpertShards:
    """Parameters split into equal row blocks (dim 0) over a 1-D mesh, block i on mesh rank i, and
    those named in `tp_dims` also into equal blocks of dim tp_dims[name] over `tp_mesh`.

    names: every such parameter (ParallelModel.expert_shards() builds this); mesh: the "ep" sub-mesh
    (size 1 when only the tp split applies); tp_dims / tp_mesh: expert-tensor parallelism's F split.
    """

    names: frozenset[str]
    mesh: DeviceMesh
    tp_dims: Mapping[str, int] = field(default_factory=dict)
    tp_mesh: DeviceMesh | None = None

    def view(self, name: str, t: torch.Tensor) -> DTensor:
        """This rank's piece `t` of parameter `name` (or of its optimizer moment) as a global DTensor."""
        dim = self.tp_dims.get(name)
        return _rows_over(t, self.mesh, None if dim is None else (self.tp_mesh, dim))


def _rows_over(t: torch.Tensor, mesh: DeviceMesh, tp_split: tuple[DeviceMesh, int] | None = None) -> DTensor:
    """View this rank's row block of a tensor split over `mesh` (block i on mesh rank i) as a
    DTensor of the full shape. If the block is itself a DTensor on a 1-D mesh (FSDP over the
    ranks holding the same experts; 2-D under HSDP), the view lives on the (ep, that mesh) grid: rows split
    over ep first, then each block as FSDP split it. `tp_split` = (tp mesh, dim): the block is also
    one of equal pieces of `dim` over the tp mesh (piece k on tp rank k), a last grid dim."""
    ep = mesh.size()
    inner = t.device_mesh if isinstance(t, DTensor) else None
    if inner is None and tp_split is None:
        grid_mesh, placements, local = mesh, (Shard(0),), t
    else:
        # The job's mesh is a regular grid of ranks, so rank offsets along ep, along the inner dims
        # (FSDP's 1-D, HSDP's 2-D) and along tp add up: grid[i, j…, k] = ep_i + inner_j… + tp_k,
        # each a global rank, less this rank once for every part after the first.
        parts = [mesh.mesh] + ([inner.mesh] if inner is not None else []) + ([tp_split[0].mesh] if tp_split else [])
        me = dist.get_rank()
        ndim = sum(p.ndim for p in parts)
        grid, at = torch.zeros((1,) * ndim, dtype=torch.int64), 0
        for p in parts:
            grid = grid + p.reshape((1,) * at + tuple(p.shape) + (1,) * (ndim - at - p.ndim)) - me
            at += p.ndim
        grid_mesh = DeviceMesh(mesh.device_type, grid + me, _init_backend=False)
        placements = (Shard(0), *(t.placements if inner is not None else ()),
                      *((Shard(tp_split[1]),) if tp_split else ()))
        local = t.to_local() if inner is not None else t
    shape = [t.shape[0] * ep, *t.shape[1:]]
    if tp_split is not None:
        shape[tp_split[1]] *= tp_split[0].size()
    shape = torch.Size(shape)
    return DTensor.from_local(local, grid_mesh, placements, run_check=False, shape=shape,
                              stride=_contiguous_stride(shape))


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))

"""The device mesh: `ParallelConfig` → one named DeviceMesh over every rank of the job.

Rank layout (row-major, the last dimension varies fastest, so TP peers are neighbours and land on
one node first, as in Megatron):

    world = pp × dp × cp × tp     mesh dims ("pp", "rep", "edps", "cp", "ep", "tp")
    dp = rep × edps × ep          rep: HSDP replicas (1 unless dp_mode=hsdp)

Expert parallelism is carved out of the data-parallel ranks (Megatron, torchtitan): the dp ranks
of one pipeline stage, context chunk and TP position are split into groups of `ep` consecutive
ranks.

  - "ep"     the ep ranks that exchange tokens by all-to-all; each holds E/ep different experts.
  - "cp"     the ranks holding the chunks of the same sequences (context parallelism).
  - "dp_cp"  every rank holding the same dense weights: ("rep", "edps", "cp", "ep") flattened.
             Dense gradients are averaged here: the cp ranks saw different tokens of the same
             sequences, the dp ranks different sequences.
  - "edp_cp" the ranks holding the same experts: ("rep", "edps", "cp"). Expert gradients are
             reduced here and divided by dp × cp, because the all-to-all already summed the
             contributions of the ep ranks' tokens.
  - "hsdp" / "ehsdp"  the 2-D (replicate, shard) meshes of HSDP for dense and expert weights:
             ("rep", ("edps", "cp", "ep")) and ("rep", ("edps", "cp")).

Routed experts are replicated over TP (etp = 1, each TP rank runs its own, identical, all-to-all)
or split over it (etp = tp, expert_tensor_parallel.py). The data-parallel rank ("dp", the batch
slice a rank reads) is a coordinate, not a group: no collective runs over dp alone.

`layout_problems` checks a layout against the launch before any process group starts, so a bad
layout fails with the rule named instead of hanging in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moetron.parallel.config import ParallelConfig

if TYPE_CHECKING:  # torch is imported where a mesh is built: the planner reads the layout rules without it
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pp", "rep", "edps", "cp", "ep", "tp")
# Flattened groups: name → the mesh dims they join.
FLAT_DIMS = {"dp_cp": ("rep", "edps", "cp", "ep"), "edp_cp": ("rep", "edps", "cp"),
             "shard_cp": ("edps", "cp", "ep"), "eshard_cp": ("edps", "cp")}


def layout_problems(cfg: ParallelConfig, world_size: int) -> list[tuple[str, object, str]]:
    """(key, value, rule) for each way the layout cannot run on `world_size` ranks."""
    out = [(k, v, r) for k, v, r in cfg.problems()]
    if out:
        return out
    if cfg.world_size != world_size:
        out.append(("pp × dp × cp × tp", f"{cfg.pp} × {cfg.dp} × {cfg.cp} × {cfg.tp} = {cfg.world_size}",
                    f"must equal the number of launched ranks ({world_size})"))
    return out


def check_layout(cfg: ParallelConfig, world_size: int) -> None:
    """Raise ValueError naming the first broken rule; call before `init_process_group`."""
    for key, value, rule in layout_problems(cfg, world_size):
        raise ValueError(f"parallel.{key} = {value}: {rule}")


def mesh_shape(cfg: ParallelConfig) -> tuple[int, ...]:
    """Sizes of MESH_DIMS for `cfg`."""
    rep = cfg.dp // cfg.shard_group
    return (cfg.pp, rep, cfg.shard_group // cfg.ep, cfg.cp, cfg.ep, cfg.tp)


@dataclass(frozen=True)
class ParallelMesh:
    """The job's mesh and the coordinates of this rank on it."""

    mesh: DeviceMesh
    cfg: ParallelConfig
    flat: dict[str, DeviceMesh] = field(default_factory=dict)
    # Sub-meshes sliced so far: slicing makes a new DeviceMesh each time (~2 ms of CPU), and
    # rank("dp") alone needs three every training step.
    sliced: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    def sub(self, dim: str) -> DeviceMesh:
        """The mesh of `dim`: one of MESH_DIMS, a FLAT_DIMS name, or "hsdp"/"ehsdp" (2-D)."""
        if dim not in self.sliced:
            self.sliced[dim] = self._slice(dim)
        return self.sliced[dim]

    def _slice(self, dim: str) -> DeviceMesh:
        if dim in self.flat:
            return self.flat[dim]
        if dim == "hsdp":
            return self.mesh["rep", "shard_cp"]
        if dim == "ehsdp":
            return self.mesh["rep", "eshard_cp"]
        return self.mesh[dim]

    def size(self, dim: str) -> int:
        if dim == "dp":
            return self.cfg.dp
        return self.sub(dim).size()

    def rank(self, dim: str) -> int:
        if dim == "dp":
            # Which slice of the global batch this rank reads: (rep, edps, ep) row-major.
            rep, edps, ep = (self.sub(d).get_local_rank() for d in ("rep", "edps", "ep"))
            return (rep * self.sub("edps").size() + edps) * self.cfg.ep + ep
        return self.sub(dim).get_local_rank()

    def group(self, dim: str):
        return self.sub(dim).get_group()

    @property
    def device_type(self) -> str:
        return self.mesh.device_type


def build_mesh(cfg: ParallelConfig, world_size: int, device_type: str = "cpu") -> ParallelMesh:
    """Build the mesh on the already initialized default process group.

    The world size is checked first (`check_layout`), so a mismatch is refused before any
    sub-group is created.
    """
    from torch.distributed.device_mesh import init_device_mesh

    check_layout(cfg, world_size)
    mesh = init_device_mesh(device_type, mesh_shape(cfg), mesh_dim_names=MESH_DIMS)
    flat = {name: mesh[dims]._flatten(name) for name, dims in FLAT_DIMS.items()}
    return ParallelMesh(mesh, cfg, flat)

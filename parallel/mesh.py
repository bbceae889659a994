"""The device mesh: `ParallelConfig` → one named DeviceMesh over every rank of the job.

Rank layout (row-major, the last dimension varies fastest, so TP peers are neighbours and land on
one node first, as in Megatron):

    world = pp × dp × tp          mesh dims ("pp", "edp", "ep", "tp"), dp = edp × ep

Expert parallelism is carved out of the data-parallel ranks (Megatron, torchtitan): the dp ranks
of one pipeline stage and TP position are split into groups of `ep` consecutive ranks.

  - "ep"  group: the ep ranks that exchange tokens by all-to-all; each holds E/ep different experts.
  - "edp" group: the dp/ep ranks that hold the *same* experts; expert gradients are reduced here
    only (and divided by dp, because the all-to-all already summed the ep ranks' contributions).
  - "dp"  = ("edp", "ep") flattened: every data-parallel rank; dense gradients are reduced here.

The rule is therefore `ep | dp` (not `ep | dp × tp`): experts are replicated over TP
(expert-TP = 1), and each TP rank runs its own, identical, all-to-all.

`layout_problems` checks a layout against the launch before any process group starts, so a bad
layout fails with the rule named instead of hanging in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moetron.parallel.config import ParallelConfig

MESH_DIMS = ("pp", "edp", "ep", "tp")


def layout_problems(cfg: ParallelConfig, world_size: int) -> list[tuple[str, object, str]]:
    """(key, value, rule) for each way the layout cannot run on `world_size` ranks."""
    out = [(k, v, r) for k, v, r in cfg.problems()]
    if out:
        return out
    if cfg.world_size != world_size:
        out.append(("pp × dp × tp", f"{cfg.pp} × {cfg.dp} × {cfg.tp} = {cfg.world_size}",
                    f"must equal the number of launched ranks ({world_size})"))
    return out


def check_layout(cfg: ParallelConfig, world_size: int) -> None:
    """Raise ValueError naming the first broken rule; call before `init_process_group`."""
    for key, value, rule in layout_problems(cfg, world_size):
        raise ValueError(f"parallel.{key} = {value}: {rule}")


@dataclass(frozen=True)
class ParallelMesh:
    """The job's mesh and the coordinates of this rank on it.

    `mesh` has dims ("pp", "edp", "ep", "tp"); `sub("dp")` is ("edp", "ep") flattened.
    """

    mesh: DeviceMesh
    dp_mesh: DeviceMesh  # the flattened ("edp", "ep") dim, kept here rather than looked up by name
    cfg: ParallelConfig

    def sub(self, dim: str) -> DeviceMesh:
        """The 1-D mesh of `dim` ("pp", "dp", "edp", "ep", "tp") this rank belongs to."""
        return self.dp_mesh if dim == "dp" else self.mesh[dim]

    def size(self, dim: str) -> int:
        return self.sub(dim).size()

    def rank(self, dim: str) -> int:
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
    check_layout(cfg, world_size)
    shape = (cfg.pp, cfg.dp // cfg.ep, cfg.ep, cfg.tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    return ParallelMesh(mesh, mesh["edp", "ep"]._flatten("dp"), cfg)

"""The parallel layout section: how many ways each dimension of the device mesh is split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Problem = tuple[str, object, str]


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """world = pp × dp × tp; expert parallelism is carved out of the data-parallel ranks (ep | dp)."""

    pp: int = 1
    # Left out of a config, it is inferred from the launch: world size / (pp × tp) (launcher/config.py).
    dp: int = 1
    tp: int = 1
    ep: int = 1
    # Virtual pipeline stages per rank (interleaved schedules).
    vpp: int = 1
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    microbatches: int = 1
    sequence_parallel: bool = False
    # "fsdp": parameters, grads and optimizer state sharded (ZeRO-3); "ddp": replicated.
    dp_mode: Literal["fsdp", "ddp"] = "fsdp"

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        for name in ("pp", "dp", "tp", "ep", "vpp", "microbatches"):
            if getattr(self, name) < 1:
                out.append((name, getattr(self, name), "must be >= 1"))
        if out:
            return out
        if self.dp % self.ep:
            out.append(("ep", self.ep, f"must divide dp ({self.dp}): experts are sharded over data-parallel ranks"))
        if self.vpp > 1 and self.schedule not in ("interleaved_1f1b", "zero_bubble"):
            out.append(("vpp", self.vpp, "virtual stages need schedule=interleaved_1f1b or zero_bubble"))
        if self.pp > 1 and self.microbatches < self.pp:
            out.append(("microbatches", self.microbatches, f"must be >= pp ({self.pp}) to fill the pipeline"))
        rounds = max(1, self.microbatches // self.pp)
        if self.pp > 1 and self.schedule in ("interleaved_1f1b", "zero_bubble") and self.microbatches % rounds:
            out.append(("microbatches", self.microbatches,
                        f"must be a multiple of microbatches // pp ({rounds}) for schedule={self.schedule}"))
        return out

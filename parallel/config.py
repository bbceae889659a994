"""The parallel layout section: how many ways each dimension of the device mesh is split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetron.kernels.config import Problem

DP_MODES = ("fsdp", "hsdp", "ddp", "zero1")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """world = pp × dp × cp × tp; expert parallelism is carved out of the data-parallel ranks
    (ep | dp), expert-tensor parallelism out of the tensor-parallel ones (etp ∈ {1, tp})."""

    pp: int = 1
    # Left out of a config, it is inferred from the launch: world size / (pp × cp × tp) (launcher/config.py).
    dp: int = 1
    tp: int = 1
    # Context parallelism: each sequence split over cp ranks (two chunks each, causal load balance).
    cp: int = 1
    ep: int = 1
    # Expert-tensor parallelism: 1 replicates each routed expert over tp; tp splits its matrices.
    etp: int = 1
    # Virtual pipeline stages per rank (interleaved schedules).
    vpp: int = 1
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    microbatches: int = 1
    sequence_parallel: bool = False
    # "fsdp": parameters, grads and optimizer state sharded over dp × cp (ZeRO-3);
    # "hsdp": the same inside groups of dp_shard data-parallel ranks, replicated across them;
    # "ddp": replicated; "zero1": replicated weights and grads, AdamW state and update sharded.
    dp_mode: Literal["fsdp", "hsdp", "ddp", "zero1"] = "fsdp"
    # HSDP only: data-parallel ranks per shard group (a node, typically); 0 means all of dp.
    dp_shard: int = 0

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def pipeline_chunks(self) -> int:
        """Micro-batches a pipeline cuts each rank's batch into: `microbatches` under pp > 1, else 1."""
        return self.microbatches if self.pp > 1 else 1

    @property
    def shard_group(self) -> int:
        """Data-parallel ranks that shard one copy of the weights (HSDP's dp_shard, else dp)."""
        return self.dp_shard if self.dp_mode == "hsdp" and self.dp_shard else self.dp

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        for name in ("pp", "dp", "tp", "cp", "ep", "etp", "vpp", "microbatches"):
            if getattr(self, name) < 1:
                out.append((name, getattr(self, name), "must be >= 1"))
        if out:
            return out
        if self.dp_mode not in DP_MODES:
            out.append(("dp_mode", self.dp_mode, f"must be one of {', '.join(DP_MODES)}"))
        if self.dp % self.ep:
            out.append(("ep", self.ep, f"must divide dp ({self.dp}): experts are sharded over data-parallel ranks"))
        if self.etp not in (1, self.tp):
            out.append(("etp", self.etp, f"must be 1 (experts replicated over tp) or tp ({self.tp})"))
        if self.dp_shard and self.dp_mode != "hsdp":
            out.append(("dp_shard", self.dp_shard, f"only applies to dp_mode=hsdp (dp_mode is {self.dp_mode})"))
        if self.dp_mode == "hsdp":
            if self.dp_shard < 1 or self.dp % self.dp_shard:
                out.append(("dp_shard", self.dp_shard, f"must divide dp ({self.dp}) for dp_mode=hsdp"))
            elif self.dp_shard % self.ep:
                out.append(("dp_shard", self.dp_shard,
                            f"must be a multiple of ep ({self.ep}): an expert-parallel group stays inside a shard group"))
        if self.vpp > 1 and self.schedule not in ("interleaved_1f1b", "zero_bubble"):
            out.append(("vpp", self.vpp, "virtual stages need schedule=interleaved_1f1b or zero_bubble"))
        if self.pp > 1 and self.schedule == "zero_bubble" and self.dp * self.cp > 1:
            # torch's split backward (input grads first, weight grads later) fails at the first
            # backward under FSDP2 and replicate alike ("Failed to run stage backward input").
            out.append(("schedule", self.schedule, f"does not run with data parallelism (dp × cp = "
                        f"{self.dp * self.cp}); use interleaved_1f1b or 1f1b"))
        if self.pp > 1 and self.microbatches < self.pp:
            out.append(("microbatches", self.microbatches, f"must be >= pp ({self.pp}) to fill the pipeline"))
        rounds = max(1, self.microbatches // self.pp)
        if self.pp > 1 and self.schedule in ("interleaved_1f1b", "zero_bubble") and self.microbatches % rounds:
            out.append(("microbatches", self.microbatches,
                        f"must be a multiple of microbatches // pp ({rounds}) for schedule={self.schedule}"))
        return out

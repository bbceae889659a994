"""Pipeline parallelism: the Decoder split by layers into stages, run by a
`torch.distributed.pipelining` schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble).

Legend: B sequences per pipeline step on this dp rank, M micro-batches, S sequence, D model dim,
V vocabulary, pp ranks, vpp virtual stages per rank, N = pp × vpp stages.

Stage s owns layers [s·L/N, (s+1)·L/N); the first also owns the embedding, the last the final
norm, the head and the loss. Rank r holds stages r, r + pp, r + 2·pp, … (loop placement, what
the interleaved schedules expect). A stage is a pruned deep copy of the meta-device Decoder, so
its parameter names are the full model's names ("layers.5.attn.wq.weight" on every layout).
Each stage is told the shapes of its micro-batch's input and output (`stage_io`), so torch never
runs a stage on placeholders to infer them: step 1 and an evaluation do the work of any other
step, and nothing a placeholder run would route (expert loads, biases) needs forgetting.

MoE aux and z losses: every stage's routers produce them, but only the last stage has a loss.
Each stage's output passes through `_AddAuxLossGrad`, an identity in forward whose backward also
returns d(loss)/d(aux) = the loss scale for the stage's summed aux loss — exactly what adding
`scale · aux` to the final loss would give. It rides on the activation every schedule already
differentiates (also the zero-bubble split into input and weight gradients, since the aux graph
hangs off the stage's own forward), so no schedule can drop it.

Packed documents: the first stage also takes the documents' starts and positions (B, S) of its
micro-batch (model/packing.py), and every stage but the last passes them on beside its hidden
states, so each stage masks the micro-batch it is running (no gradient flows through them).

Multi-token prediction (model/mtp.py) runs on the last stage, which needs the token ids and the
embedding: the ids travel as one more stage input after the documents' (stage 0 gets them twice,
as its input and as that one), and the last stage holds a copy of the embedding (as Megatron-LM
does for its MTP stage and for tied embeddings). Both copies start equal (materialized by name)
and stay equal: after each step's backward their gradients are summed over the pair of ranks of
the first and last stage (`sync_embedding_copies`), so both apply the same update; the gradient
norm counts the pair once. Training only: the last stage returns its logits and then each depth's,
stacked along the batch ((1 + D)·b rows), and the loss splits them, adding λ·(1/D) Σ_k CE_k; in
evaluation it returns the main logits alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor

from moetron.model.mtp import mtp_cross_entropy
from moetron.model.transformer import Decoder, ModelOutput
from moetron.parallel.config import ParallelConfig
from moetron.parallel.mesh import ParallelMesh

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")


class _AddAuxLossGrad(torch.autograd.Function):
    """y = x in forward; in backward dL/dx = dL/dy and dL/daux = scale."""

    @staticmethod
    def forward(ctx, x, aux, scale: float):
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_y):
        shape, dtype, device = ctx.aux_meta
        return grad_y, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


@dataclass
class StepRecord:
    """What the stages of this rank saw during one pipeline step (for losses and dashboards)."""

    loss_scale: float = 1.0
    ce: list[torch.Tensor] = field(default_factory=list)  # last stage: unscaled CE per micro-batch
    aux: list[torch.Tensor] = field(default_factory=list)  # each stage × micro-batch: summed aux
    mtp: list[torch.Tensor] = field(default_factory=list)  # last stage: (1/D) Σ_k CE_k per micro-batch
    moe: dict = field(default_factory=dict)  # layer → MoEStats of the latest micro-batch


def stages_of_rank(pp_rank: int, cfg: ParallelConfig) -> list[int]:
    return list(range(pp_rank, cfg.pp * cfg.vpp, cfg.pp))


def split_stage(meta_model: Decoder, stage: int, num_stages: int) -> Decoder:
    """A deep copy of the (meta) model keeping only what stage `stage` of `num_stages` runs."""
    n_layers = len(meta_model.layers)
    per = n_layers // num_stages
    part = copy.deepcopy(meta_model)
    part.layers = nn.ModuleDict({str(i): part.layers[str(i)] for i in range(stage * per, (stage + 1) * per)})
    last = stage == num_stages - 1
    if stage != 0:
        part.pos_embed = None
        if not (last and part.mtp is not None):  # the MTP stage keeps a copy of the embedding
            part.embed = None
    if not last:
        part.norm = part.head = part.mtp = None
    return part


def merge_stages(stages: list[Decoder]) -> nn.Module:
    """One module over the parameters of several stages of one model (the stages an interleaved
    pipeline places on one rank), each under its name in the whole model: what the optimizer and
    the checkpoint see. It shares the stages' submodules and is never run."""
    merged = nn.Module()
    merged.layers = nn.ModuleDict()
    for stage in stages:
        for name, child in stage.named_children():
            if name == "layers":
                merged.layers.update(child)
            elif child is not None and any(True for _ in child.parameters()):
                setattr(merged, name, child)
    return merged


def attach_stage_output(module: Decoder, record: StepRecord) -> None:
    """Make a stage return the tensor the schedule sends on (hidden states or logits) with the
    stage's aux loss attached for backward. Registered before data parallelism wraps the stage,
    so FSDP's own forward hooks see a plain tensor. With multi-token prediction every stage's
    last input is the token ids, handed to the Decoder as `mtp_ids_BS` and passed on."""
    if module.cfg.mtp_depth:
        module.register_forward_pre_hook(_ids_to_keyword, with_kwargs=True)
    module.register_forward_hook(_stage_output_hook(record), with_kwargs=True)


def _ids_to_keyword(module, args: tuple, kwargs: dict):
    return args[:-1], {**kwargs, "mtp_ids_BS": args[-1]}


def _stage_output_hook(record: StepRecord):

    def hook(module, args, kwargs, output: ModelOutput):
        record.aux.append(output.aux_loss.detach())
        record.moe.update(output.moe)
        logits = torch.cat([output.logits_BSV, *output.mtp_logits]) if output.mtp_logits else output.logits_BSV
        out = _AddAuxLossGrad.apply(logits, output.aux_loss, record.loss_scale)
        if module.head is not None:
            return out
        # The packed documents' tensors (args after the input) and the token ids go on to the next stage.
        ids = (kwargs["mtp_ids_BS"].contiguous(),) if "mtp_ids_BS" in kwargs else ()  # sent as they are
        return (out, *args[1:], *ids) if len(args) > 1 or ids else out

    return hook


def embedding_pair_group(mesh: ParallelMesh, cfg: ParallelConfig):
    """The process group of this rank's pipeline's first and last stage ranks (pp ranks 0 and
    pp − 1), which hold the embedding and its copy under multi-token prediction. A collective:
    every rank creates every pipeline's pair, in the same order."""
    if cfg.pp == 2:
        return mesh.group("pp")
    mine = None
    for ranks in mesh.mesh.mesh.movedim(0, -1).reshape(-1, cfg.pp).tolist():
        group = dist.new_group([ranks[0], ranks[-1]])
        if dist.get_rank() in (ranks[0], ranks[-1]):
            mine = group
    return mine


@torch.no_grad()
def sync_embedding_copies(modules: list[Decoder], group) -> None:
    """Sum the embedding's gradient over the first and the last stage (see the module docstring);
    both then hold d(loss)/d(embedding) and step alike. A rank between them does nothing."""
    # pp >= 2: rank 0 holds stage 0's embedding, rank pp − 1 the last stage's copy, no rank both.
    for module in modules:
        grad = module.embed.weight.grad if module.embed is not None else None
        if grad is not None:
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


@dataclass
class Pipeline:
    """The stages this rank runs and the schedule that runs them."""

    modules: list[Decoder]
    stage_ids: list[int]
    num_stages: int
    schedule: object
    record: StepRecord
    microbatch_BS: tuple[int, int]  # sequences and tokens (S/cp) of one micro-batch on this rank
    microbatches: int  # micro-batches per step, as the schedule was built for
    mtp_ids: bool = False  # multi-token prediction: the token ids travel to the last stage
    embedding_group: object = None  # the first and last stage's ranks (multi-token prediction)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def step(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor, loss_scale: float, *, train: bool = True,
             extra: tuple[torch.Tensor, ...] = ()) -> None:
        """One pipeline pass over B sequences in M micro-batches; backward too when `train`.

        Every rank passes the same (inputs, targets); only the first and last stage use them.
        Gradients accumulate `loss_scale × Σ_micro-batches (CE + aux)`. B × S must be the shape
        the stages were built for: M micro-batches of `microbatch_BS`. `extra`: the packed
        documents' (doc_start_BS, positions_BS) over whole sequences, when the stages were built packed.
        """
        b, s = self.microbatch_BS
        want = (b * self.microbatches, s)
        if tuple(inputs_BS.shape) != want:
            raise ValueError(f"pipeline step: got a batch of shape {tuple(inputs_BS.shape)}, but the stages "
                             f"were built for {want} (micro-batches × sequences, tokens on this rank)")
        self.record.loss_scale = loss_scale
        ids = (inputs_BS,) if self.mtp_ids else ()  # the last stage's multi-token prediction reads them
        args = (inputs_BS, *extra, *ids) if self.has_first else ()
        kwargs = {"target": targets_BS, "losses": []} if self.has_last else {}
        (self.schedule.step if train else self.schedule.eval)(*args, **kwargs)


def stage_io(module: Decoder, stage: int, num_stages: int, microbatch_BS: tuple[int, int],
             cfg: ParallelConfig, packed: bool = False) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Example input and output of one micro-batch (b sequences of S/cp tokens on this rank) of
    stage `stage`, as meta tensors, so the schedule never runs a stage on placeholders to learn them.

    In: token ids (b, S/cp) on the first stage, else hidden states (b, S/cp, D), split over S by
    tp under sequence parallelism. Out: the same hidden states, or on the last stage its local
    logits (b, S/cp, V/tp), which are never sent (torch only counts them). `packed`: every input,
    and every output but the last stage's, carries the documents' starts and positions (b, S).
    Multi-token prediction: every input and every output but the last stage's ends with the
    token ids (b, S), and the last stage's logits have each depth's after them ((1 + D)·b rows).
    """
    b, s_local = microbatch_BS
    s_hidden = s_local // (cfg.tp if cfg.sequence_parallel else 1)
    dtype = next(module.parameters()).dtype  # the residual stream stays in the weights' dtype
    d, v = module.cfg.d_model, module.cfg.vocab_size // cfg.tp

    def hidden():
        return torch.empty(b, s_hidden, d, dtype=dtype, device="meta", requires_grad=True)

    inputs = torch.empty(b, s_local, dtype=torch.long, device="meta") if stage == 0 else hidden()
    last = stage == num_stages - 1
    rows = b * (1 + module.cfg.mtp_depth)
    outputs = torch.empty(rows, s_local, v, dtype=dtype, device="meta", requires_grad=True) if last else hidden()
    docs = tuple(torch.empty(b, s_local * cfg.cp, dtype=torch.long, device="meta") for _ in range(2)) if packed else ()
    docs += (torch.empty(b, s_local, dtype=torch.long, device="meta"),) if module.cfg.mtp_depth else ()
    return (inputs, *docs), (outputs, *(() if last else docs))


def build_pipeline(stage_modules: dict[int, Decoder], record: StepRecord, mesh: ParallelMesh, cfg: ParallelConfig,
                   device: torch.device, cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   microbatch_BS: tuple[int, int], packed: bool = False, mtp_weight: float = 0.0) -> Pipeline:
    """Wrap materialized stage modules into PipelineStages and build the configured schedule.

    cross_entropy(logits_BSV, targets_BS) → mean next-token loss of one micro-batch.
    microbatch_BS: sequences and tokens (before context parallelism) of one micro-batch; every
    stage is told its input and output shapes, so no run is spent inferring them.
    mtp_weight: λ of multi-token prediction, when the model has it (see the module docstring).
    """
    num_stages = cfg.pp * cfg.vpp
    local_BS = (microbatch_BS[0], microbatch_BS[1] // cfg.cp)
    stages = []
    for sid, module in stage_modules.items():
        inputs, outputs = stage_io(module, sid, num_stages, local_BS, cfg, packed)
        stages.append(PipelineStage(module, sid, num_stages, device, input_args=inputs, output_args=outputs,
                                    group=mesh.group("pp")))

    def loss_fn(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        # Training with multi-token prediction: the main logits' b rows, then each depth's.
        logits_BSV, *ahead = logits_BSV.chunk(logits_BSV.shape[0] // targets_BS.shape[0])
        ce = cross_entropy(logits_BSV, targets_BS)
        record.ce.append(ce.detach())
        if not ahead:
            return ce * record.loss_scale
        mtp = mtp_cross_entropy(ahead, targets_BS, cross_entropy)
        record.mtp.append(mtp.detach())
        return (ce + mtp_weight * mtp) * record.loss_scale

    cls = SCHEDULES[cfg.schedule]
    # scale_grads=False: the loss scale (1 / (micro-batches × accumulation)) is applied in
    # loss_fn and to the aux gradient, so both are scaled once and identically.
    first = stages if cfg.schedule in MULTI_STAGE else stages[0]
    schedule = cls(first, n_microbatches=cfg.microbatches, loss_fn=loss_fn, scale_grads=False)
    mtp = next(iter(stage_modules.values())).cfg.mtp_depth > 0
    return Pipeline(list(stage_modules.values()), list(stage_modules), num_stages, schedule, record, local_BS,
                    cfg.microbatches, mtp_ids=mtp, embedding_group=embedding_pair_group(mesh, cfg) if mtp else None)

"""One entry point: a meta-device Decoder + mesh + layout → this rank's trainable parts.

Order (fixed; each step sees the previous one's result, as in torchtitan):
  pipeline split → context parallel → tensor (+ sequence) parallel → expert parallel → expert-tensor parallel
  → FP8 linears and experts (train.precision fp8) → activation checkpointing
  → compile → data parallel (FSDP2 / replicate) → materialize and initialize.
The model is a meta-device shell until the last step, so it never exists whole on one rank; the
initial weights equal the single-process ones for the same seed (see materialize.py).

`ParallelModel` then runs a training step the same way on every layout: the sampler's global
batch → this dp rank's slice → this cp rank's two chunks of each sequence (the sampler reads only
those: `batch_rows`, `window_spans`) → micro-batches (accumulation, and pipeline micro-batches within
each) → forward/backward with the MoE aux losses in the gradient → global gradient norm.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from moetron.model.mtp import mtp_cross_entropy
from moetron.model.packing import Packing
from moetron.model.transformer import Decoder
from moetron.parallel.activation_checkpoint import apply_activation_checkpointing
from moetron.parallel.config import ParallelConfig
from moetron.parallel.context_parallel import apply_context_parallel, split_sequence
from moetron.parallel.data_parallel import apply_data_parallel, clip_grad_norm_, set_gradient_sync
from moetron.parallel.expert_parallel import apply_expert_parallel
from moetron.parallel.expert_shards import ExpertShards
from moetron.parallel.expert_tensor_parallel import apply_expert_tensor_parallel
from moetron.parallel.float8 import apply_float8
from moetron.parallel.global_balance import apply_global_batch_balance, start_global_batch
from moetron.parallel.materialize import materialize_and_init
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.pipeline import (
    Pipeline,
    StepRecord,
    attach_stage_output,
    build_pipeline,
    merge_stages,
    split_stage,
    stages_of_rank,
    sync_embedding_copies,
)
from moetron.parallel.tensor_parallel import apply_tensor_parallel
from moetron.parallel.token_mean import GlobalTokenMean

# (logits_BSV, targets_BS, reduction="mean") → the loss, reduced as F.cross_entropy reduces it.
CrossEntropy = Callable[..., torch.Tensor]


def apply_compile(model: Decoder, *, tensor_parallel: bool = False) -> None:
    """Compile block by block: small graphs, one compilation reused by identical blocks."""
    for block in model.blocks():
        if tensor_parallel:
            # torch 2.13: between compiled blocks whose weights are DTensors, a gradient reaches
            # DTensor's redistribute backward as a plain tensor ("'Tensor' object has no attribute
            # '_local_tensor'"); an eager copy of each block's input avoids it, so the block's
            # forward is compiled and the copy stays outside.
            block.register_forward_pre_hook(_copy_hidden_states)
            block.forward = torch.compile(block.forward)
        else:
            block.compile()


def _copy_hidden_states(module: nn.Module, args: tuple) -> tuple:
    return (args[0].clone(), *args[1:])


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under loss_parallel) as a plain tensor, differentiably."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass
class StepLosses:
    """This rank's view of one step: mean CE and aux over its micro-batches, and router stats;
    `mtp`: the multi-token-prediction CE (1/D) Σ_k CE_k (model/mtp.py), 0 without it."""

    ce: torch.Tensor
    aux: torch.Tensor
    moe: dict
    mtp: torch.Tensor | float = 0.0


@dataclass
class ParallelModel:
    """This rank's parts of the model and how to run them."""

    modules: list[Decoder]  # one per pipeline stage held here; one in total without PP
    mesh: ParallelMesh
    cfg: ParallelConfig
    expert_sharded: set[str]  # routed-expert weights holding an E/ep row block
    pipeline: Pipeline | None
    cross_entropy: CrossEntropy
    # Routed-expert weights split by F over tp (etp = tp): name → the split dim.
    expert_tp_split: dict[str, int] = field(default_factory=dict)
    # Documents packed into each sequence are kept apart (model/packing.py); None: one stream.
    packing: Packing | None = None
    # Windows carry their own targets, (B, 2, S) inputs and targets (a masked-LM objective),
    # instead of next-token windows (B, S + 1).
    targets_given: bool = False
    # λ of multi-token prediction (model.mtp_loss_weight; 0 without MTP): the loss adds λ (1/D) Σ_k CE_k.
    mtp_weight: float = 0.0

    @functools.cached_property
    def module(self) -> nn.Module:
        """Every parameter this rank holds, under its name in the whole model (optimizer,
        checkpoint, FLOP counter): the one part, or a view merging the stages that an interleaved
        pipeline places here (run those through `modules`)."""
        return self.modules[0] if len(self.modules) == 1 else merge_stages(self.modules)

    def named_parameters(self):
        seen: set[int] = set()
        for name, p in chain.from_iterable(m.named_parameters() for m in self.modules):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def local_batch(self, batch_BS: torch.Tensor) -> torch.Tensor:
        """This dp rank's contiguous slice of the global batch (dp must divide it)."""
        return batch_BS.chunk(self.cfg.dp)[self.mesh.rank("dp")]

    def batch_rows(self, n: int) -> slice:
        """The rows of a global batch of n sequences that `local_batch` keeps here, so that the
        sampler reads only them (torch.chunk's cut: pieces of ⌈n / dp⌉, the last one shorter)."""
        dp, size = self.cfg.dp, -(-n // self.cfg.dp)
        start = self.mesh.rank("dp") * size
        if start >= n:
            raise ValueError(f"a batch of {n} sequences leaves dp rank {self.mesh.rank('dp')} of {dp} none")
        return slice(start, min(start + size, n))

    def window_spans(self, seq_len: int) -> list[tuple[int, int]] | None:
        """The tokens of a (seq_len + 1)-token window this rank needs, as (start, stop) offsets:
        None (all of them) without context parallelism, else its two chunks of `split_sequence`,
        each with one more token for the last target. A window read as these pieces, (B, 2, C + 1),
        goes to `local_window` in place of the whole one."""
        if self.cfg.cp == 1 or self.packing is not None or self.targets_given:
            # Packed documents: where a document begins may lie in another rank's chunk; given
            # targets: the windows are corrupted whole.
            return None
        cp, cp_rank = self.cfg.cp, self.mesh.rank("cp")
        if seq_len % (2 * cp):
            raise ValueError(f"sequence length {seq_len} must be divisible by 2 × parallel.cp ({2 * cp})")
        C = seq_len // (2 * cp)
        return [(c * C, (c + 1) * C + 1) for c in (cp_rank, 2 * cp - 1 - cp_rank)]

    def local_window(self, micro_BS1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets at this rank's positions: of (B, S + 1) whole windows all
        S, or under context parallelism its two load-balanced chunks (context_parallel.py); of
        (B, P, L) pieces already cut by `window_spans`, the L − 1 inputs and targets of each; of
        (B, 2, S) windows with their targets given (`targets_given`), those, at this rank's positions."""
        if self.targets_given:
            inputs_BS, targets_BS = micro_BS1[:, 0], micro_BS1[:, 1]
        elif micro_BS1.dim() == 3:
            return micro_BS1[..., :-1].flatten(1), micro_BS1[..., 1:].flatten(1)
        else:
            inputs_BS, targets_BS = micro_BS1[:, :-1], micro_BS1[:, 1:]
        if self.cfg.cp == 1:
            return inputs_BS, targets_BS
        cp, cp_rank = self.cfg.cp, self.mesh.rank("cp")
        return split_sequence(inputs_BS, cp, cp_rank), split_sequence(targets_BS, cp, cp_rank)

    def packed_args(self, micro_BS1: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The model's document inputs for whole windows (B, S + 1): () without packing, else
        (doc_start_BS, positions_BS) over all S positions (every cp rank gets the whole sequences')."""
        if self.packing is None:
            return ()
        return self.packing.model_inputs(micro_BS1[:, :-1])

    def loss_context(self):
        # Vocab-parallel logits: cross entropy without gathering V (forward and backward).
        return loss_parallel() if self.cfg.tp > 1 else contextlib.nullcontext()

    def forward_backward(self, batch_BS1: torch.Tensor, *, grad_accum: int, autocast) -> StepLosses:
        """Accumulate gradients of (1/grad_accum) Σ (CE + aux) over this rank's micro-batches (with
        given targets each CE is the micro-batch's share of the global batch's mean: token_mean.py).

        batch_BS1: this rank's slice (inputs and shifted targets in one window of S + 1).
        """
        start_global_batch(self.modules)
        if self.pipeline is not None:
            return self._pipeline_forward_backward(batch_BS1, grad_accum, autocast)
        self._count_scored(batch_BS1, grad_accum)
        model = self.module
        ce_sum = aux_sum = mtp_sum = 0.0
        moe: dict = {}
        for i, micro_BS1 in enumerate(batch_BS1.chunk(grad_accum)):
            set_gradient_sync(self.modules, i == grad_accum - 1, self.cfg.dp_mode)
            with self.loss_context():
                with autocast():
                    inputs_BS, targets_BS = self.local_window(micro_BS1)
                    out = model(inputs_BS, *self.packed_args(micro_BS1))
                    ce = _plain(self.cross_entropy(out.logits_BSV, targets_BS))
                    mtp = _plain(mtp_cross_entropy(out.mtp_logits, targets_BS, self.cross_entropy))
                ((ce + out.aux_loss + self.mtp_weight * mtp) / grad_accum).backward()
            ce_sum, aux_sum, moe = ce_sum + ce.detach(), aux_sum + out.aux_loss.detach(), out.moe
            mtp_sum = mtp_sum + mtp.detach()
        return StepLosses(ce_sum / grad_accum, aux_sum / grad_accum, moe, mtp_sum / grad_accum)

    def _pipeline_forward_backward(self, batch_BS1, grad_accum, autocast, *, train: bool = True) -> StepLosses:
        pipe = self.pipeline
        _reset(pipe.record)
        n = grad_accum * self.cfg.microbatches
        self._count_scored(batch_BS1, n)
        for micro_BS1 in batch_BS1.chunk(grad_accum):
            with self.loss_context(), autocast():
                pipe.step(*self.local_window(micro_BS1), 1.0 / n, train=train, extra=self.packed_args(micro_BS1))
        rec = pipe.record
        if train and pipe.embedding_group is not None:
            sync_embedding_copies(pipe.modules, pipe.embedding_group)
        zero = torch.zeros((), device=batch_BS1.device)
        ce = torch.stack([_plain(c).float() for c in rec.ce]).sum() / n if rec.ce else zero
        aux = torch.stack([a.float() for a in rec.aux]).sum() / n if rec.aux else zero
        mtp = torch.stack([_plain(c).float() for c in rec.mtp]).sum() / n if rec.mtp else zero
        return StepLosses(ce, aux, dict(rec.moe), mtp)

    @torch.no_grad()
    def evaluate(self, batch_BS1: torch.Tensor, autocast) -> torch.Tensor:
        """Mean CE of this rank's slice of one validation batch (see `global_losses`)."""
        for m in self.modules:
            m.eval()
        try:
            if self.pipeline is not None:
                # The stages take micro-batches of the shape they were built for: one pass per
                # training micro-batch's worth of sequences (a validation batch is a global batch).
                passes = batch_BS1.shape[0] // (self.pipeline.microbatch_BS[0] * self.cfg.microbatches)
                return self._pipeline_forward_backward(batch_BS1, max(passes, 1), autocast, train=False).ce
            self._count_scored(batch_BS1, 1)
            with self.loss_context(), autocast():
                inputs_BS, targets_BS = self.local_window(batch_BS1)
                logits_BSV = self.module(inputs_BS, *self.packed_args(batch_BS1)).logits_BSV
                return _plain(self.cross_entropy(logits_BSV, targets_BS))
        finally:
            for m in self.modules:
                m.train()

    def _count_scored(self, batch_BS1: torch.Tensor, chunks: int) -> None:
        """Given targets: count the step's scored positions before its first forward, for each of
        its `chunks` micro-batches' share of the global mean (token_mean.py)."""
        if isinstance(self.cross_entropy, GlobalTokenMean):
            self.cross_entropy.count(self.local_window(batch_BS1)[1], chunks)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        copies = {"embed.weight"} if self.pipeline is not None and self.pipeline.embedding_group is not None else ()
        return clip_grad_norm_(self.named_parameters(), max_norm, self.mesh, self.expert_sharded,
                               expert_tp_split=set(self.expert_tp_split), stage_copies=copies)

    def expert_shards(self) -> ExpertShards | None:
        """How the routed experts held here are pieces of the full weights, for checkpoints
        (None when every rank holds them whole)."""
        names = frozenset(self.expert_sharded | set(self.expert_tp_split))
        if not names:
            return None
        return ExpertShards(names, self.mesh.sub("ep"), tp_dims=dict(self.expert_tp_split), tp_mesh=self.mesh.sub("tp"))

    def global_losses(self, ce: torch.Tensor, aux: torch.Tensor, *held_by_last: torch.Tensor) -> tuple[float, ...]:
        """Mean over dp ranks of CE (held by the last stage) and of the aux loss summed over
        stages — the numbers one process would report for the same global batch. `held_by_last`:
        more losses of the last stage (the MTP CE), reduced like CE and returned after aux."""
        holds_ce = self.pipeline is None or self.pipeline.has_last
        counts = self.mesh.rank("tp") == 0  # tp ranks hold copies of the same values
        # cp ranks hold equal shares of each sequence: the mean of their means is the sequence's.
        last = [torch.as_tensor(x, device=ce.device).detach().float() * (holds_ce and counts)
                for x in (ce, *held_by_last)]
        t = torch.stack([last[0], aux.detach().float() * counts, *last[1:]])
        t = t / (self.cfg.dp * self.cfg.cp)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        # NOTE: host-device sync to read the losses.
        return tuple(t.tolist())


def _reset(record: StepRecord) -> None:
    record.ce.clear()
    record.aux.clear()
    record.mtp.clear()
    record.moe.clear()


def _stages(meta_model: Decoder, mesh: ParallelMesh, cfg: ParallelConfig, record: StepRecord) -> dict[int, Decoder]:
    """The pipeline stages this rank runs, by stage id (the whole model as stage 0 without PP)."""
    if cfg.pp == 1:
        return {0: meta_model}
    num_stages = cfg.pp * cfg.vpp
    parts = {s: split_stage(meta_model, s, num_stages) for s in stages_of_rank(mesh.rank("pp"), cfg)}
    for part in parts.values():
        attach_stage_output(part, record)
    return parts


def parallelize(meta_model: Decoder, mesh: ParallelMesh, cfg: ParallelConfig, *, seed: int, device: torch.device,
                cross_entropy: CrossEntropy, activation_checkpoint: str = "none", compile: bool = False,
                float8: bool = False, microbatch_BS: tuple[int, int] | None = None, packing: Packing | None = None,
                targets_given: bool = False) -> ParallelModel:
    """Split, shard, wrap and materialize `meta_model` (built on the meta device) for this rank.

    cross_entropy(logits_BSV, targets_BS, reduction="mean") → the next-token loss, as
    F.cross_entropy reduces it ("sum" is asked for only with targets_given); it runs on the last
    stage, under `loss_parallel` when tp > 1 (logits then arrive as a DTensor split over V).
    microbatch_BS: sequences and tokens of one pipeline micro-batch on this dp rank (pp > 1 only):
    train.batch_size / (dp × grad_accum × microbatches) and train.seq_len.
    float8: FP8 GEMMs for the dense linears and the experts (float8.py; tp must be 1).
    packing: keep packed documents apart (model/packing.py). targets_given: batches are (B, 2, S)
    inputs and targets (a masked-LM objective) rather than next-token windows (B, S + 1); the loss
    is then the mean over the global batch's scored positions (token_mean.py).
    """
    if cfg.pp > 1 and microbatch_BS is None:
        raise ValueError("parallelize: a pipeline (pp > 1) needs microbatch_BS, the (sequences, tokens) "
                         "of one micro-batch, to give its stages their shapes")
    if any(not p.is_meta for p in meta_model.parameters()):
        raise ValueError("parallelize expects a model built on the meta device (build_model(cfg, device='meta'))")
    full_meta = copy.deepcopy(meta_model)
    record = StepRecord()
    parts = _stages(meta_model, mesh, cfg, record)
    expert_sharded: set[str] = set()
    expert_tp_split: dict[str, int] = {}
    for part in parts.values():
        apply_context_parallel(part, mesh)
        apply_global_batch_balance(part, mesh)
        apply_tensor_parallel(part, mesh, cfg)
        expert_sharded |= apply_expert_parallel(part, mesh)
        expert_tp_split |= apply_expert_tensor_parallel(part, mesh, cfg)
        if float8:
            apply_float8(part)
        apply_activation_checkpointing(part, activation_checkpoint)
        if compile:
            apply_compile(part, tensor_parallel=cfg.tp > 1)
        apply_data_parallel(part, mesh, cfg)
    cross_entropy = _loss(cross_entropy, mesh, cfg, compile=compile, targets_given=targets_given)
    ep, ep_rank, tp, tp_rank = mesh.size("ep"), mesh.rank("ep"), mesh.size("tp"), mesh.rank("tp")

    def expert_slice(name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full weight: an expert's E/ep rows, then its F/tp slice."""
        if name in expert_sharded:
            full = full.chunk(ep)[ep_rank]
        if name in expert_tp_split:
            full = full.chunk(tp, dim=expert_tp_split[name])[tp_rank].contiguous()
        return full

    materialize_and_init(full_meta, list(parts.values()), seed=seed, device=device, ep_slice=expert_slice)
    pipeline = build_pipeline(parts, record, mesh, cfg, device, cross_entropy, microbatch_BS,
                              packed=packing is not None, mtp_weight=_mtp_weight(meta_model)) if cfg.pp > 1 else None
    return ParallelModel(list(parts.values()), mesh, cfg, expert_sharded, pipeline, cross_entropy,
                         expert_tp_split=expert_tp_split, packing=packing, targets_given=targets_given,
                         mtp_weight=_mtp_weight(meta_model))


def _loss(cross_entropy: CrossEntropy, mesh: ParallelMesh, cfg: ParallelConfig, *, compile: bool,
          targets_given: bool) -> CrossEntropy:
    """The cross entropy the last stage runs: compiled with the blocks, and with given targets
    normalized by the global batch's scored positions."""
    if compile and cfg.tp == 1:
        # The loss too (torchtitan's compile component "loss"): the logits' fp32 upcast,
        # log-softmax and NLL fuse (bf16 logits of 4 × 256 tokens × 32,000 words, forward and
        # backward on 2 CPU cores: 256 ms eager, 53 ms compiled). Not under TP: there the logits
        # are a vocabulary-split DTensor inside loss_parallel, and on torch 2.13 the compiled
        # loss was right on a cold compile cache but wrong once the cache was warm (parity case
        # tp2_compiled: losses 9% off on every later launch).
        cross_entropy = torch.compile(cross_entropy)
    if targets_given:
        # Given targets score some positions only: each micro-batch's loss is its share of the
        # global batch's mean over them (token_mean.py).
        ranks = mesh.size("dp_cp")
        cross_entropy = GlobalTokenMean(cross_entropy, mesh.group("dp_cp") if ranks > 1 else None, ranks)
    return cross_entropy


def _mtp_weight(model: Decoder) -> float:
    return model.cfg.mtp_loss_weight if model.cfg.mtp_depth else 0.0

"""Communication volume of one training step, predicted from the configs alone (no process group).

Legend: T tokens per optimizer step (batch × seq_len), D model dim, V vocabulary, E experts, K top-k,
L layers, N = pp × vpp pipeline stages, C forward chunks per rank (grad_accum × pipeline
micro-batches), b bytes per activation element, R ranks that hold one pipeline stage (dp × cp × tp),
G key/value heads, Dh head dim.

Bytes of one call follow nccl-tests' "size": all-reduce the buffer; all-gather the gathered
output; reduce-scatter the full input; all-to-all the rows this rank sends (its own included);
point-to-point the tensor sent (receives are not counted again). Every number is summed over all
ranks of the job. A 1-rank group moves nothing and is left out. Wire bytes follow from the sizes
by the usual factors ((n−1)/n for gather, scatter and all-to-all, 2(n−1)/n for a ring all-reduce).

What moetron.parallel issues per step, by dimension (each rank of a stage sees T/(dp·cp) tokens,
so a per-token tensor summed over the R ranks of a stage is T·tp tokens):
  tensor parallel   all-reduce of B×S×D after the row-parallel attention (and dense FFN) output
                    in forward and at the column-parallel input in backward; one after the
                    vocab-parallel embedding (forward) and one at the head's input (backward);
                    three per-token fp32 all-reduces in the vocab-parallel cross entropy (max,
                    sum of exponentials, target logit). No reduction of replicated weights'
                    gradients: every tp rank saw the same tokens.
  sequence parallel the same sites as all-gather / reduce-scatter pairs of the full B×S×D (the
                    MoE layer gathers its input in forward and its output gradient in backward);
                    each norm gain's gradient, a partial sum per S slice, is all-reduced once
                    (whole, also under FSDP). With absolute positions (learned, sinusoidal) the
                    embedding's output is all-reduced instead of reduce-scattered.
  expert parallel   per MoE layer and chunk: the per-expert counts (E int64, forward), then the
                    routed rows T/dp·K×D four times (dispatch and combine, forward and backward).
                    Dropless; capacity routing sends at most this.
  expert-tensor par. with etp = tp, per MoE layer and chunk: an all-reduce over tp of the experts'
                    output rows T/dp·K×D (forward) and of their input rows' gradient (backward).
                    The rows are those each rank's experts compute: its own routes, or under EP
                    the ones it receives, which over a stage add up to the same T·tp·K.
  context parallel  per attention layer and chunk: an all-gather over cp of the local K and V
                    (stacked; the gathered output is cp× the local, so T·cp·2·G·Dh over a stage)
                    and, in backward, the reduce-scatter of their gradients (the same size). Per
                    MoE layer and chunk, the router's statistics summed over cp by all-gather:
                    the route counts (E int64, forward only) and, with an aux loss, fp32 score
                    sums and token counts, E + 1 (Switch) or per sequence 2·E + 1 (sequence
                    loss), gathered forward and reduce-scattered backward.
  pipeline parallel per stage boundary and micro-batch: the activation forward, its gradient back
                    (under SP each tp rank sends its S/tp slice).
  data parallel     FSDP: every unit's parameters all-gathered in forward and again in backward
                    (the root unit, which holds only what no child holds, is kept for backward),
                    its gradients reduce-scattered once per accumulation step (the shards stay
                    sharded in memory); DDP: one gradient all-reduce per unit and optimizer
                    step, over the dp × cp ranks holding the same weights; HSDP: FSDP's gathers
                    and reduce-scatters inside a shard group of dp_shard × cp ranks, then, once
                    per optimizer step, an all-reduce of each rank's gradient shard across the
                    dp / dp_shard groups;
                    ZeRO-1: DDP's all-reduce, then one broadcast per parameter tensor from the
                    rank that updated it (a broadcast's size is the tensor). Units:
                    each block, each block's routed experts (on the dp/ep × cp ranks holding the
                    same experts, when ep > 1), the embedding, the final norm with the head.
                    Sizes are this rank's tp/ep shard, dim 0 padded to the group.
                    Under pipeline parallelism torch's schedule reduces the gradients at the end
                    of each of its steps (`perform_reduce_grad`): once per accumulation step, not
                    per optimizer step. Its backwards leave their stage gathered
                    (`set_reshard_after_backward(False)`) until the next forward reshards it, so
                    a forward or backward right after a backward gathers nothing: m + 1 gathers
                    per unit and schedule step of m micro-batches instead of 2m (measured for
                    GPipe, 1F1B and interleaved 1F1B; zero-bubble assumed alike), the root's once.
  control           per step over all ranks: the global gradient norm (one float64), the loss
                    reduction (two fp32) and the trainer's stop agreement (one fp32).
  multi-token pred. (model.mtp_depth, model/mtp.py) each depth's block is one more layer of every
                    line above (its attention, dense FFN or MoE layer, norms, FSDP/DDP unit); the
                    depth also looks the embedding up once more and runs the shared head once more
                    (one more TP/SP site each), and its cross entropy adds loss_parallel's three
                    all-reduces over the B·(S − k) positions that have a target. Under SP its
                    replicated parts (enorm, hnorm, norm, eh_proj) have partial gradients summed
                    over tp like the norms. Data parallel: those parts sit in the root unit; the
                    embedding and the head, called once more per depth, are gathered again
                    (`_mtp_regathers`). Pipeline: the token ids ride with every activation sent
                    forward (int64, no gradient back) and the gradient of the last stage's copy of
                    the embedding is all-reduced with the first stage's. No context parallelism
                    (the model refuses it).
Not modelled: linear biases under sequence parallel, activation checkpointing (recomputation
re-sends the forward all-to-alls and K/V gathers), the first step's pipeline shape exchange,
evaluation and checkpoints.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from moetron.model.config import ModelConfig
from moetron.parallel.config import ParallelConfig

KINDS = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "p2p", "broadcast")


@dataclass(frozen=True)
class Traffic:
    """One line of a prediction: `calls` collectives of `kind`, `bytes` in all, summed over ranks."""

    kind: str
    purpose: str
    calls: int
    bytes: int


def predict_step(model: ModelConfig, par: ParallelConfig, *, batch: int, seq_len: int, grad_accum: int = 1,
                 act_bytes: int = 4, param_bytes: int = 4, grad_bytes: int = 4) -> list[Traffic]:
    """Every collective one optimizer step of `batch` sequences of `seq_len` tokens issues."""
    step = _Step(model, par, batch * seq_len, grad_accum, act_bytes, batch=batch)
    out = [*_tensor_parallel(step), *_context_parallel(step), *_expert_parallel(step),
           *_expert_tensor_parallel(step), *_global_balance(step), *_pipeline(step, grad_bytes),
           *_data_parallel(step, param_bytes, grad_bytes), *_control(par)]
    return [t for t in out if t.calls]


def by_kind(traffic: list[Traffic]) -> dict[str, dict[str, int]]:
    """{kind: {"calls", "bytes"}} for every kind in KINDS (zeros where none)."""
    out = {k: {"calls": 0, "bytes": 0} for k in KINDS}
    for t in traffic:
        out[t.kind]["calls"] += t.calls
        out[t.kind]["bytes"] += t.bytes
    return out


@dataclass(frozen=True)
class _Step:
    model: ModelConfig
    par: ParallelConfig
    tokens: int
    grad_accum: int
    act_bytes: int
    batch: int = 0  # sequences per step

    @property
    def stage_ranks(self) -> int:
        return self.par.dp * self.par.cp * self.par.tp

    @property
    def chunks(self) -> int:
        return self.grad_accum * self.par.pipeline_chunks

    @property
    def seq_len(self) -> int:
        return self.tokens // self.batch

    @property
    def rank_tokens(self) -> int:
        """Tokens seen by the ranks of one stage, summed: each of dp × cp × tp sees T/(dp·cp)."""
        return self.tokens * self.par.tp

    def per_chunk(self, kind: str, purpose: str, sites: int, bytes_per_token: int) -> Traffic:
        """`sites` collectives per chunk on every rank of a stage, each moving its tokens' rows."""
        return Traffic(kind, purpose, sites * self.stage_ranks * self.chunks,
                       sites * self.rank_tokens * bytes_per_token)


def _tensor_parallel(s: _Step) -> list[Traffic]:
    m, p = s.model, s.par
    if p.tp == 1:
        return []
    row = m.d_model * s.act_bytes
    blocks, n_moe = _blocks(m), _moe_blocks(m)  # MTP blocks are split as layers (apply_tensor_parallel)
    # Sites per step: attention in and out of every block, dense FFN in and out, embedding, head;
    # each MTP depth looks the embedding up and runs the shared head once more (model/mtp.py).
    matmul_sites = 2 * blocks + 2 * (blocks - n_moe) + 2 * (1 + m.mtp_depth)
    losses = [s.per_chunk("all_reduce", "tp cross entropy (max, sum exp, target logit)", 3, 4), *_mtp_loss(s)]
    # MLA's down projections are whole on every rank: the gradient of attention's input comes out
    # whole there, and instead the latents' gradients (q's, or x's without a q latent; kv's; the
    # rope key's) are all-reduced where they enter the column-parallel heads.
    mla = m.mla
    latent_sites = [] if not mla.enabled else [
        s.per_chunk("all_reduce", f"tp MLA {what} gradients", blocks, width * s.act_bytes)
        for what, width in (("q latent", mla.q_lora_rank or m.d_model), ("kv latent", mla.kv_lora_rank),
                            ("rope key", mla.qk_rope_head_dim))]
    if not p.sequence_parallel:
        sites = matmul_sites - (blocks if mla.enabled else 0)
        return [s.per_chunk("all_reduce", "tp activations", sites, row), *losses, *latent_sites]
    # Each matmul site is one all-gather and one reduce-scatter, forward and backward in either
    # order (the embedding's backward gathers its output gradient for the vocabulary rows' update,
    # which plain TP gets for free); an MoE layer gathers on both sides instead.
    gathers = matmul_sites + 2 * n_moe
    # Absolute positions (learned, sinusoidal) are added over all of S, so on the stage holding the
    # first block the embedding's output stays whole, all-reduced instead of scattered (the split
    # at the first block, and at each MTP module's input, is a local slice whose backward gathers):
    # the main lookup and, without PP (the last stage's copy scatters), each depth's.
    whole = 1 + (m.mtp_depth if p.pp == 1 else 0) if m.position in ("learned", "sinusoidal") else 0
    scatters = matmul_sites - (blocks if mla.enabled else 0) - whole
    return [s.per_chunk("all_gather", "sp activations", gathers, row),
            s.per_chunk("reduce_scatter", "sp activations", scatters, row),
            s.per_chunk("all_reduce", "sp embedding outputs (absolute positions)", whole, row), *losses,
            *_sp_replicated_gradients(s), *latent_sites]


def _mtp_loss(s: _Step) -> list[Traffic]:
    """Each MTP depth k's vocabulary-parallel cross entropy: loss_parallel's three fp32 all-reduces
    per chunk, like the main loss, but over the positions that have a target only
    (`mtp_cross_entropy` slices the logits to the first S − k): B·(S − k) per rank, not B·S."""
    m = s.model
    if not m.mtp_depth:
        return []
    calls = 3 * m.mtp_depth * s.stage_ranks * s.chunks
    positions = sum(s.seq_len - k for k in range(1, m.mtp_depth + 1))  # per sequence, all depths
    # Over the stage: each of dp × tp ranks scores its batch / dp sequences.
    return [Traffic("all_reduce", "tp MTP cross entropy (max, sum exp, target logit)", calls,
                    3 * s.par.tp * s.batch * positions * 4)]


def _sp_replicated_gradients(s: _Step) -> list[Traffic]:
    """Sequence parallel: a replicated weight applied to the local S slice gets a partial gradient
    per slice, all-reduced over tp once per step (`clip_grad_norm_`): every norm gain (2 per block,
    the final norm, each MTP depth's enorm, hnorm and norm) and each depth's eh_proj (D × 2D),
    which `_parallelize_mtp` runs on the slice like a norm. Whole even under FSDP/HSDP: FSDP2
    redistributes a gradient to its weight's tp layout before its own reduction over dp
    (`FSDPParam._get_grad_inner_tensor`), on the unsharded gradient (measured, dp2_tp2_sp)."""
    m = s.model
    per_norm = 2 if m.norm == "layernorm" else 1
    norm_params = (2 * _blocks(m) + (m.norm_position == "pre") + 3 * m.mtp_depth) * per_norm
    D, calls = m.d_model, norm_params * s.stage_ranks
    out = [Traffic("all_reduce", "sp norm gradients (partial sums over S)", calls, calls * D * 4)]
    if m.mtp_depth:
        calls = m.mtp_depth * s.stage_ranks
        out.append(Traffic("all_reduce", "sp MTP eh_proj gradients (partial sums over S)", calls,
                           calls * D * 2 * D * 4))
    return out


def _context_parallel(s: _Step) -> list[Traffic]:
    m, p = s.model, s.par
    if p.cp == 1:
        return []
    # Each rank gathers cp× its local K and V rows: T·tp·cp rows of 2·G/tp·Dh over a stage; under
    # MLA the latent and the rope key (R + Dr), which every tp rank holds whole.
    width = (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim if m.mla.enabled
             else 2 * (m.kv_heads // p.tp) * m.dim_head)
    kv = p.cp * width * s.act_bytes
    out = [s.per_chunk("all_gather", "cp keys and values (fwd)", m.n_layers, kv),
           s.per_chunk("reduce_scatter", "cp keys' and values' gradients (bwd)", m.n_layers, kv)]
    n_moe = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    if not n_moe:
        return out
    calls = n_moe * s.chunks * s.stage_ranks
    E = m.moe.num_experts
    out.append(Traffic("all_gather", "cp router route counts", calls, calls * p.cp * E * 8))
    if m.moe.aux_loss_coef:
        sequences = s.batch // (p.dp * s.chunks)  # per rank and chunk
        row = sequences * (2 * E + 1) if m.moe.aux_loss_type == "sequence" else E + 1
        out += [Traffic("all_gather", "cp router balance statistics (fwd)", calls, calls * p.cp * row * 4),
                Traffic("reduce_scatter", "cp router balance statistics (bwd)", calls, calls * p.cp * row * 4)]
    return out


def _expert_parallel(s: _Step) -> list[Traffic]:
    m, p = s.model, s.par
    if p.ep == 1:
        return []
    n_moe = _moe_blocks(m)
    per_rank_calls = n_moe * s.chunks
    counts = Traffic("all_to_all", "ep expert counts", per_rank_calls * s.stage_ranks,
                     per_rank_calls * s.stage_ranks * m.moe.num_experts * 8)
    rows = s.per_chunk("all_to_all", "ep routed tokens (dispatch + combine, fwd + bwd)", 4 * n_moe,
                       m.moe.top_k * m.d_model * s.act_bytes)
    return [counts, rows]


def _global_balance(s: _Step) -> list[Traffic]:
    """The global-batch balance loss: each router's (E,) float64 route counts, summed over dp × cp
    in the forward of every chunk (parallel/global_balance.py)."""
    m, p = s.model, s.par
    if not (m.moe.enabled and m.moe.aux_loss_coef and m.moe.aux_loss_type == "global_batch") or p.dp * p.cp == 1:
        return []
    calls = _moe_blocks(m) * s.chunks * s.stage_ranks
    return [Traffic("all_reduce", "router loads over the global batch", calls, calls * m.moe.num_experts * 8)]


def _expert_tensor_parallel(s: _Step) -> list[Traffic]:
    m, p = s.model, s.par
    if p.etp == 1 or p.tp == 1 or not m.moe.enabled:
        return []
    n_moe = _moe_blocks(m)
    return [s.per_chunk("all_reduce", "etp expert rows (output fwd, input grad bwd)", 2 * n_moe,
                        m.moe.top_k * m.d_model * s.act_bytes)]


def _pipeline(s: _Step, grad_bytes: int) -> list[Traffic]:
    m, p = s.model, s.par
    boundaries = p.pp * p.vpp - 1
    if boundaries == 0:
        return []
    # Under sequence parallelism each tp rank sends its S/tp slice of the hidden states (stage_io).
    sent = s.per_chunk("p2p", "pp activations and their gradients", 2 * boundaries, m.d_model * s.act_bytes)
    out = [replace(sent, bytes=sent.bytes // (p.tp if p.sequence_parallel else 1))]
    if m.mtp_depth:
        # The last stage's MTP embeds the tokens ahead: every stage sends the micro-batch's token ids
        # (b × S int64, whole on every tp rank) on beside its output, one more send; no gradient back.
        out.append(s.per_chunk("p2p", "pp token ids for MTP", boundaries, 8))
        # After the step's backward every rank of the first and of the last stage all-reduces its
        # piece of the embedding's gradient over the pair (`sync_embedding_copies`).
        calls = 2 * s.stage_ranks
        out.append(Traffic("all_reduce", "pp MTP embedding copies' gradients", calls,
                           calls * _embedding_grad_local(m, p) * grad_bytes))
    return out


def _embedding_grad_local(m: ModelConfig, p: ParallelConfig) -> int:
    """Elements of the embedding's gradient one rank holds after backward: its V/tp rows, or under
    FSDP/HSDP its shard of them (dim 0 padded to the shard group). Without a data-parallel wrapper,
    which hands gradients back in their weight's layout, DTensor returns the vocabulary-parallel
    embedding's gradient Replicate: the whole V × D on every tp rank (measured, pp2_tp2)."""
    if p.dp * p.cp == 1:
        return m.vocab_size * m.d_model
    rows = m.vocab_size // p.tp
    if p.dp_mode in ("fsdp", "hsdp"):
        group = (p.shard_group if p.dp_mode == "hsdp" else p.dp) * p.cp
        rows = _padded(rows, group) // group
    return rows * m.d_model


def _data_parallel(s: _Step, param_bytes: int, grad_bytes: int) -> list[Traffic]:
    m, p = s.model, s.par
    if p.dp * p.cp == 1:
        return []
    out: list[Traffic] = []
    ranks = s.stage_ranks
    if p.pp > 1:  # per schedule step (see the module docstring); one per accumulation step
        reductions = s.grad_accum
        gathers_per_unit, gathers_per_root = s.grad_accum * (p.microbatches + 1), s.grad_accum
    else:
        reductions = 1
        gathers_per_unit, gathers_per_root = 2 * s.chunks, s.chunks
    # Alike units (the blocks of one kind) are one line: `n` times the calls and bytes.
    for u, n in Counter(_units(m, p)).items():
        if u.group * u.replicas == 1:
            continue
        if p.dp_mode in ("fsdp", "hsdp"):
            name = "hsdp" if p.dp_mode == "hsdp" else "fsdp"
            # Sharded gradients are reduce-scattered after every accumulation step's backward
            # (data_parallel.set_gradient_sync; under pp once per schedule step), HSDP's shards
            # all-reduced across replicas once per optimizer step (pp: per schedule step).
            scatters, replica_reduces = s.grad_accum * ranks * n, reductions * ranks * n
            if u.group > 1:
                gathers = ((gathers_per_root if u.root else gathers_per_unit) + u.regathers * s.chunks) * ranks * n
                out.append(Traffic("all_gather", f"{name} parameters (fwd + bwd)", gathers,
                                   gathers * u.elements * param_bytes))
                out.append(Traffic("reduce_scatter", f"{name} gradients", scatters,
                                   scatters * u.elements * grad_bytes))
            if u.replicas > 1:
                out.append(Traffic("all_reduce", "hsdp-replicas gradient shards", replica_reduces,
                                   replica_reduces * u.elements // u.group * grad_bytes))
        else:
            reduces = (reductions + (u.early_reduce and s.grad_accum > 1)) * ranks * n
            out.append(Traffic("all_reduce", "ddp gradients", reduces, reduces * u.elements * grad_bytes))
            if p.dp_mode == "zero1":
                out.append(Traffic("broadcast", "zero1 updated parameters", ranks * u.tensors * n,
                                   ranks * n * u.elements * param_bytes))
    return out


@dataclass(frozen=True)
class _Unit:
    """One data-parallel wrapping unit: its parameter elements on one rank (padded), the size of
    the group it is sharded or replicated over, and whether it is the root (kept gathered from
    forward to backward)."""

    elements: int
    group: int  # ranks sharding it (FSDP, HSDP's shard group) or replicating it (DDP, ZeRO-1)
    root: bool = False
    replicas: int = 1  # HSDP: groups holding a copy each
    tensors: int = 1  # parameter tensors in it (ZeRO-1 broadcasts each)
    regathers: int = 0  # FSDP: gathers per chunk beyond the usual (`_mtp_regathers`)
    early_reduce: bool = False  # DDP/ZeRO-1: reduced once more per step under accumulation (`_outer_units`)


def _units(m: ModelConfig, p: ParallelConfig) -> list[_Unit]:
    """Every data-parallel unit of the model (each lives on one pipeline stage)."""
    tp, ep = p.tp, p.ep
    # The ranks sharing (or replicating) one copy of the dense weights; of the experts. HSDP
    # shards inside groups of dp_shard and keeps `replicas` copies.
    shard = p.shard_group if p.dp_mode == "hsdp" else p.dp
    replicas = p.dp // shard
    dp, edp = shard * p.cp, shard // ep * p.cp
    D, F, Fe = m.d_model, m.d_ff, m.d_expert_ff // p.etp
    mats = 3 if m.activation == "swiglu" else 2
    norm = [(D,)] * (2 if m.norm == "layernorm" else 1)

    def size(shapes: list[tuple[int, ...]], group: int) -> int:
        return sum(_padded(sh[0], group) * _prod(sh[1:]) for sh in shapes)

    def ffn(hidden: int, split: int) -> list[tuple[int, ...]]:
        shapes = [(hidden // split, D)] * (mats - 1) + [(D, hidden // split)]
        if m.bias:
            shapes += [(hidden // split,)] * (mats - 1) + [(D,)]
        return shapes

    def block_units(moe: bool) -> list[_Unit]:
        block = norm * 2 + _attention_shapes(m, tp)
        if not moe:
            block += ffn(F, tp)
            return [_Unit(size(block, dp), dp, replicas=replicas, tensors=len(block))]
        block.append((m.moe.num_experts, D))
        if m.moe.shared_expert_d_ff:
            block += ffn(m.moe.shared_expert_d_ff, 1)  # replicated over tp
        experts = [(m.moe.num_experts // ep, D, Fe)] * (mats - 1) + [(m.moe.num_experts // ep, Fe, D)]
        if ep == 1:
            block += experts
            return [_Unit(size(block, dp), dp, replicas=replicas, tensors=len(block))]
        return [_Unit(size(experts, edp), edp, replicas=replicas, tensors=len(experts)),
                _Unit(size(block, dp), dp, replicas=replicas, tensors=len(block))]

    # The decoder's blocks, then each MTP depth's (wrapped alike). Blocks of one kind are alike:
    # each kind is sized once, as the planner asks this of thousands of layouts of tens of blocks.
    kinds = [m.is_moe_layer(i) for i in range(_blocks(m))]
    sized = {moe: block_units(moe) for moe in set(kinds)}
    units = [u for moe in kinds for u in sized[moe]]
    return units + _outer_units(m, p, [_Unit(size(shapes, dp), dp, replicas=replicas, tensors=len(shapes))
                                       for shapes in _outer_shapes(m, p, norm)])


def _outer_shapes(m: ModelConfig, p: ParallelConfig, norm: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Parameter shapes of the units around the blocks, in `_outer_units`' order: the embedding,
    the final norm with the head, the root's (the first stage's, then the last's)."""
    D, V = m.d_model, m.vocab_size // p.tp
    tail = (norm if m.norm_position == "pre" else []) + ([] if m.tie_embeddings else [(V, D)])
    # The root unit holds what no child holds: the learned position table (first stage) and each
    # MTP depth's enorm, hnorm, eh_proj (D × 2D) and norm (last stage); one root per stage module.
    first = [(m.max_seq_len, D)] if m.position == "learned" else []
    last = (norm * 3 + [(D, 2 * D)]) * m.mtp_depth
    return [[(V, D)], tail, *([first + last] if p.pp == 1 else [first, last])]


def _outer_units(m: ModelConfig, p: ParallelConfig, units: list[_Unit]) -> list[_Unit]:
    """The embedding (and under pp > 1 with MTP the last stage's copy of it, parallel/pipeline.py),
    the final norm with the head, the roots; with MTP's extra gathers."""
    embedding, tail, *roots = units
    embed_regathers, tail_regathers = _mtp_regathers(m, p)
    out = [replace(embedding, regathers=0 if p.pp > 1 else embed_regathers)]
    if m.mtp_depth and p.pp > 1:
        out.append(replace(embedding, regathers=embed_regathers))
    if tail.tensors:
        # With MTP the head's first post-backward (after a depth's head) runs before autograd has
        # accumulated that head's weight gradient: with one micro-batch it reduces nothing, but
        # the last of several finds the earlier ones' gradient kept unreduced there and reduces
        # it, the main head's post-backward the rest (ddp and zero1: FSDP and HSDP reduce-scatter
        # every micro-batch's gradient, which leaves none kept; the pipeline schedule instead
        # reduces once at the end of its step).
        out.append(replace(tail, regathers=tail_regathers, early_reduce=bool(m.mtp_depth) and p.pp == 1))
    return out + [replace(root, root=True) for root in roots if root.tensors]


def _mtp_regathers(m: ModelConfig, p: ParallelConfig) -> tuple[int, int]:
    """FSDP gathers per chunk that multi-token prediction adds to the unit of the embedding its
    modules look up and to that of the final norm with the head, which each depth calls again
    (torch 2.13's FSDP2; bench/comm_volume.py measures the *_mtp layouts).

    Without PP: each depth's lookup is a forward of the embedding unit of its own, resharded after
    it (D more); its input, the token ids, has no gradient, so one gather serves all of backward.
    The head, grouped with the final norm ([norm, head], pre-norm): the first depth's call
    gathers again and leaves the group incomplete (its norm did not run), so later depths reuse it
    and the root completes it at the end of forward, hooking its pre-backward to every
    differentiable output of the model. Backward gathers it at the first output's gradient, again
    after depth 1's head has resharded it (at the main logits' hook at the latest), and again after
    the final norm's backward resharded it when a decoder MoE layer's router loss (aux or z, an
    output too) comes later: 2 + that. The head alone (post-norm): each depth's call is a forward
    and a backward of its own, 2D.

    Under PP the schedule keeps units gathered after a backward and a forward reshards them: the
    last stage's embedding copy, used D times per forward, gathers D − 1 more times per
    micro-batch; the head once more (pre-norm: the first depth's call, the main call having
    resharded it) or D more (post-norm)."""
    D = m.mtp_depth
    if not D or p.dp_mode not in ("fsdp", "hsdp"):
        return 0, 0
    grouped = m.norm_position == "pre"
    if p.pp > 1:
        return D - 1, 1 if grouped else D
    router_losses = bool(m.moe.aux_loss_coef or m.moe.z_loss_coef) and any(
        m.is_moe_layer(i) for i in range(m.n_layers))
    return D, 2 + router_losses if grouped else 2 * D


def _attention_shapes(m, tp: int) -> list[tuple[int, ...]]:
    """One block's attention weights on a tensor-parallel rank (heads split, MLA's down projections
    and latent norms whole; model/attention.py, model/mla.py)."""
    D, H = m.d_model, m.n_heads // tp
    if m.mla.enabled:
        a = m.mla
        q = ([(a.q_lora_rank, D), (a.q_lora_rank,), (H * a.qk_head_dim, a.q_lora_rank)] if a.q_lora_rank
             else [(H * a.qk_head_dim, D)])
        return q + [(a.kv_lora_rank + a.qk_rope_head_dim, D), (a.kv_lora_rank,),
                    (H * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank), (D, H * a.v_head_dim)]
    G, Dh = m.kv_heads // tp, m.dim_head
    shapes = [(H * Dh, D), (G * Dh, D), (G * Dh, D), (D, H * Dh)]
    if m.bias or m.attention_bias != "none":
        shapes += [(H * Dh,), (G * Dh,), (G * Dh,)]
    if m.bias or m.attention_bias == "all":
        shapes.append((D,))
    if m.attention_sinks:
        shapes.append((H,))
    if m.qk_norm != "none":
        shapes += [(H * Dh,), (G * Dh,)] if m.qk_norm == "projection" else [(Dh,), (Dh,)]
    return shapes


def _control(p: ParallelConfig) -> list[Traffic]:
    w = p.world_size
    if w == 1:
        return []
    return [Traffic("all_reduce", "control (grad norm, losses, stop flag)", 3 * w, (8 + 8 + 4) * w)]


def _blocks(m: ModelConfig) -> int:
    """Blocks of the model: the decoder's, then one per MTP depth (parallel/ splits, wraps and
    reduces them alike: `Decoder.blocks`)."""
    return m.n_layers + m.mtp_depth


def _moe_blocks(m: ModelConfig) -> int:
    """MoE layers among `_blocks`: an MTP block is built as layer n_layers + k − 1 would be."""
    return sum(m.is_moe_layer(i) for i in range(_blocks(m)))


def _padded(n: int, group: int) -> int:
    return -(-n // group) * group


def _prod(dims: tuple[int, ...]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out

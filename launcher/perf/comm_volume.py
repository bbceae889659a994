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
                    each norm gain's gradient, a partial sum per S slice, is all-reduced once.
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
  pipeline parallel per stage boundary and micro-batch: the activation forward, its gradient back.
  data parallel     FSDP: every unit's parameters all-gathered in forward and again in backward
                    (the root unit, which holds only what no child holds, is kept for backward),
                    its gradients reduce-scattered once per step; DDP: one gradient all-reduce
                    per unit and step, over the dp × cp ranks holding the same weights; HSDP: FSDP's
                    gathers and reduce-scatters inside a shard group of dp_shard × cp ranks, then
                    an all-reduce of each rank's gradient shard across the dp / dp_shard groups;
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
Not modelled: linear biases under sequence parallel, activation checkpointing (recomputation
re-sends the forward all-to-alls and K/V gathers), the first step's pipeline shape exchange,
evaluation and checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

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
           *_expert_tensor_parallel(step), *_global_balance(step), *_pipeline(step),
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
        return self.grad_accum * (self.par.microbatches if self.par.pp > 1 else 1)

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
    n_moe = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    # Sites per step: attention in and out of every layer, dense FFN in and out, embedding, head.
    matmul_sites = 2 * m.n_layers + 2 * (m.n_layers - n_moe) + 2
    loss = s.per_chunk("all_reduce", "tp cross entropy (max, sum exp, target logit)", 3, 4)
    # MLA's down projections are whole on every rank: the gradient of attention's input comes out
    # whole there, and instead the latents' gradients (q's, or x's without a q latent; kv's; the
    # rope key's) are all-reduced where they enter the column-parallel heads.
    mla = m.mla
    latent_sites = [] if not mla.enabled else [
        s.per_chunk("all_reduce", f"tp MLA {what} gradients", m.n_layers, width * s.act_bytes)
        for what, width in (("q latent", mla.q_lora_rank or m.d_model), ("kv latent", mla.kv_lora_rank),
                            ("rope key", mla.qk_rope_head_dim))]
    if not p.sequence_parallel:
        sites = matmul_sites - (m.n_layers if mla.enabled else 0)
        return [s.per_chunk("all_reduce", "tp activations", sites, row), loss, *latent_sites]
    # Each matmul site is one all-gather and one reduce-scatter, forward and backward in either
    # order (the embedding's backward gathers its output gradient for the vocabulary rows' update,
    # which plain TP gets for free); an MoE layer gathers on both sides instead.
    gathers = matmul_sites + 2 * n_moe
    scatters = matmul_sites - (m.n_layers if mla.enabled else 0)
    norm_params = (2 * m.n_layers + (m.norm_position == "pre")) * (2 if m.norm == "layernorm" else 1)
    dp_cp = p.dp * p.cp
    norm_local = _padded(m.d_model, dp_cp) // dp_cp if p.dp_mode == "fsdp" else m.d_model
    norms = Traffic("all_reduce", "sp norm gradients (partial sums over S)", norm_params * s.stage_ranks,
                    norm_params * s.stage_ranks * norm_local * 4)
    return [s.per_chunk("all_gather", "sp activations", gathers, row),
            s.per_chunk("reduce_scatter", "sp activations", scatters, row), loss, norms, *latent_sites]


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
    n_moe = sum(m.is_moe_layer(i) for i in range(m.n_layers))
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
    calls = sum(m.is_moe_layer(i) for i in range(m.n_layers)) * s.chunks * s.stage_ranks
    return [Traffic("all_reduce", "router loads over the global batch", calls, calls * m.moe.num_experts * 8)]


def _expert_tensor_parallel(s: _Step) -> list[Traffic]:
    m, p = s.model, s.par
    if p.etp == 1 or p.tp == 1 or not m.moe.enabled:
        return []
    n_moe = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    return [s.per_chunk("all_reduce", "etp expert rows (output fwd, input grad bwd)", 2 * n_moe,
                        m.moe.top_k * m.d_model * s.act_bytes)]


def _pipeline(s: _Step) -> list[Traffic]:
    p = s.par
    boundaries = p.pp * p.vpp - 1
    if boundaries == 0:
        return []
    return [s.per_chunk("p2p", "pp activations and their gradients", 2 * boundaries, s.model.d_model * s.act_bytes)]


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
    for u in _units(m, p):
        if u.group * u.replicas == 1:
            continue
        reduces = reductions * ranks
        if p.dp_mode in ("fsdp", "hsdp"):
            name = "hsdp" if p.dp_mode == "hsdp" else "fsdp"
            if u.group > 1:
                gathers = (gathers_per_root if u.root else gathers_per_unit) * ranks
                out.append(Traffic("all_gather", f"{name} parameters (fwd + bwd)", gathers,
                                   gathers * u.elements * param_bytes))
                out.append(Traffic("reduce_scatter", f"{name} gradients", reduces,
                                   reduces * u.elements * grad_bytes))
            if u.replicas > 1:
                out.append(Traffic("all_reduce", "hsdp-replicas gradient shards", reduces,
                                   reduces * u.elements // u.group * grad_bytes))
        else:
            out.append(Traffic("all_reduce", "ddp gradients", reduces, reduces * u.elements * grad_bytes))
            if p.dp_mode == "zero1":
                out.append(Traffic("broadcast", "zero1 updated parameters", ranks * u.tensors,
                                   ranks * u.elements * param_bytes))
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

    units = []
    for i in range(m.n_layers):
        block = norm * 2 + _attention_shapes(m, tp)
        if m.is_moe_layer(i):
            block.append((m.moe.num_experts, D))
            if m.moe.shared_expert_d_ff:
                block += ffn(m.moe.shared_expert_d_ff, 1)  # replicated over tp
            experts = [(m.moe.num_experts // ep, D, Fe)] * (mats - 1) + [(m.moe.num_experts // ep, Fe, D)]
            if ep > 1:
                units.append(_Unit(size(experts, edp), edp, replicas=replicas, tensors=len(experts)))
            else:
                block += experts
        else:
            block += ffn(F, tp)
        units.append(_Unit(size(block, dp), dp, replicas=replicas, tensors=len(block)))
    units.append(_Unit(size([(m.vocab_size // tp, D)], dp), dp, replicas=replicas))
    if m.position == "learned":
        units.append(_Unit(size([(m.max_seq_len, D)], dp), dp, root=True, replicas=replicas))
    tail = (norm if m.norm_position == "pre" else []) + ([] if m.tie_embeddings else [(m.vocab_size // tp, D)])
    if tail:
        units.append(_Unit(size(tail, dp), dp, replicas=replicas, tensors=len(tail)))
    return units


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


def _padded(n: int, group: int) -> int:
    return -(-n // group) * group


def _prod(dims: tuple[int, ...]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out

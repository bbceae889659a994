"""`moetron plan`: every valid parallel layout of a config on N devices, those that fit in memory
ranked by predicted step time.

Legend: T tokens per step (global batch × S), N devices, G devices per node, m pipeline
micro-batches, C forward chunks per rank (grad_accum × m).

A layout is valid when `moetron train` would accept it: each candidate is built as a Config and
run through the same checks (`validate`, `validate_launch`), so the planner never proposes a
layout the trainer refuses. Its cost, by named part:

  memory     `memory.memory_per_rank` (weights, grads, AdamW state and activations by dp_mode, tp, etp,
             ep, cp, pp, sequence parallel and activation checkpointing) plus communication
             buffers: FSDP/HSDP's gathered copy of two blocks (the one running and the one
             prefetched), DDP/ZeRO-1's gathered copy of the rank's weights where the gradients of
             earlier micro-batches are held beside it, expert parallelism's send and receive rows.
             It fits when the total is at most MEMORY_HEADROOM of the device (allocator
             fragmentation, the CUDA context).
  compute    the FLOPs of the most loaded rank — dense work split by dp × cp × tp × pp, routed
             experts by dp × cp × pp × etp (replicated over tp when etp = 1), the LM head and the
             multi-token-prediction modules (split by tp) on the last stage, ×4/3 for the
             recomputed forward under full activation checkpointing (selective recomputes no
             matmul, only the elementwise work) — at the profile's sustained matmul rate,
             plus a fixed cost per block and chunk (×1.5 under full checkpointing, ×1.2 under
             selective: the regions replayed in backward).
  comm       `comm_volume.predict_step`'s collectives, each at the bus bandwidth (of
             its kind, where the profile tells kinds apart) and latency of the link its group
             spans: a group of consecutive ranks inside one node (TP, EP, CP laid out innermost)
             uses the intra-node link, any other the inter-node one. TP, SP, EP, ETP, CP and pipeline transfers are exposed; data-parallel ones hide
             behind compute up to the profile's `dp_overlap`.
  bubble     pipeline idle time: (pp − 1) / (m · vpp) of the busy time for GPipe, 1F1B and
             interleaved 1F1B; a third of that for zero-bubble; divided by the profile's
             oversubscription (ranks per core on CPU, where an idle rank's core serves the others).

  step = compute + overhead + exposed comm + bubble;  tokens/s = T / step;
  MFU = 6N-with-attention FLOPs per token × tokens/s / (N × peak).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from moetron.launcher.config import Config, ConfigError, validate, validate_launch
from moetron.launcher.perf.comm_volume import predict_step
from moetron.launcher.perf.device_profiles import DeviceProfile
from moetron.launcher.perf.flops import (
    flops_by_component,
    flops_per_token,
    layer_counts,
    parameter_counts,
)
from moetron.launcher.perf.memory import busiest_rank_imbalance, memory_per_rank
from moetron.parallel.config import ParallelConfig
from moetron.parallel.mesh import MESH_DIMS, mesh_shape

MEMORY_HEADROOM = 0.9
# Which mesh group a communication-volume line travels over, by its purpose's first word.
PURPOSE_DIM = {"tp": "tp", "sp": "tp", "etp": "tp", "ep": "ep", "cp": "cp", "pp": "pp", "fsdp": "dp",
               "hsdp": "dp_shard", "hsdp-replicas": "dp_rep", "ddp": "dp", "zero1": "dp", "control": "world"}
WIRE_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "p2p": lambda n: 1.0,
               "broadcast": lambda n: 1.0}


# FSDP's copies around its collectives, in bytes moved per byte of the collective's (unsharded)
# size: a gather is split into the parameters (read + write), gradients are packed into the
# reduce-scatter's input (read + write) and divided there (read + write); torch's FSDP2.
FSDP_COPIES = {"all_gather": 2, "reduce_scatter": 4}


@dataclass(frozen=True)
class Layout:
    """One candidate: the parallel section plus the train settings that change with the layout."""

    parallel: ParallelConfig
    grad_accum: int = 1
    activation_checkpoint: str = "none"

    def overrides(self) -> list[str]:
        """`key=value` overrides that turn a config into this layout."""
        p = self.parallel
        out = [f"parallel.{k}={getattr(p, k)}" for k in ("pp", "dp", "tp", "cp", "ep", "etp", "dp_mode")]
        if p.dp_mode == "hsdp":
            out.append(f"parallel.dp_shard={p.dp_shard}")
        if p.pp > 1:
            out += [f"parallel.schedule={p.schedule}", f"parallel.vpp={p.vpp}", f"parallel.microbatches={p.microbatches}"]
        out.append(f"parallel.sequence_parallel={str(p.sequence_parallel).lower()}")
        out += [f"train.grad_accum={self.grad_accum}", f"train.activation_checkpoint={self.activation_checkpoint}"]
        return out

    def label(self) -> str:
        p = self.parallel
        parts = [f"{k}{getattr(p, k)}" for k in ("pp", "dp", "tp", "cp", "ep") if getattr(p, k) > 1] or ["1 rank"]
        if p.etp > 1:
            parts.append(f"etp{p.etp}")
        if p.pp > 1:
            parts.append(f"{p.schedule}" + (f"/vpp{p.vpp}" if p.vpp > 1 else "") + f" m{p.microbatches}")
        if p.dp > 1 or p.cp > 1:
            parts.append(p.dp_mode + (f"{p.dp_shard}" if p.dp_mode == "hsdp" else ""))
        if p.sequence_parallel:
            parts.append("sp")
        if self.grad_accum > 1:
            parts.append(f"ga{self.grad_accum}")
        if self.activation_checkpoint != "none":
            parts.append("ac" if self.activation_checkpoint == "full" else "sac")
        return " ".join(parts)


@dataclass
class Prediction:
    layout: Layout
    memory: dict[str, float]  # bytes per rank by part, and "total"
    fits: bool
    flops_per_rank: float
    comm_bytes: dict[str, float]  # per rank, by collective kind
    link_bytes: dict[str, float]  # per rank, "intra" / "inter" node
    times: dict[str, float]  # seconds: compute, overhead, comm_exposed, comm_total, bubble
    bubble: float  # fraction of busy time
    step_s: float
    tokens_per_s: float
    mfu: float
    reason: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["layout"] = {"label": self.layout.label(), "overrides": self.layout.overrides()}
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def base_layouts(cfg: Config, gpus: int, *, gpus_per_node: int) -> Iterator[ParallelConfig]:
    """Every parallel section for `gpus` ranks, before any rule is checked. TP and CP stay inside a
    node (their collectives are on every layer's critical path)."""
    m = cfg.model
    experts = m.moe.num_experts if m.moe.enabled else 1
    for tp, cp, pp in itertools.product(_divisors(gpus), repeat=3):
        if gpus % (tp * cp * pp) or tp * cp > gpus_per_node or m.n_layers % pp:
            continue
        dp = gpus // (tp * cp * pp)
        for ep in (e for e in _divisors(dp) if experts % e == 0):
            for etp in sorted({1, tp}):
                if etp > 1 and not m.moe.enabled:
                    continue
                modes = [("fsdp", 0), ("ddp", 0), ("zero1", 0)] if dp * cp > 1 else [("fsdp", 0)]
                if dp > 1:
                    modes += [("hsdp", s) for s in _divisors(dp) if 1 < s < dp and s % ep == 0]
                for (mode, shard), sp in itertools.product(modes, (False, True) if tp > 1 else (False,)):
                    for schedule, vpp, micro in _schedules(pp, m.n_layers):
                        yield ParallelConfig(pp=pp, dp=dp, tp=tp, cp=cp, ep=ep, etp=etp, vpp=vpp, schedule=schedule,
                                             microbatches=micro, sequence_parallel=sp, dp_mode=mode, dp_shard=shard)


# Activation checkpointing, from the most memory to the least: selective keeps the matmul outputs.
AC_MODES = ("none", "selective", "full")


def variants(cfg: Config, par: ParallelConfig) -> list[Layout]:
    """The train settings tried with one parallel section, cheapest in memory last: gradient
    accumulation from 1 up (smaller micro-batches, each still divisible into the pipeline's
    micro-batches; only the one giving train.micro_batch_size where that is set), then the same
    with selective and with full activation checkpointing."""
    if cfg.train.batch_size % par.dp:
        return []
    per_rank = cfg.train.batch_size // par.dp
    micro = par.pipeline_chunks
    accums = [a for a in _divisors(per_rank) if a <= 64 and (per_rank // a) % micro == 0]
    if cfg.train.micro_batch_size:  # only the accumulation that gives the micro-batch asked for
        accums = [a for a in accums if per_rank // (a * micro) == cfg.train.micro_batch_size]
    return [Layout(par, a, ac) for ac in AC_MODES for a in accums]


def _schedules(pp: int, n_layers: int) -> list[tuple[str, int, int]]:
    if pp == 1:
        return [("1f1b", 1, 1)]
    out = []
    for micro in (pp, 2 * pp, 4 * pp):
        out += [("1f1b", 1, micro), ("zero_bubble", 1, micro)]
        if n_layers % (2 * pp) == 0:
            out.append(("interleaved_1f1b", 2, micro))
    return out


def layout_config(cfg: Config, layout: Layout) -> Config:
    return dataclasses.replace(cfg, parallel=layout.parallel, train=dataclasses.replace(
        cfg.train, grad_accum=layout.grad_accum, activation_checkpoint=layout.activation_checkpoint))


def is_valid(full: Config, gpus: int) -> bool:
    """Whether `moetron train` accepts this config on `gpus` ranks (the same checks, in order)."""
    try:
        validate(full)
        validate_launch(full, gpus)
    except ConfigError:
        return False
    return True


def _group_spans(par: ParallelConfig) -> dict[str, tuple[int, int]]:
    """{mesh dimension or flattened group: (ranks in the group, consecutive ranks it spans)}."""
    sizes = dict(zip(MESH_DIMS, mesh_shape(par)))
    spans = {d: (sizes[d], sizes[d] * math.prod(sizes[e] for e in MESH_DIMS[i + 1:])) for i, d in enumerate(MESH_DIMS)}
    spans["world"] = par.world_size, par.world_size
    # the ranks of one copy of the weights: rep × edps × cp × ep, tp innermost
    spans["dp"] = par.dp * par.cp, par.dp * par.cp * par.tp
    # HSDP's shard group: edps × cp × ep
    spans["dp_shard"] = par.shard_group * par.cp, par.shard_group * par.cp * par.tp
    # HSDP's replicas, one per shard group: spread over the whole stage
    spans["dp_rep"] = par.dp // par.shard_group, par.world_size // par.pp
    return spans


def predict_memory(cfg: Config, layout: Layout, *, expert_imbalance: float = 1.0) -> dict[str, float]:
    """Bytes per rank by part (weights, grads, optimizer, activations, buffers) and their total.
    `cfg` gives the model and the batch; the parallel layout, accumulation and checkpointing are
    `layout`'s (cfg's own are not read, so cfg need not be `layout_config(cfg, layout)`).
    `expert_imbalance`: the busiest expert-parallel rank's routes over the mean (1 = balanced)."""
    t, par = cfg.train, layout.parallel
    act_bytes = _activation_bytes(cfg)
    chunks = layout.grad_accum * par.pipeline_chunks
    micro = max(t.batch_size // (par.dp * chunks), 1)
    mem = memory_per_rank(cfg.model, par, seq_len=t.seq_len, micro_batch=micro,
                          activation_checkpoint=layout.activation_checkpoint, activation_bytes=act_bytes,
                          expert_imbalance=expert_imbalance, chunks=chunks).to_dict()
    mem["buffers"] = _buffers(cfg, par, micro, act_bytes, mem, expert_imbalance, chunks)
    mem["total"] = sum(mem[k] for k in ("weights", "grads", "optimizer", "activations", "buffers"))
    return mem


def predict(cfg: Config, layout: Layout, profile: DeviceProfile, *, gpus_per_node: int,
            expert_imbalance: float = 1.0) -> Prediction:
    """Memory, FLOPs, communication, bubble and step time of `layout` (see the module docstring)."""
    m, t, par = cfg.model, cfg.train, layout.parallel
    tokens = t.batch_size * t.seq_len
    mem = predict_memory(cfg, layout, expert_imbalance=expert_imbalance)
    fits = mem["total"] <= MEMORY_HEADROOM * profile.memory_bytes
    flops_rank, compute_s, overhead_s = _compute(cfg, layout, profile)
    comm = _communication(cfg, layout, profile, gpus_per_node=gpus_per_node)
    memory_s = _memory_bound_bytes(cfg, par, tokens / (par.dp * par.cp), _activation_bytes(cfg),
                                   layout.activation_checkpoint in ("full", "selective"), mem) / profile.hbm_bw
    for moved in comm.copied:  # FSDP's copies around its collectives go through device memory
        memory_s += moved / profile.hbm_bw
    exposed_s = comm.exposed_s + max(0.0, comm.dp_s - profile.dp_overlap * compute_s)
    bubble = pipeline_bubble(par, profile)
    busy = compute_s + memory_s + overhead_s + exposed_s
    step_s = busy * (1 + bubble)
    tokens_per_s = tokens / step_s
    mfu = flops_per_token(m, t.seq_len) * tokens_per_s / (par.world_size * profile.peak_flops)
    times = {"compute": compute_s, "memory_bound": memory_s, "overhead": overhead_s, "comm_exposed": exposed_s,
             "comm_total": comm.total_s, "bubble": busy * bubble}
    reason = "" if fits else (f"needs {mem['total'] / 2**30:.1f} GiB per rank, more than "
                              f"{MEMORY_HEADROOM:.0%} of {profile.memory_bytes / 2**30:.0f} GiB")
    return Prediction(layout, mem, fits, flops_rank, comm.comm_bytes, comm.link_bytes, times, bubble, step_s,
                      tokens_per_s, mfu, reason)


def _activation_bytes(cfg: Config) -> int:
    return 4 if cfg.train.precision == "fp32" else 2


def _compute(cfg: Config, layout: Layout, profile: DeviceProfile) -> tuple[float, float, float]:
    """(FLOPs, their seconds, the fixed per-block overhead's seconds) on the most loaded rank: the
    last pipeline stage, which also holds the head and the MTP modules (their blocks too)."""
    m, t, par = cfg.model, cfg.train, layout.parallel
    ac, sac = layout.activation_checkpoint == "full", layout.activation_checkpoint == "selective"
    chunks = layout.grad_accum * par.pipeline_chunks
    comp = flops_by_component(m, t.seq_len, causal=m.attention != "eager")
    rank_tokens = t.batch_size * t.seq_len / (par.dp * par.cp)
    experts = comp["experts"] / par.etp
    layers = (sum(v for k, v in comp.items() if k not in ("experts", "lm_head", "mtp")) / par.tp + experts) / par.pp
    recompute = 4 / 3 if ac else 1.0
    # MTP runs whole on the last stage (parallel/pipeline.py), not a 1/pp share of every stage;
    # recomputed like a layer (its eh_proj and head pass too: a small overstatement).
    flops_rank = rank_tokens * ((layers + comp["mtp"] / par.tp) * recompute + comp["lm_head"] / par.tp)
    compute_s = flops_rank / (profile.peak_flops * profile.matmul_efficiency)
    blocks = m.n_layers / par.pp + m.mtp_depth
    overhead_s = profile.block_overhead * blocks * chunks * (1.5 if ac else 1.2 if sac else 1.0)
    return flops_rank, compute_s, overhead_s


@dataclass
class PricedComm:
    """One step's collectives on one rank, each priced on the link its group spans."""

    comm_bytes: dict[str, float] = field(default_factory=dict)  # by collective kind
    link_bytes: dict[str, float] = field(default_factory=lambda: {"intra": 0.0, "inter": 0.0})
    copied: list[float] = field(default_factory=list)  # bytes FSDP copies through memory, per collective
    exposed_s: float = 0.0  # seconds on the critical path: every group but data parallelism's
    dp_s: float = 0.0  # seconds of data-parallel collectives, which overlap compute
    total_s: float = 0.0


def _communication(cfg: Config, layout: Layout, profile: DeviceProfile, *, gpus_per_node: int) -> PricedComm:
    """`predict_step`'s collectives at the bus bandwidth (of their kind) and latency of their link."""
    t, par = cfg.train, layout.parallel
    items = predict_step(cfg.model, par, batch=t.batch_size, seq_len=t.seq_len, grad_accum=layout.grad_accum,
                         act_bytes=_activation_bytes(cfg))
    world = par.world_size
    out = PricedComm()
    spans = _group_spans(par)
    for item in items:
        dim = PURPOSE_DIM.get(item.purpose.split()[0].lower(), "world")
        n, span = spans[dim]
        if n <= 1:
            continue
        link = "intra" if span <= gpus_per_node else "inter"
        per_rank = item.bytes / world
        bw, latency = (profile.intra_bw, profile.intra_latency) if link == "intra" else (profile.inter_bw,
                                                                                          profile.inter_latency)
        bw *= profile.kind_bw.get(item.kind, 1.0)
        seconds = per_rank * WIRE_FACTOR[item.kind](n) / bw + item.calls / world * latency
        out.comm_bytes[item.kind] = out.comm_bytes.get(item.kind, 0.0) + per_rank
        if dim in ("dp", "dp_shard") and item.kind in FSDP_COPIES:
            out.copied.append(FSDP_COPIES[item.kind] * per_rank)
        out.link_bytes[link] += per_rank
        out.total_s += seconds
        if dim == "dp":
            out.dp_s += seconds
        else:
            out.exposed_s += seconds
    return out


def pipeline_bubble(par: ParallelConfig, profile: DeviceProfile) -> float:
    """Idle time over busy time of a pipeline schedule (see the module docstring)."""
    if par.pp == 1:
        return 0.0
    bubble = (par.pp - 1) / (par.microbatches * par.vpp)
    if par.schedule == "zero_bubble":
        bubble /= 3
    return bubble / profile.oversubscription


def _memory_bound_bytes(cfg: Config, par: ParallelConfig, rank_tokens: float, act_bytes: int, ac: bool,
                        mem: dict) -> float:
    """Bytes the elementwise work moves through device memory in one step on one rank: per token and
    layer (forward; backward counted twice) the norms and residual adds (14·D), rotary on q and k
    (4·(H + G)·Dh), the activation on each route (3·K·F) and the permutation around the experts
    (4·K·D), split like their tensors; then the optimizer reading and writing weights, grads and
    both moments."""
    m = cfg.model
    K = m.moe.top_k if m.moe.enabled else 1
    F = m.d_expert_ff if m.moe.enabled else m.d_ff
    d_split = par.tp if par.sequence_parallel else 1
    # MLA rotates only each query head's rope part and the one shared rope key.
    rotary = (4 * (m.n_heads / par.tp + 1) * m.mla.qk_rope_head_dim if m.mla.enabled
              else 4 * (m.n_heads + m.kv_heads) * m.dim_head / par.tp)
    per_layer = (14 * m.d_model / d_split + rotary
                 + 3 * K * F / (par.etp if m.moe.enabled else par.tp) + 4 * K * m.d_model)
    passes = 3 + (1 if ac else 0)
    # The last stage's blocks: its share of the decoder's and every MTP depth's.
    layer_bytes = passes * per_layer * act_bytes * rank_tokens * (m.n_layers / par.pp + m.mtp_depth)
    return layer_bytes + 2 * (mem["weights"] + mem["grads"] + mem["optimizer"])


@functools.lru_cache(maxsize=16)
def _block_params(m) -> tuple[float, float]:
    """(parameters of one block outside the routed experts, routed-expert parameters of one MoE block)."""
    counts = parameter_counts(m)
    _, n_moe = layer_counts(m)
    dense = (counts.total - counts.embedding - counts.experts - counts.mtp) / m.n_layers  # the decoder's blocks
    return dense, counts.experts / max(n_moe, 1)


def _buffers(cfg: Config, par: ParallelConfig, micro: int, act_bytes: int, mem: dict[str, float],
             imbalance: float = 1.0, chunks: int = 1) -> float:
    """Communication buffers: FSDP/HSDP's gathered copy of two blocks (the routed experts being
    their own unit, E/ep of them), and in backward a block's whole gradient with the reduce-scatter's
    copy of it (fp32), held while only that block's share of the activations has been freed: that
    sets the peak when a micro-batch's activations are small beside the block (bench/plan_check.py:
    dp4 fsdp with 4 accumulation steps measured 1.24× the prediction without it); EP's send +
    receive rows (received: × the busiest rank's imbalance).

    ddp and zero1 (torch's `replicate`, FSDP2 over one shard) gather every unit into a copy of its
    weights in a micro-batch's forward and free it unit by unit in backward, as the unit's gradients
    appear: with one chunk per step the copy and the gradients take turns, and the `grads` term
    counts both. With more (`chunks`: grad_accum × pipeline micro-batches) the gradients of the
    earlier backwards are held beside the copy (bench/plan_check.py: dp4 ddp with 2 accumulation
    steps measured 1.24× the prediction without it, zero1 1.35×, pp2 dp2 ddp 1F1B 1.23×).
    `mem`: memory_per_rank's parts ("weights", "activations")."""
    m = cfg.model
    out = 0.0
    if par.dp_mode in ("fsdp", "hsdp") and par.dp * par.cp > 1:
        dense, experts = _block_params(m)
        block = (dense / par.tp + experts / (par.ep * par.etp)) * 4  # one block's fp32 parameters here
        out += 2 * block + max(0.0, 2 * block - mem["activations"] / max(m.n_layers / par.pp, 1))
    if par.dp_mode in ("ddp", "zero1") and par.dp * par.cp > 1 and chunks > 1:
        out += mem["weights"]  # the gathered copy of this rank's weights
    if par.ep > 1 and m.moe.enabled:
        rows = micro * cfg.train.seq_len / par.cp * m.moe.top_k
        out += (1 + busiest_rank_imbalance(m, par.ep, imbalance)) * rows * m.d_model * act_bytes
    return out


@dataclass
class Plan:
    ranked: list[Prediction]  # fitting layouts, fastest first
    dropped: list[Prediction]  # valid layouts that do not fit
    considered: int

    def refusal(self, cfg: Config, config: str, devices: int, profile: str) -> str:
        """One line on why no layout of `config` (loaded as `cfg`) is ranked on `devices` × `profile`."""
        if self.dropped:
            return f"no layout of {config} fits on {devices} × {profile}: {self.dropped[0].reason}"
        m = cfg.model
        experts = f", {m.moe.num_experts} experts" if m.moe.enabled else ""
        return (f"no layout of {config} is valid on {devices} devices: no split into pp × dp × cp × tp (× ep) "
                f"suits its {m.n_layers} layers, {m.n_heads} heads{experts} and batch of {cfg.train.batch_size} "
                f"sequences; try another number of devices or batch size")


def plan(cfg: Config, gpus: int, profile: DeviceProfile, *, gpus_per_node: int,
         expert_imbalance: float = 1.0) -> Plan:
    """For each parallel section, the fastest valid variant (gradient accumulation, activation
    checkpointing) that fits; sections where none fits are dropped with their leanest variant's
    memory. The fitting ones are ranked by predicted step time."""
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: must be >= 1")
    ranked, dropped, n = [], [], 0
    budget = MEMORY_HEADROOM * profile.memory_bytes
    for par in base_layouts(cfg, gpus, gpus_per_node=gpus_per_node):
        layouts = variants(cfg, par)
        # The variants differ only in what `variants` already checks: validate one in full.
        if not layouts or not is_valid(layout_config(cfg, layouts[0]), gpus):
            continue
        n += len(layouts)
        best = _candidates(cfg, layouts, gpus, budget, expert_imbalance)
        if best:
            preds = [predict(full, layout, profile, gpus_per_node=gpus_per_node, expert_imbalance=expert_imbalance)
                     for layout, full in best]
            ranked.append(min(preds, key=lambda p: (p.step_s, p.memory["total"])))
        else:
            layout = layouts[-1]  # the leanest: most accumulation, checkpointed
            dropped.append(predict(layout_config(cfg, layout), layout, profile, gpus_per_node=gpus_per_node,
                                   expert_imbalance=expert_imbalance))
    ranked.sort(key=lambda p: (p.step_s, p.memory["total"]))
    dropped.sort(key=lambda p: p.memory["total"])
    return Plan(ranked, dropped, n)


def _candidates(cfg: Config, layouts: list[Layout], gpus: int, budget: float,
                imbalance: float) -> list[tuple[Layout, Config]]:
    """The variants of one parallel section that can be its fastest: for each checkpointing choice
    the least accumulation that fits (time rises with accumulation), unless a lighter choice fits
    at the same accumulation — checkpointing then only adds recompute, overhead and memory
    traffic. Memory falls as accumulation rises, so the first fit is found by bisection: memory
    estimates for every accumulation of every section were a third of a large model's plan."""
    out: list[tuple[Layout, Config]] = []
    for ac in AC_MODES:
        group = [layout for layout in layouts if layout.activation_checkpoint == ac]
        lo, hi = 0, len(group)
        while lo < hi:
            mid = (lo + hi) // 2
            mem = predict_memory(cfg, group[mid], expert_imbalance=imbalance)
            if mem["total"] <= budget:
                hi = mid
            else:
                lo = mid + 1
        if lo == len(group):
            continue
        layout = group[lo]
        full = layout_config(cfg, layout)
        if is_valid(full, gpus) and all(kept.grad_accum != layout.grad_accum for kept, _ in out):
            out.append((layout, full))
    return out


def auto_layout(config: str, overrides: list[str], ranks: int, profile: str, *, gpus_per_node: int) -> list[str]:
    """The overrides of the layout `plan` ranks first for `config` on `ranks` devices."""
    return choose_layout(config, overrides, ranks, profile, gpus_per_node=gpus_per_node).layout.overrides()


def choose_layout(config: str, overrides: list[str], ranks: int, profile: str, *, gpus_per_node: int) -> Prediction:
    """The layout `plan` ranks first for `config` on `ranks` devices of `profile`, with its predicted
    step time and memory. Raises ConfigError (one line) when no layout fits."""
    from moetron.launcher.config import load_config
    from moetron.launcher.perf.device_profiles import get_profile

    # The plan chooses the accumulation; the preset's own would only constrain how the batch splits.
    # Loaded without the rank count: the plan chooses the layout, so the config's own (dp inferred
    # from the ranks) need not be valid.
    cfg = load_config(config, [*overrides, "train.grad_accum=1"])
    dev = get_profile(profile)
    result = plan(cfg, ranks, dev, gpus_per_node=gpus_per_node)
    if not result.ranked:
        raise ConfigError(f"--layout auto: {result.refusal(cfg, config, ranks, dev.name)}")
    return result.ranked[0]

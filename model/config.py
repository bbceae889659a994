"""The model's own config section: architecture and MoE routing.

The launcher builds these from YAML; the model sees nothing else of the job's config.
`problems()` lists rule violations as (field, value, rule) so the launcher can report
them with their full dotted key before anything runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from moetron.kernels.config import Problem


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Mixture-of-Experts routing and expert sizes. `num_experts: 0` makes a dense model."""

    num_experts: int = 0
    top_k: int = 2
    # Hidden size of one expert's FFN; 0 takes the model's d_ff.
    d_expert: int = 0
    # Tokens an expert may take: ceil(top_k * tokens / num_experts * capacity_factor).
    # null means dropless: every routed token is computed.
    capacity_factor: Optional[float] = None
    min_capacity: int = 0
    # How router logits become scores: "softmax" over the experts (Switch, Mixtral) or an
    # independent "sigmoid" per expert (DeepSeek-V3, GLM-4.5).
    score: Literal["softmax", "sigmoid"] = "softmax"
    # "softmax": the raw score weights each expert (Switch Transformer);
    # "renormalize": the kept top-k scores are rescaled to sum to one (Mixtral, GShard top-2, DeepSeek-V3).
    weighting: Literal["softmax", "renormalize"] = "renormalize"
    # Combine weights are multiplied by this (DeepSeek-V3's routed scaling factor, 2.5 there).
    route_scale: float = 1.0
    # Aux-loss-free balancing (Wang et al. 2024; DeepSeek-V3 §2.1.2): a per-expert bias added to
    # the scores for choosing experts only, moved after each optimizer step by this rate ·
    # sign(mean load − expert load), loads counted over the global batch. 0 disables it.
    bias_update_rate: float = 0.0
    # Group-limited routing: experts split into num_groups equal groups; each token keeps its
    # topk_groups best groups (scored by the sum of their top top_k/topk_groups scores, as
    # megatron-core does; DeepSeek-V3's top-2 of 8/4) and picks its top_k experts inside them.
    # With one group per EP rank a token's routes reach at most topk_groups ranks. 0: off.
    num_groups: int = 0
    topk_groups: int = 0
    # A group's score for that choice: the sum of its best `group_score_top` scores; 0 takes
    # top_k // topk_groups (megatron-core). DeepSeek-V3 sums its best 2, DeepSeek-V2's
    # group_limited_greedy takes the group's best 1 (its max).
    group_score_top: int = 0
    aux_loss_coef: float = 0.01
    # Where the balance loss counts loads: "micro_batch" (Switch, GShard; the routes taken),
    # "global_batch" (Qwen3, Megatron-Core's global_aux_loss: the routes of the step's micro-batches
    # so far on every data-parallel rank, so the last micro-batch sees the whole global batch's) or
    # "sequence" (DeepSeek-V3's complementary loss: each sequence's own loads, of the unbiased top-k
    # scores, averaged over sequences; with a bias it is usually tiny, e.g. 1e-4).
    aux_loss_type: Literal["micro_batch", "global_batch", "sequence"] = "micro_batch"
    z_loss_coef: float = 0.0
    # Multiplicative uniform noise (1 ± jitter) on the router input while training (Switch).
    jitter: float = 0.0
    # An always-on expert beside the routed ones (DeepSeek-MoE); 0 disables it.
    shared_expert_d_ff: int = 0
    # The shared expert's output scaled per token by sigmoid(x · w), w a learned (D,) vector (Qwen2-MoE).
    shared_expert_gate: bool = False
    # A learned bias on the router's logits (GPT-OSS), and biases on the experts' projections.
    router_bias: bool = False
    expert_bias: bool = False
    # The experts' SwiGLU as GPT-OSS writes it: gate clamped to at most `swiglu_limit`, up to
    # ±swiglu_limit (0: no clamp), gate · sigmoid(swiglu_alpha · gate) · (up + swiglu_up_offset).
    # The defaults (0, 1, 0) are plain SwiGLU; GPT-OSS uses (7.0, 1.702, 1.0).
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    swiglu_up_offset: float = 0.0
    # Layer i is MoE when i >= first_dense_layers and (i + 1) % every == 0: every=1 → every layer,
    # 2 → every other layer (Switch, GShard); DeepSeek-MoE keeps its first layer dense.
    every: int = 1
    first_dense_layers: int = 0
    # Further layers kept dense whatever `every` says (Qwen-MoE's mlp_only_layers).
    dense_layers: tuple[int, ...] = ()
    # "grouped": one grouped GEMM over ragged expert groups; "loop": per-expert reference.
    experts_impl: Literal["grouped", "loop"] = "grouped"

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        if self.num_experts < 0:
            out.append(("num_experts", self.num_experts, "must be >= 0 (0 means dense)"))
        if self.enabled:
            if not 1 <= self.top_k <= self.num_experts:
                out.append(("top_k", self.top_k, f"must be in 1..num_experts ({self.num_experts})"))
            if self.capacity_factor is not None and self.capacity_factor <= 0:
                out.append(("capacity_factor", self.capacity_factor, "must be > 0, or null for dropless"))
            if self.every < 1:
                out.append(("every", self.every, "must be >= 1"))
            if self.num_groups or self.topk_groups:
                if self.num_groups < 1 or self.num_experts % self.num_groups:
                    out.append(("num_groups", self.num_groups,
                                f"must divide num_experts ({self.num_experts}) when topk_groups is set"))
                elif not 1 <= self.topk_groups <= self.num_groups:
                    out.append(("topk_groups", self.topk_groups, f"must be in 1..num_groups ({self.num_groups})"))
                elif not self.topk_groups <= self.top_k <= self.topk_groups * (self.num_experts // self.num_groups):
                    out.append(("top_k", self.top_k,
                                f"must be in topk_groups ({self.topk_groups})..the experts of the kept groups "
                                f"({self.topk_groups * (self.num_experts // self.num_groups)})"))
                elif not 0 <= self.group_score_top <= self.num_experts // self.num_groups:
                    out.append(("group_score_top", self.group_score_top,
                                f"must be in 0..the experts of a group ({self.num_experts // self.num_groups})"))
            if self.weighting == "renormalize" and self.top_k == 1:
                # Renormalizing one probability makes every weight 1.0 and starves the router of gradient.
                out.append(("weighting", self.weighting, "top_k=1 needs weighting=softmax (Switch)"))
        if self.route_scale <= 0:
            out.append(("route_scale", self.route_scale, "must be > 0"))
        if self.shared_expert_gate and not self.shared_expert_d_ff:
            out.append(("shared_expert_gate", True, "needs a shared expert (moe.shared_expert_d_ff > 0)"))
        if self.swiglu_alpha <= 0:
            out.append(("swiglu_alpha", self.swiglu_alpha, "must be > 0 (1.0: plain SwiGLU)"))
        for name in ("aux_loss_coef", "z_loss_coef", "jitter", "min_capacity", "d_expert", "shared_expert_d_ff",
                     "first_dense_layers", "bias_update_rate", "num_groups", "topk_groups", "swiglu_limit"):
            if getattr(self, name) < 0:
                out.append((name, getattr(self, name), "must be >= 0"))
        return out


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3). `kv_lora_rank: 0` keeps ordinary attention.

    Keys and values come from one compressed latent c_kv = RMSNorm(x · W_dkv) of `kv_lora_rank`
    dims, which is all the KV cache keeps besides one RoPE key of `qk_rope_head_dim` shared by
    the heads. Queries come from x directly, or through their own latent of `q_lora_rank` dims.
    A head's query and key are [nope | rope] (qk_nope_head_dim + qk_rope_head_dim wide), its
    value v_head_dim wide: 192 and 128 in V3.
    """

    kv_lora_rank: int = 0
    # 0: queries projected from x directly (DeepSeek-V2-Lite).
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # With rope_scaling yarn, YaRN's temperature scales the softmax scale, so every q·k dim and not
    # only the rotated ones, by (0.1 · yarn_mscale · ln(factor) + 1)² and leaves cos and sin alone
    # (DeepSeek's mscale_all_dim: 0.707 in V2, 1.0 in V3).
    yarn_mscale: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim"):
            if getattr(self, name) < 0:
                out.append((name, getattr(self, name), "must be >= 0"))
        if self.enabled:
            if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
                out.append(("qk_rope_head_dim", self.qk_rope_head_dim, "must be even and >= 2"))
            if self.v_head_dim < 1:
                out.append(("v_head_dim", self.v_head_dim, "must be >= 1"))
            if self.yarn_mscale < 0:
                out.append(("yarn_mscale", self.yarn_mscale, "must be >= 0"))
        return out


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only Transformer; with `moe.num_experts > 0` some FFNs are MoE layers."""

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    # Key/value heads: n_heads → MHA, 1 → MQA, in between → GQA. null takes n_heads.
    n_kv_heads: Optional[int] = None
    # null takes d_model // n_heads.
    head_dim: Optional[int] = None
    d_ff: int = 1024
    activation: Literal["swiglu", "gelu", "relu"] = "swiglu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    # "pre": x + f(norm(x)) (GPT-2 onward); "post": norm(x + f(x)) (Vaswani et al. 2017).
    norm_position: Literal["pre", "post"] = "pre"
    # false: every position attends to every other (a bidirectional encoder, as BERT), no causal mask.
    causal: bool = True
    # "t5": T5's relative position bias, one learned bias per (offset bucket, head), shared by all layers.
    position: Literal["rope", "alibi", "sinusoidal", "learned", "t5", "none"] = "rope"
    # T5 buckets: half exact offsets 0..num_buckets/2−1, half log-spaced up to max_distance (T5: 32, 128).
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    rope_theta: float = 10000.0
    # Context extension: "linear" divides positions by the factor (position interpolation),
    # "ntk" raises the base by factor ** (d / (d - 2)) (NTK-aware scaling), "yarn" interpolates
    # only the frequencies that turn less than once over the original context and scales q·k by
    # (0.1·ln(factor) + 1)² (Peng et al. 2023). Each can be set at load time on a model trained without.
    rope_scaling: Literal["none", "linear", "ntk", "yarn"] = "none"
    rope_scaling_factor: float = 1.0
    # YaRN's original context (the length the model was trained at); null takes max_seq_len.
    rope_original_max_seq_len: Optional[int] = None
    # YaRN's ramp between the kept and the interpolated frequencies starts and ends at whole pair
    # indices (true: floor and ceil, transformers' `truncate` default) or where the formula puts
    # them (false: GPT-OSS).
    rope_yarn_truncate: bool = True
    max_seq_len: int = 2048
    dropout: float = 0.0
    bias: bool = False
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention: Literal["eager", "sdpa", "triton"] = "sdpa"
    # RMSNorm on queries and keys before RoPE (always RMSNorm, eps norm_eps): "head" normalizes each
    # head over Dh with one Dh-sized gain per q and k (Qwen3), "projection" the whole q (H·Dh) and
    # k (G·Dh) projections with gains of those sizes (OLMo, OLMoE).
    qk_norm: Literal["none", "head", "projection"] = "none"
    # Biases on the attention projections alone (`bias` puts them on every linear): "qkv" on q, k
    # and v (Qwen2-MoE), "all" on the output projection too (GPT-OSS).
    attention_bias: Literal["none", "qkv", "all"] = "none"
    # A learned logit per head that joins every query's softmax as one more key with no value
    # (GPT-OSS's attention sinks): attention may give weight to "nothing".
    attention_sinks: bool = False
    # Sliding-window attention: a query sees itself and the sliding_window − 1 positions before it
    # (0: off). `layer_types` says per layer "full" or "sliding"; empty with a window: every layer slides.
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    # Multi-token prediction (DeepSeek-V3 §2.2): `mtp_depth` sequential modules, module k predicting
    # token i + 1 + k from the main model's state and token i + k's embedding, each adding
    # mtp_loss_weight / mtp_depth times its cross-entropy to the loss (λ; V3: 0.3, later 0.1).
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    mla: MLAConfig = field(default_factory=MLAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def rope_original_len(self) -> int:
        return self.rope_original_max_seq_len or self.max_seq_len

    @property
    def d_expert_ff(self) -> int:
        return self.moe.d_expert or self.d_ff

    def is_moe_layer(self, layer: int) -> bool:
        moe = self.moe
        return (moe.enabled and layer >= moe.first_dense_layers and (layer + 1) % moe.every == 0
                and layer not in moe.dense_layers)

    def layer_window(self, layer: int) -> int:
        """Keys a query of `layer` sees (itself included); 0: every earlier position."""
        if not self.sliding_window:
            return 0
        if not self.layer_types:
            return self.sliding_window
        # An MTP block (layer >= n_layers, model/mtp.py) that layer_types does not list attends fully.
        return self.sliding_window if layer < len(self.layer_types) and self.layer_types[layer] == "sliding" else 0

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                out.append((name, getattr(self, name), "must be >= 1"))
        if out:
            return out
        if self.n_kv_heads is not None and not 1 <= self.n_kv_heads <= self.n_heads:
            out.append(("n_kv_heads", self.n_kv_heads, f"must be in 1..n_heads ({self.n_heads})"))
        elif self.n_heads % self.kv_heads:
            out.append(("n_kv_heads", self.kv_heads, f"must divide n_heads ({self.n_heads}) for grouped-query attention"))
        if self.head_dim is None and self.d_model % self.n_heads:
            out.append(("n_heads", self.n_heads, f"must divide d_model ({self.d_model}), or set head_dim"))
        if self.position == "rope" and not self.mla.enabled and self.dim_head % 2:  # mla: qk_rope_head_dim
            out.append(("head_dim", self.dim_head, "must be even for rope"))
        if self.position == "sinusoidal" and self.d_model % 2:
            out.append(("d_model", self.d_model, "must be even for sinusoidal positions"))
        if self.rope_scaling_factor < 1.0:
            out.append(("rope_scaling_factor", self.rope_scaling_factor, "must be >= 1.0"))
        if self.rope_original_max_seq_len is not None and self.rope_original_max_seq_len < 1:
            out.append(("rope_original_max_seq_len", self.rope_original_max_seq_len, "must be >= 1, or null"))
        if self.position == "t5":
            if self.t5_num_buckets < 2:
                out.append(("t5_num_buckets", self.t5_num_buckets, "must be >= 2"))
            elif self.t5_max_distance <= self.t5_num_buckets // 2:
                out.append(("t5_max_distance", self.t5_max_distance,
                            f"must exceed t5_num_buckets // 2 ({self.t5_num_buckets // 2}), the exact buckets"))
        if not self.causal and self.position in ("alibi", "t5"):
            # Both biases here are the decoder's one-sided ones (T5's causal buckets, ALiBi's past-only penalty).
            out.append(("position", self.position, "must be rope, learned, sinusoidal or none with causal: false"))
        if not 0.0 <= self.dropout < 1.0:
            out.append(("dropout", self.dropout, "must be in [0, 1)"))
        if self.norm_eps <= 0 or self.init_std <= 0:
            out.append(("norm_eps" if self.norm_eps <= 0 else "init_std",
                        self.norm_eps if self.norm_eps <= 0 else self.init_std, "must be > 0"))
        out += self._attention_variant_problems()
        out += [(f"mla.{k}", v, rule) for k, v, rule in self.mla.problems()]
        out += [(f"moe.{k}", v, rule) for k, v, rule in self.moe.problems()]
        return out

    def _attention_variant_problems(self) -> list[Problem]:
        out: list[Problem] = []
        if self.sliding_window < 0:
            out.append(("sliding_window", self.sliding_window, "must be >= 0 (0: full attention)"))
        if self.layer_types:
            if len(self.layer_types) != self.n_layers:
                out.append(("layer_types", list(self.layer_types), f"must list n_layers ({self.n_layers}) entries"))
            elif any(t not in ("full", "sliding") for t in self.layer_types):
                out.append(("layer_types", list(self.layer_types), "entries must be full or sliding"))
            elif not self.sliding_window:
                out.append(("layer_types", list(self.layer_types), "needs sliding_window > 0"))
        if self.sliding_window and not self.causal:
            out.append(("sliding_window", self.sliding_window, "must be 0 with causal: false (a window looks back)"))
        moe = self.moe
        if (moe.swiglu_limit, moe.swiglu_alpha, moe.swiglu_up_offset) != (0.0, 1.0, 0.0) and self.activation != "swiglu":
            out.append(("activation", self.activation, "must be swiglu with moe.swiglu_limit/alpha/up_offset set"))
        if self.mtp_depth < 0:
            out.append(("mtp_depth", self.mtp_depth, "must be >= 0 (0: no multi-token prediction)"))
        if self.mtp_loss_weight < 0:
            out.append(("mtp_loss_weight", self.mtp_loss_weight, "must be >= 0"))
        if self.mla.enabled:
            if self.n_kv_heads not in (None, self.n_heads):
                out.append(("n_kv_heads", self.n_kv_heads, "must be null or n_heads with mla (every head has its key)"))
            if self.position != "rope":
                out.append(("position", self.position, "must be rope with mla (its decoupled key is a RoPE key)"))
            if self.qk_norm != "none":
                out.append(("qk_norm", self.qk_norm, "must be none with mla (its latents have their own norms)"))
            # Not built for MLA (DeepSeek has none of them): biases, sinks and sliding windows.
            for key, plain in (("bias", False), ("attention_bias", "none"), ("attention_sinks", False),
                               ("sliding_window", 0)):
                if getattr(self, key) != plain:
                    out.append((key, getattr(self, key), f"must be {plain!r} with mla"))
        if self.moe.dense_layers and any(not 0 <= i < self.n_layers for i in self.moe.dense_layers):
            out.append(("moe.dense_layers", list(self.moe.dense_layers), f"must be layers in 0..{self.n_layers - 1}"))
        return out

"""The job's config: typed, frozen sections loaded from YAML, `a.b=value` overrides, one validation pass.

Each section is a dataclass owned by the folder that uses it (`ModelConfig` in model/,
`ParallelConfig` in parallel/, `KernelConfig` in kernels/); the run-level sections live here.
Every problem is reported as one `ConfigError` naming the dotted key, its value and the rule.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from moetron.kernels.config import KernelConfig, Problem
from moetron.model.config import ModelConfig
from moetron.parallel.config import ParallelConfig


class ConfigError(ValueError):
    """A config problem, printed as one line by the CLI (exit status 2)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Sharded checkpoints under <run>/checkpoints; `every: 0` saves only at the end and on signals."""

    every: int = 0
    keep: int = 3
    # Written as `async` in YAML and overrides (a Python keyword, hence the field name).
    async_save: bool = field(default=False, metadata={"key": "async"})
    # A periodic save that fails (full disk, quota, permissions): "stop" ends the run with the
    # error (exit 2); "continue" reports it in one line, counts it as `failed_saves` and trains
    # on. Either way the previous checkpoint stays `latest` and no partial folder is left; the
    # final save's failure always ends the run with exit 2.
    on_error: Literal["stop", "continue"] = "stop"

    def problems(self) -> list[Problem]:
        out = [(k, getattr(self, k), "must be >= 0") for k in ("every",) if getattr(self, k) < 0]
        if self.keep < 1:
            out.append(("keep", self.keep, "must be >= 1"))
        return out


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The optimization loop. `batch_size` is global: sequences per optimizer step on all ranks."""

    # Run name; null takes the config file's name. Outputs go to <run_dir>/<name>/.
    name: Optional[str] = None
    run_dir: str = "runs"
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    # Micro-batches accumulated per optimizer step (batch_size must divide evenly).
    grad_accum: int = 1
    # Sequences per micro-batch on each rank (Megatron's --micro-batch-size); 0: whatever
    # batch_size / (parallel.dp × grad_accum × the pipeline's micro-batches) gives. Set, the layout
    # must give exactly that, and `--layout auto` picks only layouts that do: the balance loss and
    # the router capacity are per micro-batch, so keeping its size keeps the objective across layouts.
    micro_batch_size: int = 0
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 100
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    # Steps over which the lr warms up and decays to min_lr (Megatron's --lr-decay-iters); after them
    # it stays at min_lr. null: train.steps of the run's first start — a resumed run keeps the
    # length its checkpoint was trained with, so raising train.steps extends a run without
    # re-bending what it already did.
    lr_decay_steps: Optional[int] = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # Clip the global gradient norm to this; 0 disables clipping.
    grad_clip: float = 1.0
    # A step with a non-finite loss or grad norm is skipped; this many in a row stop the run.
    max_skipped_steps: int = 5
    # "auto": bf16 autocast on CUDA and on CPUs with native bf16 matmuls (AMX/AVX512-BF16), else fp32.
    # "fp8": bf16 autocast with the dense linears' and the experts' GEMMs in FP8 (torchao, rowwise
    # scales; parallel/float8.py), on GPUs of compute capability 8.9 or newer.
    precision: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    # Intra-op CPU threads; 0 keeps torch's default.
    threads: int = 0
    compile: bool = False
    # Recompute each block in backward instead of keeping its activations ("full"), or keep the
    # matmul and collective outputs and recompute only the cheap ops between them ("selective").
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    # Per-device peak FLOP/s (in TFLOP/s) that MFU is measured against; 0: the GPU's bf16 dense
    # peak from a table, or on CPU a matmul peak measured once and cached.
    peak_tflops: float = 0.0
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # "clm": predict each next token (a decoder); "mlm": BERT's masked-language modelling — 15% of
    # positions scored, their inputs masked (80%), replaced by a random token (10%) or kept (10%),
    # with a mask token past the tokenizer's vocabulary (an encoder: model.causal false).
    objective: Literal["clm", "mlm"] = "clm"

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        for k in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_every", "eval_batches",
                  "max_skipped_steps"):
            if getattr(self, k) < 1:
                out.append((k, getattr(self, k), "must be >= 1"))
        for k in ("lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip", "threads", "eps", "peak_tflops",
                  "micro_batch_size"):
            if getattr(self, k) < 0:
                out.append((k, getattr(self, k), "must be >= 0"))
        if self.lr_decay_steps is not None and self.lr_decay_steps < 1:
            out.append(("lr_decay_steps", self.lr_decay_steps, "must be >= 1 (or null: train.steps)"))
        if self.min_lr > self.lr:
            out.append(("min_lr", self.min_lr, f"must be <= lr ({self.lr})"))
        for k in ("beta1", "beta2"):
            if not 0 <= getattr(self, k) < 1:
                out.append((k, getattr(self, k), "must be in [0, 1)"))
        if self.grad_accum >= 1 and self.batch_size % self.grad_accum:
            out.append(("grad_accum", self.grad_accum, f"must divide batch_size ({self.batch_size})"))
        if self.name is not None and (not self.name or "/" in self.name or self.name.startswith(".")):
            out.append(("name", self.name, "must be a plain folder name"))
        out += [(f"checkpoint.{k}", v, r) for k, v, r in self.checkpoint.problems()]
        return out


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from: "stdlib" (the Python standard library's own source, no download),
    the PREFIX of a Megatron indexed corpus (PREFIX.bin + PREFIX.idx, as `moetron data prepare`
    or Megatron's preprocess_data.py write it), or `blend`: several, weighted."""

    source: str = "stdlib"
    # Megatron's --data-path: [weight, PREFIX, weight, PREFIX, …] or [PREFIX]; replaces `source`.
    blend: Optional[list] = None
    # "byte", or a tokenizer.json path: for "stdlib" and corpora without moetron's PREFIX.json.
    tokenizer: str = "byte"
    # Share of documents held out for validation: by a hash of the name for "stdlib", the last
    # documents of a corpus other than moetron's (whose PREFIX.json records its own split).
    val_fraction: float = 0.02
    # Packed documents kept apart (Megatron's --reset-attention-mask): attention never crosses the
    # end-of-document token that closes each document in the corpus.
    document_mask: bool = False
    # Positions restart at each document (Megatron's --reset-position-ids); needs document_mask.
    reset_positions: bool = False
    # The end-of-document token id; null: the tokenizer's end-of-text id (what `moetron data prepare` writes).
    eod_id: Optional[int] = None

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        if not 0 < self.val_fraction < 1:
            out.append(("val_fraction", self.val_fraction, "must be in (0, 1)"))
        if self.reset_positions and not self.document_mask:
            out.append(("reset_positions", True, "needs data.document_mask: true (positions restart where the "
                                                 "mask starts a document; without it the documents see each other)"))
        if self.eod_id is not None and self.eod_id < 0:
            out.append(("eod_id", self.eod_id, "must be a token id >= 0, or null for the tokenizer's end-of-text id"))
        if self.blend is not None:
            rule = _blend_problem(self.blend)
            if rule is None and self.source != "stdlib":
                rule = f"replaces data.source ({self.source!r}): set one of them"
            if rule is not None:
                out.append(("blend", self.blend, rule))
        return out

    def blend_pairs(self) -> list[tuple[float, str]] | None:
        """The blend as (weight, PREFIX) pairs (one source: weight 1), or None without a blend."""
        if self.blend is None:
            return None
        if len(self.blend) == 1:
            return [(1.0, str(self.blend[0]))]
        return [(float(w), str(p)) for w, p in zip(self.blend[::2], self.blend[1::2])]


def _blend_problem(blend: list) -> str | None:
    """What is wrong with a data.blend list, or None."""
    form = "must alternate weight and prefix, as [0.7, data/a, 0.3, data/b], or be one [prefix]"
    if len(blend) == 1:
        return None if isinstance(blend[0], str) and blend[0] else form
    if not blend or len(blend) % 2:
        return form
    for weight, prefix in zip(blend[::2], blend[1::2]):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not isinstance(prefix, str):
            return form
        if not (math.isfinite(weight) and weight > 0):
            return f"weight {weight!r} of {prefix}: every weight must be > 0"
    names = [Path(p).name for p in blend[1::2]]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        return f"two sources named {twice[0]!r}: metrics key each source by its file name, so they must differ"
    return None


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    """Defaults for `moetron submit`; its command-line flags override them."""

    partition: Optional[str] = None
    time: str = "01:00:00"
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    exclusive: bool = False
    requeue_limit: int = 3
    # Seconds before the time limit at which the job is told to checkpoint and requeue.
    signal_seconds: int = 120

    def problems(self) -> list[Problem]:
        out = [(k, getattr(self, k), "must be >= 1") for k in ("nodes", "cpus_per_task") if getattr(self, k) < 1]
        out += [(k, getattr(self, k), "must be >= 0")
                for k in ("gpus_per_node", "requeue_limit", "signal_seconds") if getattr(self, k) < 0]
        return out


@dataclass(frozen=True, kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    @property
    def run_name(self) -> str:
        return self.train.name or "run"

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path, overrides: list[str] = (), *, world_size: int | None = None) -> Config:
    """Read a YAML preset, apply `a.b=value` overrides, build the typed config and validate it.

    `world_size`, when known (the launch's ranks, a Slurm allocation's GPUs), fills in `parallel.dp`
    if neither the preset nor an override gives it, as Megatron-LM and torchtitan do:
    dp = world_size / (pp × cp × tp). A `dp` that is given is kept, and checked against the launch later.
    """
    path = resolve_config_path(path)
    data = read_yaml_with_base(path)
    for item in overrides:
        apply_override(data, item)
    data.setdefault("train", {})
    if isinstance(data["train"], dict) and data["train"].get("name") is None:
        data["train"]["name"] = path.stem
    launch_problem = None
    if world_size is not None:
        try:
            _infer_dp(data, world_size)
        except ConfigError as e:
            # A layout that cannot fit the launch is reported after what is wrong with the config
            # itself: `parallel.tp=3` on 8 heads is about the heads, whatever the rank count.
            launch_problem = e
    cfg = from_dict(Config, data)
    validate(cfg)
    if launch_problem is not None:
        raise launch_problem
    return cfg


def packaged_configs() -> Path:
    """The folder of presets shipped inside the package (moetron/configs/)."""
    return Path(__file__).resolve().parents[1] / "configs"


def preset_names() -> list[str]:
    """The shipped presets by bare name: tiny, mixtral-8x7b, …"""
    return sorted(p.stem for p in packaged_configs().glob("*.yaml"))


def resolve_config_path(name: str | Path) -> Path:
    """The YAML file a CONFIG argument names: a path relative to the current folder first; else the
    package's own presets, by path (`configs/tiny.yaml`, `tiny.yaml`) or by bare name (`tiny`), so a
    preset loads from any folder."""
    path = Path(name)
    if path.is_file() or path.is_absolute():
        return path
    shipped = packaged_configs()
    candidates = [shipped.parent / path, shipped / path]
    if not path.suffix:
        candidates.append(shipped / f"{path}.yaml")
    for candidate in candidates:
        if candidate.is_file() and candidate.parent == shipped:
            return candidate
    return path


def _infer_dp(data: dict[str, Any], world_size: int) -> None:
    par = data.setdefault("parallel", {})
    if not isinstance(par, dict) or par.get("dp") is not None:
        return
    pp, cp, tp = par.get("pp", 1), par.get("cp", 1), par.get("tp", 1)
    if not all(isinstance(v, int) and v >= 1 for v in (pp, cp, tp)):
        return  # the field checks name the bad value
    if world_size % (pp * cp * tp):
        raise ConfigError(f"parallel.pp × cp × tp = {pp} × {cp} × {tp} = {pp * cp * tp}: must divide the number of "
                          f"launched ranks ({world_size}) so that parallel.dp can be inferred")
    par["dp"] = world_size // (pp * cp * tp)


def read_yaml_with_base(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a preset; a top-level `base: other.yaml` (relative to this file) is read first and this
    file's keys are merged over it, section by section."""
    if not path.is_file():
        if seen:
            raise ConfigError(f"{path}: no such config file (the `base:` of {seen[-1]})")
        raise ConfigError(f"{path}: no such config file or preset; a CONFIG is a YAML path or one of the "
                          f"presets moetron ships: {', '.join(preset_names())} (e.g. `moetron train tiny`)")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: `base:` chain loops back to itself")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_problem(path, e)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must hold a mapping of sections (model:, train:, …)")
    base = data.pop("base", None)
    if base is None:
        return data
    return _merge(read_yaml_with_base(path.parent / str(base), seen + (path.resolve(),)), data)


def _yaml_problem(path: Path, e: yaml.YAMLError) -> str:
    """`file:line:column: not valid YAML: the problem` (1-based, as editors count), on one line."""
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = ": ".join(filter(None, (getattr(e, "context", None), getattr(e, "problem", None)))) or str(e)
    return f"{where}: not valid YAML: {' '.join(problem.split())}"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a config from plain data (a resolved config saved in a run folder)."""
    cfg = from_dict(Config, data)
    validate(cfg)
    return cfg


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in nested `data`; the value is parsed as YAML (1 → int, true → bool)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=200")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
    node[parts[-1]] = value


def _field_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from nested dicts, checking every key and type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} = {data!r}: must be a mapping")
    hints = typing.get_type_hints(cls)
    fields = {_field_key(f): f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            guess = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {prefix}{guess[0]}?)" if guess else f" (known: {', '.join(sorted(fields))})"
            raise ConfigError(f"unknown key {prefix}{key}{hint}")
    kwargs = {}
    for key, f in fields.items():
        if key in data:
            kwargs[f.name] = _coerce(hints[f.name], data[key], f"{prefix}{key}")
    return cls(**kwargs)


# The types a value must already have, as YAML reads it, and how an error names them.
_EXACT_TYPES = {bool: "true or false", list: "a list", str: "a string"}


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key} = {value!r}: must be one of {', '.join(map(str, choices))}")
        return value
    if tp in _EXACT_TYPES:
        if not isinstance(value, tp):
            raise ConfigError(f"{key} = {value!r}: must be {_EXACT_TYPES[tp]}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r}: must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; people write it that way.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} = {value!r}: must be a number")
        return float(value)
    if origin is tuple:
        # YAML lists become tuples, so frozen configs stay hashable (e.g. model.layer_types).
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {value!r}: must be a list")
        item_tp = typing.get_args(tp)[0]
        return tuple(_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value))
    raise TypeError(f"unsupported config type {tp} for {key}")


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {_field_key(f): _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):  # YAML and JSON both write lists
        return list(obj)
    return obj


# ---------------------------------------------------------------------------------------------
# Validation


def validate(cfg: Config) -> None:
    """Raise ConfigError for the first problem: each section's own rules, then cross-section ones."""
    for section in ("model", "parallel", "train", "data", "kernel", "slurm"):
        for key, value, rule in getattr(cfg, section).problems():
            raise ConfigError(f"{section}.{key} = {value!r}: {rule}")
    for key, value, rule in _cross_section_problems(cfg) + _mtp_problems(cfg) + _fp8_problems(cfg):
        raise ConfigError(f"{key} = {value!r}: {rule}")


def _fp8_problems(cfg: Config) -> list[Problem]:
    """FP8 linears are torchao's Float8Linear, which tensor parallelism would need its own styles for."""
    if cfg.train.precision == "fp8" and cfg.parallel.tp > 1:
        rule = ("must be 1 with train.precision=fp8 (FP8 linears are not split over tp ranks yet); use bf16 "
                "with tp, or fp8 with dp, ep and pp")
        return [("parallel.tp", cfg.parallel.tp, rule)]
    return []


def _mtp_problems(cfg: Config) -> list[Problem]:
    """Multi-token prediction (model/mtp.py) predicts tokens ahead of whole causal windows."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if not m.mtp_depth:
        return []
    out: list[Problem] = []
    if t.objective != "clm":
        out.append(("model.mtp_depth", m.mtp_depth, "needs train.objective clm (next-token prediction)"))
    if m.mtp_depth >= t.seq_len:
        out.append(("model.mtp_depth", m.mtp_depth, f"must be below train.seq_len ({t.seq_len}): depth k scores "
                                                    "the seq_len − k positions with a target"))
    if p.cp > 1:
        # Depth k embeds the token k places ahead, which may sit in another cp rank's chunk.
        out.append(("parallel.cp", p.cp, "must be 1 with model.mtp_depth > 0 (the tokens ahead cross chunks)"))
    return out


def _tied_embedding_problems(m, p) -> list[Problem]:
    if not m.tie_embeddings:
        return []
    if p.pp > 1:
        return [("model.tie_embeddings", True, "cannot tie the embedding (first stage) to the head (last stage) "
                 "with parallel.pp > 1")]
    if p.dp * p.cp > 1:
        # Materializing the sharded model from meta unties the two (each gets its own tensor), and
        # FSDP refuses one parameter in two groups: refused until both are handled.
        return [("model.tie_embeddings", True, "is not supported with data or context parallelism "
                 "(parallel.dp × parallel.cp > 1) yet; set it to false")]
    return []


def _cross_section_problems(cfg: Config) -> list[Problem]:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    out: list[Problem] = []
    if t.seq_len > m.max_seq_len:
        out.append(("train.seq_len", t.seq_len, f"must be <= model.max_seq_len ({m.max_seq_len})"))
    if t.batch_size % (p.dp * t.grad_accum):
        out.append(("train.batch_size", t.batch_size,
                    f"must be divisible by parallel.dp × train.grad_accum ({p.dp} × {t.grad_accum})"))
    if m.n_heads % p.tp:
        out.append(("parallel.tp", p.tp, f"must divide model.n_heads ({m.n_heads})"))
    if m.kv_heads % p.tp:
        out.append(("parallel.tp", p.tp, f"must divide the KV heads ({m.kv_heads})"))
    if m.vocab_size % p.tp:
        out.append(("parallel.tp", p.tp, f"must divide model.vocab_size ({m.vocab_size})"))
    if (t.objective == "mlm") == m.causal:
        out.append(("train.objective", t.objective, "mlm needs model.causal: false (an encoder) and clm needs "
                                                    "model.causal: true (a bidirectional model sees the token it must predict)"))
    if cfg.data.document_mask and not m.causal:
        out.append(("data.document_mask", True, "needs model.causal: true (an encoder's documents are its windows)"))
    if cfg.data.eod_id is not None and cfg.data.eod_id >= m.vocab_size:
        out.append(("data.eod_id", cfg.data.eod_id, f"must be a token id below model.vocab_size ({m.vocab_size})"))
    if m.qk_norm != "none" and p.tp > 1:
        # projection: the norm spans every head, split over the tp ranks; head: the shared Dh-sized
        # gains would get each rank's heads' gradient only, and drift apart.
        out.append(("parallel.tp", p.tp, f"must be 1 with model.qk_norm={m.qk_norm} (not split over tp ranks yet)"))
    if m.moe.enabled and m.moe.num_experts % p.ep:
        out.append(("parallel.ep", p.ep, f"must divide model.moe.num_experts ({m.moe.num_experts})"))
    if not m.moe.enabled and p.ep > 1:
        out.append(("parallel.ep", p.ep, "needs an MoE model (model.moe.num_experts > 0)"))
    if m.n_layers % (p.pp * p.vpp):
        out.append(("parallel.pp", p.pp, f"× vpp ({p.vpp}) must divide model.n_layers ({m.n_layers})"))
    micro = t.batch_size // max(p.dp * t.grad_accum, 1)
    if p.pp > 1 and micro % p.microbatches:
        out.append(("parallel.microbatches", p.microbatches,
                    f"must divide the per-rank micro-batch ({micro} sequences)"))
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        out.append(("train.seq_len", t.seq_len,
                    f"must be divisible by 2 × parallel.cp ({2 * p.cp}): each cp rank holds two equal chunks"))
    if p.cp > 1 and p.sequence_parallel and p.tp > 1 and (t.seq_len // p.cp) % p.tp:
        out.append(("train.seq_len", t.seq_len,
                    f"/ parallel.cp ({p.cp}) must be divisible by parallel.tp ({p.tp}) with sequence_parallel"))
    if p.etp > 1 and m.moe.enabled and m.d_expert_ff % p.etp:
        out.append(("parallel.etp", p.etp, f"must divide the expert hidden size ({m.d_expert_ff})"))
    out += _tied_embedding_problems(m, p)
    if p.pp > 1 and m.position == "t5":
        out.append(("model.position", "t5", "T5's bias table is shared by every layer, so it cannot be split "
                    "between pipeline stages (parallel.pp > 1)"))
    if p.sequence_parallel and p.tp > 1:
        if t.seq_len % p.tp:
            out.append(("train.seq_len", t.seq_len, f"must be divisible by parallel.tp ({p.tp}) with sequence_parallel"))
        if t.compile:
            # Measured (tests/parallel/parity_worker.py): compiled blocks with sequence-parallel
            # norms and gathers give losses ~4e-5 off and gradients 1-60% off on torch 2.13.
            out.append(("train.compile", True, "is not supported with parallel.sequence_parallel=true: compiled "
                        "sequence-parallel blocks do not train like eager ones; set one of them false"))
    return out


def sequences_per_micro_batch(cfg: Config) -> int:
    """Sequences in each micro-batch a rank runs forward: the global batch cut into
    dp × grad_accum × (pipeline micro-batches) pieces."""
    p, t = cfg.parallel, cfg.train
    return t.batch_size // max(p.dp * t.grad_accum * p.pipeline_chunks, 1)


def _micro_batch_problem(cfg: Config) -> str | None:
    """Why the layout does not give train.micro_batch_size's sequences per micro-batch, or None."""
    p, t = cfg.parallel, cfg.train
    got = sequences_per_micro_batch(cfg)
    if not t.micro_batch_size or got == t.micro_batch_size:
        return None
    pipeline, per_rank = p.pipeline_chunks, t.batch_size // p.dp
    chunks = t.micro_batch_size * pipeline
    fix = f"train.grad_accum={per_rank // chunks}" if per_rank % chunks == 0 else "another parallel.dp or train.batch_size"
    return (f"train.micro_batch_size = {t.micro_batch_size}: the layout gives {got} sequences per micro-batch "
            f"(train.batch_size / (dp × grad_accum × pipeline micro-batches) = {t.batch_size} / ({p.dp} × "
            f"{t.grad_accum} × {pipeline})); set {fix}, or train.micro_batch_size=0")


def validate_launch(cfg: Config, world_size: int) -> None:
    """Check the layout against the launched ranks, before any process group starts."""
    p = cfg.parallel
    if p.world_size != world_size:
        raise ConfigError(f"parallel.pp × dp × cp × tp = {p.pp} × {p.dp} × {p.cp} × {p.tp} = {p.world_size}: must "
                          f"equal the number of launched ranks ({world_size}); leave parallel.dp out to infer it "
                          f"(dp = ranks / (pp × cp × tp))")
    # Here, not among the config's own problems: the planner loads a config with grad_accum=1 and
    # then tries the accumulations that give this micro-batch.
    problem = _micro_batch_problem(cfg)
    if problem:
        raise ConfigError(problem)

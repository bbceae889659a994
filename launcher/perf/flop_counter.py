"""FLOPs counted while a real step runs, per component, to check the analytic accounting of
`moetron.launcher.perf.flops` against what executed.

`torch.utils.flop_counter` knows mm/bmm/addmm but not CPU attention
(`_scaled_dot_product_flash_attention_for_cpu`), `torch._grouped_mm`, or our own ops
(`moetron::grouped_mm`, `moetron::flash_attention_*`), so those get formulas here. Attention
backward is counted as twice its forward (the gradient matmuls), not the 2.5× torch counts when
a flash kernel recomputes the scores: recomputation is hardware work, not model work, and the
analytic side counts model FLOPs.

Under tensor parallelism the counter sees what each rank runs: a DTensor op is let through first
(the mode answers NotImplemented, as `CommDebugMode` does), and the local matmuls it turns into
are counted, so a column-parallel projection counts its 1/tp share instead of the global matmul;
the ops DTensor runs on fake tensors to learn output shapes do no work and are not counted.

Attribution: module hooks keep a stack of the component being run forward; when a component's
module returns, the autograd nodes it created are tagged with its name, so the backward ops
(which run outside any module) are charged to the component whose forward created them. Inside
a multi-token-prediction module everything (its block, and the shared head it calls) is "mtp".
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from moetron.launcher.perf.flops import ATTENTION_COMPONENTS, COMPONENTS
from moetron.model.attention import Attention
from moetron.model.layers import FeedForward
from moetron.model.mla import MLAttention
from moetron.model.moe import MoELayer
from moetron.model.mtp import MTPModule, mtp_cross_entropy
from moetron.model.transformer import Block

_TAG = "moetron_component"
OTHER = "other"


def _attention_fwd(q_BHSDh, k_BGLDh, v_BGLDv=None, *_args, **_kwargs) -> int:
    """QKᵀ and PV over every (query, key) pair of every query head (v may be narrower: MLA)."""
    B, H, S, Dh = q_BHSDh.shape
    Dv = Dh if not isinstance(v_BGLDv, torch.Tensor) else v_BGLDv.shape[-1]
    return 2 * B * H * S * k_BGLDh.shape[-2] * (Dh + Dv)


def _attention_bwd(_grad, q_BHSDh, k_BGLDh, v_BGLDv=None, *_args, **_kwargs) -> int:
    return 2 * _attention_fwd(q_BHSDh, k_BGLDh, v_BGLDv)


def _grouped_mm(x_TK, w_EKN, offsets_E, *_args, **_kwargs) -> int:
    # NOTE: host-device sync to read how many rows belong to a group; only while counting.
    rows = int(offsets_E[-1]) if offsets_E.numel() else 0
    return 2 * rows * x_TK.shape[-1] * w_EKN.shape[-1]


def _grouped_mm_wgrad(x_TK, dy_TN, offsets_E, *_args, **_kwargs) -> int:
    rows = int(offsets_E[-1]) if offsets_E.numel() else 0
    return 2 * rows * x_TK.shape[-1] * dy_TN.shape[-1]


def _torch_grouped_mm(a, b, *_args, **_kwargs) -> int:
    # Forward (T×K)·(E×K×N) and weight gradient (K×T)·(T×N) alike: each of a's rows meets one
    # K×N (or T×N) matrix once.
    return 2 * a.shape[0] * a.shape[1] * b.shape[-1]


def _registry_formula(packet) -> Callable:
    formula = flop_registry[packet]
    return lambda *args, **kwargs: formula(*args, **kwargs, out_val=None)


def flop_formulas() -> dict[str, Callable[..., int]]:
    """Op name (as `str(func.overloadpacket)`) → FLOPs from its arguments."""
    formulas: dict[str, Callable[..., int]] = {str(p): _registry_formula(p) for p in flop_registry}
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
        formulas[f"aten.{name}"] = _attention_fwd
        formulas[f"aten.{name}_backward"] = _attention_bwd
    formulas["aten._grouped_mm"] = _torch_grouped_mm
    # FP8 experts (train.precision fp8): torchao's grouped GEMM runs these, with the operands' shapes of _grouped_mm.
    formulas["aten._scaled_grouped_mm"] = _torch_grouped_mm
    formulas["moetron.grouped_mm"] = _grouped_mm
    formulas["moetron.grouped_mm_wgrad"] = _grouped_mm_wgrad
    formulas["moetron.flash_attention_fwd"] = _attention_fwd
    formulas["moetron.flash_attention_bwd"] = lambda do, q, k, v, *rest: _attention_bwd(do, q, k, v)
    return formulas


def component_modules(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, component) for every module that owns a component, innermost first within a
    layer so that a component's tag never overwrites a nested one's."""
    out: list[tuple[nn.Module, str]] = []
    for module in model.modules():
        if isinstance(module, MTPModule):
            out.append((module, "mtp"))
        elif isinstance(module, (Attention, MLAttention)):
            names = ("wq", "wk", "wv", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")
            out += [(getattr(module, n), "attention_projections") for n in names if hasattr(module, n)]
            out.append((module, "attention_scores"))
        elif isinstance(module, Block) and isinstance(module.ffn, FeedForward):
            out.append((module.ffn, "dense_ffn"))
        elif isinstance(module, MoELayer):
            out += [(module.router, "router"), (module.experts, "experts")]
            if module.shared is not None:
                out.append((module.shared, "shared_expert"))
    head = getattr(model, "head", None)
    if isinstance(head, nn.Module):
        out.append((head, "lm_head"))
    return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def _tag_graph(outputs: Any, inputs: Any, component: str) -> None:
    """Tag every untagged autograd node between the module's outputs and its inputs."""
    stop = {t.grad_fn for t in _tensors(inputs) if t.grad_fn is not None}
    todo = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    seen: set = set()
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        node.metadata.setdefault(_TAG, component)
        todo.extend(next_node for next_node, _ in node.next_functions)


class ComponentFlopCounter(TorchDispatchMode):
    """Counts matmul-like FLOPs of everything run inside it, forward and backward, by component.

        with ComponentFlopCounter(model) as counter:
            loss = ...; loss.backward()
        counter.counts  # {"attention_projections": ..., ..., "other": ...}
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.formulas = flop_formulas()
        self.counts: dict[str, int] = defaultdict(int)
        self.uncounted: set[str] = set()
        self._stack: list[str] = []
        self._handles: list = []

    def __enter__(self):
        for module, component in component_modules(self.model):
            self._handles.append(module.register_forward_pre_hook(self._enter_component(component)))
            self._handles.append(module.register_forward_hook(self._leave_component(component), with_kwargs=True))
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return super().__exit__(*exc)

    def _enter_component(self, component: str):
        def hook(module, args):
            self._stack.append("mtp" if "mtp" in self._stack else component)
        return hook

    def _leave_component(self, component: str):
        def hook(module, args, kwargs, output):
            _tag_graph(output, (args, kwargs), self._stack.pop())
        return hook

    def _component(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:
            return node.metadata.get(_TAG, OTHER)
        return self._stack[-1] if self._stack else OTHER

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local ops (counted on the way back in) instead
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(issubclass(t, FakeTensor) for t in types):
            return out  # DTensor's sharding propagation learning a shape: no real work
        formula = self.formulas.get(str(func.overloadpacket))
        if formula is not None:
            self.counts[self._component()] += int(formula(*args, **kwargs))
        elif any(word in str(func) for word in ("mm", "attention", "matmul", "conv")):
            # A matmul-like op nobody wrote a formula for: reported, so a new kernel is not silently free.
            self.uncounted.add(str(func.overloadpacket))
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_component(self) -> dict[str, int]:
        """Counts in COMPONENTS order, then "other" (matmuls outside every component)."""
        return {name: self.counts.get(name, 0) for name in (*COMPONENTS, OTHER)}


@dataclasses.dataclass
class ComponentCheck:
    component: str
    analytic: float
    counted: float

    @property
    def ratio(self) -> float:
        if self.analytic == 0:
            return 1.0 if self.counted == 0 else math.inf
        return self.counted / self.analytic

    @property
    def in_attention(self) -> bool:
        return self.component in ATTENTION_COMPONENTS


def compare(analytic_per_token: dict[str, float], counted: dict[str, int], tokens: int) -> list[ComponentCheck]:
    """Per component (and "other" and "total"), analytic FLOPs for `tokens` tokens vs counted."""
    rows = [ComponentCheck(name, analytic_per_token.get(name, 0) * tokens, counted.get(name, 0))
            for name in (*COMPONENTS, OTHER)]
    rows.append(ComponentCheck("total", sum(r.analytic for r in rows), sum(r.counted for r in rows)))
    return rows


def worst_mismatch(rows: list[ComponentCheck], *, outside_attention: bool = True) -> float:
    """Largest |counted/analytic - 1| over the components (and their total) outside attention."""
    keep = [r for r in rows if r.component != "total" and not (outside_attention and r.in_attention)]
    outside = ComponentCheck("outside", sum(r.analytic for r in keep), sum(r.counted for r in keep))
    return max(abs(r.ratio - 1.0) for r in [*keep, outside])


@dataclasses.dataclass
class FlopMeasurement:
    """FLOPs counted over `steps` real training steps of `tokens` tokens in all."""

    counted: dict[str, int]
    tokens: int
    kept_fraction: float  # routed assignments computed / assigned (1.0 when dropless or dense)
    uncounted_ops: list[str]

    def rows(self, analytic_per_token: dict[str, float]) -> list[ComponentCheck]:
        """Analytic vs counted; the experts' analytic share is scaled by the routes that were
        kept, so capacity drops do not read as an accounting error."""
        scaled = dict(analytic_per_token)
        scaled["experts"] = scaled.get("experts", 0) * self.kept_fraction
        return compare(scaled, self.counted, self.tokens)


def single_process_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens_BS1: torch.Tensor,
                        autocast: Callable) -> dict:
    """One plain training step (next-token cross entropy + MoE aux losses, backward, optimizer
    step) on one process → the per-layer MoE stats, for `measure_flops`. With multi-token
    prediction its loss joins, weighted as the trainer weighs it."""
    with autocast():
        out = model(tokens_BS1[:, :-1])
        ce = _cross_entropy(out.logits_BSV, tokens_BS1[:, 1:])
        mtp = mtp_cross_entropy(out.mtp_logits, tokens_BS1[:, 1:], _cross_entropy)
    (ce + out.aux_loss + model.cfg.mtp_loss_weight * mtp).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out.moe


def _cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())


def measure_flops(model: nn.Module, step: Callable[[], dict], steps: int, tokens_per_step: int) -> FlopMeasurement:
    """Count FLOPs of `steps` calls of `step()` (one real training step, which returns the
    per-layer MoE stats of its last micro-batch)."""
    counted: dict[str, int] = defaultdict(int)
    kept: list[float] = []
    uncounted: set[str] = set()
    for _ in range(steps):
        with ComponentFlopCounter(model) as counter:
            moe = step()
        for name, value in counter.counts.items():
            counted[name] += value
        uncounted |= counter.uncounted
        # NOTE: host-device sync to read the dropped fractions.
        kept += [1.0 - float(s.dropped_fraction) for s in moe.values()]
    return FlopMeasurement(dict(counted), steps * tokens_per_step, sum(kept) / len(kept) if kept else 1.0,
                           sorted(uncounted))

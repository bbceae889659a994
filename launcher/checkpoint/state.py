"""What a checkpoint holds and how it maps onto the live, possibly sharded, objects of one rank.

Keys are layout-independent: parameter names (as `get_state_dict` gives them, FSDP/TP/PP
wrappers removed) and, for the optimizer, `state.<param name>.<field>` and
`param_groups.<param name>.<hyper-parameter>` (`flatten_optimizer_state_dict`), so a pipeline
stage, a TP shard or a DP shard each write and read only their own entries. DTensors (TP, FSDP)
carry their global shape and offsets already. Routed experts under expert parallelism are plain
tensors holding rows [i·El, (i+1)·El) of the full (E, ·, ·) weight, and under expert-tensor
parallelism (etp = tp) also F range [k·F/tp, (k+1)·F/tp) on tp rank k; `global_views` presents them
to DCP as DTensors over the (ep, tp) grid, so their key names the full tensor on every layout
instead of E/ep × tp different tensors colliding under one name:

  expert weight piece        placements of the view (grid dims)
  ep only                    Shard(0) over ep
  ep and FSDP/HSDP           Shard(0) over ep, then FSDP's Shard(0) over its 1-D (2-D) mesh
  etp = tp (ep any)          … then Shard(2) (w_gate_EDF, w_up_EDF) or Shard(1) (w_down_EFD) over tp
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from moetron.parallel.expert_shards import ExpertShards


@dataclass
class LiveState:
    """This rank's state dicts, one pair per model part (pipeline stage) it holds."""

    parts: list[tuple[nn.Module, torch.optim.Optimizer | None]]
    model: list[dict[str, Any]]
    optim: list[dict[str, Any]] | None

    def merged(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": {k: v for sd in self.model for k, v in sd.items()}}
        if self.optim is not None:
            out["optim"] = {k: v for sd in self.optim for k, v in sd.items()}
        return out


def live_state(model: nn.Module | Sequence[nn.Module],
               optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
               options: StateDictOptions) -> LiveState:
    """State dicts of every part; with several parts (interleaved pipeline stages) each needs its
    own optimizer, as its flattened keys then stay disjoint."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if optimizer is None:
        return LiveState([(m, None) for m in models], [get_model_state_dict(m, options=options) for m in models], None)
    optims = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if len(optims) != len(models):
        raise ValueError(f"{len(models)} model parts but {len(optims)} optimizers; give one optimizer per part")
    pairs = [get_state_dict(m, o, options=options) for m, o in zip(models, optims)]
    return LiveState(list(zip(models, optims)), [p[0] for p in pairs], [p[1] for p in pairs])


def restore_live_state(live: LiveState, options: StateDictOptions) -> None:
    """Push the (now loaded) state dicts back into the modules and optimizers."""
    for i, (m, o) in enumerate(live.parts):
        if o is None:
            set_model_state_dict(m, live.model[i], options=options)
        else:
            set_state_dict(m, o, model_state_dict=live.model[i], optim_state_dict=live.optim[i], options=options)


def global_views(model, optimizer, expert_shards: ExpertShards | None, options: StateDictOptions) -> dict[str, Any]:
    """{"model": …, "optim": …} ready for dcp.save: the live tensors, expert blocks as DTensors."""
    return views_of(live_state(model, optimizer, options).merged(), expert_shards)


def views_of(state: dict[str, Any], expert_shards: ExpertShards | None) -> dict[str, Any]:
    """`state` with expert-sharded tensors (and their optimizer moments) viewed as global DTensors;
    the views share storage, so DCP loads into them in place."""
    if expert_shards is None:
        return state
    names = expert_shards.names
    out = {"model": {k: expert_shards.view(k, v) if k in names else v for k, v in state["model"].items()}}
    if "optim" in state:
        out["optim"] = {k: expert_shards.view(_param_of(k), v) if _is_moment_of(k, v, names) else v
                        for k, v in state["optim"].items()}
    return out


def _param_of(key: str) -> str:
    """"state.<param name>.<field>" → the parameter name."""
    return key[len("state."):].rsplit(".", 1)[0]


def _is_moment_of(key: str, value: Any, names: frozenset[str]) -> bool:
    """An optimizer tensor shaped like an expert-sharded parameter (exp_avg, not the scalar step)."""
    if not key.startswith("state.") or not isinstance(value, torch.Tensor) or value.ndim == 0:
        return False
    return _param_of(key) in names


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, as plain JSON-able data."""
    state = {
        "torch": torch.get_rng_state().tolist(),
        "python": _to_lists(random.getstate()),
        "numpy": _to_lists(np.random.get_state(legacy=False)),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _to_lists(obj: Any) -> Any:
    if isinstance(obj, (tuple, list)):
        return [_to_lists(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_lists(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def dcp_call(fn, *args, **kwargs):
    """Call a DCP function without its warning about running without a process group: one
    process is a supported layout here, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*no_dist.*")
        return fn(*args, **kwargs)

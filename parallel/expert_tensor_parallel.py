"""Expert-tensor parallelism (Megatron-Core's ETP): each routed expert's matrices split over mesh["tp"].

Legend: E experts in the model, El = E / ep experts held by this ep rank, D model dim, F expert hidden
dim, A rows this rank's experts compute (its own routes, or those received by all-to-all), tp ranks.

With parallel.etp = 1 the routed experts are whole on every tp rank (replicated, as the router is),
so each tp rank repeats the same expert work. With etp = tp they are split like a Megatron FFN:

  w_gate_EDF, w_up_EDF   columns, dim 2 (F): tp rank k holds F range [k·F/tp, (k+1)·F/tp)
  w_down_EFD             rows, dim 1 (F): the same F range
  b_gate_EF, b_up_EF     (expert biases, GPT-OSS) dim 1 (F): the same F range
  b_down_ED              replicated: every tp rank adds it to its partial sum, so the reduction
                         takes tp − 1 copies back off (their values detached: the gradient reaches
                         the bias through the one kept, whole on every tp rank)
  router, shared expert  replicated (as under plain TP)

on top of expert parallelism's split of dim 0 (E) over "ep", so a rank holds (El, D, F/tp) and
(El, F/tp, D) plain tensors under the full weights' parameter names. The activation is elementwise
along F, so each tp rank runs the whole expert computation on its F slice and gets a partial sum
of y_AD. Around the experts module (hooks; the model code stays single-device):

  x_AD in    identity forward; all-reduce of its gradient over tp in backward (each F slice
             contributes a partial dx)
  y_AD out   all-reduce over tp in forward (the partial sums); identity backward

Every tp rank routes the same tokens and runs the same dispatch (the MoE input is whole under TP,
and gathered over S by `_SequenceGatheredMoE` under sequence parallel), so the A rows line up across
the tp ranks. The sum is taken before the weighted combine (and before expert parallelism's
return all-to-all), so the combine weights, hence the router, see the whole y_AD and get exact,
tp-identical gradients.
Cost: two all-reduces of A × D per MoE layer and micro-batch (comm_volume.py), in the experts'
dtype (bf16 under autocast, as in Megatron), instead of tp-fold repeated expert matmuls.

Everything that knows expert shards knows the F split through the returned {name: dim} map:
initialization (each rank its piece of the single-process init), the global gradient norm
(the tp pieces are distinct, not copies), and checkpoints (`expert_shards.ExpertShards`: a
(ep, tp) grid, Shard(0) over ep and Shard(dim) over tp, so a key names the full (E, ·, ·) tensor
on every layout). Expert gradients are complete on each rank (every row passed through its
slice) and are reduced over "edp_cp" by the data-parallel wrapper as without ETP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moetron.model.experts import GroupedExperts, expert_rows, row_experts
from moetron.parallel.config import ParallelConfig
from moetron.parallel.expert_parallel import moe_layers
from moetron.parallel.mesh import ParallelMesh

# The F dim of each routed-expert weight: the one split over tp.
F_DIMS = {"w_gate_EDF": 2, "w_up_EDF": 2, "w_down_EFD": 1, "b_gate_EF": 1, "b_up_EF": 1}


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over the tp group in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # never reduce autograd's buffer in place
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce (sum) over the tp group forward; identity backward (the output's gradient is
    the same on every tp rank, and each partial sum's gradient is that gradient)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def split_expert_columns(experts: GroupedExperts, tp: int, tp_rank: int) -> dict[str, int]:
    """Replace each routed-expert weight by its F slice for `tp_rank` (on the same device: meta
    before materialization), keeping parameter names. Returns {weight name: split dim}."""
    split: dict[str, int] = {}
    for name, dim in F_DIMS.items():
        w = getattr(experts, name)
        if w is None:
            continue
        if w.shape[dim] % tp:
            raise ValueError(f"expert hidden size {w.shape[dim]} is not divisible by tp ({tp}) for etp = tp")
        local = w.detach().chunk(tp, dim=dim)[tp_rank].clone()
        setattr(experts, name, nn.Parameter(local, requires_grad=w.requires_grad))
        split[name] = dim
    return split


def _register_tp_regions(experts: nn.Module, group: dist.ProcessGroup) -> None:
    """Enter the experts through a copy-to-tp region and leave them through a reduce-from-tp one."""
    tp = dist.get_world_size(group)

    def enter(module, args):
        x_AD, *rest = args
        return (_CopyToTensorParallel.apply(x_AD, group), *rest)

    def leave(module, args, y_AD):
        y_AD = _ReduceFromTensorParallel.apply(y_AD, group)
        if getattr(module, "b_down_ED", None) is None:
            return y_AD
        b_AD = expert_rows(module.b_down_ED.detach().to(y_AD.dtype), row_experts(args[1], y_AD.shape[0]))
        return y_AD - (tp - 1) * b_AD

    experts.register_forward_pre_hook(enter)
    experts.register_forward_hook(leave)


def apply_expert_tensor_parallel(model: nn.Module, mesh: ParallelMesh, cfg: ParallelConfig) -> dict[str, int]:
    """Split every MoELayer's routed experts over mesh["tp"] by F (etp = tp > 1); run after expert
    parallelism. Returns {parameter name: the dim split over tp} (empty when etp = 1)."""
    if cfg.etp == 1 or cfg.tp == 1:
        return {}
    tp, tp_rank, group = mesh.size("tp"), mesh.rank("tp"), mesh.group("tp")
    split: dict[str, int] = {}
    for name, moe in moe_layers(model):
        dims = split_expert_columns(moe.experts, tp, tp_rank)
        split |= {f"{name}.experts.{w}": d for w, d in dims.items()}
        _register_tp_regions(moe.experts, group)
    return split

"""Gradient clipping is torch's: `ParallelModel.clip_grad_norm_` (parallel/data_parallel.py) returns the
global norm before clipping and scales every gradient by max_norm / (norm + 1e-6) only where that is
below 1, as `torch.nn.utils.clip_grad_norm_` does. (The global norm over sharded layouts is checked
against one process in every case of tests/parallel/test_parity.py.)"""

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moetron.launcher.config import load_config
from moetron.launcher.train.trainer import build_parallel_model

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=32", "model.moe.num_experts=4", "train.seq_len=16", "train.batch_size=2",
         "train.precision=fp32"]


def torch_clipped(grads: dict[str, torch.Tensor], max_norm: float) -> tuple[float, dict[str, torch.Tensor]]:
    """torch.nn.utils.clip_grad_norm_ on copies of `grads` → (norm, clipped gradients)."""
    params = {}
    for name, g in grads.items():
        params[name] = torch.zeros_like(g, requires_grad=True)
        params[name].grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
    return float(norm), {name: p.grad for name, p in params.items()}


@pytest.mark.forked
def test_clipping_scales_gradients_down_only_as_torch_does():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        cfg = load_config(TINY, SMALL, world_size=1)
        torch.manual_seed(0)
        pm = build_parallel_model(cfg, torch.device("cpu"))
        batch_BS1 = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        pm.forward_backward(pm.local_batch(batch_BS1), grad_accum=1, autocast=contextlib.nullcontext)
        grads = {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}
        norm = float(torch.stack([g.double().norm() for g in grads.values()]).norm())
        for max_norm in (norm / 3, 2 * norm):  # clipped to a third; left alone (never scaled up)
            for n, p in pm.named_parameters():
                if n in grads:
                    p.grad.copy_(grads[n])
            got_norm = float(pm.clip_grad_norm_(max_norm))
            want_norm, want = torch_clipped(grads, max_norm)
            assert got_norm == pytest.approx(want_norm, rel=1e-6)
            for n, p in pm.named_parameters():
                if n in grads:
                    assert torch.allclose(p.grad, want[n], rtol=1e-6, atol=0), (max_norm / norm, n)
            clipped = float(torch.stack([p.grad.double().norm() for n, p in pm.named_parameters() if n in grads]).norm())
            assert clipped == pytest.approx(min(max_norm, norm), rel=1e-5)
    finally:
        dist.destroy_process_group()

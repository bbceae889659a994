"""The optimizer's two parameter groups and the learning-rate schedule, each against something
independent of launcher/train/optim.py: the module tree (which tensors are weight matrices) and
torch's own schedulers (LinearLR for the warmup, CosineAnnealingLR or LinearLR for the decay)."""

from pathlib import Path

import pytest
import torch
from torch import nn

from moetron.launcher.config import TrainConfig, load_config
from moetron.launcher.train.optim import build_optimizer, lr_at
from moetron.model.experts import GroupedExperts
from moetron.model.transformer import build_model

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.d_ff=128", "model.moe.d_expert=64"]
MODELS = {
    "t5 bias, tied head": ["model.position=t5", "model.n_kv_heads=2", "model.tie_embeddings=true"],
    "learned positions, MTP": ["model.position=learned", "model.n_kv_heads=2", "model.mtp_depth=1"],
    "gpt-oss: biases everywhere, sinks": ["model.n_kv_heads=2", "model.attention_bias=all", "model.attention_sinks=true",
                                          "model.moe.router_bias=true", "model.moe.expert_bias=true"],
    "MLA, qk-norm, shared expert": ["model.n_kv_heads=null", "model.mla.kv_lora_rank=16", "model.mla.q_lora_rank=16",
                                    "model.moe.shared_expert_d_ff=64"],
}


def weight_matrices(model: nn.Module) -> set[int]:
    """ids of the parameters that multiply activations as matrices: nn.Linear weights and the
    experts' stacked E×… weights. Everything else (norm gains, biases, embeddings, sinks) is not,
    and a head tied to the embedding is the embedding."""
    out = set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            out.add(id(module.weight))
        if isinstance(module, GroupedExperts):
            out |= {id(p) for p in module.parameters(recurse=False) if p.ndim == 3}
    return out - {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


@pytest.mark.parametrize("overrides", MODELS.values(), ids=MODELS.keys())
def test_weight_decay_applies_to_weight_matrices_only(overrides):
    cfg = load_config(TINY, [*SMALL, *overrides, "train.weight_decay=0.05"])
    model = build_model(cfg.model)
    decay, no_decay = build_optimizer(model, cfg.train).param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    matrices = weight_matrices(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in decay["params"]} == {names[i] for i in matrices}
    assert {id(p) for p in decay["params"] + no_decay["params"]} == set(names)  # every parameter, once


def torch_lrs(cfg: TrainConfig, length: int, n: int) -> list[float]:
    """The first n learning rates of linear warmup over cfg.warmup_steps, then decay over steps
    warmup..length, then flat, stepped by torch's schedulers on a one-parameter SGD."""
    def stepped(scheduler_for, count: int) -> list[float]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        scheduler = scheduler_for(optimizer)
        lrs = []
        for _ in range(count):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return lrs

    warmup = cfg.warmup_steps
    out = stepped(lambda o: torch.optim.lr_scheduler.LinearLR(o, 1 / warmup, 1.0, max(warmup - 1, 1)), warmup) if warmup else []
    span = max(length - warmup, 0)
    if cfg.lr_schedule == "cosine":
        out += stepped(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, span, cfg.min_lr), span)
    elif cfg.lr_schedule == "linear":
        out += stepped(lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, cfg.min_lr / cfg.lr, span), span)
    flat = cfg.lr if cfg.lr_schedule == "constant" else cfg.min_lr
    return (out + [flat] * n)[:n]


@pytest.mark.parametrize("schedule,warmup,steps,decay_steps", [
    ("cosine", 3, 20, None), ("cosine", 0, 10, None), ("cosine", 1, 8, 15), ("cosine", 4, 5, None),
    ("linear", 5, 12, None), ("linear", 10, 6, None), ("constant", 4, 10, None), ("constant", 0, 3, None),
])
def test_schedule_matches_torchs_schedulers(schedule, warmup, steps, decay_steps):
    cfg = TrainConfig(lr=3e-3, min_lr=2e-4, warmup_steps=warmup, lr_schedule=schedule, steps=steps,
                      lr_decay_steps=decay_steps)
    length = decay_steps or steps
    n = max(length, warmup) + 5  # past the schedule's end: flat at min_lr (lr when constant)
    assert [lr_at(step, cfg) for step in range(n)] == pytest.approx(torch_lrs(cfg, length, n), rel=1e-9, abs=0)


def test_a_resumed_run_keeps_its_schedule_length():
    """lr_at's decay_steps (a resumed run's first length) overrides train.steps."""
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, steps=30)
    assert [lr_at(s, cfg, decay_steps=10) for s in range(30)] == pytest.approx(torch_lrs(cfg, 10, 30), rel=1e-9)

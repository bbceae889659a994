"""train.precision fp8 (parallel/float8.py): which matmuls go to FP8, and that the swapped model
trains like the bf16 one within FP8's precision. The FP8 GEMMs need a GPU of compute capability
8.9+; here torchao's emulation casts to float8_e4m3fn and back and multiplies in high precision,
which is what decides the numbers (the GPU's FP8 tensor cores then only change the accumulation)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moetron.launcher.config import ConfigError, load_config
from moetron.model.experts import GroupedExperts
from moetron.model.transformer import build_model

pytest.importorskip("torchao.float8")
from moetron.parallel.float8 import apply_float8

TINY = "configs/tiny.yaml"
# Dense FFN blocks between the MoE ones, a shared expert with its 1-wide gate (Qwen2-MoE), and
# an expert width that is no multiple of 16 in the second config below.
DENSE_AND_SHARED = ["model.moe.every=2", "model.moe.shared_expert_d_ff=64", "model.moe.shared_expert_gate=true"]


def linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_every_linear_but_the_router_gate_the_head_and_odd_widths_goes_to_fp8():
    cfg = load_config(TINY, DENSE_AND_SHARED)
    model = build_model(cfg.model, device="meta")
    before = linears(model)
    # Worked out from the names: the router's gate (8 wide), the shared expert's gate (1 wide) and
    # the head stay; attention's four projections, the dense FFNs' and the shared experts' go.
    stay = {n for n in before if n.endswith((".router.gate", ".shared_gate")) or n == "head"}
    moe_layers = cfg.model.n_layers // 2  # every second layer
    assert len(stay) == 2 * moe_layers + 1
    swapped = apply_float8(model)
    assert set(swapped) == set(before) - stay
    from torchao.float8.float8_linear import Float8Linear

    after = linears(model)
    assert {n for n, m in after.items() if isinstance(m, Float8Linear)} == set(swapped)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(e.fp8 and e.row_multiple == 16 for e in experts)


def test_experts_whose_width_is_no_multiple_of_16_stay_in_bf16():
    model = build_model(load_config(TINY, ["model.moe.d_expert=72"]).model, device="meta")
    apply_float8(model)
    assert not any(m.fp8 for m in model.modules() if isinstance(m, GroupedExperts))


def test_an_fp8_model_trains_like_the_bf16_one_within_fp8_precision():
    """Same weights and tokens, bf16 autocast both: three SGD steps' losses within 1% (e4m3 keeps
    3 mantissa bits, ~6% per element, averaged over the dot products) yet not equal, which they would
    be if nothing had been cast; checkpoint keys unchanged."""
    cfg = load_config(TINY, ["model.moe.every=2"])
    torch.manual_seed(0)
    bf16 = build_model(cfg.model)
    fp8 = build_model(cfg.model)
    fp8.load_state_dict(bf16.state_dict())
    apply_float8(fp8, emulate=True)
    assert list(fp8.state_dict()) == list(bf16.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (bf16, fp8)]
    for _ in range(3):
        ids_BS1 = torch.randint(0, cfg.model.vocab_size, (2, 65))
        losses = []
        for model, opt in zip((bf16, fp8), opts):
            with torch.autocast("cpu", torch.bfloat16):
                out = model(ids_BS1[:, :-1])
                loss = F.cross_entropy(out.logits_BSV.float().flatten(0, 1), ids_BS1[:, 1:].flatten()) + out.aux_loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=0.01) and losses[1] != losses[0]


def test_fp8_with_tensor_parallelism_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^parallel.tp = 2: must be 1 with train.precision=fp8 .*use bf16 with tp"):
        load_config(TINY, ["train.precision=fp8", "parallel.tp=2"])

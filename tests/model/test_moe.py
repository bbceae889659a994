"""The MoE layer against a deliberately dumb per-token reference, finite differences
(torch.autograd.gradcheck in float64) and its own per-expert loop path.

Legend: B batch, S sequence, T = B·S tokens, D model dim, F expert hidden dim, E experts, K top-k.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.layers import FeedForward
from moetron.model.moe import MoELayer
from moetron.model.transformer import build_model


def _config(*, top_k=2, capacity_factor=None, d_model=8, d_expert=6, num_experts=4, activation="swiglu",
            **moe) -> ModelConfig:
    weighting = "softmax" if top_k == 1 else "renormalize"
    return ModelConfig(d_model=d_model, n_heads=2, activation=activation, moe=MoEConfig(
        num_experts=num_experts, top_k=top_k, d_expert=d_expert, capacity_factor=capacity_factor,
        weighting=weighting, aux_loss_coef=0.01, z_loss_coef=1e-3, **moe))


def _layer(cfg: ModelConfig, seed: int, dtype=torch.float32) -> MoELayer:
    """A layer with weights large enough that routing is decisive and outputs are O(1)."""
    torch.manual_seed(seed)
    layer = MoELayer(cfg).to(dtype)
    layer.init_weights(std=0.5, out_std=0.5)
    return layer


def _reference_forward(layer: MoELayer, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Loop over tokens and over their chosen experts; capacity by explicit queue; weighted sum.
    → (y_TD, kept_TK, dropped fraction)."""
    cfg = layer.router.cfg
    T = x_TD.shape[0]
    w_router_ED = layer.router.gate.weight
    ex = layer.experts
    chosen, probs = [], []
    for t in range(T):
        p_E = torch.softmax(x_TD[t] @ w_router_ED.T, dim=-1)
        order = sorted(range(cfg.num_experts), key=lambda e: -float(p_E[e].detach()))[: cfg.top_k]
        chosen.append(order)
        probs.append(p_E)
    capacity = (math.inf if cfg.capacity_factor is None else
                max(math.ceil(cfg.top_k * T / cfg.num_experts * cfg.capacity_factor), cfg.min_capacity))
    taken = [0] * cfg.num_experts
    kept_TK = torch.zeros(T, cfg.top_k, dtype=torch.bool)
    for k in range(cfg.top_k):
        for t in range(T):
            e = chosen[t][k]
            kept_TK[t, k] = taken[e] < capacity
            taken[e] += 1
    rows = []
    for t in range(T):
        weights = [probs[t][e] if kept_TK[t, k] else probs[t][e] * 0 for k, e in enumerate(chosen[t])]
        if cfg.weighting == "renormalize":
            total = sum(weights)
            weights = [w / total if total > 0 else w for w in weights]
        y_D = x_TD.new_zeros(x_TD.shape[1])
        for k, e in enumerate(chosen[t]):
            if kept_TK[t, k]:
                h_F = F.silu(x_TD[t] @ ex.w_gate_EDF[e]) * (x_TD[t] @ ex.w_up_EDF[e])
                y_D = y_D + weights[k] * (h_F @ ex.w_down_EFD[e])
        if layer.shared is not None:
            y_D = y_D + layer.shared(x_TD[t])
        rows.append(y_D)
    dropped = 1.0 - kept_TK.float().mean().item()
    return torch.stack(rows), kept_TK, dropped


@pytest.mark.parametrize("top_k,capacity_factor", [(1, None), (1, 0.75), (2, None), (2, 0.5), (3, 1.0)])
@pytest.mark.parametrize("shared", [0, 5])
def test_layer_equals_per_token_reference(top_k, capacity_factor, shared):
    """Output, kept routes, dropped fraction and input gradient against the per-token loop, in float64."""
    cfg = _config(top_k=top_k, capacity_factor=capacity_factor, shared_expert_d_ff=shared)
    layer = _layer(cfg, seed=top_k, dtype=torch.float64)
    x_BSD = torch.randn(2, 12, cfg.d_model, dtype=torch.float64, requires_grad=True)
    y_BSD, stats = layer(x_BSD)
    x_TD = x_BSD.detach().reshape(-1, cfg.d_model).requires_grad_()
    y_ref_TD, kept_TK, dropped = _reference_forward(layer, x_TD)
    torch.testing.assert_close(y_BSD.reshape(-1, cfg.d_model), y_ref_TD, rtol=1e-10, atol=1e-12)
    assert math.isclose(float(stats.dropped_fraction), dropped, abs_tol=1e-6)
    if capacity_factor is not None and capacity_factor < 1:
        assert dropped > 0, "the case meant to drop routes drops none"
    dy_TD = torch.randn_like(y_ref_TD)
    (grad,) = torch.autograd.grad(y_BSD, x_BSD, dy_TD.view_as(y_BSD))
    (grad_ref,) = torch.autograd.grad(y_ref_TD, x_TD, dy_TD)
    torch.testing.assert_close(grad.reshape(-1, cfg.d_model), grad_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("top_k,capacity_factor", [(1, None), (1, 0.75), (2, None), (2, 0.5)])
@pytest.mark.parametrize("experts_impl", ["grouped", "loop"])
def test_gradcheck_float64(top_k, capacity_factor, experts_impl):
    """Finite differences in float64 through router, experts, combine and both aux losses.
    (In float64 the grouped path runs its per-group loop; routing decisions are fixed by the seed
    far from ties, so the perturbations do not flip them.)"""
    cfg = _config(top_k=top_k, capacity_factor=capacity_factor, experts_impl=experts_impl, d_model=4,
                  d_expert=3, shared_expert_d_ff=2)
    layer = _layer(cfg, seed=11, dtype=torch.float64)
    names = [n for n, _ in layer.named_parameters()]
    x_BSD = torch.randn(1, 8, cfg.d_model, dtype=torch.float64, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    if capacity_factor is not None:
        assert layer(x_BSD)[1].dropped_fraction > 0, "the case meant to drop routes drops none"

    def f(x_BSD, *params):
        y_BSD, stats = functional_call(layer, dict(zip(names, params)), (x_BSD,))
        return y_BSD, stats.aux_loss, stats.z_loss

    assert torch.autograd.gradcheck(f, (x_BSD, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("top_k,capacity_factor", [(1, 1.0), (2, None), (2, 0.75)])
def test_grouped_and_loop_experts_agree(top_k, capacity_factor):
    """experts_impl="grouped" (one grouped GEMM per projection) against "loop" (one matmul per
    expert): output and the gradient of every parameter and of the input, fp32, ragged groups."""
    outs = {}
    for impl in ("grouped", "loop"):
        cfg = _config(top_k=top_k, capacity_factor=capacity_factor, experts_impl=impl, d_model=32, d_expert=48,
                      num_experts=8, shared_expert_d_ff=16)
        layer = _layer(cfg, seed=3)
        layer.init_weights(std=0.2, out_std=0.1)
        x_BSD = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
        y_BSD, stats = layer(x_BSD)
        dy_BSD = torch.randn(y_BSD.shape, generator=torch.Generator().manual_seed(5))
        (y_BSD * dy_BSD).sum().add(stats.aux_loss + stats.z_loss).backward()
        outs[impl] = [y_BSD.detach(), x_BSD.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(outs["grouped"], outs["loop"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,capacity_factor", [(torch.float32, None), (torch.float32, 0.75), (torch.bfloat16, None)])
def test_padded_expert_groups_change_nothing(dtype, capacity_factor):
    """Groups padded to a multiple of 16 rows (what CPU bf16 multiplies get) against exact groups:
    the same output and the same gradient of the input and of every parameter (fp32 to 1e-6;
    bf16 within its rounding), with dropped routes and an expert left empty."""
    outs, layouts = {}, {}
    for rows in (1, 16):
        cfg = _config(top_k=2, capacity_factor=capacity_factor, d_model=32, d_expert=48, num_experts=8,
                      shared_expert_d_ff=16)
        layer = _layer(cfg, seed=3, dtype=dtype)
        layer.init_weights(std=0.2, out_std=0.1)
        with torch.no_grad():
            layer.router.gate.weight[0] = -1.0  # positive inputs never pick expert 0 (an empty group)
        layer.experts.row_multiple = rows
        x_BSD = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(4)).abs().to(dtype).requires_grad_()
        routing = layer.router(x_BSD.reshape(-1, 32), num_sequences=2)
        layouts[rows] = layer.hooks.dispatcher.dispatch(x_BSD.reshape(-1, 32), routing)
        y_BSD, stats = layer(x_BSD)
        dy_BSD = torch.randn(y_BSD.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
        (y_BSD * dy_BSD).sum().add(stats.aux_loss + stats.z_loss).backward()
        outs[rows] = [y_BSD.detach(), x_BSD.grad] + [p.grad for p in layer.parameters()]
    _, offsets_E, state = layouts[16]
    sizes_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    exact_E = torch.diff(layouts[1][1], prepend=offsets_E.new_zeros(1))
    assert sizes_E[0] == 0 and torch.all(sizes_E % 16 == 0) and torch.all(sizes_E - exact_E < 16)
    assert int((state.weight_R == 0).sum()) >= int((sizes_E - exact_E).sum()) > 0
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(outs[16], outs[1]):
        torch.testing.assert_close(a, b, **tol)


def test_group_row_multiple_pads_only_large_cpu_bf16_groups():
    from moetron.kernels.grouped_mm import CPU_GROUP_MIN_ROWS, CPU_GROUP_ROWS, group_row_multiple

    cpu = torch.device("cpu")
    assert group_row_multiple(cpu, torch.bfloat16, CPU_GROUP_MIN_ROWS) == CPU_GROUP_ROWS
    assert group_row_multiple(cpu, torch.bfloat16, CPU_GROUP_MIN_ROWS - 1) == 1
    assert group_row_multiple(cpu, torch.float32, 4096) == 1
    layer = _layer(_config(d_model=8, num_experts=2), seed=0)
    x_TD = torch.randn(CPU_GROUP_MIN_ROWS, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer.experts.group_row_multiple(x_TD, CPU_GROUP_MIN_ROWS) == CPU_GROUP_ROWS
    assert layer.experts.group_row_multiple(x_TD, CPU_GROUP_MIN_ROWS) == 1


class _CountingDispatcher:
    """Any object keeping the `Dispatcher` contract: here the layer's own, counting its calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def dispatch(self, x_TD, routing):
        self.calls.append("dispatch")
        return self.inner.dispatch(x_TD, routing)

    def combine(self, y_RD, state):
        self.calls.append("combine")
        return self.inner.combine(y_RD, state)

    def spread(self, routing):
        self.calls.append("spread")
        return self.inner.spread(routing)


def test_layer_runs_any_dispatcher_in_its_hooks():
    """The layer asks its dispatcher for the contract and nothing else: a stand-in in its hooks
    gets dispatch, combine and spread once each and gives the same output."""
    layer = _layer(_config(), seed=2)
    x_BSD = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))
    want_BSD, _ = layer(x_BSD)
    layer.hooks.dispatcher = stand_in = _CountingDispatcher(layer.hooks.dispatcher)
    got_BSD, _ = layer(x_BSD)
    assert stand_in.calls == ["dispatch", "combine", "spread"] and torch.equal(got_BSD, want_BSD)


def test_a_copied_layer_pads_groups_as_its_own_experts_prefer():
    """A deep copy (what a pipeline stage is made of) has its own hooks, and its dispatcher asks
    the copy's experts for the row multiple, not the original's."""
    layer = _layer(_config(), seed=2)
    twin = copy.deepcopy(layer)
    twin.experts.row_multiple = 16
    assert twin.hooks is not layer.hooks
    x_TD = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    routing = layer.router(x_TD)
    offsets_E = layer.hooks.dispatcher.dispatch(x_TD, routing)[1]
    twin_offsets_E = twin.hooks.dispatcher.dispatch(x_TD, routing)[1]
    assert int(offsets_E[-1]) == 12 * 2  # exact groups: every route, no padding
    assert torch.all(torch.diff(twin_offsets_E, prepend=twin_offsets_E.new_zeros(1)) % 16 == 0)
    assert int(twin_offsets_E[-1]) > 12 * 2


def test_dropped_tokens_get_exactly_zero():
    """A token whose every route is over capacity gets an all-zero MoE output (it rides the
    residual), and only those tokens do."""
    cfg = _config(top_k=2, capacity_factor=0.25)
    layer = _layer(cfg, seed=7)
    x_TD = torch.randn(1, 48, cfg.d_model)
    y_BSD, _ = layer(x_TD)
    routing = layer.router(x_TD.reshape(-1, cfg.d_model))
    all_dropped_T = ~routing.kept_TK.any(-1)
    assert all_dropped_T.sum() > 0
    y_TD = y_BSD.reshape(-1, cfg.d_model)
    assert torch.equal(y_TD[all_dropped_T], torch.zeros_like(y_TD[all_dropped_T]))
    assert (y_TD[~all_dropped_T].abs().sum(-1) > 0).all()


def test_shared_expert_adds_a_dense_ffn():
    """With a shared expert the output is the routed output of the same weights plus a plain
    FeedForward of the same input."""
    cfg = _config(top_k=2, capacity_factor=1.0, shared_expert_d_ff=10)
    layer = _layer(cfg, seed=8)
    routed_only = MoELayer(cfg.replace(moe=MoEConfig(**{**cfg.moe.__dict__, "shared_expert_d_ff": 0})))
    routed_only.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("shared.")})
    dense = FeedForward(cfg.d_model, 10, cfg.activation)
    dense.load_state_dict({k.removeprefix("shared."): v for k, v in layer.state_dict().items()
                           if k.startswith("shared.")})
    x_BSD = torch.randn(2, 10, cfg.d_model)
    torch.testing.assert_close(layer(x_BSD)[0], routed_only(x_BSD)[0] + dense(x_BSD), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("every", [1, 2, 3])
def test_moe_every_kth_layer(every):
    """Layer i is MoE exactly when (i + 1) % every == 0; the others are dense FFNs; the model
    reports stats for the MoE layers only and sums their aux and z losses."""
    cfg = ModelConfig(d_model=16, n_layers=6, n_heads=2, d_ff=32, moe=MoEConfig(
        num_experts=4, top_k=2, d_expert=8, every=every, z_loss_coef=1e-3))
    model = build_model(cfg)
    expected = [i for i in range(6) if (i + 1) % every == 0]
    assert [i for i in range(6) if isinstance(model.layers[str(i)].ffn, MoELayer)] == expected
    assert all(type(model.layers[str(i)].ffn) is FeedForward for i in range(6) if i not in expected)
    out = model(torch.randint(0, cfg.vocab_size, (2, 8)))
    assert sorted(out.moe) == expected
    torch.testing.assert_close(out.aux_loss, sum(s.aux_loss + s.z_loss for s in out.moe.values()))


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_stats_match_direct_computation(capacity_factor):
    """Per-layer counts (routes per expert before drops), dropped fraction and mean router
    entropy, each computed directly from the router's softmax."""
    cfg = _config(top_k=2, capacity_factor=capacity_factor, num_experts=6)
    layer = _layer(cfg, seed=9)
    x_BSD = torch.randn(3, 16, cfg.d_model)
    _, stats = layer(x_BSD)
    x_TD = x_BSD.reshape(-1, cfg.d_model)
    probs_TE = torch.softmax(x_TD @ layer.router.gate.weight.T, dim=-1)
    top_TK = probs_TE.topk(2, dim=-1).indices
    assert torch.equal(stats.counts_E, torch.bincount(top_TK.flatten(), minlength=6))
    entropy = torch.distributions.Categorical(probs=probs_TE).entropy().mean()
    torch.testing.assert_close(stats.entropy, entropy, rtol=1e-5, atol=1e-6)
    _, _, dropped = _reference_forward(layer.double(), x_TD.double())
    assert math.isclose(float(stats.dropped_fraction), dropped, abs_tol=1e-6)
    assert (dropped > 0) == (capacity_factor is not None)

"""Pre-norm vs post-norm at initialization, as Xiong et al. (2020) found it, measured with
bench/norm_depth.py (Vaswani's setting: LayerNorm, ReLU FFN, Xavier init, d = 256).

Statistic: g_l = ‖∂loss/∂W2‖_F of layer l's FFN output projection, one LM loss on random
tokens, averaged over 3 seeds; `tilt` = mean g over the last quarter of the layers / over the
first quarter.

- Their Fig. 3 at L = 24: post-norm's gradients grow toward the output. Pre-norm's do not: in
  Xavier's setting they fall as ≈ 1/sqrt(l), because the residual stream's norm grows as sqrt(l)
  (their Lemma 2) and each later norm divides by it. With moetron's depth-scaled init the stream
  stays level and pre-norm's profile is flat, the figure's pre-norm curve.
- Their Theorem 1: the last layer's gradient is O(1) in depth for post-norm and O(1/sqrt(L)) for
  pre-norm. Checked as g_L(L=24) / g_L(L=6): ≈ 1 post, ≈ sqrt(6/24) = 0.5 pre.
"""

import pytest
import torch


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("norm_depth")


@pytest.fixture(scope="module")
def norms(bench):
    return {(p, L): bench.mean_grad_norms(L, p, seeds=3) for p in ("post", "pre") for L in (6, 24)}


def test_gradient_profile_across_layers_at_depth_24(bench, norms):
    """Xiong et al. Fig. 3 at L = 24: post-norm's gradients grow toward the output (tilt ≈ 1.55
    measured; seeds one by one range 1.0–2.2), pre-norm's fall (≈ 0.41)."""
    post, pre = norms["post", 24], norms["pre", 24]
    assert bool(torch.isfinite(post).all() and torch.isfinite(pre).all())
    assert bench.tilt(post) > 1.25, bench.tilt(post)
    assert bench.tilt(pre) < 0.6, bench.tilt(pre)
    # Pre-norm's fall is steady, layer after layer: ≈ 1/sqrt(l) (the residual stream's growth).
    falls = (pre[1:] < pre[:-1]).float().mean()
    assert falls > 0.8, falls


def test_pre_norm_is_flat_under_depth_scaled_init(bench):
    """With residual projections scaled by 1/sqrt(2L) every sublayer starts near the identity, the
    stream's norm stays level, and both placements' profiles are flat (tilt 1.00 ± 0.02 seen)."""
    for p in ("pre", "post"):
        g = bench.mean_grad_norms(24, p, seeds=2, init="moetron")
        assert abs(bench.tilt(g) - 1) < 0.1, (p, bench.tilt(g))


def test_last_layer_gradient_versus_depth(norms):
    """Xiong et al. Theorem 1: post-norm's last-layer gradient does not depend on depth, pre-norm's
    shrinks as 1/sqrt(L) (0.5 from L = 6 to 24; 0.65 measured with 3 seeds, 0.36 ≈ sqrt(6/48)
    from 6 to 48 in the bench)."""
    post = float(norms["post", 24][-1] / norms["post", 6][-1])
    pre = float(norms["pre", 24][-1] / norms["pre", 6][-1])
    assert 0.7 < post < 1.4, post
    assert 0.35 < pre < 0.8, pre
    assert pre < 0.8 * post, (pre, post)

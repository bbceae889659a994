"""Pre-norm vs post-norm at initialization, as Xiong et al. (2020) found it, measured with
bench/norm_depth.py (Vaswani's setting: LayerNorm, ReLU FFN, Xavier init).

Statistic: g_l = ‖∂loss/∂W2‖_F of layer l's FFN output projection, one LM loss on random
tokens, averaged over 3 seeds.

- Xiong's Theorem 1: the last layer's gradient is O(1) in depth for post-norm and
  O(1/sqrt(L)) for pre-norm. Checked as g_L(L=24) / g_L(L=6): ≈ 1 post, ≈ sqrt(6/24) = 0.5 pre.
- Their Fig. 3, the per-layer profile, relative between the two: post-norm's stays roughly level
  (g_L / g_1 between 0.5 and 1.5 over seeds), pre-norm's falls toward the output (g_l ∝ 1/sqrt(l):
  the residual stream's scale grows as sqrt(l) and each later norm divides by it). In this
  decoder-only setting post-norm's does not grow outright as in the paper's encoder-decoder.
  Checked as the tilt g_L / g_1 at L = 24.
"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "norm_depth.py"


@pytest.fixture(scope="module")
def norms():
    spec = importlib.util.spec_from_file_location("norm_depth", BENCH)
    norm_depth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(norm_depth)
    return {(p, L): norm_depth.mean_grad_norms(L, p, seeds=3, batch=4, seq_len=32)
            for p in ("post", "pre") for L in (6, 24)}


def test_last_layer_gradient_versus_depth(norms):
    """Xiong et al. Theorem 1: post-norm's last-layer gradient does not depend on depth, pre-norm's
    shrinks as 1/sqrt(L)."""
    post = float(norms["post", 24][-1] / norms["post", 6][-1])
    pre = float(norms["pre", 24][-1] / norms["pre", 6][-1])
    assert 0.7 < post < 1.4, post
    assert abs(pre / math.sqrt(6 / 24) - 1) < 0.35, pre


def test_gradient_profile_across_layers_at_depth_24(norms):
    """Xiong et al. Fig. 3 at L = 24: relative to pre-norm, post-norm's gradients sit toward the
    output — post-norm's last/first ratio stays above 0.5, pre-norm's falls below 0.45, and the
    two differ by more than 1.8× (seen 2.0–5.5× over six seed triples)."""
    tilt_post = float(norms["post", 24][-1] / norms["post", 24][0])
    tilt_pre = float(norms["pre", 24][-1] / norms["pre", 24][0])
    assert tilt_post > 0.5, tilt_post
    assert tilt_pre < 0.45, tilt_pre
    assert tilt_post / tilt_pre > 1.8, (tilt_post, tilt_pre)
    assert bool(torch.isfinite(norms["post", 24]).all() and torch.isfinite(norms["pre", 24]).all())

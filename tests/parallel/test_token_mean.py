"""The masked-LM loss of a step is one mean over the scored positions of all its micro-batches
(parallel/token_mean.py; across ranks: the *_mlm cases of test_parity.py)."""

import torch
import torch.nn.functional as F

from moetron.launcher.train.trainer import next_token_cross_entropy
from moetron.parallel.token_mean import IGNORE_INDEX, GlobalTokenMean


def _targets(scored: int, S: int = 8, V: int = 11) -> torch.Tensor:
    t = torch.full((1, S), IGNORE_INDEX)
    t[0, :scored] = torch.arange(scored) % V
    return t


def test_micro_batches_sum_to_the_mean_over_all_scored_positions():
    torch.manual_seed(0)
    logits = [torch.randn(1, 8, 11, requires_grad=True) for _ in range(2)]
    targets = [_targets(1), _targets(6)]  # one micro-batch scores 1 position, the other 6
    loss = GlobalTokenMean(next_token_cross_entropy, None, ranks=1)
    loss.count(torch.cat(targets), chunks=2)
    step = sum(loss(x, t) for x, t in zip(logits, targets)) / 2  # the caller's 1/A per micro-batch
    want = F.cross_entropy(torch.cat(logits).flatten(0, 1), torch.cat(targets).flatten())
    assert torch.allclose(step, want)
    mean_of_means = sum(next_token_cross_entropy(x, t) for x, t in zip(logits, targets)) / 2
    assert not torch.allclose(mean_of_means, want)  # the two weightings differ on this batch
    step.backward()
    want_grads = torch.autograd.grad(want, logits)
    for x, g in zip(logits, want_grads):
        assert torch.allclose(x.grad, g)


def test_a_micro_batch_without_a_scored_position_adds_nothing():
    """A context-parallel rank's chunks may hold none: no 0/0, a zero loss and zero gradient."""
    x = torch.randn(1, 8, 11, requires_grad=True)
    loss = GlobalTokenMean(next_token_cross_entropy, None, ranks=1)
    loss.count(_targets(0), chunks=1)
    out = loss(x, _targets(0))
    out.backward()
    assert out.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x))
    assert next_token_cross_entropy(x, _targets(0)).isnan()  # what a plain mean gives

"""T5's relative position bias (model.position: t5): the causal buckets against the formula written
out with math and against transformers' T5 implementation, one table shared by all layers, the
attention backends against a per-query loop (output and the table's gradient), and its config rules.

Legend: S query positions, L key positions, H heads, N buckets.
"""

import math

import pytest
import torch

from moetron.model.attention import Attention
from moetron.model.config import ModelConfig
from moetron.model.positions import RelativePositionBias, t5_relative_bucket
from moetron.model.transformer import build_model

CASES = [(32, 128), (8, 20), (2, 3), (64, 1000), (5, 7)]


def _bucket_by_the_formula(n: int, num_buckets: int, max_distance: int) -> int:
    """Offset n = query − key ≥ 0: exact below N/2, else N/2 + ⌊log(n / (N/2)) / log(max / (N/2)) ·
    N/2⌋, at most N − 1. A key after its query (n < 0) counts as n = 0."""
    exact = num_buckets // 2
    n = max(n, 0)
    if n < exact:
        return n
    return min(num_buckets - 1, exact + math.floor(math.log(n / exact) / math.log(max_distance / exact)
                                                   * (num_buckets - exact)))


@pytest.mark.parametrize("num_buckets,max_distance", CASES)
def test_buckets_follow_the_formula(num_buckets, max_distance):
    q_S, k_L = torch.arange(0, 3000, 7), torch.arange(0, 3000, 11)
    got_SL = t5_relative_bucket(q_S, k_L, num_buckets, max_distance)
    want = [[_bucket_by_the_formula(int(q - k), num_buckets, max_distance) for k in k_L] for q in q_S]
    assert torch.equal(got_SL, torch.tensor(want))
    assert int(got_SL.max()) == num_buckets - 1 and int(got_SL.min()) == 0


@pytest.mark.parametrize("num_buckets,max_distance", CASES)
def test_buckets_equal_transformers_t5_decoder(num_buckets, max_distance):
    """T5's decoder self-attention: `_relative_position_bucket(key − query, bidirectional=False)`."""
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    q_S, k_L = torch.arange(5000), torch.arange(0, 5000, 3)
    hf_SL = t5.T5Attention._relative_position_bucket(k_L[None, :] - q_S[:, None], bidirectional=False,
                                                     num_buckets=num_buckets, max_distance=max_distance)
    assert torch.equal(t5_relative_bucket(q_S, k_L, num_buckets, max_distance), hf_SL.long())


def test_bias_is_the_table_at_each_offset_s_bucket():
    table = RelativePositionBias(8, 3, 20)
    torch.nn.init.normal_(table.weight)
    q_S, k_L = torch.tensor([0, 9, 30]), torch.arange(31)
    bias_HSL = table.bias(q_S, k_L)
    assert bias_HSL.shape == (3, 3, 31)
    for h in range(3):
        for i, q in enumerate(q_S.tolist()):
            for j in range(31):
                assert bias_HSL[h, i, j] == table.weight[_bucket_by_the_formula(q - j, 8, 20), h]


def test_one_table_is_shared_by_every_layer():
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=3, n_heads=4, d_ff=32, max_seq_len=16, position="t5",
                      t5_num_buckets=16)
    model = build_model(cfg)
    tables = [n for n, _ in model.named_parameters() if "t5" in n]
    assert tables == ["t5_bias.weight"] and model.t5_bias.weight.shape == (16, 4)
    seen = []
    for block in model.layers.values():
        block.attn.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["t5_bias"]), with_kwargs=True)
    model(torch.zeros(1, 4, dtype=torch.long)).logits_BSV.sum().backward()
    assert len(seen) == 3 and all(t is model.t5_bias for t in seen)
    assert model.t5_bias.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", ["eager", "sdpa", "triton"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attention_equals_a_per_query_loop(backend, kv_heads):
    """softmax(q·k / √Dh + table[bucket(i − j), h]) over keys j ≤ i, one query at a time in
    float64, for the output and for the table's gradient. "triton" takes the reference bias path."""
    torch.manual_seed(0)
    D, H, Dh, S = 32, 4, 8, 13
    attn = Attention(D, H, kv_heads, Dh, backend=backend).double()
    attn.init_weights(std=0.2, out_std=0.2)
    table = RelativePositionBias(8, H, 12).double()
    torch.nn.init.normal_(table.weight)
    x_BSD = torch.randn(2, S, D, dtype=torch.float64)
    attn(x_BSD, t5_bias=table).sum().backward()
    got_grad = table.weight.grad.clone()
    table.weight.grad = None
    with torch.no_grad():
        q = attn.wq(x_BSD).view(2, S, H, Dh)
        k = attn.wk(x_BSD).view(2, S, kv_heads, Dh).repeat_interleave(H // kv_heads, dim=2)
        v = attn.wv(x_BSD).view(2, S, kv_heads, Dh).repeat_interleave(H // kv_heads, dim=2)
    rows = []
    for i in range(S):
        buckets_L = torch.tensor([_bucket_by_the_formula(i - j, 8, 12) for j in range(i + 1)])
        scores_BHL = torch.einsum("bhd,blhd->bhl", q[:, i], k[:, : i + 1]) / math.sqrt(Dh) + table.weight[buckets_L].T
        rows.append(torch.einsum("bhl,blhd->bhd", scores_BHL.softmax(-1), v[:, : i + 1]).reshape(2, 1, H * Dh))
    want = attn.wo(torch.cat(rows, dim=1))
    want.sum().backward()
    torch.testing.assert_close(attn(x_BSD, t5_bias=table), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, table.weight.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("changes,key", [({"t5_num_buckets": 1}, "t5_num_buckets"),
                                         ({"t5_num_buckets": 32, "t5_max_distance": 16}, "t5_max_distance")])
def test_config_rules(changes, key):
    cfg = ModelConfig(position="t5", **changes)
    assert [k for k, _, _ in cfg.problems()] == [key]
    assert ModelConfig(position="t5").problems() == []

"""Context parallelism's pieces in one process (no process group): the load-balanced split, the
reordering of gathered keys and values, and attention of local queries over the gathered keys
equal to the matching rows of whole-sequence attention (RoPE, ALiBi, GQA; eager and SDPA).
The real collectives run in tests/parallel/test_parity.py (cp2* cases)."""

import pytest
import torch

from moetron.model.attention import Attention
from moetron.model.positions import alibi_slopes, rope_cos_sin, rope_inv_freq
from moetron.parallel.context_parallel import ContextShard, global_order, split_sequence


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_holds_the_positions_it_names_and_balances_causal_work(cp):
    S = 8 * cp
    positions_1S = torch.arange(S)[None]
    held = [split_sequence(positions_1S, cp, r)[0] for r in range(cp)]
    for r in range(cp):
        assert torch.equal(held[r], ContextShard(None, cp, r).positions(S // cp, "cpu"))
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(S))
    # Query i attends to i + 1 keys: every rank does the same number of (query, key) pairs.
    assert len({int((h + 1).sum()) for h in held}) == 1


def test_split_refuses_a_sequence_not_divisible_by_two_cp():
    with pytest.raises(ValueError, match=r"divisible by 2 × parallel.cp \(4\)"):
        split_sequence(torch.zeros(2, 6), 2, 0)


def test_gathered_chunks_come_back_in_position_order():
    cp, B, G, S, Dh = 3, 2, 2, 12, 4
    full_2BGSDh = torch.randn(2, B, G, S, Dh)
    gathered = torch.cat([split_sequence(full_2BGSDh.transpose(1, 3), cp, r).transpose(1, 3) for r in range(cp)])
    assert torch.equal(global_order(gathered, cp), full_2BGSDh)


class _Recorded:
    """Stands in for the all-gather: first records each rank's local K/V, then serves them all."""

    def __init__(self, cp: int):
        self.cp, self.pieces, self.serving = cp, [], False

    def gather_kv(self, k_BGSDh, v_BGSDh):
        if not self.serving:
            self.pieces.append(torch.stack([k_BGSDh, v_BGSDh]))
            return k_BGSDh, v_BGSDh
        kv_2BGSDh = global_order(torch.cat(self.pieces), self.cp)
        return kv_2BGSDh[0], kv_2BGSDh[1]


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_local_queries_over_gathered_keys_equal_whole_sequence_attention(backend, position):
    torch.manual_seed(0)
    cp, B, S, D, H, G, Dh = 2, 2, 16, 32, 4, 2, 8
    attn = Attention(D, H, G, Dh, backend=backend).double()
    x_BSD = torch.randn(B, S, D, dtype=torch.float64)
    inv_freq = rope_inv_freq(Dh, 10000.0).double()

    def kwargs(positions_S):
        if position == "rope":
            return {"rope": tuple(t.double() for t in rope_cos_sin(positions_S, inv_freq))}
        return {"alibi_slopes_H": alibi_slopes(H).double()}

    want_BSD = attn(x_BSD, **kwargs(torch.arange(S)))
    attn.hooks.kv_exchange = _Recorded(cp)
    shards = [ContextShard(None, cp, r) for r in range(cp)]
    for serving in (False, True):
        attn.hooks.kv_exchange.serving = serving
        got = []
        for r, shard in enumerate(shards):
            positions_S = shard.positions(S // cp, "cpu")
            got.append(attn(split_sequence(x_BSD, cp, r), positions_S=positions_S, **kwargs(positions_S)))
    for r in range(cp):
        torch.testing.assert_close(got[r], split_sequence(want_BSD, cp, r), rtol=1e-10, atol=1e-10)

"""KV-cache generation: decoding from the cache equals rerunning the whole prefix, for every position
encoding and head layout; top-k / top-p keep exactly the tokens a direct computation keeps."""

import pytest
import torch

from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.generate import Sampling, allowed_tokens, generate, generate_without_cache, next_token
from moetron.model.transformer import build_model

VOCAB = 48


def tiny(**changes) -> ModelConfig:
    # A larger init than training's makes logits spread out, so a small error would change tokens.
    base = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32,
                init_std=0.2, moe=MoEConfig(num_experts=4, top_k=2, d_expert=24))
    return ModelConfig(**{**base, **changes})


def model_for(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(cfg).eval()


@pytest.mark.parametrize("position", ["rope", "alibi", "sinusoidal", "learned", "t5", "none"])
@pytest.mark.parametrize("heads", [{"n_kv_heads": 2}, {"n_kv_heads": 1}, {"n_kv_heads": None}],
                         ids=["gqa", "mqa", "mha"])
def test_cached_decoding_equals_recomputing_the_prefix(position, heads):
    model = model_for(tiny(position=position, **heads))
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    ids, logits = generate(model, prompt, 10, return_logits=True)
    ref_ids, ref_logits = generate_without_cache(model, prompt, 10)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("position", ["rope", "alibi", "t5"])
def test_chunked_prefill_equals_one_pass(attention, position):
    """Chunks after the first attend to the cache and to themselves (queries not starting at 0)."""
    model = model_for(tiny(attention=attention, position=position))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model(ids).logits_BSV
        caches = model.new_caches(2, 12)
        parts = [model(ids[:, a:b], caches=caches, start_pos=a).logits_BSV for a, b in ((0, 5), (5, 6), (6, 12))]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=1e-5)


def test_sampling_with_the_cache_draws_the_same_tokens_as_without():
    model = model_for(tiny())
    prompt = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(3))
    sampling = Sampling(temperature=0.8, top_k=10, top_p=0.9)
    cached = generate(model, prompt, 8, sampling, generator=torch.Generator().manual_seed(7))
    recomputed, _ = generate_without_cache(model, prompt, 8, sampling, generator=torch.Generator().manual_seed(7))
    assert torch.equal(cached, recomputed)


def test_a_seed_fixes_the_continuation():
    model = model_for(tiny())
    prompt = torch.tensor([[1, 2, 3]])
    sampling = Sampling(temperature=1.5)

    def run(seed):
        return generate(model, prompt, 12, sampling, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))


def direct_allowed(logits_V: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The textbook definition, one row at a time in float64: the k most likely tokens; then, of
    those renormalized, the fewest most likely whose probability sums to at least p."""
    order = sorted(range(len(logits_V)), key=lambda i: -float(logits_V[i]))
    kept = order[:top_k] if top_k else order
    probs = torch.softmax(logits_V.double()[kept], dim=0).tolist()
    nucleus, total = [], 0.0
    for token, p in zip(kept, probs):
        nucleus.append(token)
        total += p
        if total >= top_p:
            break
    return set(nucleus)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.5), (0, 0.9), (8, 0.7), (1, 0.3), (0, 1e-6), (3, 1.0)])
def test_top_k_top_p_keep_what_the_definition_keeps(top_k, top_p):
    logits_BV = torch.randn(16, 40, generator=torch.Generator().manual_seed(top_k * 100 + int(top_p * 10))) * 3
    mask_BV = allowed_tokens(logits_BV, top_k=top_k, top_p=top_p)
    for row in range(logits_BV.shape[0]):
        assert set(mask_BV[row].nonzero()[:, 0].tolist()) == direct_allowed(logits_BV[row], top_k, top_p)


@pytest.mark.parametrize("top_p,size", [(0.25, 1), (0.5, 2), (0.75, 3), (0.8, 4), (1.0, 4)])
def test_a_nucleus_that_reaches_top_p_exactly_stops_there(top_p, size):
    """Four equally likely tokens (probability 0.25 each, exact in binary): the fewest whose sum is at
    least p. Random logits never land on the boundary, where a nucleus one token too large hides."""
    mask_BV = allowed_tokens(torch.zeros(1, 4), top_p=top_p)
    assert int(mask_BV.sum()) == size


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (0, 0.6), (6, 0.8)])
def test_sampling_only_ever_picks_allowed_tokens(top_k, top_p):
    logits_BV = torch.randn(4, 30, generator=torch.Generator().manual_seed(5)) * 2
    sampling = Sampling(temperature=1.0, top_k=top_k, top_p=top_p)
    allowed = [direct_allowed(logits_BV[r], top_k, top_p) for r in range(4)]
    gen = torch.Generator().manual_seed(0)
    seen = [set() for _ in range(4)]
    for _ in range(500):
        for r, token in enumerate(next_token(logits_BV, sampling, gen).tolist()):
            seen[r].add(token)
    for r in range(4):
        assert seen[r] <= allowed[r]
        # 500 draws reach every allowed token whose renormalized probability is not tiny.
        probs = torch.softmax(logits_BV[r].double()[sorted(allowed[r])], 0)
        likely = {t for t, p in zip(sorted(allowed[r]), probs.tolist()) if p > 0.02}
        assert likely <= seen[r]


def test_greedy_and_zero_temperature_take_the_argmax():
    logits_BV = torch.randn(8, 20, generator=torch.Generator().manual_seed(9))
    for sampling in (Sampling(greedy=True, temperature=5.0, top_k=3), Sampling(temperature=0.0)):
        assert torch.equal(next_token(logits_BV, sampling), logits_BV.argmax(-1))


def test_generation_stops_at_eos_and_finished_rows_repeat_it():
    model = model_for(tiny())
    prompt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(4))
    free = generate(model, prompt, 8)
    eos = int(free[0, 2])
    stopped = generate(model, prompt, 8, eos_id=eos)
    first = free[0].tolist().index(eos)
    assert stopped[0].tolist() == free[0, : first + 1].tolist() + [eos] * (stopped.shape[1] - first - 1)
    row1 = free[1].tolist()
    if eos in row1:
        assert stopped.shape[1] == max(first, row1.index(eos)) + 1
    else:
        assert stopped.shape[1] == 8 and stopped[1].tolist() == row1


def test_vocabulary_padding_is_never_chosen():
    model = model_for(tiny())
    prompt = torch.randint(0, VOCAB, (4, 3), generator=torch.Generator().manual_seed(6))
    ids = generate(model, prompt, 10, Sampling(temperature=3.0), generator=torch.Generator().manual_seed(0),
                   vocab_size=10)
    assert int(ids.max()) < 10


def test_refuses_to_run_past_the_context():
    model = model_for(tiny(max_seq_len=16))
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, torch.zeros(1, 10, dtype=torch.long), 7)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 2, Sampling(top_p=0.0))

"""A blend draws each source's share the way Megatron's BlendedDataset does: the sources of its
samples equal megatron-core's own `build_blending_indices` (the compiled helper), and a sequence
worked out by hand; it resumes exactly and reads only a rank's rows and spans."""

import json
import warnings

import numpy as np
import pytest

from moetron.launcher.data.blend import BlendSampler
from moetron.launcher.data.corpus import WindowSampler

SEQ = 8


def sources(weights):
    """Source k: tokens 1000·k …, so every window tells which source it came from."""
    return [(f"s{k}", w, [np.arange(1000 * k, 1000 * k + 40 * SEQ + 1 + 3 * k * SEQ, dtype=np.uint16)])
            for k, w in enumerate(weights)]


def test_the_sources_of_07_03_by_hand():
    # i = 0: deficits 0.7·1 − 0, 0.3·1 − 0 → s0; i = 1: 0.7 − 1, 0.3 − 0 → s1; i = 2: 1.4 − 1, 0.6 − 1 → s0;
    # i = 3: 2.1 − 2, 0.9 − 1 → s0; i = 4: 2.8 − 3, 1.2 − 1 → s1; and so on.
    assert BlendSampler(sources([0.7, 0.3]), SEQ, 0).next_sources(10) == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0]
    # Weights are normalized: 7 : 3 is 0.7 : 0.3.
    assert BlendSampler(sources([7, 3]), SEQ, 0).next_sources(10) == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.5, 0.25, 0.125, 0.125], [0.01, 0.99], [3, 1, 2]])
def test_counts_stay_within_one_sample_of_the_weights_as_megatron_blends(weights):
    sampler = BlendSampler(sources(weights), SEQ, 0)
    picks = sampler.next_sources(500)
    share = np.asarray(weights, float) / sum(weights)
    for n in (1, 2, 3, 7, 10, 33, 100, 499, 500):
        counts = np.bincount(picks[:n], minlength=len(weights))
        assert np.all(np.abs(counts - share * n) <= 1), (n, counts, share * n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp")
    dataset_index = np.zeros(500, dtype=np.int16)
    sample_index = np.zeros(500, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, sample_index, share, len(weights), 500, False)
    assert picks == dataset_index.tolist()


def test_batches_follow_the_sources_and_resume_exactly():
    straight = BlendSampler(sources([0.7, 0.3]), SEQ, 3)
    batches = [straight.next_batch(6) for _ in range(20)]  # 120 samples: s0's 40 windows go round twice
    first = batches[0].numpy()[:, 0] // 1000
    assert first.tolist() == [0, 1, 0, 0, 1, 0]
    assert straight.tokens_by_source() == {"s0": 84 * SEQ, "s1": 36 * SEQ}
    part = BlendSampler(sources([0.7, 0.3]), SEQ, 3)
    for _ in range(9):
        part.next_batch(6)
    resumed = BlendSampler(sources([0.7, 0.3]), SEQ, 3)
    resumed.load_state_dict(json.loads(json.dumps(part.state_dict())))
    assert all(np.array_equal(resumed.next_batch(6), b) for b in batches[9:])


def test_a_lone_source_draws_what_a_window_sampler_draws_and_loads_its_old_state():
    shards = [np.arange(700, dtype=np.uint16)]
    window, blend = WindowSampler(shards, SEQ, 5), BlendSampler([("a", 1.0, shards)], SEQ, 5)
    for _ in range(30):  # past an epoch of 87 windows
        assert np.array_equal(window.next_batch(4), blend.next_batch(4))
    again = BlendSampler([("a", 1.0, shards)], SEQ, 5)
    again.load_state_dict(window.state_dict())  # a checkpoint's position from before blends
    assert np.array_equal(again.next_batch(4), window.next_batch(4))


def test_a_rank_reads_its_rows_and_spans_of_the_blended_batch():
    spans = [(0, 3), (6, 9)]
    reference = BlendSampler(sources([0.6, 0.4]), SEQ, 1)
    full = [reference.next_batch(8) for _ in range(3)]
    for rows in (slice(0, 4), slice(4, 8), slice(2, 4)):
        rank = BlendSampler(sources([0.6, 0.4]), SEQ, 1)
        for global_BS1 in full:
            part = rank.next_batch(8, rows, spans)
            want = np.stack([global_BS1[rows, a:b] for a, b in spans], axis=1)
            assert np.array_equal(part.numpy(), want)
        assert rank.state_dict() == reference.state_dict()
        assert rank.tokens_read == (rows.stop - rows.start) * 3 * 6  # only its rows' spans were read


def test_a_position_saved_for_other_sources_is_refused_by_name():
    from moetron.launcher.config import ConfigError

    saved = BlendSampler(sources([0.5, 0.5]), SEQ, 0).state_dict()
    with pytest.raises(ConfigError, match=r"for the sources \['s0', 's1'\], this run's data are \['s0', 's1', 's2'\]"):
        BlendSampler(sources([1, 1, 1]), SEQ, 0).load_state_dict(saved)

"""Each rank reads only its part of the global batch, in the global order.

The ranks' meshes are the real ones (`build_mesh`), built one rank at a time in this process on
torch's fake process group, so `ParallelModel` cuts batches exactly as on a launch. The oracle is
one process's sampler: a rank's rows and positions must equal its slice of that global batch, at
every step, across an epoch boundary and after a resume from a state saved under another layout.
"""

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from moetron.launcher.data.corpus import WindowSampler, validation_batches
from moetron.parallel.config import ParallelConfig
from moetron.parallel.context_parallel import split_sequence
from moetron.parallel.mesh import build_mesh
from moetron.parallel.parallelize import ParallelModel

SEQ, BATCH, SEED = 16, 8, 5
# name: (layout, world size)
LAYOUTS = {"dp1": ({}, 1), "dp2": ({"dp": 2}, 2), "dp4": ({"dp": 4}, 4),
           "dp2_cp2": ({"dp": 2, "cp": 2}, 4), "dp2_tp2_ep2": ({"dp": 2, "tp": 2, "ep": 2}, 4)}


def ranks(name: str) -> Iterator[ParallelModel]:
    """The ParallelModel of each rank of layout `name` in turn (no modules: only the batch cutting
    is used), each while its rank's (fake) process group is up: the mesh reads its coordinates there."""
    layout, world = LAYOUTS[name]
    cfg = ParallelConfig(**layout)
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            yield ParallelModel([], build_mesh(cfg, world), cfg, set(), None, cross_entropy=None)
        finally:
            dist.destroy_process_group()


def shards() -> list[np.ndarray]:
    # 19 + 13 windows of 17 tokens: an epoch every 4 global batches of 8.
    return [np.arange(19 * SEQ + 1, dtype=np.uint16), np.arange(30_000, 30_000 + 13 * SEQ + 5, dtype=np.uint16)]


def expected_part(pm: ParallelModel, global_BS1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets as the trainer cut them before: slice, then split."""
    return pm.local_window(pm.local_batch(global_BS1))


def read_part(pm: ParallelModel, sampler: WindowSampler) -> torch.Tensor:
    return sampler.next_batch(BATCH, pm.batch_rows(BATCH), pm.window_spans(SEQ))


def assert_same_part(pm: ParallelModel, part: torch.Tensor, global_BS1: torch.Tensor) -> None:
    got, want = pm.local_window(part), expected_part(pm, global_BS1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if pm.cfg.cp == 1:
        assert torch.equal(part, global_BS1.chunk(pm.cfg.dp)[pm.mesh.rank("dp")])


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_rank_reads_its_slice_of_the_global_batch_and_resumes_under_any_layout(name):
    reference = WindowSampler(shards(), SEQ, SEED)
    global_batches = [reference.next_batch(BATCH) for _ in range(7)]  # crosses an epoch boundary
    states = []
    for pm in ranks(name):
        sampler = WindowSampler(shards(), SEQ, SEED)
        for global_BS1 in global_batches[:6]:
            assert_same_part(pm, read_part(pm, sampler), global_BS1)
        states.append(sampler.state_dict())
    # A state saved by any rank of this layout resumes every rank of another at the same place.
    assert all(state == states[0] for state in states)
    for pm in ranks("dp4" if name != "dp4" else "dp2_cp2"):
        resumed = WindowSampler(shards(), SEQ, SEED)
        resumed.load_state_dict(states[-1])
        assert_same_part(pm, read_part(pm, resumed), global_batches[6])


def test_context_parallel_pieces_are_the_split_sequence():
    """Independent of local_window: the pieces, shifted, are split_sequence of inputs and targets."""
    for pm in ranks("dp2_cp2"):
        window_BS1 = WindowSampler(shards(), SEQ, SEED).next_batch(BATCH)
        pieces_BPL = WindowSampler(shards(), SEQ, SEED).next_batch(BATCH, None, pm.window_spans(SEQ))
        assert pieces_BPL.shape == (BATCH, 2, SEQ // 4 + 1)
        cp_rank = pm.mesh.rank("cp")
        assert torch.equal(pieces_BPL[..., :-1].flatten(1), split_sequence(window_BS1[:, :-1], 2, cp_rank))
        assert torch.equal(pieces_BPL[..., 1:].flatten(1), split_sequence(window_BS1[:, 1:], 2, cp_rank))


class CountingShard:
    """A token shard that records every range of tokens read from it."""

    def __init__(self, tokens: np.ndarray):
        self.tokens, self.reads = tokens, []

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, _ = index.indices(len(self.tokens))
        self.reads.append((start, stop))
        return self.tokens[index]


@pytest.mark.parametrize("name", ["dp1", "dp4", "dp2_cp2"])
def test_a_rank_reads_only_its_rows_and_positions(name):
    steps = 3
    read_per_rank = []
    for pm in ranks(name):
        dp, cp = pm.cfg.dp, pm.cfg.cp
        counted = [CountingShard(s) for s in shards()]
        sampler = WindowSampler(counted, SEQ, SEED)
        for _ in range(steps):
            read_part(pm, sampler)
        read = sum(b - a for s in counted for a, b in s.reads)
        assert read == sampler.tokens_read
        read_per_rank.append(read)
    # The global batch is BATCH windows of SEQ + 1 tokens; a rank reads BATCH / dp of them, and
    # under cp its two chunks of SEQ / (2 cp) tokens, each with the next token for the last target.
    per_window = SEQ + 1 if cp == 1 else 2 * (SEQ // (2 * cp) + 1)
    assert read_per_rank == [steps * BATCH // dp * per_window] * LAYOUTS[name][1]


def test_batch_rows_cut_like_chunk_and_refuse_a_rank_left_without_rows():
    for pm in ranks("dp4"):
        for n in (8, 10, 9):  # 10 and 9: torch.chunk's ragged cut (3, 3, 3, 1) and (3, 3, 3, 0 → none)
            rows = torch.arange(n)
            pieces = rows.chunk(4)
            r = pm.mesh.rank("dp")
            if r < len(pieces):
                assert torch.equal(rows[pm.batch_rows(n)], pieces[r])
            else:
                with pytest.raises(ValueError, match=f"a batch of {n} sequences leaves dp rank 3 of 4 none"):
                    pm.batch_rows(n)


def test_validation_batches_of_a_rank_are_its_part_of_the_global_ones():
    val = [np.arange(10 * SEQ + 1, dtype=np.uint16)]  # 10 windows: batches of 4, 4 and 2
    whole = validation_batches(val, SEQ, 4, 3)
    assert [len(b) for b in whole] == [4, 4, 2]
    for pm in ranks("dp2_cp2"):
        parts = validation_batches(val, SEQ, 4, 3, rows=pm.batch_rows, spans=pm.window_spans(SEQ))
        for part, batch in zip(parts, whole, strict=True):
            assert_same_part(pm, part, batch)

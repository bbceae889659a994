"""Packed documents kept apart: a packed sequence scores each document as if it were alone.

Legend: B batch, S sequence, V vocabulary.

The oracle is the same model run on each document by itself (positions from 0, as a document
starts a sequence): with `doc_start_BL` attention never crosses a boundary and with
`positions_BL` restarting per document the position encodings are the alone run's, so every
position's logits — and hence the packed loss, the token-weighted mean of the documents' losses —
must be the alone run's.
"""

import pytest
import torch
import torch.nn.functional as F

from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.packing import document_positions, document_starts
from moetron.model.transformer import build_model

EOD = 1


def _packed(lengths_per_row: list[list[int]], vocab: int, seed: int = 0) -> torch.Tensor:
    """Rows of documents with the given lengths, each ending in EOD (other ids never EOD) → (B, S)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in lengths_per_row:
        docs = [torch.randint(2, vocab, (n,), generator=g) for n in lengths]
        for d in docs:
            d[-1] = EOD
        rows.append(torch.cat(docs))
    return torch.stack(rows)


def test_document_starts_and_positions():
    ids_BS = torch.tensor([[5, 1, 7, 7, 1, 1, 3], [1, 4, 4, 4, 4, 1, 9]])
    want = torch.tensor([[0, 0, 2, 2, 2, 5, 6], [0, 1, 1, 1, 1, 1, 6]])
    assert torch.equal(document_starts(ids_BS, EOD), want)
    assert torch.equal(document_positions(want), torch.tensor([[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 0]]))


def _config(position: str, backend: str, d_model: int = 32, n_heads: int = 4) -> ModelConfig:
    return ModelConfig(vocab_size=48, d_model=d_model, n_layers=2, n_heads=n_heads, n_kv_heads=n_heads // 2, d_ff=48,
                       position=position,
                       attention=backend, max_seq_len=64,
                       moe=MoEConfig(num_experts=4, top_k=2, d_expert=24, every=2, capacity_factor=None))


@pytest.mark.parametrize("position,backend", [("rope", "sdpa"), ("learned", "eager"), ("sinusoidal", "sdpa"),
                                              ("alibi", "eager"), ("t5", "sdpa"), ("rope", "triton"),
                                              ("alibi", "interpret")])
def test_packed_logits_equal_each_document_alone(position, backend):
    """"triton": the flash-attention op on its torch path (fp64); "interpret": its Triton kernels,
    run by the interpreter (fp32, head dim 32, documents crossing the 32-position tiles)."""
    torch.manual_seed(0)
    interpret = backend == "interpret"
    dtype, tol = (torch.float32, 2e-5) if interpret else (torch.float64, 1e-9)
    cfg = _config(position, "triton", d_model=64, n_heads=2) if interpret else _config(position, backend)
    model = build_model(cfg, dtype=dtype).eval()
    if backend in ("triton", "interpret"):
        model.set_kernel_backend("interpret" if interpret else "torch")
    lengths = [[5, 1, 9, 17], [20, 12]]
    ids_BS = _packed(lengths, 48)
    doc_start_BS = document_starts(ids_BS, EOD)
    with torch.no_grad():
        packed_BSV = model(ids_BS, doc_start_BS, document_positions(doc_start_BS)).logits_BSV
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                alone_1SV = model(ids_BS[b : b + 1, start : start + n]).logits_BSV
                torch.testing.assert_close(packed_BSV[b, start : start + n], alone_1SV[0], rtol=tol, atol=tol)
                start += n


def test_packed_loss_is_token_weighted_mean_of_document_losses():
    torch.manual_seed(1)
    model = build_model(_config("rope", "sdpa"))
    window_BS1 = _packed([[7, 11, 15]], 48, seed=3)
    ids_BS, targets_BS = window_BS1[:, :-1], window_BS1[:, 1:]
    doc_start_BS = document_starts(ids_BS, EOD)
    logits_BSV = model(ids_BS, doc_start_BS, document_positions(doc_start_BS)).logits_BSV
    packed = F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())
    losses, counts = [], []
    for start, stop in ((0, 7), (7, 18), (18, 32)):
        alone = model(ids_BS[:, start:stop]).logits_BSV
        losses.append(F.cross_entropy(alone.flatten(0, 1), targets_BS[:, start:stop].flatten()))
        counts.append(stop - start)
    want = sum(n * loss for n, loss in zip(counts, losses)) / sum(counts)
    torch.testing.assert_close(packed, want, rtol=1e-5, atol=1e-6)
    # Without the mask the documents see each other: the same sequence scores differently.
    unmasked = F.cross_entropy(model(ids_BS).logits_BSV.flatten(0, 1), targets_BS.flatten())
    assert abs(unmasked.item() - packed.item()) > 1e-4

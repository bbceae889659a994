"""`Decoder.set_kernel_backend` reaches every fused op: the Triton kernels (interpreted on CPU)
and the torch path give the same model output and gradients."""

import os

import pytest
import torch

from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.transformer import build_model


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (no GPU)")
def test_interpreted_kernels_match_the_torch_path():
    pytest.importorskip("triton")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=96, attention="triton",
                      position="alibi", moe=MoEConfig(num_experts=4, top_k=2, d_expert=48))
    model = build_model(cfg)
    ids = torch.randint(0, 64, (2, 40))

    def run(backend):
        model.set_kernel_backend(backend)
        model.zero_grad()
        out = model(ids)
        out.logits_BSV.square().mean().backward()
        return out.logits_BSV.detach(), [p.grad.clone() for p in model.parameters()]

    ref_logits, ref_grads = run("torch")
    logits, grads = run("interpret")
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-6)


def test_unknown_backend_is_refused():
    model = build_model(ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, d_ff=32,
                                    moe=MoEConfig(num_experts=2, top_k=1, weighting="softmax")))
    model.set_kernel_backend("cuda-magic")
    with pytest.raises(ValueError, match="backend='cuda-magic'"):
        model(torch.randint(0, 32, (1, 8)))

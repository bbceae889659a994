"""`Decoder.set_kernel_backend` reaches every fused op: the Triton kernels and the torch path give the
same model output and gradients. On a GPU the real compiled kernels run; without one, Triton's
interpreter runs the same kernels on the CPU."""


import pytest
import torch

from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.transformer import build_model


def _assert_near(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """max |got - want| <= rel * max |want|: tf32 errors scale with a tensor's largest entry."""
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel} x {scale:.3g}"


def test_triton_kernels_match_the_torch_path(triton_target):
    backend, device = triton_target
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=96, attention="triton",
                      position="alibi", moe=MoEConfig(num_experts=4, top_k=2, d_expert=48))
    model = build_model(cfg, device=device)
    ids = torch.randint(0, 64, (2, 40), device=device)

    def run(backend):
        model.set_kernel_backend(backend)
        model.zero_grad()
        out = model(ids)
        out.logits_BSV.square().mean().backward()
        return out.logits_BSV.detach(), [(n, p.grad.clone()) for n, p in model.named_parameters()]

    ref_logits, ref_grads = run("torch")
    logits, grads = run(backend)
    if backend == "interpret":  # full fp32 products, as the torch path on the CPU
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
        for (name, g), (_, r) in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-6, msg=lambda m, name=name: f"grad of {name}: {m}")
        return
    # Compiled fp32 kernels multiply in tf32 (10-bit mantissas) while torch's CUDA matmuls stay fp32:
    # the kernel tests allow 5e-3 of the largest entry per op; two layers of them compound.
    _assert_near(logits, ref_logits, 1e-2, "logits")
    for (name, g), (_, r) in zip(grads, ref_grads):
        _assert_near(g, r, 2e-2, f"grad of {name}")


def test_unknown_backend_is_refused():
    model = build_model(ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, d_ff=32,
                                    moe=MoEConfig(num_experts=2, top_k=1, weighting="softmax")))
    model.set_kernel_backend("cuda-magic")
    with pytest.raises(ValueError, match="backend='cuda-magic'"):
        model(torch.randint(0, 32, (1, 8)))

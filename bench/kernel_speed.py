"""Check, then time, moetron's Triton kernels against torch's own on one GPU, in one run.

    python bench/kernel_speed.py                 # everything, ~2-4 minutes on an H100/H200
    python bench/kernel_speed.py --only attention --seq-lens 4096

Grouped GEMM (bf16): forward, dX and dW on MoE expert shapes, each beside cuBLAS dense matmul of
the same FLOPs (x_TK @ w_KN) and torch._grouped_mm on the same groups. Attention (bf16, head dim
128, causal): forward and backward beside SDPA's flash backend. Targets: grouped GEMM >= 0.9x
dense and >= 1.0x torch._grouped_mm; attention forward >= 0.9x, backward >= 0.8x SDPA-flash.

FLOP convention: 2 per multiply-add; causal attention counts only the unmasked half; attention
backward is 2.5x its forward (FlashAttention's convention). Prints a table, then one JSON line.

Legend: T routed rows (tokens x top-k), K/N features, E experts; B batch, H heads, S positions,
D head dim.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

# name: (tokens, top_k, experts, d_model, d_ff)
MOE_SHAPES = {
    "mixtral-8x7b": (16384, 2, 8, 4096, 14336),
    "fine-grained-64e": (16384, 6, 64, 2048, 1408),
}
ATTN_HEADS, ATTN_HEAD_DIM, ATTN_TOKENS = 32, 128, 16384


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["all", "grouped_mm", "attention"], default="all")
    p.add_argument("--moe-shapes", nargs="+", choices=list(MOE_SHAPES), default=list(MOE_SHAPES))
    p.add_argument("--seq-lens", nargs="+", type=int, default=[2048, 4096, 8192, 16384],
                   help=f"attention sequence lengths; batch = {ATTN_TOKENS} // seq_len (at least 1)")
    p.add_argument("--rep-ms", type=int, default=100, help="time spent timing each measurement")
    return p.parse_args(argv)


def bench_ms(fn, rep_ms: int) -> float:
    """Median time of fn in ms, L2 flushed between runs (triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="median")


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def routed_offsets(tokens: int, top_k: int, experts: int, device) -> torch.Tensor:
    """Cumulative rows per expert for random top-k routing (uneven, like a real router's)."""
    logits = torch.randn(tokens, experts, device=device)
    chosen = logits.topk(top_k, dim=-1).indices.flatten()
    return torch.bincount(chosen, minlength=experts).cumsum(0).to(torch.int32)


def check_grouped_mm(device) -> dict:
    """Ragged groups with empty ones and tail rows: Triton against the fp64 loop reference."""
    from moetron.kernels.grouped_mm import grouped_mm, grouped_mm_reference

    offsets_E = torch.tensor([0, 300, 300, 777, 1000, 1000], device=device, dtype=torch.int32)
    x = torch.randn(1033, 520, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(6, 520, 700, device=device) / 520**0.5).bfloat16().requires_grad_()
    y = grouped_mm(x, w, offsets_E)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = grouped_mm_reference(x64, w64, offsets_E)
    y64.backward(dy.double())
    errs = {"y": rel_err(y, y64), "dx": rel_err(x.grad, x64.grad), "dw": rel_err(w.grad, w64.grad)}
    return {"check": "grouped_mm", "max_rel_err": max(errs.values()), "ok": max(errs.values()) < 2e-2, **errs}


def check_attention(device) -> dict:
    """Causal GQA with ALiBi and ragged lengths, then a decode step: against the eager reference."""
    from moetron.kernels.flash_attention import flash_attention, flash_attention_reference

    errs = {}
    for name, (S_Q, S_K) in {"prefill": (1000, 1000), "decode": (77, 1000)}.items():
        q = torch.randn(2, 8, S_Q, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 2, S_K, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 2, S_K, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        slopes = 2.0 ** (-torch.arange(1, 9, device=device).float())
        o = flash_attention(q, k, v, True, slopes)
        do = torch.randn_like(o)
        o.backward(do)
        ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
        o_ref = flash_attention_reference(*ref, True, slopes)
        o_ref.backward(do.float())
        errs |= {f"{name}_o": rel_err(o, o_ref)}
        errs |= {f"{name}_d{n}": rel_err(t.grad, r.grad) for n, t, r in zip("qkv", (q, k, v), ref)}
    return {"check": "attention", "max_rel_err": max(errs.values()), "ok": max(errs.values()) < 3e-2, **errs}


def bench_grouped_mm(name: str, rep_ms: int, device) -> list[dict]:
    from moetron.kernels.grouped_mm_triton import grouped_mm_triton, grouped_mm_wgrad_triton

    tokens, top_k, E, d_model, d_ff = MOE_SHAPES[name]
    T = tokens * top_k
    offsets_E = routed_offsets(tokens, top_k, E, device)
    rows = []
    for proj, (K, N) in {"up": (d_model, d_ff), "down": (d_ff, d_model)}.items():
        x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
        w = (torch.randn(E, K, N, device=device) / K**0.5).bfloat16()
        dy = torch.randn(T, N, device=device, dtype=torch.bfloat16)
        w_dense, dy_dense = w[0], dy
        flops = 2.0 * T * K * N
        passes = {
            "fwd": (lambda: grouped_mm_triton(x, w, offsets_E, "triton"),
                    lambda: torch._grouped_mm(x, w, offs=offsets_E),
                    lambda: x @ w_dense),
            "dx": (lambda: grouped_mm_triton(dy, w.transpose(1, 2), offsets_E, "triton"),
                   lambda: torch._grouped_mm(dy, w.transpose(1, 2), offs=offsets_E),
                   lambda: dy_dense @ w_dense.T),
            "dw": (lambda: grouped_mm_wgrad_triton(x, dy, offsets_E, "triton"),
                   lambda: torch._grouped_mm(x.T, dy, offs=offsets_E),
                   lambda: x.T @ dy_dense),
        }
        for pass_name, (ours, grouped, dense) in passes.items():
            err = rel_err(ours(), grouped())
            t_ours, t_grouped, t_dense = (bench_ms(f, rep_ms) for f in (ours, grouped, dense))
            rows.append({
                "op": "grouped_mm", "shape": f"{name}/{proj}", "pass": pass_name,
                "T": T, "K": K, "N": N, "E": E, "rel_err_vs_torch": err,
                "ours_tflops": tflops(flops, t_ours), "grouped_mm_tflops": tflops(flops, t_grouped),
                "dense_tflops": tflops(flops, t_dense),
                "ratio_vs_dense": t_dense / t_ours, "ratio_vs_grouped_mm": t_grouped / t_ours,
            })
    return rows


def bench_attention(seq_len: int, rep_ms: int, device) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    B, H, S, D = max(1, ATTN_TOKENS // seq_len), ATTN_HEADS, seq_len, ATTN_HEAD_DIM
    q, k, v, do = (torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16) for _ in range(4))
    scale = D**-0.5
    fwd_op, bwd_op = torch.ops.moetron.flash_attention_fwd, torch.ops.moetron.flash_attention_bwd
    o, lse = fwd_op(q, k, v, True, None, scale, "triton")

    def sdpa(q_, k_, v_):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale)

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o_sdpa = sdpa(qg, kg, vg)
    grads_sdpa = torch.autograd.grad(o_sdpa, (qg, kg, vg), do, retain_graph=True)
    grads_ours = bwd_op(do, q, k, v, o, lse, True, None, scale, "triton")
    err = max([rel_err(o, o_sdpa)] + [rel_err(a, b) for a, b in zip(grads_ours, grads_sdpa)])

    flops_fwd = 4.0 * B * H * S * S * D / 2  # causal: half the logits are masked
    t_fwd = bench_ms(lambda: fwd_op(q, k, v, True, None, scale, "triton"), rep_ms)
    t_fwd_sdpa = bench_ms(lambda: sdpa(q, k, v), rep_ms)
    t_bwd = bench_ms(lambda: bwd_op(do, q, k, v, o, lse, True, None, scale, "triton"), rep_ms)
    t_bwd_sdpa = bench_ms(lambda: torch.autograd.grad(o_sdpa, (qg, kg, vg), do, retain_graph=True), rep_ms)
    common = {"op": "attention", "shape": f"B{B} H{H} S{S} D{D} causal", "rel_err_vs_torch": err}
    return [
        common | {"pass": "fwd", "ours_tflops": tflops(flops_fwd, t_fwd), "sdpa_flash_tflops": tflops(flops_fwd, t_fwd_sdpa),
                  "ratio_vs_sdpa_flash": t_fwd_sdpa / t_fwd},
        common | {"pass": "bwd", "ours_tflops": tflops(2.5 * flops_fwd, t_bwd),
                  "sdpa_flash_tflops": tflops(2.5 * flops_fwd, t_bwd_sdpa), "ratio_vs_sdpa_flash": t_bwd_sdpa / t_bwd},
    ]


def print_table(rows: list[dict]) -> None:
    print(f"{'op':<11}{'shape':<30}{'pass':<5}{'ours':>8}{'dense':>8}{'_grouped':>9}{'sdpa-fa':>8}"
          f"{'x dense':>8}{'x grp':>7}{'x sdpa':>7}{'err':>9}")
    for r in rows:
        cell = lambda key, fmt: format(r[key], fmt) if key in r else "-"  # noqa: E731
        print(f"{r['op']:<11}{r['shape']:<30}{r['pass']:<5}{cell('ours_tflops', '8.1f'):>8}"
              f"{cell('dense_tflops', '8.1f'):>8}{cell('grouped_mm_tflops', '9.1f'):>9}"
              f"{cell('sdpa_flash_tflops', '8.1f'):>8}{cell('ratio_vs_dense', '8.2f'):>8}"
              f"{cell('ratio_vs_grouped_mm', '7.2f'):>7}{cell('ratio_vs_sdpa_flash', '7.2f'):>7}"
              f"{cell('rel_err_vs_torch', '9.1e'):>9}")
    print("(TFLOP/s; ratios > 1 mean ours is faster)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernel_speed.py needs a CUDA GPU (it times compiled Triton kernels against cuBLAS and "
              "SDPA); none is visible here. The CPU tests are `pytest tests/kernels`.", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    checks, rows = [], []
    if args.only in ("all", "grouped_mm"):
        checks.append(check_grouped_mm(device))
        for name in args.moe_shapes:
            rows += bench_grouped_mm(name, args.rep_ms, device)
    if args.only in ("all", "attention"):
        checks.append(check_attention(device))
        for seq_len in args.seq_lens:
            rows += bench_attention(seq_len, args.rep_ms, device)
    for c in checks:
        print(f"check {c['check']}: max relative error {c['max_rel_err']:.2e} -> {'ok' if c['ok'] else 'FAILED'}")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print_table(rows)
    print(json.dumps({"bench": "kernels", "device": torch.cuda.get_device_name(device), "checks": checks,
                      "results": rows}))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

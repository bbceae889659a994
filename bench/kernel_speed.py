"""Check, then time (and optionally tune), moetron's Triton kernels against torch's own, in one run.

    python bench/kernel_speed.py                      # check + time, ~1-2 minutes on an H100/H200
    python bench/kernel_speed.py --tune               # also try candidate tiles, report the best per shape
    python bench/kernel_speed.py --only attention --seq-lens 4096
    python bench/kernel_speed.py --dry-run            # CPU: tiny shapes through Triton's interpreter

Grouped GEMM (bf16): forward, dX and dW on MoE expert shapes, each beside cuBLAS dense matmul of
the same FLOPs (x_TK @ w_KN) and torch._grouped_mm on the same groups. Attention (bf16, head dim
128, causal): forward and backward beside SDPA's flash backend. Targets: grouped GEMM >= 0.9x
dense and >= 1.0x torch._grouped_mm; attention forward >= 0.9x, backward >= 1.0x SDPA-flash.

--tune times every candidate tile of `TUNE_*` on each shape (a candidate must first reproduce
torch's result), and prints the fastest beside the shipped one; commit the winners into
FORWARD_CONFIGS / WGRAD_CONFIGS / SHIPPED_CONFIGS.

--dry-run runs every code path on CPU at toy sizes (the interpreter, host timers, no SDPA flash)
so the script and its JSON can be tested without a GPU; its numbers mean nothing.

FLOP convention: 2 per multiply-add; causal attention counts only the unmasked half; attention
backward is 2.5x its forward (FlashAttention's convention). Prints a table, then one JSON line.

Legend: T routed rows (tokens x top-k), K/N features, E experts; B batch, H heads, S positions,
D head dim.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# name: (tokens, top_k, experts, d_model, d_ff)
MOE_SHAPES = {
    "mixtral-8x7b": (16384, 2, 8, 4096, 14336),
    "deepseek-64e": (16384, 6, 64, 2048, 1408),
}
DRY_MOE_SHAPES = {"toy": (48, 2, 4, 64, 96)}
ATTN_HEADS, ATTN_HEAD_DIM, ATTN_TOKENS = 32, 128, 16384
DRY_ATTN = (2, 32, 64)  # heads, head dim, tokens


def _gemm(m, n, k, group, warps, stages):
    from moetron.kernels.grouped_mm_triton import GemmConfig

    return GemmConfig(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=group, num_warps=warps, num_stages=stages)


def tune_candidates(dry_run: bool) -> dict:
    """Candidate tiles per kernel: around the shipped ones, within Hopper's 227 KiB of shared memory."""
    from moetron.kernels.attention_tiles import AttnConfig

    if dry_run:
        return {"forward": [_gemm(32, 32, 32, 2, 4, 1), _gemm(16, 32, 32, 1, 4, 1)],
                "wgrad": [_gemm(32, 32, 32, 1, 4, 1), _gemm(16, 32, 16, 1, 4, 1)],
                "attn_fwd": [AttnConfig(32, 32, 4, 1), AttnConfig(16, 32, 4, 1)],
                "attn_dkdv": [AttnConfig(32, 32, 4, 1), AttnConfig(16, 32, 4, 1)],
                "attn_dq": [AttnConfig(32, 32, 4, 1), AttnConfig(32, 16, 4, 1)]}
    return {
        "forward": [_gemm(128, 256, 64, 8, 8, 3), _gemm(128, 256, 64, 8, 8, 4), _gemm(256, 128, 64, 8, 8, 3),
                    _gemm(128, 128, 64, 8, 8, 4), _gemm(128, 128, 64, 8, 4, 4), _gemm(64, 256, 64, 8, 8, 4)],
        "wgrad": [_gemm(64, 128, 128, 1, 8, 4), _gemm(64, 128, 128, 1, 4, 3), _gemm(32, 128, 128, 1, 8, 4),
                  _gemm(64, 256, 128, 1, 8, 3), _gemm(128, 128, 128, 1, 8, 3), _gemm(64, 128, 256, 1, 8, 3)],
        "attn_fwd": [AttnConfig(128, 64, 8, 3), AttnConfig(128, 128, 8, 3), AttnConfig(128, 64, 4, 3),
                     AttnConfig(64, 64, 4, 4), AttnConfig(128, 32, 4, 4), AttnConfig(128, 128, 8, 2)],
        "attn_dkdv": [AttnConfig(32, 128, 4, 5), AttnConfig(64, 128, 8, 3), AttnConfig(32, 64, 4, 4),
                      AttnConfig(64, 64, 4, 3)],
        "attn_dq": [AttnConfig(128, 32, 4, 5), AttnConfig(128, 64, 8, 3), AttnConfig(64, 32, 4, 4),
                    AttnConfig(64, 64, 4, 3)],
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["all", "grouped_mm", "attention"], default="all")
    p.add_argument("--moe-shapes", nargs="+", choices=list(MOE_SHAPES), default=list(MOE_SHAPES))
    p.add_argument("--seq-lens", nargs="+", type=int, default=[2048, 4096, 8192, 16384],
                   help=f"attention sequence lengths; batch = {ATTN_TOKENS} // seq_len (at least 1)")
    p.add_argument("--rep-ms", type=int, default=100, help="time spent timing each measurement")
    p.add_argument("--tune", action="store_true", help="time candidate tiles too and report the fastest")
    p.add_argument("--dry-run", action="store_true", help="CPU, interpreter, toy shapes: exercises the code only")
    p.add_argument("--json", type=Path, help="also write the JSON result here")
    return p.parse_args(argv)


class Timer:
    """Median time of fn in ms: triton.testing.do_bench (CUDA events, L2 flushed) on a GPU,
    host clock on CPU (dry runs)."""

    def __init__(self, rep_ms: int, device: torch.device):
        self.rep_ms, self.device = rep_ms, device

    def __call__(self, fn) -> float:
        if self.device.type == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=max(10, self.rep_ms // 4), rep=self.rep_ms, return_mode="median")
        # No warm-up call: each kernel timed here has already run once (checked against torch) and
        # the interpreter compiles nothing. Calls repeat until rep_ms is spent: a slow interpreted
        # call is timed once, torch's fast ones many times (the median drops their first).
        times, deadline = [], time.perf_counter() + self.rep_ms * 1e-3
        while not times or time.perf_counter() < deadline:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


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


def check_grouped_mm(device, backend: str) -> dict:
    """Ragged groups with empty ones and tail rows: Triton against the fp64 loop reference."""
    from moetron.kernels.grouped_mm import grouped_mm, grouped_mm_reference

    offsets_E = torch.tensor([0, 300, 300, 777, 1000, 1000], device=device, dtype=torch.int32)
    T, K, N = 1033, 520, 700
    if backend == "interpret":
        offsets_E, T, K, N = torch.tensor([0, 30, 30, 77, 100], dtype=torch.int32), 103, 52, 70
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(len(offsets_E), K, N, device=device) / K**0.5).bfloat16().requires_grad_()
    y = grouped_mm(x, w, offsets_E, backend=backend)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = grouped_mm_reference(x64, w64, offsets_E)
    y64.backward(dy.double())
    errs = {"y": rel_err(y, y64), "dx": rel_err(x.grad, x64.grad), "dw": rel_err(w.grad, w64.grad)}
    return {"check": "grouped_mm", "max_rel_err": max(errs.values()), "ok": max(errs.values()) < 2e-2, **errs}


def check_attention(device, backend: str) -> dict:
    """Causal GQA with ALiBi and ragged lengths, then a decode step: against the eager reference."""
    from moetron.kernels.flash_attention import flash_attention, flash_attention_reference

    errs = {}
    shapes = {"prefill": (1000, 1000), "decode": (77, 1000)}
    H, G, D = 8, 2, 128
    if backend == "interpret":
        shapes, D = {"prefill": (40, 40), "decode": (7, 40)}, 32
    for name, (S_Q, S_K) in shapes.items():
        q = torch.randn(2, H, S_Q, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, G, S_K, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, G, S_K, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        slopes = 2.0 ** (-torch.arange(1, H + 1, device=device).float())
        o = flash_attention(q, k, v, True, slopes, backend=backend)
        do = torch.randn_like(o)
        o.backward(do)
        ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
        o_ref = flash_attention_reference(*ref, True, slopes)
        o_ref.backward(do.float())
        errs |= {f"{name}_o": rel_err(o, o_ref)}
        errs |= {f"{name}_d{n}": rel_err(t.grad, r.grad) for n, t, r in zip("qkv", (q, k, v), ref)}
    return {"check": "attention", "max_rel_err": max(errs.values()), "ok": max(errs.values()) < 3e-2, **errs}


def _try_grouped_mm(fn):
    """torch._grouped_mm where this torch has it for these operands, else None."""
    try:
        fn()
        return fn
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _tune(kind: str, shape: str, pass_name: str, candidates, run, reference, flops: float, timer, shipped) -> list[dict]:
    """Time each candidate tile that reproduces `reference`; one row each (failures included)."""
    rows = []
    for cfg in candidates:
        row = {"kernel": kind, "shape": shape, "pass": pass_name, "config": _config_dict(cfg), "shipped": cfg == shipped}
        try:
            err = rel_err(run(cfg), reference)
            row["rel_err"] = err
            if not err < 3e-2:
                rows.append(row | {"status": "wrong"})
                continue
            ms = timer(lambda c=cfg: run(c))
            rows.append(row | {"status": "ok", "ms": ms, "tflops": tflops(flops, ms)})
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile (shared memory) is a result
            rows.append(row | {"status": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"})
    return rows


def _config_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def bench_grouped_mm(shape: tuple, name: str, timer, device, backend: str, tune: dict | None) -> tuple[list, list]:
    from moetron.kernels.grouped_mm_triton import (
        forward_config,
        grouped_mm_triton,
        grouped_mm_wgrad_triton,
        wgrad_config,
    )

    tokens, top_k, E, d_model, d_ff = shape
    T = tokens * top_k
    offsets_E = routed_offsets(tokens, top_k, E, device)
    rows, tuning = [], []
    interpret = backend == "interpret"
    for proj, (K, N) in {"up": (d_model, d_ff), "down": (d_ff, d_model)}.items():
        x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
        w = (torch.randn(E, K, N, device=device) / K**0.5).bfloat16()
        dy = torch.randn(T, N, device=device, dtype=torch.bfloat16)
        w_dense = w[0]
        flops = 2.0 * T * K * N
        passes = {
            "fwd": (lambda c=None: grouped_mm_triton(x, w, offsets_E, backend, c),
                    lambda: torch._grouped_mm(x, w, offs=offsets_E),
                    lambda: x @ w_dense, forward_config(N, x.dtype, interpret), "forward"),
            "dx": (lambda c=None: grouped_mm_triton(dy, w.transpose(1, 2), offsets_E, backend, c),
                   lambda: torch._grouped_mm(dy, w.transpose(1, 2), offs=offsets_E),
                   lambda: dy @ w_dense.T, forward_config(K, x.dtype, interpret), "forward"),
            "dw": (lambda c=None: grouped_mm_wgrad_triton(x, dy, offsets_E, backend, c),
                   lambda: torch._grouped_mm(x.T, dy, offs=offsets_E),
                   lambda: x.T @ dy, wgrad_config(x.dtype, interpret), "wgrad"),
        }
        for pass_name, (ours, grouped, dense, shipped, kind) in passes.items():
            grouped = _try_grouped_mm(grouped)
            reference = grouped().float() if grouped else dense_reference(pass_name, x, w, dy, offsets_E)
            err = rel_err(ours(), reference)
            t_ours, t_dense = timer(ours), timer(dense)
            t_grouped = timer(grouped) if grouped else None
            row = {"op": "grouped_mm", "shape": f"{name}/{proj}", "pass": pass_name, "T": T, "K": K, "N": N, "E": E,
                   "rel_err_vs_torch": err, "ours_tflops": tflops(flops, t_ours), "dense_tflops": tflops(flops, t_dense),
                   "ratio_vs_dense": t_dense / t_ours, "config": _config_dict(shipped)}
            if t_grouped:
                row |= {"grouped_mm_tflops": tflops(flops, t_grouped), "ratio_vs_grouped_mm": t_grouped / t_ours}
            rows.append(row)
            if tune is not None:
                tuning += _tune(kind, f"{name}/{proj}", pass_name, tune[kind], ours, reference, flops, timer, shipped)
    return rows, tuning


def dense_reference(pass_name, x, w, dy, offsets_E):
    """The per-group loop in fp32, where torch._grouped_mm is missing (CPU dry runs)."""
    from moetron.kernels.grouped_mm import grouped_mm_reference, grouped_mm_wgrad_reference

    if pass_name == "fwd":
        return grouped_mm_reference(x.float(), w.float(), offsets_E)
    if pass_name == "dx":
        return grouped_mm_reference(dy.float(), w.float().transpose(1, 2), offsets_E)
    return grouped_mm_wgrad_reference(x.float(), dy.float(), offsets_E)


def bench_attention(seq_len: int, timer, device, backend: str, tune: dict | None, dry_run: bool) -> tuple[list, list]:
    from torch.nn.functional import scaled_dot_product_attention

    from moetron.kernels.attention_tiles import attention_configs
    from moetron.kernels.flash_attention_triton import flash_attention_bwd_triton, flash_attention_fwd_triton

    heads, head_dim, tokens = DRY_ATTN if dry_run else (ATTN_HEADS, ATTN_HEAD_DIM, ATTN_TOKENS)
    B, H, S, D = max(1, tokens // seq_len), heads, seq_len, head_dim
    q, k, v, do = (torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16) for _ in range(4))
    scale = D**-0.5
    shipped = attention_configs(D, q.dtype, backend == "interpret")

    def fwd(c=None):
        return flash_attention_fwd_triton(q, k, v, True, None, scale, backend, c)

    o, lse = fwd()

    def bwd(c=None):
        return flash_attention_bwd_triton(do, q, k, v, o, lse, True, None, scale, backend, c)

    def sdpa(q_, k_, v_):
        if device.type != "cuda":
            return scaled_dot_product_attention(q_.float(), k_.float(), v_.float(), is_causal=True, scale=scale)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale)

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o_sdpa = sdpa(qg, kg, vg)
    grads_sdpa = torch.autograd.grad(o_sdpa, (qg, kg, vg), do.to(o_sdpa.dtype), retain_graph=True)
    grads_ours = bwd()
    err = max([rel_err(o, o_sdpa)] + [rel_err(a, b) for a, b in zip(grads_ours, grads_sdpa)])

    flops_fwd = 4.0 * B * H * S * S * D / 2  # causal: half the logits are masked
    t_fwd, t_fwd_sdpa = timer(fwd), timer(lambda: sdpa(q, k, v))
    t_bwd = timer(bwd)
    t_bwd_sdpa = timer(lambda: torch.autograd.grad(o_sdpa, (qg, kg, vg), do.to(o_sdpa.dtype), retain_graph=True))
    shape = f"B{B} H{H} S{S} D{D} causal"
    common = {"op": "attention", "shape": shape, "rel_err_vs_torch": err}
    rows = [
        common | {"pass": "fwd", "ours_tflops": tflops(flops_fwd, t_fwd), "sdpa_flash_tflops": tflops(flops_fwd, t_fwd_sdpa),
                  "ratio_vs_sdpa_flash": t_fwd_sdpa / t_fwd, "config": _config_dict(shipped.fwd)},
        common | {"pass": "bwd", "ours_tflops": tflops(2.5 * flops_fwd, t_bwd),
                  "sdpa_flash_tflops": tflops(2.5 * flops_fwd, t_bwd_sdpa), "ratio_vs_sdpa_flash": t_bwd_sdpa / t_bwd,
                  "config": {"dkdv": _config_dict(shipped.dkdv), "dq": _config_dict(shipped.dq)}},
    ]
    tuning = [] if tune is None else _tune_attention(tune, shape, fwd, bwd, o_sdpa.detach(), grads_sdpa, flops_fwd,
                                                     timer, shipped)
    return rows, tuning


def _tune_attention(tune: dict, shape: str, fwd, bwd, o_ref, grads_ref, flops_fwd: float, timer, shipped) -> list:
    """The attention tile sweep: the forward, then dK/dV with the shipped dQ tile, then dQ with the
    shipped dK/dV tile, each candidate checked against SDPA's output or gradients."""
    from moetron.kernels.attention_tiles import AttnConfigs

    tuning = _tune("attn_fwd", shape, "fwd", tune["attn_fwd"], lambda c: fwd(c)[0], o_ref, flops_fwd, timer,
                   shipped.fwd)
    ref = torch.cat([g.flatten() for g in grads_ref])

    def bwd_flat(c):
        return torch.cat([g.flatten() for g in bwd(c)])

    tuning += _tune("attn_dkdv", shape, "bwd", [AttnConfigs(shipped.fwd, c, shipped.dq) for c in tune["attn_dkdv"]],
                    bwd_flat, ref, 2.5 * flops_fwd, timer, shipped)
    tuning += _tune("attn_dq", shape, "bwd", [AttnConfigs(shipped.fwd, shipped.dkdv, c) for c in tune["attn_dq"]],
                    bwd_flat, ref, 2.5 * flops_fwd, timer, shipped)
    return tuning


def best_tiles(tuning: list[dict]) -> list[dict]:
    """Per (kernel, shape, pass): the fastest correct candidate and its speedup over the shipped
    tile. `best` is the whole configuration; `tile` the part that was varied (for the attention
    backward, the dK/dV or the dQ tile of the three)."""
    out = []
    keys = sorted({(r["kernel"], r["shape"], r["pass"]) for r in tuning})
    for key in keys:
        ok = [r for r in tuning if (r["kernel"], r["shape"], r["pass"]) == key and r["status"] == "ok"]
        if not ok:
            out.append({"kernel": key[0], "shape": key[1], "pass": key[2], "best": None, "tile": None})
            continue
        best = min(ok, key=lambda r: r["ms"])
        shipped = next((r for r in ok if r["shipped"]), None)
        tile = best["config"][key[0].removeprefix("attn_")] if key[0] in ("attn_dkdv", "attn_dq") else best["config"]
        out.append({"kernel": key[0], "shape": key[1], "pass": key[2], "best": best["config"], "tile": tile,
                    "best_tflops": best["tflops"],
                    "speedup_vs_shipped": shipped["ms"] / best["ms"] if shipped else None})
    return out


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


def print_best(best: list[dict]) -> None:
    for b in best:
        gain = f"{b['speedup_vs_shipped']:.2f}x shipped" if b.get("speedup_vs_shipped") else "-"
        print(f"tune {b['kernel']:<10}{b['shape']:<30}{b['pass']:<5}{gain:>14}  {b['tile']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        # The interpreter must be chosen before triton is first imported.
        os.environ["TRITON_INTERPRET"] = "1"
        device, backend = torch.device("cpu"), "interpret"
    elif not torch.cuda.is_available():
        print("bench/kernel_speed.py needs a CUDA GPU (it times compiled Triton kernels against cuBLAS and SDPA); "
              "none is visible here. Use --dry-run to exercise it on CPU; the CPU tests are `pytest tests/kernels`.",
              file=sys.stderr)
        return 2
    else:
        device, backend = torch.device("cuda"), "triton"
    torch.manual_seed(0)
    timer = Timer(args.rep_ms, device)
    tune = tune_candidates(args.dry_run) if args.tune else None
    checks, rows, tuning = [], [], []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"

    def result() -> dict:
        return {"bench": "kernels", "device": name, "torch": torch.__version__, "dry_run": args.dry_run,
                "checks": checks, "results": rows, "tuning": tuning, "best_tiles": best_tiles(tuning)}

    def save() -> None:
        # Written after every shape, so a run stopped at its time limit keeps what it measured.
        if args.json:
            args.json.write_text(json.dumps(result(), indent=1))

    if args.only in ("all", "grouped_mm"):
        checks.append(check_grouped_mm(device, backend))
        shapes = DRY_MOE_SHAPES if args.dry_run else {n: MOE_SHAPES[n] for n in args.moe_shapes}
        for shape_name, shape in shapes.items():
            r, t = bench_grouped_mm(shape, shape_name, timer, device, backend, tune)
            rows += r
            tuning += t
            save()
    if args.only in ("all", "attention"):
        checks.append(check_attention(device, backend))
        for seq_len in ([64] if args.dry_run else args.seq_lens):
            r, t = bench_attention(seq_len, timer, device, backend, tune, args.dry_run)
            rows += r
            tuning += t
            save()
    for c in checks:
        print(f"check {c['check']}: max relative error {c['max_rel_err']:.2e} -> {'ok' if c['ok'] else 'FAILED'}")
    print(f"device: {name}, torch {torch.__version__}")
    print_table(rows)
    print_best(result()["best_tiles"])
    save()
    print(json.dumps(result()))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

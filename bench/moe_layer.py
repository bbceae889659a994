"""One MoE layer's forward + backward: how much of it is not expert GEMMs.

Routing (router GEMM, softmax, top-k, renormalize, counts), dispatch (sort, gather), the SwiGLU
between the grouped GEMMs and combine (gather, weight, sum over the top-k) are the layer's own
cost; the expert GEMMs are the work it exists to do. This times the layer eager and compiled (`torch.compile` of
the layer, as `train.compile=true` compiles the block around it) and splits a few profiled calls
of each by the profiler's operator self time into expert GEMMs (the grouped GEMMs and what they
call) and everything else.

    python bench/moe_layer.py                       # d=256, 8 experts of 512, top-2, 2,048 tokens, fp32
    python bench/moe_layer.py --precision bf16 --experts 64
    python bench/moe_layer.py --sum-routes         # scatter-add against gather, eager and compiled

Prints a table and one JSON line. Numbers are only comparable within a run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.moe import MoELayer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_throughput import profile_breakdown, time_interleaved  # beside this script


def layer_step(layer, x_TD: torch.Tensor, precision: str):
    """forward + backward of one layer on x_TD as a closure returning its seconds. The backward
    starts from given output gradients (no loss ops of the bench's own), and the parameters'
    gradients are cleared first (as a step's first micro-batch finds them)."""
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
    dy_TD = torch.randn_like(x_TD)

    def step() -> float:
        layer.zero_grad(set_to_none=True)
        x = x_TD.detach().requires_grad_()
        start = time.perf_counter()
        with autocast():
            y_BSD, stats = layer(x[None])
        torch.autograd.backward((y_BSD, stats.aux_loss), (dy_TD[None].to(y_BSD.dtype), torch.ones_like(stats.aux_loss)))
        return time.perf_counter() - start

    return step


def sum_routes(tokens: int, top_k: int, d_model: int, rounds: int) -> dict[str, float]:
    """ms to sum each token's K routed rows (in expert order) into the token: by scatter-adding
    rows into tokens (`index_add_`, what autograd makes of a gather's backward) against gathering
    each token's rows and summing over K (what dispatch's backward and combine do), eager and
    compiled; medians of `rounds` calls."""
    routes = tokens * top_k
    order_A = torch.randperm(routes)  # the route held by each row, as an expert sort leaves them
    row_A = torch.empty_like(order_A).scatter_(0, order_A, torch.arange(routes))
    y_AD = torch.randn(routes, d_model)

    def scatter(y_AD):
        return y_AD.new_zeros(tokens, d_model).index_add_(0, order_A // top_k, y_AD)

    def gather(y_AD):
        return y_AD.index_select(0, row_A).view(tokens, top_k, d_model).sum(1)

    def timed(fn):
        def call() -> float:
            start = time.perf_counter()
            fn(y_AD)
            return time.perf_counter() - start
        return call

    fns = {"scatter_eager": scatter, "gather_eager": gather,
           "scatter_compiled": torch.compile(scatter), "gather_compiled": torch.compile(gather)}
    times = time_interleaved({name: timed(fn) for name, fn in fns.items()}, 1, rounds)
    return {name: round(1e3 * statistics.median(t), 3) for name, t in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--d-expert", type=int, default=512)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-calls", type=int, default=5, help="calls in each profile")
    p.add_argument("--no-compile", action="store_true", help="time the eager layer only")
    p.add_argument("--sum-routes", action="store_true",
                   help="instead: time summing routed rows into tokens, scatter-add against gather")
    args = p.parse_args(argv)
    if args.sum_routes:
        ms = sum_routes(args.tokens, args.top_k, args.d_model, args.steps)
        print(f"sum {args.tokens} × {args.top_k} routed rows of {args.d_model} into tokens, ms: "
              + ", ".join(f"{k} {v}" for k, v in ms.items()))
        print(json.dumps({"bench": "moe_layer.sum_routes", "threads": torch.get_num_threads(), **ms}))
        return

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=args.d_model, n_layers=1, n_heads=1, activation="swiglu",
                      moe=MoEConfig(num_experts=args.experts, top_k=args.top_k, d_expert=args.d_expert,
                                    capacity_factor=None, weighting="renormalize", aux_loss_coef=0.01))
    layer = MoELayer(cfg)
    layer.init_weights(0.02, 0.02)
    x_TD = torch.randn(args.tokens, args.d_model)
    steps = {"eager": layer_step(layer, x_TD, args.precision)}
    if not args.no_compile:
        steps["compiled"] = layer_step(torch.compile(layer), x_TD, args.precision)
    times = time_interleaved(steps, args.warmup, args.steps)
    # Several calls per profile: one call's split moves by a few points from run to run.
    calls = args.profile_calls
    breakdown = {name: profile_breakdown(lambda step=step: [step() for _ in range(calls)])
                 for name, step in steps.items()}

    rows = {}
    for name, parts in breakdown.items():
        total = sum(parts.values())
        rows[name] = {"ms": round(1e3 * statistics.median(times[name]), 2),
                      "profiled_ms": round(total / calls, 2), "expert_gemm_ms": round(parts["expert_gemms"] / calls, 2),
                      "not_expert_gemm_share": round(1 - parts["expert_gemms"] / total, 3)}
    shape = (f"d={args.d_model} experts={args.experts}x{args.d_expert} top-{args.top_k} "
             f"tokens={args.tokens} {args.precision}")
    print(f"MoE layer forward + backward, {shape}, median of {args.steps}")
    print(f"{'':<10}{'ms':>9}{'expert GEMMs ms':>17}{'rest (share)':>16}")
    for name, r in rows.items():
        print(f"{name:<10}{r['ms']:>9.2f}{r['expert_gemm_ms']:>17.2f}{r['not_expert_gemm_share']:>15.1%}")
    print(json.dumps({"bench": "moe_layer", "shape": shape, "threads": torch.get_num_threads(), **rows}))


if __name__ == "__main__":
    main()

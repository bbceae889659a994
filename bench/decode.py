"""KV-cache decoding against recomputing the whole prefix: the reference page's exercise, measured.

The page (../shared/reference/transformer-architecture.txt, "Build it yourself") asks to "Build a
12-layer decoder-only model with KV cache and confirm that adding model.eval() plus the cache cuts
per-token decode latency by roughly L · n / 2 vs naive recompute-everything decoding."

This builds moetron's own Decoder (12 layers, dense SwiGLU FFN, RoPE, MHA; random weights, as
latency does not depend on them), puts it in eval mode and, under torch.no_grad in fp32 on the CPU,
decodes greedily from a random prompt of n tokens both ways:

  cached      one prefill of the prompt, then one token a step through the KV cache (model/generate.py's path)
  recompute   every step reruns the whole prefix (generate_without_cache's path)

Each step after the first is timed on its own, in --rounds interleaved rounds; the table gives,
for each way, the median over steps of each step's fastest round (the machine is shared: the
fastest is the one other load slowed least), their ratio (the speedup), the page's L·n/2 and the
ratio of FLOPs the two steps need (moetron's FLOP model, launcher/perf/flops.py: 2 per active
weight per query, 4·H·Dh per query-key pair per layer).

Why the FLOP ratio is not L·n/2: recomputing a prefix of n runs all n positions through every one of
the L layers, and one cached step runs one position through the same L layers, so L cancels. The
ratio is ≈ n where the weight matmuls dominate (n ≪ 8·D) and falls toward n/2 where attention does
(the cached query still reads all n keys; the prefix's queries read n/2 on average).

    python bench/decode.py --quick    # 2 × 256 model, n = 16, 32: a few seconds
    python bench/decode.py            # 12 × 256 model, n = 64 … 2048: ~75 s, one thread

Writes DIR/decode[_quick].md (the table) and DIR/decode[_quick].png (speedup against n); prints
the table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SIZES = {
    "quick": dict(vocab_size=320, d_model=256, n_layers=2, n_heads=4, d_ff=1024),
    "full": dict(vocab_size=320, d_model=256, n_layers=12, n_heads=8, d_ff=1024),
}
LENGTHS = {"quick": [16, 32], "full": [64, 128, 256, 512, 1024, 2048]}
PAGE_CLAIM = "cuts per-token decode latency by roughly L · n / 2"


def build_decoder(size: str, max_len: int, seed: int = 0):
    """moetron's Decoder of `size` (a dense SwiGLU FFN per layer, RoPE, MHA), eval mode."""
    import torch

    from moetron.model.config import ModelConfig
    from moetron.model.transformer import build_model

    torch.manual_seed(seed)
    cfg = ModelConfig(**SIZES[size], activation="swiglu", norm="rmsnorm", position="rope", attention="sdpa",
                      max_seq_len=max_len)
    return build_model(cfg).eval()


def decode_cached(model, prompt_1S, steps: int):
    """Greedy decoding through the KV cache → (new ids (1, N), logits each was chosen from
    (1, N, V), seconds of each step after the prefill (N − 1,)). Step t feeds token t − 1 at
    position S + t − 1, so its query sees S + t keys."""
    import torch

    from moetron.model.generate import Sampling, next_token

    S, greedy = prompt_1S.shape[1], Sampling(greedy=True)
    with torch.no_grad():
        caches = model.new_caches(1, S + steps)
        logits_1V = model(prompt_1S, caches=caches, start_pos=0).logits_BSV[:, -1]
        ids, logits, seconds = [next_token(logits_1V, greedy)], [logits_1V], []
        for t in range(1, steps):
            start = time.perf_counter()
            logits_1V = model(ids[-1][:, None], caches=caches, start_pos=S + t - 1).logits_BSV[:, -1]
            ids.append(next_token(logits_1V, greedy))
            seconds.append(time.perf_counter() - start)
            logits.append(logits_1V)
    return torch.stack(ids, dim=1), torch.stack(logits, dim=1), seconds


def decode_recompute(model, prompt_1S, steps: int):
    """Greedy decoding by rerunning the whole prefix each step → as `decode_cached`; step t runs
    S + t positions, so its last query sees the same S + t keys as the cached step t."""
    import torch

    from moetron.model.generate import Sampling, next_token

    greedy = Sampling(greedy=True)
    ids_1T, new, logits, seconds = prompt_1S, [], [], []
    with torch.no_grad():
        for t in range(steps):
            start = time.perf_counter()
            logits_1V = model(ids_1T).logits_BSV[:, -1]
            ids_1 = next_token(logits_1V, greedy)
            if t:  # the first step is the cached path's prefill: untimed on both sides
                seconds.append(time.perf_counter() - start)
            new.append(ids_1)
            logits.append(logits_1V)
            ids_1T = torch.cat([ids_1T, ids_1[:, None]], dim=1)
    return torch.stack(new, dim=1), torch.stack(logits, dim=1), seconds


def forward_flops(cfg, queries: int, context: int) -> int:
    """Forward FLOPs of the last `queries` of `context` positions (causal: query i of them sees
    context − queries + i + 1 keys), in launcher/perf/flops.py's convention at a third of a
    training step's: 2 per active weight per query, 4·L·H·Dh per query-key pair (QKᵀ and PV)."""
    from moetron.launcher.perf.flops import attention_flops_per_token, params_active

    first = context - queries + 1
    pairs = (first + context) * queries // 2
    return 2 * params_active(cfg) * queries + attention_flops_per_token(cfg, 1) // 3 * pairs


def flop_ratio(cfg, n: int, steps: int) -> float:
    """FLOPs of the timed recompute steps over those of the timed cached steps (contexts n+1 … n+steps−1)."""
    contexts = range(n + 1, n + steps)
    return sum(forward_flops(cfg, c, c) for c in contexts) / sum(forward_flops(cfg, 1, c) for c in contexts)


def measure(model, n: int, steps: int, rounds: int, seed: int) -> dict:
    """One row of the table: both decodings from the same random prompt of n tokens, `rounds`
    times, interleaved; each step's fastest round (what other load on the machine did not slow
    down), then the median over steps."""
    import torch

    prompt_1S = torch.randint(0, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    runs_c, runs_r = [], []
    for _ in range(rounds):
        runs_c.append(decode_cached(model, prompt_1S, steps))
        runs_r.append(decode_recompute(model, prompt_1S, steps))
    (ids_c, logits_c, _), (_, logits_r, _) = runs_c[0], runs_r[0]
    cached = statistics.median(map(min, zip(*(run[2] for run in runs_c))))
    recompute = statistics.median(map(min, zip(*(run[2] for run in runs_r))))
    contexts = range(n + 1, n + steps)
    return {"n": n, "ms_cached": 1e3 * cached, "ms_recompute": 1e3 * recompute, "speedup": recompute / cached,
            "flop_ratio": flop_ratio(model.cfg, n, steps), "page_claim": model.cfg.n_layers * n / 2,
            "gflops_cached": statistics.fmean(forward_flops(model.cfg, 1, c) for c in contexts) / cached / 1e9,
            "gflops_recompute": statistics.fmean(forward_flops(model.cfg, c, c) for c in contexts) / recompute / 1e9,
            "same_tokens": all(torch.equal(ids_c, run[0]) for run in runs_c + runs_r),
            "max_logit_diff": float((logits_c - logits_r).abs().max())}


def table(rows: list[dict]) -> str:
    head = ["n", "ms/token cached", "ms/token recompute", "speedup", "FLOP ratio", "page: L·n/2",
            "GFLOP/s cached", "GFLOP/s recompute", "same greedy tokens", "max abs Δlogit"]
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for r in rows:
        lines.append(f"| {r['n']} | {r['ms_cached']:.2f} | {r['ms_recompute']:.2f} | {r['speedup']:.1f}× "
                     f"| {r['flop_ratio']:.0f} | {r['page_claim']:.0f} | {r['gflops_cached']:.1f} "
                     f"| {r['gflops_recompute']:.1f} | {'yes' if r['same_tokens'] else 'NO'} "
                     f"| {r['max_logit_diff']:.1e} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    ns = [r["n"] for r in rows]
    fig = Figure(figsize=(7, 4.2), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(ns, [r["speedup"] for r in rows], marker="o", label="measured speedup (recompute / cached)")
    ax.plot(ns, [r["flop_ratio"] for r in rows], marker="s", linestyle="--", label="FLOP ratio")
    ax.plot(ns, [r["page_claim"] for r in rows], linestyle=":", color="grey", label="the page's L·n/2")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("prompt length n")
    ax.set_ylabel("per-token decode latency ratio")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 × 256 model, n = 16, 32: seconds")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt lengths n (default by mode)")
    p.add_argument("--steps", type=int, default=9, help="tokens decoded per n; all but the first are timed")
    p.add_argument("--rounds", type=int, default=3, help="decodings per n and way; each step's fastest counts")
    p.add_argument("--threads", type=int, default=1, help="intra-op CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out", help="folder for the .md and .png")
    args = p.parse_args()
    size = "quick" if args.quick else "full"
    lengths = args.lengths or LENGTHS[size]

    import torch

    torch.set_num_threads(args.threads)
    model = build_decoder(size, max(lengths) + args.steps, args.seed)
    measure(model, lengths[0], 3, 1, args.seed)  # warm-up: first calls allocate and pick kernels
    rows = []
    for n in lengths:
        rows.append(measure(model, n, args.steps, args.rounds, args.seed))
        print(f"n = {n}: {rows[-1]['speedup']:.1f}× ({rows[-1]['ms_cached']:.2f} ms cached)", flush=True)
    c = model.cfg
    title = (f"{c.n_layers} layers, D {c.d_model}, H {c.n_heads}, F {c.d_ff}, fp32, threads {args.threads}; "
             f"median over {args.steps - 1} decode steps of the fastest of {args.rounds} rounds")
    text = f"{title}\n\n{table(rows)}\n"
    print(f"\n{text}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "decode_quick" if args.quick else "decode"
    (args.out / f"{stem}.md").write_text(text)
    plot(rows, args.out / f"{stem}.png", title)
    print(f"wrote {args.out / stem}.md, .png")
    print(json.dumps({"bench": "decode", "size": size, "n_layers": c.n_layers, "steps": args.steps,
                      "rounds": args.rounds, "threads": args.threads, "page_claim": PAGE_CLAIM, "rows": rows}))


if __name__ == "__main__":
    main()

"""Training-step tokens/s: moetron's Mixtral-layout MoE against transformers' MixtralForCausalLM
(same config, batch and precision) and against a dense moetron model of equal active parameters.

All models are built in one process and timed in interleaved rounds (one step of each per
round), so drift in machine load hits them alike; the median step time of each is reported.
A step is forward, cross-entropy (+ the router's aux loss), backward and AdamW.

    python bench/model_throughput.py                 # d=256, 4 layers, 8/4 heads, 8 experts of 512, top-2, 8 × 256
    python bench/model_throughput.py --quick         # a smoke run on a small shape
    python bench/model_throughput.py --precision bf16 --steps 30
    python bench/model_throughput.py --ac             # also moetron's MoE with full and selective checkpointing
    python bench/model_throughput.py --compile        # also moetron's models compiled (train.compile=true)
    python bench/model_throughput.py --expert-sweep 8 16 32 64 --no-transformers

moetron's models step with the optimizer `moetron train` builds (fused AdamW where the device has
it); transformers' with torch's default AdamW. `--ac` reports, beside tokens/s, the heap that one
forward leaves allocated for backward (glibc's in-use bytes after minus before). `--expert-sweep`
times moetron's MoE at each expert count with expert width and top-k fixed (active parameters
fixed, total growing): forward + backward alone and the full step with AdamW, relative to the first.

`--compile` adds copies of moetron's two models compiled as `train.compile=true` compiles them
(block by block, and the cross-entropy), timed in the same rounds after their compilation.

After the timed rounds one more step of each model runs under the profiler, and its operators'
self time is split into expert GEMMs (grouped GEMMs and what they call), attention (SDPA or the
flash kernels, forward and backward), other matmuls (projections, dense FFN, LM head) and
everything else (routing, permutes, norms, activations, the optimizer).

Prints a table and one JSON line. Numbers are only comparable within a run: on a shared 2-core
machine other load slows everything several-fold (the run warns when the load average is high).

Under bf16 autocast the two MoEs do not run the same arithmetic: transformers' Mixtral sends its
experts through `torch._grouped_mm`, which has no autocast rule, and casts the input to the
weights' dtype (transformers/integrations/moe.py `_grouped_mm`), so its experts stay in fp32;
moetron's experts run in bf16 as asked. On a CPU without native bf16 that favours transformers.
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

from moetron.launcher.config import TrainConfig
from moetron.launcher.train.optim import build_optimizer
from moetron.launcher.train.trainer import next_token_cross_entropy
from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.transformer import build_model
from moetron.parallel.activation_checkpoint import apply_activation_checkpointing
from moetron.parallel.parallelize import apply_compile


def moetron_configs(args) -> dict[str, ModelConfig]:
    """The Mixtral layout (RMSNorm, SwiGLU, RoPE, GQA, softmax → top-k → renormalize, dropless)
    and its dense twin, whose FFN is as wide as the top_k experts a token activates."""
    moe = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, d_ff=args.top_k * args.d_expert, activation="swiglu",
                      norm="rmsnorm", position="rope", attention="sdpa", max_seq_len=args.seq_len,
                      moe=MoEConfig(num_experts=args.experts, top_k=args.top_k, d_expert=args.d_expert,
                                    capacity_factor=None, weighting="renormalize", aux_loss_coef=args.aux_coef))
    return {"moetron-moe": moe, "moetron-dense": moe.replace(moe=MoEConfig())}


def transformers_mixtral(args):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_expert,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, num_local_experts=args.experts,
                        num_experts_per_tok=args.top_k, max_position_embeddings=args.seq_len,
                        output_router_logits=True, router_aux_loss_coef=args.aux_coef, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return MixtralForCausalLM(cfg)


def moetron_loss(model, ids_BS, cross_entropy=next_token_cross_entropy):
    out = model(ids_BS)
    return cross_entropy(out.logits_BSV[:, :-1], ids_BS[:, 1:]) + out.aux_loss


def compiled_twin(model: torch.nn.Module, cfg: ModelConfig):
    """A copy of `model` compiled as `train.compile=true` compiles (block by block, and the
    trainer's loss), with its loss function."""
    twin = build_model(cfg)
    twin.load_state_dict(model.state_dict())
    apply_compile(twin)
    cross_entropy = torch.compile(next_token_cross_entropy)
    return twin, lambda m, ids_BS: moetron_loss(m, ids_BS, cross_entropy)


def transformers_loss(model, ids_BS):
    # labels = inputs: the model shifts them itself and adds coef × its load-balancing loss.
    return model(input_ids=ids_BS, labels=ids_BS).loss


def time_interleaved(steps: dict, warmup: int, rounds: int) -> dict:
    """Seconds of each call of each closure in `steps` (each returns its own seconds): `warmup`
    untimed rounds, then `rounds` rounds of one call of every closure, interleaved so drift in
    the machine's load hits them alike."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            times[key].append(step())
    return times


def make_step(model, loss_fn, ids_BS, precision, *, moetron_optimizer: bool, timed: str = "step"):
    """One training step as a closure returning its seconds; `timed="fwd_bwd"` returns the time
    of forward + backward only (the optimizer still steps, untimed)."""
    opt = (build_optimizer(model, TrainConfig(lr=1e-4)) if moetron_optimizer
           else torch.optim.AdamW(model.parameters(), lr=1e-4))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with autocast():
            loss = loss_fn(model, ids_BS)
        loss.backward()
        fwd_bwd = time.perf_counter() - start
        opt.step()
        elapsed = time.perf_counter() - start
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss {loss.item()}")
        return fwd_bwd if timed == "fwd_bwd" else elapsed

    return step


# Profile classes: an operator belongs to the first class whose names appear in it or in the
# operators that called it (a grouped GEMM's own matmuls count as expert GEMMs).
EXPERT_OPS = ("grouped_mm",)
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "moetron::flash")
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
PROFILE_KINDS = ("expert_gemms", "attention", "other_matmuls", "everything_else")


def profile_breakdown(step) -> dict[str, float]:
    """Milliseconds of one call of `step` by class — expert GEMMs, attention, other matmuls,
    everything else — from the profiler's self CPU time of each operator."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    out = dict.fromkeys(PROFILE_KINDS, 0.0)
    for event in prof.events():
        names, parent = [event.name], event.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        if any(key in name for name in names for key in EXPERT_OPS):
            kind = "expert_gemms"
        elif any(key in name for name in names for key in ATTENTION_OPS):
            kind = "attention"
        elif event.name in MATMUL_OPS:
            kind = "other_matmuls"
        else:
            kind = "everything_else"
        out[kind] += event.self_cpu_time_total / 1e3
    return out


def kept_for_backward(model, loss_fn, ids_BS, precision) -> int:
    """Heap bytes one forward leaves allocated (what autograd keeps for backward, plus the loss)."""
    from plan_check import HeapPeak  # bench/plan_check.py, beside this script: glibc's in-use bytes

    heap = HeapPeak()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    before = heap.in_use()
    with autocast:
        loss = loss_fn(model, ids_BS)
    kept = heap.in_use() - before
    loss.backward()
    model.zero_grad(set_to_none=True)
    return kept


def expert_sweep(args) -> dict:
    """tokens/s of moetron's MoE at each expert count, forward + backward and the full step."""
    ids_BS = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    tokens = args.batch * args.seq_len
    steps = {}
    for experts in args.expert_sweep:
        torch.manual_seed(0)
        cfg = moetron_configs(argparse.Namespace(**{**vars(args), "experts": experts}))["moetron-moe"]
        model = build_model(cfg).train()
        for timed in ("fwd_bwd", "step"):
            steps[experts, timed] = make_step(model, moetron_loss, ids_BS, "fp32", moetron_optimizer=True, timed=timed)
        steps[experts, "params"] = sum(p.numel() for p in model.parameters())
    times = time_interleaved({k: v for k, v in steps.items() if callable(v)}, args.warmup, args.steps)
    tok_s = {k: tokens / statistics.median(v) for k, v in times.items()}
    first = args.expert_sweep[0]
    rows = [{"experts": e, "params": steps[e, "params"],
             "fwd_bwd_tokens_per_s": tok_s[e, "fwd_bwd"], "step_tokens_per_s": tok_s[e, "step"],
             "fwd_bwd_vs_first": tok_s[e, "fwd_bwd"] / tok_s[first, "fwd_bwd"],
             "step_vs_first": tok_s[e, "step"] / tok_s[first, "step"]} for e in args.expert_sweep]
    print(f"{'experts':>8}{'params':>14}{'fwd+bwd tok/s':>15}{'vs E=' + str(first):>9}{'step tok/s':>12}{'vs E=' + str(first):>9}")
    for r in rows:
        print(f"{r['experts']:>8}{r['params']:>14,}{r['fwd_bwd_tokens_per_s']:>15,.0f}{r['fwd_bwd_vs_first']:>8.2f}x"
              f"{r['step_tokens_per_s']:>12,.0f}{r['step_vs_first']:>8.2f}x")
    return {"expert_sweep": rows}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--d-expert", type=int, default=512)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=15, help="timed steps per model and precision")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=None,
                   help="default: fp32, and bf16 where the CPU multiplies bf16 natively (AVX512-BF16, AMX)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--no-transformers", action="store_true", help="time the moetron models only")
    p.add_argument("--quick", action="store_true", help="smoke run: batch 2 × 64, 3 steps, 1 warmup")
    p.add_argument("--ac", action="store_true", help="add moetron's MoE with full and selective checkpointing")
    p.add_argument("--compile", action="store_true",
                   help="add moetron's MoE and dense models compiled as train.compile=true compiles them")
    p.add_argument("--expert-sweep", type=int, nargs="+", metavar="E",
                   help="instead: time moetron's MoE at these expert counts (fp32), expert width fixed")
    args = p.parse_args(argv)
    if args.precision is None:
        args.precision = ["fp32", "bf16"] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else ["fp32"]
        if "bf16" not in args.precision:
            # Without AVX512-BF16/AMX, bf16 matmuls are emulated (~1 GFLOP/s): hours, and no peer compares.
            print("note: this CPU has no native bf16 matmul; timing fp32 only (ask with --precision bf16)",
                  file=sys.stderr)
    if args.quick:
        args.batch, args.seq_len, args.steps, args.warmup = 2, 64, 3, 1
    return args


def models_to_compare(args) -> tuple[dict, dict]:
    """The models the bench times, by name, and each one's loss function: moetron's MoE and dense
    twins, their activation-checkpointed and compiled variants when asked, Hugging Face's Mixtral."""
    torch.manual_seed(0)
    models = {name: build_model(cfg) for name, cfg in moetron_configs(args).items()}
    if args.ac:
        for mode in ("full", "selective"):
            models[f"moetron-moe-ac-{mode}"] = build_model(moetron_configs(args)["moetron-moe"])
            models[f"moetron-moe-ac-{mode}"].load_state_dict(models["moetron-moe"].state_dict())
            apply_activation_checkpointing(models[f"moetron-moe-ac-{mode}"], mode)
    loss_fns = {name: moetron_loss for name in models}
    if args.compile:
        for name, cfg in moetron_configs(args).items():
            models[f"{name}-compiled"], loss_fns[f"{name}-compiled"] = compiled_twin(models[name], cfg)
    if not args.no_transformers:
        models["transformers-mixtral"] = transformers_mixtral(args)
        loss_fns["transformers-mixtral"] = transformers_loss
    return models, loss_fns


def throughput_ratios(row: dict, compiled: bool) -> dict:
    """Ratios of tokens/s between the models of one precision (`row`: name → tokens/s)."""
    ratios = {"moe/dense": row["moetron-moe"] / row["moetron-dense"]}
    if "transformers-mixtral" in row:
        ratios["moetron/transformers"] = row["moetron-moe"] / row["transformers-mixtral"]
    if compiled:
        ratios["compiled/eager moe"] = row["moetron-moe-compiled"] / row["moetron-moe"]
        ratios["compiled/eager dense"] = row["moetron-dense-compiled"] / row["moetron-dense"]
        ratios["moe/dense compiled"] = row["moetron-moe-compiled"] / row["moetron-dense-compiled"]
        if "transformers-mixtral" in row:
            ratios["moetron compiled/transformers"] = row["moetron-moe-compiled"] / row["transformers-mixtral"]
    return ratios


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_1m = os.getloadavg()[0]
    if load_1m > 0.5:
        print(f"WARNING: 1-minute load average is {load_1m:.2f} before starting; other work on this "
              f"machine will distort the numbers (compare ratios, rerun when it is quiet)", file=sys.stderr)

    if args.expert_sweep:
        result = expert_sweep(args)
        print(json.dumps({"bench": "model_throughput", "threads": args.threads, "steps": args.steps,
                          "load_avg_before": round(load_1m, 2), "load_avg_after": round(os.getloadavg()[0], 2),
                          "shape": f"d={args.d_model} L={args.layers} expert width {args.d_expert} top-{args.top_k} "
                                   f"batch={args.batch}x{args.seq_len}", **result}))
        return
    models, loss_fns = models_to_compare(args)
    ids_BS = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    tokens = args.batch * args.seq_len

    steps = {(name, prec): make_step(model.train(), loss_fns[name], ids_BS, prec,
                                     moetron_optimizer=name.startswith("moetron"))
             for prec in args.precision for name, model in models.items()}
    kept = {(name, prec): kept_for_backward(model, loss_fns[name], ids_BS, prec)
            for prec in args.precision for name, model in models.items()} if args.ac else {}
    times = time_interleaved(steps, args.warmup, args.steps)

    # After the timed rounds, so the profiler's own cost touches no timing.
    breakdown = {key: profile_breakdown(step) for key, step in steps.items()}
    tok_s = {prec: {name: tokens / statistics.median(times[name, prec]) for name in models} for prec in args.precision}
    params = {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()}
    ratios = {prec: throughput_ratios(row, args.compile) for prec, row in tok_s.items()}
    shape = (f"d={args.d_model} L={args.layers} heads={args.heads}/{args.kv_heads} "
             f"experts={args.experts}x{args.d_expert} top-{args.top_k} batch={args.batch}x{args.seq_len}")
    print(f"{shape}, {args.threads} threads, median of {args.steps} steps, "
          f"load avg {load_1m:.2f} → {os.getloadavg()[0]:.2f}")
    print(f"{'precision':<10}{'model':<26}{'params':>12}{'ms/step':>10}{'tokens/s':>12}" + (f"{'kept MiB':>10}" if kept else ""))
    for prec in args.precision:
        for name in models:
            ms = 1e3 * statistics.median(times[name, prec])
            kept_mib = f"{kept[name, prec] / 2**20:>10.1f}" if kept else ""
            print(f"{prec:<10}{name:<26}{params[name]:>12,}{ms:>10.1f}{tok_s[prec][name]:>12,.0f}{kept_mib}")
        print(f"{prec:<10}" + "   ".join(f"{k} = {v:.2f}x" for k, v in ratios[prec].items()))
    print("profile of one step: ms of operator self time (share)")
    print(f"{'precision':<10}{'model':<26}" + "".join(f"{k:>18}" for k in PROFILE_KINDS))
    for (name, prec), parts in breakdown.items():
        total = sum(parts.values())
        print(f"{prec:<10}{name:<26}" + "".join(f"{parts[k]:>11.1f} ({parts[k] / total:>4.0%})" for k in PROFILE_KINDS))
    print(json.dumps({
        "bench": "model_throughput", "shape": shape, "quick": args.quick, "threads": args.threads,
        "steps": args.steps, "load_avg_before": round(load_1m, 2), "load_avg_after": round(os.getloadavg()[0], 2),
        "params": params, "tokens_per_s": {p: {n: round(v, 1) for n, v in r.items()} for p, r in tok_s.items()},
        "ratios": {p: {k: round(v, 3) for k, v in r.items()} for p, r in ratios.items()},
        "kept_for_backward_bytes": {f"{n}/{p}": v for (n, p), v in kept.items()},
        "profile_ms": {f"{n}/{p}": {k: round(v, 2) for k, v in parts.items()} for (n, p), parts in breakdown.items()},
    }))


if __name__ == "__main__":
    main()

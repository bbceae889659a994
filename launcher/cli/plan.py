"""`moetron plan CONFIG --gpus N`: the parallel layouts of a config on N devices that fit in memory,
ranked by predicted step time; `--calibrate` measures this machine's profile for `--gpu cpu` (or,
where a CUDA GPU is, its GPU's for `--gpu gpu`)."""

from __future__ import annotations

import json
import sys

from moetron.launcher.cli.help import HelpFormatter


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="choose the parallel layout for N devices from a cost model",
        description="Enumerate every parallel layout moetron train accepts for the config on N devices "
                    "(pp, dp, tp, cp, ep, etp, vpp, schedule, micro-batches, dp_mode and HSDP shard size, "
                    "sequence parallel, gradient accumulation, activation checkpointing), drop those that "
                    "do not fit in device memory, and rank the rest by predicted step time. Each row shows "
                    "memory per rank by part, communication per rank by kind and link, the pipeline bubble, "
                    "step time, tokens/s and MFU. The cost model is described in moetron/launcher/perf/planner.py; "
                    "device profiles and their sources in launcher/perf/device_profiles.py.",
        formatter_class=HelpFormatter)
    p.add_argument("config", nargs="?", help="YAML preset, e.g. configs/mixtral-8x7b.yaml")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="config overrides")
    p.add_argument("--gpus", type=int, help="devices (ranks) to plan for")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (NVLink domain)")
    p.add_argument("--gpu", default="H100",
                   help="device profile: H100, H200, A100, B200, or cpu or gpu (this machine's, calibrated)")
    p.add_argument("--interconnect", default=None, help="inter-node link: ndr, hdr, roce400, eth100")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step; train.batch_size when not given")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length; train.seq_len when not given")
    p.add_argument("--expert-imbalance", type=float, default=1.0,
                   help="routes held by the busiest expert-parallel rank over the mean (1 = balanced; "
                        "moe_max_vio + 1 in metrics.jsonl bounds it); capped by model.moe.capacity_factor")
    p.add_argument("--top", type=int, default=10, help="layouts to show")
    p.add_argument("--where", nargs="+", metavar="FIELD=VALUE", default=(),
                   help="show only layouts with these parallel fields (e.g. pp=4 ep=8 tp=1), with their rank")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--overrides-only", action="store_true",
                   help="print only the best layout's config overrides (for scripts and --layout auto)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine for --gpu cpu (matmul rate, gloo collectives, per-block overhead), "
                        "or where CUDA is its GPU for --gpu gpu (matmul rate, memory bandwidth, per-block overhead)")
    p.add_argument("--ranks", type=int, default=4, help="ranks to calibrate collectives with")
    p.add_argument("--max-spread", type=float, metavar="RATIO",
                   help="refuse to store a calibration whose repeats differ by more than this (max/min; default "
                        "1.5): raise it only where a rough profile is good enough, e.g. on a shared CI machine")
    p.set_defaults(run=run)


def run(args) -> int:
    from moetron.launcher.config import ConfigError

    if args.calibrate:
        profile, path = calibrate_here(args)
        print(json.dumps(profile.to_dict(), indent=1) if args.json else f"calibrated {profile.name}: written to {path}")
        if not args.config:
            return 0
    if not args.config or args.gpus is None:
        raise ConfigError("needs a CONFIG and --gpus N (or --calibrate alone)")
    cfg, profile, result = make_plan(args)
    if not result.ranked:
        raise ConfigError(result.refusal(cfg, args.config, args.gpus, profile.name))
    if args.overrides_only:
        print(" ".join(result.ranked[0].layout.overrides()))
        return 0
    shown = matching(result.ranked, args.where)
    if args.json:
        print(json.dumps({"config": args.config, "gpus": args.gpus, "profile": profile.to_dict(),
                          "considered": result.considered,
                          "ranked": [{"rank": i, **p.to_dict()} for i, p in shown[:args.top]],
                          # `matching` pairs each with its position; a layout that does not fit has no rank.
                          "dropped": [p.to_dict() for _, p in matching(result.dropped, args.where)[:args.top]]}))
        return 0
    print_plan(cfg, args, profile, result, shown)
    return 0


def calibrate_here(args):
    """This machine's profile: its GPU's ("gpu") where CUDA is, else its CPU's ("cpu")."""
    import torch

    if torch.cuda.is_available():
        from moetron.launcher.perf.calibrate_gpu import calibrate_gpu

        return calibrate_gpu(torch.device("cuda"))
    from moetron.launcher.perf.calibrate import MAX_SPREAD, calibrate

    return calibrate(ranks=args.ranks, max_spread=args.max_spread or MAX_SPREAD)


def matching(predictions, where) -> list:
    """(1-based rank, prediction) of those whose parallel fields equal every FIELD=VALUE of `where`."""
    from moetron.launcher.config import ConfigError

    wanted = {}
    for item in where:
        key, sep, value = item.partition("=")
        if not sep or not hasattr(predictions[0].layout.parallel if predictions else None, key):
            raise ConfigError(f"--where {item!r}: expected FIELD=VALUE with a parallel field, e.g. pp=4")
        wanted[key] = value
    return [(i, p) for i, p in enumerate(predictions, 1)
            if all(str(getattr(p.layout.parallel, k)).lower() == v.lower() for k, v in wanted.items())]


def make_plan(args):
    from moetron.launcher.config import ConfigError, load_config
    from moetron.launcher.perf.device_profiles import get_profile

    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: must be >= 1")
    overrides = list(args.overrides)
    if args.global_batch:
        overrides.append(f"train.batch_size={args.global_batch}")
    if args.seq_len:
        overrides.append(f"train.seq_len={args.seq_len}")
    # The plan picks the accumulation and the layout: neither the preset's accumulation nor its dp
    # inferred from --gpus need suit the devices.
    cfg = load_config(args.config, [*overrides, "train.grad_accum=1"])
    profile = get_profile(args.gpu, interconnect=args.interconnect)
    if args.expert_imbalance < 1:
        raise ConfigError(f"--expert-imbalance {args.expert_imbalance}: must be >= 1 (the busiest rank over the mean)")
    # Imported once the config is valid: the planner loads torch (the mesh's shape), which takes seconds.
    from moetron.launcher.perf.planner import plan

    return cfg, profile, plan(cfg, args.gpus, profile, gpus_per_node=args.gpus_per_node,
                              expert_imbalance=args.expert_imbalance)


def print_plan(cfg, args, profile, result, shown) -> None:
    from rich.console import Console
    from rich.table import Table

    from moetron.launcher.perf import display

    console = Console(width=None if sys.stdout.isatty() else 1000)
    gib = 2**30
    t = cfg.train
    table = Table(title=f"{args.config} on {args.gpus} × {profile.name} ({args.gpus_per_node} per node): "
                        f"{t.batch_size} × {t.seq_len} tokens per step; {result.considered} layouts valid, "
                        f"{len(result.ranked)} parallel sections fit, {len(result.dropped)} do not",
                  title_justify="left")
    for col in ("#", "layout", "step s", "throughput", "MFU", "GiB/rank w+g+o+act+buf", "comm GB/rank intra | inter",
                "exposed comm s", "bubble"):
        table.add_column(col, no_wrap=col != "layout")
    for i, p in shown[:args.top]:
        m = p.memory
        parts = "+".join(f"{m[k] / gib:.1f}" for k in ("weights", "grads", "optimizer", "activations", "buffers"))
        table.add_row(str(i), p.layout.label(), display.significant(p.step_s), display.tokens_per_s(p.tokens_per_s),
                      display.mfu(p.mfu),
                      f"{m['total'] / gib:.1f} = {parts}",
                      f"{p.link_bytes['intra'] / 1e9:.2f} | {p.link_bytes['inter'] / 1e9:.2f}",
                      display.significant(p.times['comm_exposed']), f"{p.bubble:.1%}")
    console.print(table)
    best = result.ranked[0]
    console.print("best as overrides: " + " ".join(best.layout.overrides()))
    if args.where and not shown:
        console.print(f"no fitting layout has {' '.join(args.where)}")
    if result.dropped:
        console.print(f"does not fit (leanest variant of each, smallest first), e.g. "
                      f"{result.dropped[0].layout.label()}: {result.dropped[0].reason}")

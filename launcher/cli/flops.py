"""`moetron flops CONFIG [key=value ...]`: parameters, FLOPs per token, KV cache and memory per rank,
before spending any GPU; with `--measure`, the same FLOPs counted on real training steps."""

from __future__ import annotations

import sys

from moetron.launcher.cli.help import HelpFormatter

# Counted and analytic FLOPs outside attention may differ by this much before `--measure` fails.
MEASURE_TOLERANCE = 0.02


def register(sub) -> None:
    p = sub.add_parser(
        "flops", help="parameters, FLOPs, KV cache and memory of a config",
        description="Account for a model: total, embedding and active parameters; training FLOPs per "
                    "token by component (attention both as the full square and causal-halved); KV "
                    "cache; memory per rank for the config's parallel layout. --measure runs real "
                    "training steps on random tokens and compares the FLOPs they executed, exiting "
                    "with status 1 when counted and analytic differ by more than 2% outside attention.",
        formatter_class=HelpFormatter)
    p.add_argument("config", help="YAML preset, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="config overrides")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length; train.seq_len when not given")
    p.add_argument("--batch", type=int, default=None, help="sequences per step; train.batch_size when not given")
    p.add_argument("--kv-bytes", type=int, default=2, help="bytes per cached key/value element (2: bf16)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--measure", action="store_true", help="count FLOPs on real forward+backward steps")
    p.add_argument("--measure-batch", type=int, default=2, help="sequences per measured step")
    p.add_argument("--measure-steps", type=int, default=1, help="measured steps")
    p.set_defaults(run=run)


def measure(cfg, seq_len: int, batch: int, steps: int):
    """Run `steps` real training steps (AdamW, the configured precision) on random tokens while
    counting FLOPs → FlopMeasurement."""
    import torch

    from moetron.launcher.perf.flop_counter import measure_flops, single_process_step
    from moetron.launcher.train.device import resolve_device, use_bf16
    from moetron.launcher.train.optim import build_optimizer
    from moetron.model.transformer import build_model

    device = resolve_device(cfg)
    bf16 = use_bf16(cfg, device)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, device=device)
    optimizer = build_optimizer(model, cfg.train)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def step() -> dict:
        tokens_BS1 = torch.randint(0, cfg.model.vocab_size, (batch, seq_len + 1), device=device)
        return single_process_step(model, optimizer, tokens_BS1, autocast)

    return measure_flops(model, step, steps, batch * seq_len), "bf16" if bf16 else "fp32"


def run(args) -> int:
    import json

    from moetron.launcher.config import ConfigError, load_config

    cfg = load_config(args.config, args.overrides)  # before torch is loaded, so a bad config answers at once
    from moetron.launcher.perf.flop_counter import worst_mismatch
    from moetron.launcher.perf.flops import flops_by_component
    from moetron.launcher.perf.mfu import config_accounting

    seq_len = cfg.train.seq_len if args.seq_len is None else args.seq_len
    batch = cfg.train.batch_size if args.batch is None else args.batch
    for flag, value in (("--seq-len", seq_len), ("--batch", batch), ("--measure-batch", args.measure_batch),
                        ("--measure-steps", args.measure_steps)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    if args.measure and seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len}: must be <= model.max_seq_len ({cfg.model.max_seq_len}) to measure")
    acct = config_accounting(cfg, seq_len=seq_len, batch=batch, kv_bytes=args.kv_bytes)

    rows, worst = None, 0.0
    if args.measure:
        measurement, precision = measure(cfg, seq_len, args.measure_batch, args.measure_steps)
        rows = measurement.rows(flops_by_component(cfg.model, seq_len))
        worst = worst_mismatch(rows)
        acct["measured"] = {
            "precision": precision, "tokens": measurement.tokens, "kept_fraction": measurement.kept_fraction,
            "uncounted_ops": measurement.uncounted_ops, "worst_mismatch_outside_attention": worst,
            "ok": worst <= MEASURE_TOLERANCE,
            "components": {r.component: {"analytic": r.analytic, "counted": r.counted, "ratio": r.ratio}
                           for r in rows},
        }
    if args.json:
        print(json.dumps(acct))
    else:
        _print_tables(cfg, acct, rows)
    return 1 if rows is not None and worst > MEASURE_TOLERANCE else 0


def _print_tables(cfg, acct: dict, rows) -> None:
    from rich.console import Console
    from rich.table import Table

    from moetron.launcher.perf.flops import human, summary_rows

    # Piped into a file or `less`, rich would assume 80 columns and cut cells ("para…"); print whole.
    console = Console(width=None if sys.stdout.isatty() else 1000)
    m, lay = cfg.model, acct["layout"]
    title = (f"{cfg.run_name}: L={m.n_layers} D={m.d_model} H={m.n_heads}/{m.kv_heads} "
             + (f"MLA R={m.mla.kv_lora_rank} Rq={m.mla.q_lora_rank} " if m.mla.enabled else "")
             + (f"E={m.moe.num_experts} top-{m.moe.top_k}" if m.moe.enabled else "dense")
             + f"  · layout pp={lay['pp']} tp={lay['tp']} cp={lay['cp']} ep={lay['ep']} etp={lay['etp']} "
             + f"dp={lay['dp']} ({lay['dp_mode']}" + (f", shard {lay['dp_shard']}" if lay['dp_mode'] == "hsdp" else "") + ")")
    summary = Table(title=title, title_justify="left")
    summary.add_column("field", no_wrap=True)
    summary.add_column("value", justify="right", no_wrap=True)
    summary.add_column("note")
    for row in summary_rows(acct):
        summary.add_row(*row)
    console.print(summary)

    parts = Table(title="training FLOPs per token by component", title_justify="left")
    for column in ("component", "params", "active", "FLOP/token", "share", "causal FLOP/token"):
        parts.add_column(column, justify="left" if column == "component" else "right", no_wrap=True)
    for name, c in acct["components"].items():
        parts.add_row(name, human(c["params"]), human(c["params_active"]), human(c["flops_per_token"]),
                      f"{c['flops_per_token'] / acct['flops_per_token']:.1%}", human(c["flops_per_token_causal"]))
    console.print(parts)
    console.print(f"[dim]convention: {acct['convention']}[/dim]")

    if rows is None:
        return
    meas = acct["measured"]
    check = Table(title=f"measured on {meas['tokens']} tokens ({meas['precision']}, random tokens; "
                        f"routes kept {meas['kept_fraction']:.1%})", title_justify="left")
    for column in ("component", "analytic FLOP", "counted FLOP", "counted/analytic"):
        check.add_column(column, justify="left" if column == "component" else "right", no_wrap=True)
    for r in rows:
        flag = "" if r.in_attention or abs(r.ratio - 1) <= MEASURE_TOLERANCE else " [red]✗[/red]"
        note = " (convention, not checked)" if r.in_attention else ""
        check.add_row(r.component, human(r.analytic), human(r.counted), f"{r.ratio:.4f}{flag}{note}")
    console.print(check)
    if meas["uncounted_ops"]:
        console.print(f"[yellow]matmul-like ops without a FLOP formula: {', '.join(meas['uncounted_ops'])}[/yellow]")
    verdict = "[green]agree[/green]" if meas["ok"] else "[red]disagree[/red]"
    console.print(f"outside attention, counted and analytic {verdict} within {MEASURE_TOLERANCE:.0%} "
                  f"(worst {meas['worst_mismatch_outside_attention']:.2%})")

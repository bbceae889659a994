"""`moetron train CONFIG [key=value ...]`: train on this process or on every rank of a launch."""

from __future__ import annotations

from moetron.launcher.cli.help import HelpFormatter


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model from a YAML config",
        description="Train the model a YAML config describes. Overrides follow the config as "
                    "dotted key=value pairs, e.g. `moetron train configs/tiny.yaml model.moe.top_k=1 "
                    "train.steps=200`. Outputs go to <train.run_dir>/<train.name>/ (metrics.jsonl, "
                    "tensorboard/, checkpoints/). Under torchrun, srun or mpirun every rank runs this.",
        formatter_class=HelpFormatter)
    p.add_argument("config", help="YAML preset, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="config overrides")
    p.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                   help="auto: continue from the run folder's newest complete checkpoint (or start "
                        "fresh if the folder is new); none: fresh start, refused if the folder holds a "
                        "run; PATH: a checkpoint folder")
    p.add_argument("--exit-after", type=int, default=None, metavar="N",
                   help="stop after N steps of this invocation, with a checkpoint (as a preemption would)")
    p.add_argument("--layout", choices=("config", "auto"), default="config",
                   help="auto: at every start, the layout `moetron plan` ranks first for the ranks this "
                        "launch has (overrides the config's parallel section, train.grad_accum and "
                        "train.activation_checkpoint; train.batch_size, the global batch, stays, and a resumed "
                        "run keeps its micro-batch size where a layout can); a checkpoint of another layout "
                        "is resharded into it. Written to the run folder's layouts.jsonl")
    p.add_argument("--gpu", default=None, metavar="PROFILE",
                   help="device profile for --layout auto: H100, H200, A100, B200 or cpu (default: this "
                        "machine's GPU, or cpu, measured on first use)")
    p.set_defaults(run=run)


def run(args) -> int:
    try:
        return _run(args)
    except Exception as e:
        from moetron.launcher.cli.main import is_user_error
        from moetron.launcher.cluster.elastic import stop_agent_at_exit

        # Refused for a reason a restart would meet again (a config, a world too small for any
        # layout): under torchrun, this node's agent stops instead of restarting the ranks.
        if is_user_error(e):
            stop_agent_at_exit()
        raise


def _run(args) -> int:
    from moetron.launcher.cluster.bootstrap import detect_rank
    from moetron.launcher.cluster.elastic import restart_problem
    from moetron.launcher.config import ConfigError, load_config

    problem = restart_problem()  # said at the start, not at the first restart
    if problem:
        raise ConfigError(problem)
    info = detect_rank()
    overrides, choice = list(args.overrides), None
    if args.layout == "auto":
        overrides, choice = _auto_layout(args, info)
    cfg = load_config(args.config, overrides, world_size=info.world_size)
    # Imported once the config is valid: torch and the training stack take seconds to load.
    from moetron.launcher.train.trainer import train

    run_path = train(cfg, resume=args.resume, exit_after=args.exit_after, layout_choice=choice)
    if not info.is_main:
        return 0
    print(f"run folder:   {run_path}")
    print(f"metrics:      {run_path / 'metrics.jsonl'}")
    # The runs folder, not this run's: TensorBoard then shows every run of it side by side.
    print(f"tensorboard:  tensorboard --logdir {run_path.parent}")
    print(f"checkpoints:  {run_path / 'checkpoints'}")
    return 0


def _auto_layout(args, info) -> tuple[list[str], dict]:
    """The config's overrides plus the layout the planner ranks first for this launch's ranks, and
    how it chose (every rank plans alike: the same config, world size, run folder and profile).

    A resumed run keeps the micro-batch size of its last start where some layout gives it (the
    balance loss and router capacity are per micro-batch: the same groups of sequences keep the
    same objective, so the curve continues); where none does, the plan is free and says so."""
    import os
    import sys

    from moetron.launcher.config import ConfigError
    from moetron.launcher.perf import display
    from moetron.launcher.perf.planner import choose_layout

    profile = args.gpu or _this_device()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or info.world_size)
    size = _kept_micro_batch(args, info.world_size)
    kept = [f"train.micro_batch_size={size}"] if size else []
    try:
        best = choose_layout(args.config, [*args.overrides, *kept], info.world_size, profile, gpus_per_node=per_node)
    except ConfigError:
        if not kept:
            raise
        best = choose_layout(args.config, args.overrides, info.world_size, profile, gpus_per_node=per_node)
        if info.is_main:
            print(f"--layout auto: no layout on {info.world_size} ranks keeps the previous start's "
                  f"{size}-sequence micro-batches; the balance loss now sees other micro-batches, "
                  f"so the loss curve shifts slightly", file=sys.stderr)
        kept = []
    choice = {"profile": profile, "step_s": best.step_s, "tokens_per_s": best.tokens_per_s,
              "memory_gib": best.memory["total"] / 2**30}
    if info.is_main:
        print(f"--layout auto on {info.world_size} × {profile}: {best.layout.label()} ({' '.join(best.layout.overrides())}); "
              f"predicted {display.significant(best.step_s)} s/step, {choice['memory_gib']:.2f} GiB per rank", file=sys.stderr)
    return [*args.overrides, *kept, *best.layout.overrides()], choice


def _kept_micro_batch(args, world_size: int) -> int | None:
    """Sequences per micro-batch of the run's last start, to keep at this resume; None for a fresh
    start, or where the config sets train.micro_batch_size itself."""
    from pathlib import Path

    from moetron.launcher.config import ConfigError, load_config
    from moetron.launcher.train.layout_log import previous_micro_batch

    if args.resume == "none":
        return None
    try:
        cfg = load_config(args.config, [*args.overrides, "train.grad_accum=1"], world_size=world_size)
    except ConfigError:
        return None  # choose_layout says what is wrong
    return None if cfg.train.micro_batch_size else previous_micro_batch(Path(cfg.train.run_dir) / cfg.run_name)


def _this_device() -> str:
    """The profile of the GPU this process would train on (by its name), else "cpu"."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().upper()
    for known in ("H200", "H100", "B200", "A100"):
        if known in name:
            return known
    return "H100"

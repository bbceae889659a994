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
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                   help="auto: continue from the run folder's newest complete checkpoint (or start "
                        "fresh if the folder is new); none: fresh start, refused if the folder holds a "
                        "run; PATH: a checkpoint folder")
    p.add_argument("--exit-after", type=int, default=None, metavar="N",
                   help="stop after N steps of this invocation, with a checkpoint (as a preemption would)")
    p.set_defaults(run=run)


def run(args) -> int:
    from moetron.launcher.cluster.bootstrap import detect_rank
    from moetron.launcher.config import load_config

    info = detect_rank()
    cfg = load_config(args.config, args.overrides, world_size=info.world_size)
    # Imported once the config is valid: torch and the training stack take seconds to load.
    from moetron.launcher.train.trainer import train

    run_path = train(cfg, resume=args.resume, exit_after=args.exit_after)
    if not info.is_main:
        return 0
    print(f"run folder:   {run_path}")
    print(f"metrics:      {run_path / 'metrics.jsonl'}")
    # The runs folder, not this run's: TensorBoard then shows every run of it side by side.
    print(f"tensorboard:  tensorboard --logdir {run_path.parent}")
    print(f"checkpoints:  {run_path / 'checkpoints'}")
    return 0

"""`moetron submit CONFIG [key=value ...] --nodes N --gpus-per-node G ...`: a Slurm batch job that
trains the config, checkpoints on its time-limit or preemption signal, requeues and resumes."""

from __future__ import annotations

import sys

from moetron.launcher.cli.help import HelpFormatter


def register(sub) -> None:
    p = sub.add_parser(
        "submit", help="submit a training job to Slurm",
        description="Submit a Slurm batch job that trains CONFIG: one task per GPU (on CPU-only nodes, "
                    "the layout's parallel.pp × dp × cp × tp ranks), every task started by srun. Ahead of "
                    "the time limit, or when preempted, every rank finishes its step and checkpoints; "
                    "the job then requeues itself (up to --requeue-limit times) and resumes into the "
                    "same run folder. The batch script and the resolved config are written to "
                    "<run>/slurm/, so `sbatch <run>/slurm/job.sbatch` submits the same job by hand. "
                    "Flags left out take the config's `slurm:` section.",
        formatter_class=HelpFormatter)
    p.add_argument("config", help="YAML preset, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="config overrides")
    p.add_argument("--nodes", type=node_range, metavar="N|MIN-MAX",
                   help="nodes; slurm.nodes when not given. MIN-MAX: the job starts on as many nodes as are up "
                        "(at least MIN) and plans its layout for them (needs --layout auto); when a node fails, "
                        "the ranks start again on the nodes left and resume from the newest checkpoint")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node, one rank each; 0: CPU-only nodes")
    p.add_argument("--cpus-per-task", type=int, help="CPU cores per rank")
    p.add_argument("--partition", help="partition; slurm.partition when not given, else the cluster's default")
    p.add_argument("--time", help="time limit: minutes, HH:MM:SS or D-HH:MM:SS")
    p.add_argument("--account", help="account to charge")
    p.add_argument("--qos", help="quality of service")
    p.add_argument("--constraint", help="node features, e.g. h100")
    p.add_argument("--exclusive", action="store_true", default=None, help="whole nodes only")
    p.add_argument("--requeue-limit", type=int, metavar="K",
                   help="times the job requeues itself after a checkpoint (and, with --nodes MIN-MAX, times its "
                        "ranks start again after a lost node)")
    p.add_argument("--signal-seconds", type=int, metavar="S",
                   help="seconds before the time limit at which the ranks are told to checkpoint")
    p.add_argument("--layout", choices=("config", "auto"), default="config",
                   help="auto: the parallel layout `moetron plan` ranks first for this allocation (overrides "
                        "the config's parallel section, gradient accumulation and activation checkpointing)")
    p.add_argument("--gpu", default=None,
                   help="device profile for --layout auto: H100, H200, A100, B200; CPU-only nodes use the "
                        "calibrated cpu profile (moetron plan --calibrate)")
    p.add_argument("--dry-run", action="store_true", help="print the batch script; write and submit nothing")
    p.set_defaults(run=run)


def node_range(text: str) -> tuple[int, int]:
    """--nodes N or MIN-MAX → (MIN, MAX)."""
    import argparse
    import re

    found = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
    if found is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a node count N or a range MIN-MAX")
    nodes = (int(found.group(1)), int(found.group(2) or found.group(1)))
    if not 1 <= nodes[0] <= nodes[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return nodes


def run(args) -> int:
    from pathlib import Path

    cfg, slurm_cfg = config_and_allocation(args)
    from moetron.launcher.cluster.submit import build_submission

    min_nodes, train_args = None, ()
    if args.nodes and args.nodes[0] < args.nodes[1]:
        # The ranks of each start plan their own layout for the nodes Slurm gave them.
        min_nodes, train_args = args.nodes[0], ("--layout", "auto", "--gpu", _profile(args, slurm_cfg))
    sub = build_submission(cfg, slurm_cfg, cwd=Path.cwd(), min_nodes=min_nodes, train_args=train_args)
    check_partition(slurm_cfg.partition, dry_run=args.dry_run)
    if args.dry_run:
        sys.stdout.write(sub.script)
        print(f"moetron submit: dry run, nothing written or submitted; the script would go to {sub.script_path}",
              file=sys.stderr)
        return 0
    submit(sub, slurm_cfg)
    return 0


def config_and_allocation(args):
    """(the job's Config, its Slurm section with the flags applied); under --layout auto the
    config carries the layout `moetron plan` ranks first for the allocation."""
    from moetron.launcher.cluster.submit import SlurmError, apply_flags
    from moetron.launcher.config import load_config

    min_nodes, nodes = args.nodes or (None, None)
    # One rank per GPU: parallel.dp, where the config leaves it out, fills the allocation.
    flag_ranks = nodes * args.gpus_per_node if nodes and args.gpus_per_node else None
    cfg = load_config(args.config, args.overrides, world_size=flag_ranks)

    if min_nodes is not None and min_nodes < nodes and args.layout != "auto":
        raise SlurmError(f"--nodes {min_nodes}-{nodes}: a job that may start on fewer nodes plans its layout at every "
                         f"start; add --layout auto")
    slurm_cfg = apply_flags(
        cfg.slurm, nodes=nodes, gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
        partition=args.partition, time=args.time, account=args.account, qos=args.qos,
        constraint=args.constraint, exclusive=args.exclusive, requeue_limit=args.requeue_limit,
        signal_seconds=args.signal_seconds)
    if flag_ranks is None and slurm_cfg.gpus_per_node > 0:  # the allocation came from the config's slurm:
        cfg = load_config(args.config, args.overrides, world_size=slurm_cfg.nodes * slurm_cfg.gpus_per_node)
    if args.layout == "auto":
        from moetron.launcher.perf.planner import auto_layout

        # GPU nodes: one rank per GPU; CPU-only nodes: as many ranks as the config's layout has.
        ranks = slurm_cfg.nodes * slurm_cfg.gpus_per_node or cfg.parallel.world_size
        per_node = slurm_cfg.gpus_per_node or max(ranks // slurm_cfg.nodes, 1)
        profile = _profile(args, slurm_cfg)
        if min_nodes is not None and min_nodes < nodes:  # refused now if even the fewest nodes fit nothing
            fewest = auto_layout(args.config, args.overrides, min_nodes * per_node, profile, gpus_per_node=per_node)
            print(f"moetron submit: on {min_nodes} node(s) --layout auto would choose {' '.join(fewest)}",
                  file=sys.stderr)
        chosen = auto_layout(args.config, args.overrides, ranks, profile, gpus_per_node=per_node)
        print(f"moetron submit: --layout auto chose {' '.join(chosen)}", file=sys.stderr)
        cfg = load_config(args.config, [*args.overrides, *chosen], world_size=ranks)
    return cfg, slurm_cfg


def _profile(args, slurm_cfg) -> str:
    """The device profile --layout auto plans with: --gpu, else cpu on CPU-only nodes, else H100."""
    return args.gpu or ("cpu" if slurm_cfg.gpus_per_node == 0 else "H100")


def check_partition(partition: str | None, *, dry_run: bool) -> None:
    """Refuse a partition the cluster does not have. A dry run works away from a cluster too:
    where no controller answers it only warns."""
    from moetron.launcher.cluster import submit as cluster

    try:
        known = cluster.partitions()
    except cluster.SlurmError as e:
        if not dry_run:
            raise
        print(f"moetron submit: warning: partition not checked ({e})", file=sys.stderr)
    else:
        cluster.check_partition(partition, known)


def submit(sub, slurm_cfg) -> None:
    """Write the batch script, submit it, record the job in the run folder and say where it is."""
    from moetron.launcher.cluster.jobs import Slurm, active_jobs
    from moetron.launcher.cluster.submit import check_run_folder, record_job, sbatch, write_submission

    slurm = Slurm()
    check_run_folder(sub.config, lambda path: active_jobs(slurm, path))
    script = write_submission(sub)
    job_id = sbatch(script)
    record_job(sub, job_id, slurm_cfg)
    if sub.min_nodes < slurm_cfg.nodes:
        print(f"submitted job {job_id}: {sub.tasks_per_node} rank(s) on each of {sub.nodes_text} nodes, "
              f"its layout planned at every start")
    else:
        print(f"submitted job {job_id}: {sub.tasks} rank(s) on {slurm_cfg.nodes} node(s)")
    print(f"run folder:   {sub.run_path}")
    print(f"script:       {script}")
    print(f"log:          {sub.folder / f'{job_id}.out'}   (moetron logs {job_id} -f)")
    print(f"status:       moetron status {job_id}")

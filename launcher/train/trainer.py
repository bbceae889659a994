"""The training loop: data → forward/backward (with accumulation) → clip → AdamW step → log, eval,
checkpoint. Stops cleanly on Ctrl-C, SIGTERM or SIGUSR1: the current step finishes, a checkpoint
is written, and the run can be resumed.

Legend: B sequences per micro-batch, S sequence length, V vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moetron.launcher.checkpoint.store import Checkpointer, CheckpointError, load_checkpoint
from moetron.launcher.cluster.bootstrap import detect_rank, init_distributed, shutdown
from moetron.launcher.config import Config, ConfigError, validate_launch
from moetron.launcher.data.corpus import WindowSampler, load_token_data, validation_batches
from moetron.launcher.train.dashboards import start_run_dashboards
from moetron.launcher.train.metrics import MetricsLogger
from moetron.launcher.train.nonfinite import (
    NonFiniteError,
    SkipGuard,
    all_finite,
    diagnose,
    is_finite,
    optimizer_tensors,
    stop_message,
)
from moetron.launcher.train.optim import lr_at, optimizer_for, set_lr
from moetron.launcher.train.progress import Progress
from moetron.launcher.train.run_dir import open_run_dir, truncate_metrics
from moetron.model.transformer import Decoder, build_model
from moetron.parallel.expert_bias import biased_routers, clear_expert_counts, update_expert_biases
from moetron.parallel.mesh import build_mesh
from moetron.parallel.parallelize import ParallelModel, parallelize


class StopFlag:
    """Set by SIGINT/SIGTERM/SIGUSR1 so the loop can finish its step and checkpoint.
    A second Ctrl-C interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopFlag":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            # `python -m moetron` holds SIGUSR1 pending until here (see __main__.py): one that came
            # during start-up is delivered now, and the loop stops before its first step.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc) -> None:
        if self._previous:
            # A late SIGUSR1 (the checkpoint is written) stays pending instead of killing the rank.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def __bool__(self) -> bool:
        return self.signum is not None

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank has been signalled. Ranks receive a signal at slightly different
        moments; all must stop after the same step, or those still training would wait forever
        in a collective for those that went on to checkpoint."""
        if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            return bool(self)
        flag = torch.tensor([float(bool(self))], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        # NOTE: host-device sync to read the flag, once per step.
        if flag.item() and self.signum is None:
            self.signum = signal.SIGUSR1  # told by another rank
        return bool(flag.item())


def resolve_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda': no CUDA device is visible (use auto or cpu)")
    return torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")


def use_bf16(cfg: Config, device: torch.device) -> bool:
    """bf16 autocast on CUDA, and on CPUs whose oneDNN has native bf16 matmuls (AVX512-BF16, AMX)."""
    if cfg.train.precision != "auto":
        return cfg.train.precision == "bf16"
    return device.type == "cuda" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass
class StepResult:
    loss: float
    aux_loss: float
    grad_norm: float
    moe: dict
    # Non-finite loss or grad norm: the optimizer did not step (launcher/train/nonfinite.py); why.
    skipped: bool = False
    reason: str = ""


class StepHooks:
    """Calls into the loop around each step, for debugging and fault injection (tests poison one
    rank's batch or gradients through them). `step` is the 1-based number of the step running."""

    def before_step(self, step: int, pm: ParallelModel) -> None:
        """Before the forward passes of `step`."""

    def after_backward(self, step: int, pm: ParallelModel) -> None:
        """After the backward passes of `step`, before the gradients are reduced, clipped and applied."""


def next_token_cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over tokens, in fp32 (logits may be a DTensor split over V under TP)."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())


def language_model_loss(model: Decoder, batch_BS1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Next-token cross entropy (mean over tokens, fp32) and the MoE aux losses of one micro-batch."""
    out = model(batch_BS1[:, :-1])
    return next_token_cross_entropy(out.logits_BSV, batch_BS1[:, 1:]), out.aux_loss, out.moe


def build_parallel_model(cfg: Config, device: torch.device) -> ParallelModel:
    """This rank's part of the model: built on the meta device, split and sharded for the layout,
    then materialized with the same initial weights as one process (see moetron.parallel)."""
    mesh = build_mesh(cfg.parallel, torch.distributed.get_world_size(), device.type)
    p, t = cfg.parallel, cfg.train
    microbatch_BS = (t.batch_size // (p.dp * t.grad_accum * p.microbatches), t.seq_len)
    return parallelize(build_model(cfg.model, device="meta"), mesh, p, seed=t.seed, device=device,
                       cross_entropy=next_token_cross_entropy, compile=t.compile,
                       activation_checkpoint=t.activation_checkpoint, microbatch_BS=microbatch_BS)


def train_step(pm: ParallelModel, optimizer: torch.optim.Optimizer, batch_BS1: torch.Tensor, *,
               grad_accum: int, grad_clip: float, autocast, after_backward=None) -> StepResult:
    """One optimizer step on the global batch; this rank computes its data-parallel slice. A step
    whose global loss or gradient norm is not finite leaves weights and optimizer state as they were."""
    losses = pm.forward_backward(pm.local_batch(batch_BS1), grad_accum=grad_accum, autocast=autocast)
    if after_backward is not None:
        after_backward()
    grad_norm = float(pm.clip_grad_norm_(grad_clip if grad_clip > 0 else float("inf")))
    ce, aux = pm.global_losses(losses.ce, losses.aux)
    skipped = not is_finite(ce, grad_norm)
    reason = diagnose(ce, grad_norm, losses.moe, pm.named_parameters()) if skipped else ""
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(ce, aux, grad_norm, losses.moe, skipped, reason)


def evaluate(pm: ParallelModel, batches: list[torch.Tensor], autocast, device) -> float:
    ce = [pm.evaluate(pm.local_batch(b.to(device)), autocast) for b in batches]
    return pm.global_losses(torch.stack(ce).mean(), torch.zeros((), device=device))[0]


def moe_summary(moe: dict) -> dict[str, float]:
    """Layer-averaged router numbers for metrics.jsonl."""
    if not moe:
        return {}
    n = len(moe)
    out = {
        "moe_dropped_fraction": sum(float(s.dropped_fraction) for s in moe.values()) / n,
        "moe_router_entropy": sum(float(s.entropy) for s in moe.values()) / n,
        "moe_z_loss": sum(float(s.z_loss) for s in moe.values()) / n,
        # MaxVio (Wang et al. 2024): max load / mean load − 1 of the last micro-batch, layer-averaged.
        "moe_max_vio": sum(float(s.counts_E.max() / s.counts_E.float().mean().clamp_min(1e-9)) - 1
                           for s in moe.values()) / n,
    }
    if all(s.remote_routes is not None for s in moe.values()):  # expert parallelism: this rank's tokens
        out["moe_remote_routes_per_token"] = sum(float(s.remote_routes) for s in moe.values()) / n
        out["moe_ep_ranks_per_token"] = sum(float(s.ranks_per_token) for s in moe.values()) / n
    return out


def train(cfg: Config, *, resume: str = "auto", exit_after: int | None = None, console=print,
          hooks: StepHooks | None = None) -> Path:
    """Train on this process, one rank of a launch (torchrun, srun, mpirun) or the only one;
    returns the run folder. `exit_after` stops (with a checkpoint) after that many steps of this
    invocation, as a preemption would. Raises NonFiniteError when training diverges."""
    info = detect_rank()
    validate_launch(cfg, info.world_size)  # before any process group starts
    if torch.distributed.is_initialized():  # a caller that already joined the group keeps it
        return _train(cfg, resume, exit_after, console, info, resolve_device(cfg), hooks)
    device = init_distributed(info)
    try:
        return _train(cfg, resume, exit_after, console if info.is_main else _quiet, info,
                      device if info.world_size > 1 else resolve_device(cfg), hooks)
    finally:
        shutdown()


def _quiet(*args, **kwargs) -> None:
    """The console of ranks other than 0."""


def _on_rank0(fn):
    """Run `fn` on rank 0 and hand its result (or its exception) to every rank."""
    box: list = [None]
    if torch.distributed.get_rank() == 0:
        try:
            box[0] = (True, fn())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[0] = (False, e)
    torch.distributed.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _train(cfg: Config, resume: str, exit_after: int | None, console, info, device: torch.device,
           hooks: StepHooks | None) -> Path:
    t = cfg.train
    run = _on_rank0(lambda: open_run_dir(cfg, resume))  # one decision, one folder, for all ranks
    if info.world_size > 1:
        console(f"{info.world_size} ranks, launched by {info.launcher}, rendezvous at {info.master_addr}:{info.master_port}")
    if run.resume_from is not None and _checkpoint_step(run.resume_from) >= t.steps:
        # A job requeued after its last step (the signal came late) must not spend its start.
        console(f"{run.path} already finished: {run.resume_from} is at step {t.steps}; nothing to train")
        return run.path
    if t.threads:
        torch.set_num_threads(t.threads)
    bf16 = use_bf16(cfg, device)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    data = load_token_data(cfg.data.source, cfg.data.tokenizer, cfg.data.val_fraction)
    if data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size}: must be >= the tokenizer's "
                          f"vocabulary ({data.vocab_size}, {data.tokenizer.name})")
    torch.manual_seed(t.seed)
    pm = build_parallel_model(cfg, device)
    model = pm.module  # all of this rank's parameters, whatever the pipeline schedule
    for part in pm.modules:
        part.set_kernel_backend(cfg.kernel.backend)
    optimizer = optimizer_for(pm, t)
    sampler = WindowSampler(data.train, t.seq_len, t.seed)
    val_batches = validation_batches(data.val, t.seq_len, t.batch_size, t.eval_batches)
    step, tokens, elapsed = 0, 0, 0.0
    guard = SkipGuard(t.max_skipped_steps)
    decay_steps = t.lr_decay_steps or t.steps
    # Routed experts are plain pieces per ep (and, with etp = tp, tp) rank; the checkpoint stores
    # each weight as one tensor.
    ep_shards = pm.expert_shards()
    if run.resume_from is not None:
        state = load_checkpoint(run.resume_from, model, optimizer, expert_shards=ep_shards)
        step, tokens, elapsed = state["step"], state["tokens"], state.get("elapsed_s", 0.0)
        decay_steps = _schedule_length(t, state, console)
        guard.total = state.get("skipped_steps", 0)
        sampler.load_state_dict(state["sampler"])
        if info.is_main:  # one writer: another rank replacing the file would orphan rank 0's open log
            truncate_metrics(run.path, step)
        console(f"resumed from {run.resume_from} at step {step}")

    metrics = MetricsLogger(run.path, enabled=info.is_main, purge_step=step + 1 if step else None)
    metrics.text("config", "```yaml\n" + _yaml(cfg) + "\n```")
    meter, dashboards = start_run_dashboards(cfg, metrics, device, bf16, world_size=info.world_size, console=console)
    tokens_per_step = t.batch_size * t.seq_len

    checkpointer = Checkpointer(run.checkpoints, keep=t.checkpoint.keep, async_save=t.checkpoint.async_save,
                                expert_shards=ep_shards)
    saved_step = step if run.resume_from is not None else None

    def checkpoint() -> Path | None:
        """The finished checkpoint, or None while an async one is being written."""
        nonlocal saved_step
        saved_step = step
        if not all_finite([*model.parameters(), *optimizer_tensors(optimizer)], device):
            raise NonFiniteError(f"step {step}: weights or optimizer state are not finite; no checkpoint "
                                 f"written, the last good one is {last_ckpt or 'none'}")
        return checkpointer.save(step, model, optimizer, {
            "step": step, "tokens": tokens, "sampler": sampler.state_dict(), "lr_decay_steps": decay_steps,
            "skipped_steps": guard.total,
            "elapsed_s": time.perf_counter() - clock0,
            "config": cfg.to_dict(), "layout": {"world_size": info.world_size, **cfg.to_dict()["parallel"]}})

    failed_saves = 0

    def periodic(save: Callable[[], Path | None]) -> Path | None:
        """A periodic save (or poll of one in flight) under train.checkpoint.on_error."""
        nonlocal failed_saves
        try:
            return save()
        except CheckpointError as e:  # raised on every rank alike, so every rank goes on alike
            if t.checkpoint.on_error == "stop":
                raise
            failed_saves += 1
            console(f"{e}; training continues (train.checkpoint.on_error=continue)")
            return None

    last_ckpt = run.resume_from
    stopped = diverged = None
    # closing: metrics.jsonl and TensorBoard's files are closed on an error too (a failed save).
    with StopFlag() as stop, Progress(total=t.steps, start=step, enabled=info.is_main) as progress, \
            contextlib.closing(metrics):
        # Throughput counts the time of training iterations only, not evaluation or checkpoints.
        window_time, window_tokens = 0.0, 0
        clock0 = time.perf_counter() - elapsed  # wall time of every attempt of this run, summed
        stop_at = min(t.steps, step + exit_after) if exit_after else t.steps
        if step == 0:
            # Where the validation curve starts (an untrained model sits near ln(vocab_size));
            # TensorBoard only, so every metrics.jsonl record is a training step. Every rank
            # evaluates: the loss is reduced across them.
            initial_val_loss = evaluate(pm, val_batches, autocast, device)
            if metrics.tensorboard is not None:
                metrics.tensorboard.add_scalar("val_loss", initial_val_loss, 0)
        while step < stop_at and not stop.agreed(device):
            iter_t0 = time.perf_counter()
            lr = lr_at(step - guard.total, t, decay_steps)  # skipped steps do not move the schedule
            set_lr(optimizer, lr)
            batch = sampler.next_batch(t.batch_size).to(device)
            step_t0 = time.perf_counter()
            if hooks is not None:
                hooks.before_step(step + 1, pm)
            after_backward = (lambda: hooks.after_backward(step + 1, pm)) if hooks is not None else None
            with meter.step(model, tokens_per_step):
                result = train_step(pm, optimizer, batch, grad_accum=t.grad_accum, grad_clip=t.grad_clip,
                                    autocast=autocast, after_backward=after_backward)
            guard.record(result.skipped, result.reason)
            if cfg.model.moe.bias_update_rate > 0:  # aux-loss-free balancing, after the optimizer step
                if result.skipped:
                    clear_expert_counts(pm.modules)
                else:
                    update_expert_biases(pm.modules, pm.mesh, cfg.model.n_layers, cfg.model.moe.num_experts, device)
            step_time = time.perf_counter() - step_t0
            step += 1
            tokens += tokens_per_step
            window_tokens += tokens_per_step
            window_time += time.perf_counter() - iter_t0
            record = {"loss": result.loss, "lr": lr, "tokens": tokens,
                      "elapsed_s": round(time.perf_counter() - clock0, 3)}
            if result.skipped:
                console(f"step {step}: skipped, not finite ({result.reason}); weights unchanged")
            if step % t.log_every == 0 or step == t.steps or result.skipped:
                if failed_saves:
                    record["failed_saves"] = failed_saves
                record.update(grad_norm=result.grad_norm, skipped_steps=guard.total, aux_loss=result.aux_loss,
                              tokens_per_s=window_tokens / window_time, step_time=step_time,
                              **moe_summary(result.moe))
                record.update(meter.window(window_tokens, window_time))
                dashboards.log_moe(step, result.moe)
                dashboards.log_bias(step, {i: r.expert_bias_E for i, r in biased_routers(pm.modules).items()})
                window_time, window_tokens = 0.0, 0
            if step % t.eval_every == 0 or step == t.steps:
                record["val_loss"] = evaluate(pm, val_batches, autocast, device)
            if len(record) > 4:
                metrics.log(step, record)
            progress.update(step, record)
            last_ckpt = periodic(checkpointer.poll) or last_ckpt
            if guard.exhausted():
                diverged = stop_message(step, guard.last_reason, guard.limit, last_ckpt)
                break
            if t.checkpoint.every and step % t.checkpoint.every == 0 and not result.skipped:
                last_ckpt = periodic(checkpoint) or last_ckpt
        stopped = stop.signum
        # A periodic save still in flight settles first, so its failure is not the final one's.
        last_ckpt = periodic(checkpointer.wait) or last_ckpt
        # Before a fresh run's first step there is nothing to save, and a checkpoint of an optimizer
        # that never stepped would not restore as one (DCP initializes its state by stepping it).
        if saved_step != step and step > 0 and diverged is None:
            last_ckpt = checkpoint() or last_ckpt
        last_ckpt = checkpointer.wait() or last_ckpt
    if diverged is not None:
        raise NonFiniteError(diverged)
    if stopped is not None:
        saved = f"checkpoint {last_ckpt}" if last_ckpt else "nothing to save before the first step"
        console(f"stopped by signal {signal.Signals(stopped).name} after step {step}; {saved}; "
                f"rerun the same command to resume")
    return run.path


def _schedule_length(t, state: dict, console) -> int:
    """The lr schedule's length on resume: the checkpoint's, unless train.lr_decay_steps sets one."""
    saved = state.get("lr_decay_steps")
    if t.lr_decay_steps is not None or saved is None:
        return t.lr_decay_steps or t.steps
    if saved != t.steps:
        console(f"lr schedule keeps the length it was started with ({saved} steps, now train.steps = "
                f"{t.steps}); set train.lr_decay_steps to change it")
    return saved


def _checkpoint_step(ckpt: Path) -> int:
    return json.loads((ckpt / "state.json").read_text())["step"]


def _yaml(cfg: Config) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

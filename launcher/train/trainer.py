"""The training loop: data → forward/backward (with accumulation) → clip → AdamW step → log, eval,
checkpoint. Stops cleanly on Ctrl-C, SIGTERM or SIGUSR1: the current step finishes, a checkpoint
is written, and the run can be resumed.

`_loop` is the whole of it; the parts around it decide their own timing: the StepLogger
(launcher/train/step_logger.py) when to log and evaluate, the CheckpointManager
(launcher/train/checkpointer.py) when to save and what a failed save does, and the
aux-loss-free bias update runs as a hook of the optimizer's step (ExpertBiasUpdate). Before any
of it, nothing is written to the run folder until the config, the data and the checkpoint are
found usable (launcher/train/startup.py): a refused start leaves no folder behind.

Legend: B sequences per micro-batch, S sequence length, V vocabulary.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from moetron.launcher.checkpoint.store import load_checkpoint
from moetron.launcher.cluster.bootstrap import RankInfo, detect_rank, init_distributed, shutdown
from moetron.launcher.cluster.elastic import job_identity
from moetron.launcher.config import Config, sequences_per_micro_batch, validate_launch
from moetron.launcher.data.blend import BlendSampler, blend_sampler, blend_validation_batches
from moetron.launcher.data.corpus import TokenData
from moetron.launcher.data.mlm import MaskedLM
from moetron.launcher.run_dir import RunDir, RunError, open_run_dir, write_run_dir
from moetron.launcher.train.checkpointer import CheckpointManager
from moetron.launcher.train.dashboards import start_run_dashboards
from moetron.launcher.train.device import check_fp8, resolve_device, use_bf16
from moetron.launcher.train.layout_log import change_line, record_start
from moetron.launcher.train.metrics import MetricsLogger
from moetron.launcher.train.nonfinite import NonFiniteError, SkipGuard, diagnose, is_finite, stop_message
from moetron.launcher.train.optim import lr_at, optimizer_for, set_lr
from moetron.launcher.train.run_lease import FenceLost, RunFence, hold_run, refusal
from moetron.launcher.train.startup import (
    already_finished,
    checked_data,
    load_resumable,
    report_set_aside,
    schedule_warnings,
)
from moetron.launcher.train.step_logger import StepLogger
from moetron.model.packing import Packing
from moetron.model.transformer import build_model
from moetron.parallel.expert_bias import clear_expert_counts, update_expert_biases
from moetron.parallel.expert_shards import ExpertShards
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

    def agreed(self, device: torch.device, lost: str | None = None) -> bool:
        """Whether any rank has been signalled. Ranks receive a signal at slightly different
        moments; all must stop after the same step, or those still training would wait forever
        in a collective for those that went on to checkpoint. `lost`: rank 0's line when another
        world took the run folder (RunFence.lost), agreed on in the same all-reduce: every rank
        raises FenceLost."""
        if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            if lost:
                raise FenceLost(lost)
            return bool(self)
        flag = torch.tensor([float(bool(self)), float(lost is not None)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        # NOTE: host-device sync to read the flags, once per step.
        signalled, taken = flag.tolist()
        if taken:
            raise FenceLost(lost or "another world took the run folder (rank 0 names it)")
        if signalled and self.signum is None:
            self.signum = signal.SIGUSR1  # told by another rank
        return bool(signalled)


@dataclass
class StepResult:
    loss: float
    aux_loss: float
    grad_norm: float
    moe: dict
    # Non-finite loss or grad norm: the optimizer did not step (launcher/train/nonfinite.py); why.
    skipped: bool = False
    reason: str = ""
    # Multi-token prediction's CE averaged over depths (model/mtp.py); None without MTP.
    mtp_loss: float | None = None


@dataclass
class TrainState:
    """Where the run is; with the sampler's position, what a checkpoint's state.json restores."""

    decay_steps: int  # the lr schedule's length (kept on resume, see _schedule_length)
    skips: SkipGuard
    step: int = 0
    tokens: int = 0
    earlier_s: float = 0.0  # wall time of the earlier attempts of this run
    # Under data.blend: tokens each source has given so far, by file name (for the records).
    source_tokens: dict[str, int] = field(default_factory=dict)
    _clock0: float = 0.0

    def start_clock(self) -> None:
        self._clock0 = time.perf_counter() - self.earlier_s

    def elapsed_s(self) -> float:
        """Wall time of every attempt of this run, summed."""
        return time.perf_counter() - self._clock0


@dataclass
class Components:
    """What this rank trains with."""

    cfg: Config
    pm: ParallelModel
    optimizer: torch.optim.Optimizer
    sampler: BlendSampler
    val_batches: list[torch.Tensor]
    device: torch.device
    bf16: bool
    # Routed experts are plain pieces per ep (and, with etp = tp, tp) rank; the checkpoint stores
    # each weight as one tensor.
    expert_shards: ExpertShards | None
    # train.objective mlm: how windows become corrupted inputs and their targets.
    mlm: MaskedLM | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.pm.module  # all of this rank's parameters, whatever the pipeline schedule

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    def evaluate(self) -> float:
        return evaluate(self.pm, self.val_batches, self.autocast, self.device)


class ExpertBiasUpdate:
    """Aux-loss-free balancing (model.moe.bias_update_rate > 0) as a hook on the optimizer's step:
    after each step every rank moves its routers' biases by the global batch's expert loads (a
    collective, parallel/expert_bias.py). A skipped step never steps the optimizer, and train_step
    forgets its routes, so the biases stay as they were."""

    def __init__(self, pm: ParallelModel, cfg: Config, device: torch.device):
        self.pm, self.cfg, self.device = pm, cfg, device
        self._depth = 0

    def register(self, optimizer: torch.optim.Optimizer) -> None:
        # A step inside a step runs the hooks again: ZeRO-1's ShardedAdamW.step calls AdamW.step,
        # which torch wraps with the same hooks once any AdamW was built. The outermost one updates.
        optimizer.register_step_pre_hook(self._enter)
        optimizer.register_step_post_hook(self._exit)

    def _enter(self, optimizer, args, kwargs) -> None:
        self._depth += 1

    def _exit(self, optimizer, args, kwargs) -> None:
        self._depth -= 1
        if self._depth == 0:
            m = self.cfg.model
            # MTP blocks route too: their rows follow the decoder's (layer n_layers + k − 1).
            update_expert_biases(self.pm.modules, self.pm.mesh, m.n_layers + m.mtp_depth, m.moe.num_experts,
                                 self.device)


def next_token_cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor,
                             reduction: str = "mean") -> torch.Tensor:
    """Cross entropy over tokens, in fp32 (logits may be a DTensor split over V under TP); targets
    of -100 (masked-LM positions not scored) are left out of the sum and the mean."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten(), reduction=reduction)


def build_parallel_model(cfg: Config, device: torch.device, packing: Packing | None = None) -> ParallelModel:
    """This rank's part of the model: built on the meta device, split and sharded for the layout,
    then materialized with the same initial weights as one process (see moetron.parallel).
    `packing`: keep the documents of each window apart (data.document_mask)."""
    mesh = build_mesh(cfg.parallel, torch.distributed.get_world_size(), device.type)
    p, t = cfg.parallel, cfg.train
    microbatch_BS = (sequences_per_micro_batch(cfg), t.seq_len)  # read by a pipeline only
    return parallelize(build_model(cfg.model, device="meta"), mesh, p, seed=t.seed, device=device,
                       cross_entropy=next_token_cross_entropy, compile=t.compile, float8=t.precision == "fp8",
                       activation_checkpoint=t.activation_checkpoint, microbatch_BS=microbatch_BS,
                       packing=packing, targets_given=t.objective == "mlm")


def train_step(pm: ParallelModel, optimizer: torch.optim.Optimizer, batch_BS1: torch.Tensor, *,
               grad_accum: int, grad_clip: float, autocast, after_backward=None, local: bool = False) -> StepResult:
    """One optimizer step on the global batch; this rank computes its data-parallel slice (`local`:
    the batch given is that slice already, as the sampler read it). A step whose global loss or
    gradient norm is not finite leaves weights, optimizer state and expert biases as they were.
    `after_backward()`, if given, runs before the gradients are reduced."""
    losses = pm.forward_backward(batch_BS1 if local else pm.local_batch(batch_BS1), grad_accum=grad_accum,
                                 autocast=autocast)
    if after_backward is not None:
        after_backward()
    grad_norm = float(pm.clip_grad_norm_(grad_clip if grad_clip > 0 else float("inf")))
    ce, aux, mtp = pm.global_losses(losses.ce, losses.aux, losses.mtp)
    skipped = not is_finite(ce, grad_norm)
    reason = diagnose(ce, grad_norm, losses.moe, pm.named_parameters()) if skipped else ""
    if skipped:
        clear_expert_counts(pm.modules)  # its routes go with its gradients
    else:
        optimizer.step()  # and its hooks (ExpertBiasUpdate)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(ce, aux, grad_norm, losses.moe, skipped, reason,
                      mtp_loss=mtp if pm.modules[0].cfg.mtp_depth else None)


def evaluate(pm: ParallelModel, batches: list[torch.Tensor], autocast, device) -> float:
    """Mean validation CE over `batches`, this rank's parts of them (see `_build`)."""
    ce = [pm.evaluate(b.to(device), autocast) for b in batches]
    return pm.global_losses(torch.stack(ce).mean(), torch.zeros((), device=device))[0]


def train(cfg: Config, *, resume: str = "auto", exit_after: int | None = None, console=print,
          layout_choice: dict | None = None) -> Path:
    """Train on this process, one rank of a launch (torchrun, srun, mpirun) or the only one;
    returns the run folder. `exit_after` stops (with a checkpoint) after that many steps of this
    invocation, as a preemption would. Raises NonFiniteError when training diverges.
    `layout_choice`: how `--layout auto` chose cfg's layout, for the run folder's layouts.jsonl."""
    info = detect_rank()
    validate_launch(cfg, info.world_size)  # before any process group starts
    if torch.distributed.is_initialized():  # a caller that already joined the group keeps it
        return _train(cfg, resume, exit_after, console, info, resolve_device(cfg), layout_choice)
    device = init_distributed(info)
    try:
        return _train(cfg, resume, exit_after, console if info.is_main else _quiet, info,
                      device if info.world_size > 1 else resolve_device(cfg), layout_choice)
    finally:
        shutdown()


def _train(cfg: Config, resume: str, exit_after: int | None, console, info: RankInfo, device: torch.device,
           layout_choice: dict | None = None) -> Path:
    t = cfg.train
    check_fp8(cfg, device)
    # One decision for all ranks, and nothing written until data and checkpoint are found usable.
    run = _on_rank0(lambda: _open_run(cfg, resume))
    if info.world_size > 1:
        console(f"{info.world_size} ranks, launched by {info.launcher}, rendezvous at {info.master_addr}:{info.master_port}")
    if run.resume_from is not None and already_finished(run, t.steps, console):
        return run.path  # a job requeued after its last step (the signal came late) must not spend its start
    if t.threads:
        torch.set_num_threads(t.threads)
    parts = _build(cfg, device, checked_data(cfg))
    state, run = _start_state(parts, run, console)
    # From here on this world writes to the folder, once it holds it (launcher/train/run_lease.py).
    with hold_run(run.path, job_identity(), info.world_size, state.step, _on_rank0, info.is_main, console) as fence:
        return _train_held(parts, state, run, fence, exit_after, console, info, layout_choice)


def _open_run(cfg: Config, resume: str) -> RunDir:
    """`open_run_dir`'s decision, writing nothing; refused while a live world of another job holds the folder."""
    run = open_run_dir(cfg, resume, create=False)
    problem = refusal(run.path, job_identity())
    if problem:
        raise RunError(problem)
    return run


def _train_held(parts: Components, state: TrainState, run: RunDir, fence: RunFence, exit_after: int | None,
                console, info: RankInfo, layout_choice: dict | None) -> Path:
    """The run once this world holds its folder: the folder written, the loop, the final save."""
    cfg, device, t = parts.cfg, parts.device, parts.cfg.train
    moved = _on_rank0(lambda: write_run_dir(run, cfg))
    if cfg.model.moe.bias_update_rate > 0:  # after the resume: loading steps the optimizer once
        ExpertBiasUpdate(parts.pm, cfg, device).register(parts.optimizer)
    metrics = MetricsLogger(run.path, enabled=info.is_main, purge_step=state.step + 1 if state.step else None,
                            may_write=fence.held)
    metrics.text("config", "```yaml\n" + _yaml(cfg) + "\n```")
    report_set_aside(moved, run, state.step, metrics, console)
    if info.is_main:
        _note_layout(run.path, cfg, state.step, info.world_size, layout_choice, metrics, console)
    meter, dashboards = start_run_dashboards(cfg, metrics, device, parts.bf16, world_size=info.world_size,
                                             console=console)
    checkpoints = CheckpointManager(run.checkpoints, t.checkpoint, parts.model, parts.optimizer, device=device,
                                    expert_shards=parts.expert_shards, resumed_from=run.resume_from,
                                    step=state.step, state=lambda: _checkpoint_state(parts, state, info.world_size,
                                                                                     fence.world),
                                    console=console, guard=fence.check)
    logger = StepLogger(t, metrics, meter, dashboards, start_step=state.step, start_tokens=state.tokens,
                        enabled=info.is_main,
                        evaluate=parts.evaluate, modules=parts.pm.modules, console=console)
    stop_at = min(t.steps, state.step + exit_after) if exit_after else t.steps
    with StopFlag() as stop, logger:
        diverged = _loop(parts, state, stop, stop_at, logger, checkpoints, fence)
        stopped = stop.signum
        last = checkpoints.finish(state.step, diverged=diverged is not None)
    if diverged is not None:
        raise NonFiniteError(diverged)
    if stopped is not None:
        saved = f"checkpoint {last}" if last else "nothing to save before the first step"
        console(f"stopped by signal {signal.Signals(stopped).name} after step {state.step}; {saved}; "
                f"rerun the same command to resume")
    return run.path


def _note_layout(run: Path, cfg: Config, step: int, world_size: int, choice: dict | None, metrics, console) -> None:
    """This start in layouts.jsonl; a layout other than the previous start's said and marked in TensorBoard."""
    before, now = record_start(run, cfg, step, world_size, choice)
    change = change_line(before, now) if before else None
    if change:
        console(change)
        metrics.text("layout", change, step)


def _loop(parts: Components, state: TrainState, stop: StopFlag, stop_at: int, logger: StepLogger,
          checkpoints: CheckpointManager, fence: RunFence) -> str | None:
    """Train until step `stop_at` or a signal all ranks agree on; returns why the run diverged, or None.
    Raises FenceLost, on every rank after the same step, once another world holds the run folder."""
    state.start_clock()
    logger.start(state.step)
    while state.step < stop_at and not stop.agreed(parts.device, fence.lost()):
        iteration_t0 = time.perf_counter()  # throughput counts training iterations only
        lr, result, step_s = _step(parts, state, logger.meter)
        logger.after_step(state, lr, result, step_s=step_s, iteration_s=time.perf_counter() - iteration_t0,
                          failed_saves=checkpoints.failed_saves)
        # Before the divergence check, whose message names the newest checkpoint: the step that
        # exhausts the guard was skipped, and a skipped step is never saved.
        checkpoints.after_step(state.step, result.skipped)
        if state.skips.exhausted():
            return stop_message(state.step, state.skips.last_reason, state.skips.limit, checkpoints.last)
    return None


def _step(parts: Components, state: TrainState, meter) -> tuple[float, StepResult, float]:
    """One iteration: learning rate, batch, train_step → (lr, result, seconds of the step itself)."""
    t = parts.cfg.train
    lr = lr_at(state.step - state.skips.total, t, state.decay_steps)  # skipped steps do not move the schedule
    set_lr(parts.optimizer, lr)
    # Only this rank's rows and positions are read and moved; the sampler passes the whole batch.
    pm = parts.pm
    rows = pm.batch_rows(t.batch_size)
    batch = parts.sampler.next_batch(t.batch_size, rows, pm.window_spans(t.seq_len))
    if parts.mlm is not None:
        batch = parts.mlm.pairs(batch, state.step, rows, t.batch_size)
    batch = batch.to(parts.device)
    step_t0 = time.perf_counter()
    tokens = t.batch_size * t.seq_len
    with meter.step(parts.model, tokens):
        result = train_step(parts.pm, parts.optimizer, batch, grad_accum=t.grad_accum, grad_clip=t.grad_clip,
                            autocast=parts.autocast, local=True)
    state.skips.record(result.skipped, result.reason)
    step_s = time.perf_counter() - step_t0
    state.step += 1
    state.tokens += tokens
    if parts.cfg.data.blend is not None:
        state.source_tokens = parts.sampler.tokens_by_source()
    return lr, result, step_s


def _build(cfg: Config, device: torch.device, data: TokenData) -> Components:
    """This rank's model, optimizer and windows of `data`, in the order that fixes the random draws."""
    t = cfg.train
    bf16 = use_bf16(cfg, device)
    torch.manual_seed(t.seed)
    d = cfg.data
    packing = Packing(data.tokenizer.eos_id if d.eod_id is None else d.eod_id, d.reset_positions) \
        if d.document_mask else None
    pm = build_parallel_model(cfg, device, packing)
    for part in pm.modules:
        part.set_kernel_backend(cfg.kernel.backend)
    optimizer = optimizer_for(pm, t)
    sampler = blend_sampler(data.sources, "train", t.seq_len, t.seed)
    val_batches = blend_validation_batches(data.sources, t.seq_len, t.batch_size, t.eval_batches,
                                           rows=pm.batch_rows, spans=pm.window_spans(t.seq_len))
    mlm = MaskedLM(data.vocab_size, t.seed) if t.objective == "mlm" else None
    if mlm is not None:  # the same corruption at every evaluation
        rows = pm.batch_rows(t.batch_size)
        val_batches = [mlm.pairs(b, -1 - i, rows, t.batch_size) for i, b in enumerate(val_batches)]
    return Components(cfg, pm, optimizer, sampler, val_batches, device, bf16, pm.expert_shards(), mlm)


def _start_state(parts: Components, run: RunDir, console) -> tuple[TrainState, RunDir]:
    """Step 0, or where the checkpoint the run resumes from left off (its tensors and RNGs loaded),
    and the run, which may resume from an older checkpoint than chosen if that one was damaged."""
    t = parts.cfg.train
    state = TrainState(decay_steps=t.lr_decay_steps or t.steps, skips=SkipGuard(t.max_skipped_steps))
    if run.resume_from is not None:
        saved, run = load_resumable(run, parts.cfg, lambda ckpt: load_checkpoint(
            ckpt, parts.model, parts.optimizer, expert_shards=parts.expert_shards), _on_rank0)
        state.step, state.tokens, state.earlier_s = saved["step"], saved["tokens"], saved.get("elapsed_s", 0.0)
        state.decay_steps = _schedule_length(t, saved, console)
        state.skips.total = saved.get("skipped_steps", 0)
        parts.sampler.load_state_dict(saved["sampler"])
        console(f"resumed from {run.resume_from} at step {state.step}")
    for line in schedule_warnings(t, state.decay_steps):
        console(line)
    return state, run


def _checkpoint_state(parts: Components, state: TrainState, world_size: int, world: str) -> dict:
    """A checkpoint's plain data (rank 0's becomes its state.json); `world`: the run lease's id of
    the world that wrote it (launcher/train/run_lease.py)."""
    return {"step": state.step, "tokens": state.tokens, "sampler": parts.sampler.state_dict(), "world": world,
            "lr_decay_steps": state.decay_steps, "skipped_steps": state.skips.total,
            "elapsed_s": state.elapsed_s(),
            "config": parts.cfg.to_dict(), "layout": {"world_size": world_size, **parts.cfg.to_dict()["parallel"]}}


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


def _schedule_length(t, state: dict, console) -> int:
    """The lr schedule's length on resume: the checkpoint's, unless train.lr_decay_steps sets one."""
    saved = state.get("lr_decay_steps")
    if t.lr_decay_steps is not None or saved is None:
        return t.lr_decay_steps or t.steps
    if saved != t.steps:
        console(f"lr schedule keeps the length it was started with ({saved} steps, now train.steps = "
                f"{t.steps}); set train.lr_decay_steps to change it")
    return saved


def _yaml(cfg: Config) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

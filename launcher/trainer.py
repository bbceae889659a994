"""The training loop: data → forward/backward (with accumulation) → clip → AdamW step → log, eval,
checkpoint. Stops cleanly on Ctrl-C, SIGTERM or SIGUSR1: the current step finishes, a checkpoint
is written, and the run can be resumed.

Legend: B sequences per micro-batch, S sequence length, V vocabulary.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moetron.launcher.config import Config, ConfigError
from moetron.launcher.data import WindowSampler, load_token_data, validation_batches
from moetron.launcher.metrics import MetricsLogger
from moetron.launcher.optim import build_optimizer, lr_at, set_lr
from moetron.launcher.progress import Progress
from moetron.launcher.run_dir import open_run_dir, truncate_metrics
from moetron.model import Decoder, build_model
from moetron.parallel.checkpoint import load_checkpoint, save_checkpoint


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
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def __bool__(self) -> bool:
        return self.signum is not None


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


def language_model_loss(model: Decoder, batch_BS1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Next-token cross entropy (mean over tokens, fp32) and the MoE aux losses of one micro-batch."""
    out = model(batch_BS1[:, :-1])
    ce = F.cross_entropy(out.logits_BSV.float().flatten(0, 1), batch_BS1[:, 1:].flatten())
    return ce, out.aux_loss, out.moe


def train_step(model: Decoder, optimizer: torch.optim.Optimizer, batch_BS1: torch.Tensor, *,
               grad_accum: int, grad_clip: float, autocast) -> StepResult:
    ce_sum, aux_sum, moe = 0.0, 0.0, {}
    for micro_BS1 in batch_BS1.chunk(grad_accum):
        with autocast():
            ce, aux, moe = language_model_loss(model, micro_BS1)
        ((ce + aux) / grad_accum).backward()
        ce_sum += ce.detach()
        aux_sum += aux.detach()
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # NOTE: host-device sync to read the losses.
    return StepResult(float(ce_sum) / grad_accum, float(aux_sum) / grad_accum, float(grad_norm), moe)


@torch.no_grad()
def evaluate(model: Decoder, batches: list[torch.Tensor], autocast, device) -> float:
    model.eval()
    losses = []
    for b in batches:
        with autocast():
            losses.append(language_model_loss(model, b.to(device))[0])
    model.train()
    return float(torch.stack(losses).mean())


def moe_summary(moe: dict) -> dict[str, float]:
    """Layer-averaged router numbers for metrics.jsonl."""
    if not moe:
        return {}
    n = len(moe)
    return {
        "moe_dropped_fraction": sum(float(s.dropped_fraction) for s in moe.values()) / n,
        "moe_router_entropy": sum(float(s.entropy) for s in moe.values()) / n,
        "moe_z_loss": sum(float(s.z_loss) for s in moe.values()) / n,
    }


def train(cfg: Config, *, resume: str = "auto", exit_after: int | None = None, console=print) -> Path:
    """Train on one process; returns the run folder. `exit_after` stops (with a checkpoint) after
    that many steps of this invocation, as a preemption would."""
    t = cfg.train
    run = open_run_dir(cfg, resume)
    device = resolve_device(cfg)
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
    model = build_model(cfg.model, device=device)
    optimizer = build_optimizer(model, t)
    sampler = WindowSampler(data.train, t.seq_len, t.seed)
    val_batches = validation_batches(data.val, t.seq_len, t.batch_size, t.eval_batches)
    step, tokens = 0, 0
    if run.resume_from is not None:
        state = load_checkpoint(run.resume_from, model, optimizer)
        step, tokens = state["step"], state["tokens"]
        sampler.load_state_dict(state["sampler"])
        truncate_metrics(run.path, step)
        console(f"resumed from {run.resume_from} at step {step}")

    metrics = MetricsLogger(run.path, purge_step=step + 1 if step else None)
    metrics.text("config", "```yaml\n" + _yaml(cfg) + "\n```")
    tokens_per_step = t.batch_size * t.seq_len

    def checkpoint() -> Path:
        return save_checkpoint(run.checkpoints, step, model, optimizer, {
            "step": step, "tokens": tokens, "sampler": sampler.state_dict(),
            "config": cfg.to_dict(), "layout": {"world_size": 1}}, keep=t.checkpoint.keep)

    last_ckpt = run.resume_from
    stopped = None
    with StopFlag() as stop, Progress(total=t.steps, start=step, enabled=True) as progress:
        window_t0, window_tokens = time.perf_counter(), 0
        stop_at = min(t.steps, step + exit_after) if exit_after else t.steps
        while step < stop_at and not stop:
            lr = lr_at(step, t)
            set_lr(optimizer, lr)
            batch = sampler.next_batch(t.batch_size).to(device)
            step_t0 = time.perf_counter()
            result = train_step(model, optimizer, batch, grad_accum=t.grad_accum, grad_clip=t.grad_clip,
                                autocast=autocast)
            step_time = time.perf_counter() - step_t0
            step += 1
            tokens += tokens_per_step
            window_tokens += tokens_per_step
            record = {"loss": result.loss, "lr": lr, "tokens": tokens}
            if step % t.log_every == 0 or step == t.steps:
                elapsed = time.perf_counter() - window_t0
                record.update(grad_norm=result.grad_norm, aux_loss=result.aux_loss,
                              tokens_per_s=window_tokens / elapsed, step_time=step_time, **moe_summary(result.moe))
                window_t0, window_tokens = time.perf_counter(), 0
            if step % t.eval_every == 0 or step == t.steps:
                record["val_loss"] = evaluate(model, val_batches, autocast, device)
            if len(record) > 3:
                metrics.log(step, record)
            progress.update(step, record)
            if t.checkpoint.every and step % t.checkpoint.every == 0:
                last_ckpt = checkpoint()
        stopped = stop.signum
        if last_ckpt is None or not last_ckpt.name.endswith(f"{step:08d}"):
            last_ckpt = checkpoint()
    metrics.close()
    if stopped is not None:
        console(f"stopped by signal {signal.Signals(stopped).name} after step {step}; "
                f"checkpoint {last_ckpt}; rerun the same command to resume")
    return run.path


def _yaml(cfg: Config) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

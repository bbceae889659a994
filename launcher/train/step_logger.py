"""What the training loop reports after each step, and when.

Every step updates the progress bar (or line). A step's record in metrics.jsonl (and its numbers
in TensorBoard) starts with loss, lr, tokens and elapsed_s, and is written only at
- a log step (every train.log_every, the last step, and every skipped step), with grad_norm,
  skipped_steps, failed_saves (once a save failed), aux_loss, mtp_loss (with multi-token prediction:
  its CE averaged over depths, also on the console), step_time, the router summary, and
  throughput and MFU over the window since the last log step, which holds training iterations
  only: no evaluation, no checkpoints. The MoE dashboards are drawn then too;
- an evaluation step (every train.eval_every, and the last step), with val_loss.
Every rank makes the same calls (evaluation is a collective); only rank 0's MetricsLogger writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from moetron.launcher.config import TrainConfig
from moetron.launcher.train.metrics import MetricsLogger
from moetron.launcher.train.progress import Progress
from moetron.parallel.expert_bias import biased_routers

if TYPE_CHECKING:
    from moetron.launcher.perf.mfu import MfuMeter
    from moetron.launcher.train.dashboards import Dashboards
    from moetron.launcher.train.trainer import StepResult, TrainState


class StepLogger:
    """Use as a context manager around the loop: it shows the progress bar, and closes
    metrics.jsonl and TensorBoard's files on the way out, after an error too (a failed save).

    `evaluate()` returns the validation loss (all ranks); `modules` are this rank's model parts,
    whose aux-loss-free biases the dashboards draw."""

    def __init__(self, cfg: TrainConfig, metrics: MetricsLogger, meter: MfuMeter, dashboards: Dashboards, *,
                 start_step: int, start_tokens: int, enabled: bool, evaluate: Callable[[], float],
                 modules: list[nn.Module], console: Callable[[str], None]):
        self.cfg, self.metrics, self.meter, self.dashboards = cfg, metrics, meter, dashboards
        self.evaluate, self.modules, self.console = evaluate, modules, console
        self.progress = Progress(total=cfg.steps, start=start_step, enabled=enabled)
        # Throughput counts the tokens the trainer counted (TrainState.tokens), not a formula of its own.
        self._tokens_seen = start_tokens
        self._window_tokens, self._window_s = 0, 0.0

    def __enter__(self) -> "StepLogger":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.metrics.close()
        finally:
            self.progress.__exit__(*exc)

    def start(self, step: int) -> None:
        """Before the first step of a fresh run: where the validation curve starts (an untrained
        model sits near ln(vocab_size)); TensorBoard only, so every metrics.jsonl record is a
        training step."""
        if step != 0:
            return
        val_loss = self.evaluate()
        if self.metrics.tensorboard is not None:
            self.metrics.tensorboard.add_scalar("val_loss", val_loss, 0)

    def after_step(self, state: TrainState, lr: float, result: StepResult, *, step_s: float, iteration_s: float,
                   failed_saves: int) -> None:
        """Report the step `state.step` just finished: `step_s` the step itself, `iteration_s` the
        whole iteration (learning rate, batch, step)."""
        step = state.step
        self._window_tokens += state.tokens - self._tokens_seen
        self._tokens_seen = state.tokens
        self._window_s += iteration_s
        record = {"loss": result.loss, "lr": lr, "tokens": state.tokens, "elapsed_s": round(state.elapsed_s(), 3)}
        record.update({f"tokens/{name}": n for name, n in state.source_tokens.items()})  # under data.blend
        if result.skipped:
            self.console(f"step {step}: skipped, not finite ({result.reason}); weights unchanged")
        log = step % self.cfg.log_every == 0 or step == self.cfg.steps or result.skipped
        if log:
            record.update(self._log_step(step, result, state.skips.total, step_s, failed_saves))
        evaluate = step % self.cfg.eval_every == 0 or step == self.cfg.steps
        if evaluate:
            record["val_loss"] = self.evaluate()
        if log or evaluate:
            self.metrics.log(step, record)
        self.progress.update(step, record)

    def _log_step(self, step: int, result: StepResult, skipped_steps: int, step_s: float,
                  failed_saves: int) -> dict:
        """A log step's numbers (in the order metrics.jsonl has them); draws the dashboards and
        starts the next throughput window."""
        out = {"failed_saves": failed_saves} if failed_saves else {}
        out.update(grad_norm=result.grad_norm, skipped_steps=skipped_steps, aux_loss=result.aux_loss)
        if result.mtp_loss is not None:  # multi-token prediction's CE, mean over depths (its loss / λ)
            out["mtp_loss"] = result.mtp_loss
        out.update(tokens_per_s=self._window_tokens / self._window_s, step_time=step_s, **moe_summary(result.moe))
        out.update(self.meter.window(self._window_tokens, self._window_s))
        self.dashboards.log_moe(step, result.moe)
        self.dashboards.log_bias(step, {i: r.expert_bias_E for i, r in biased_routers(self.modules).items()})
        self._window_tokens, self._window_s = 0, 0.0
        return out


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

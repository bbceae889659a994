"""TensorBoard dashboards beyond the flat scalars of MetricsLogger: MoE expert load per layer as a
heatmap image and as histograms, per-layer router scalars, the accounting table as text, and a
custom-scalars layout that puts the panels people compare side by side.

Legend: L MoE layers (rows of the heatmap), E experts.

Tags written here (the flat scalars — loss, val_loss, lr, grad_norm, tokens_per_s,
tflops_per_device, mfu, mfu_measured, memory_gib, step_time — come from the trainer's record):
  moe/expert_load                       image: L × E heatmap with axes, colour = load / mean load
                                        (colour bar 0..2, 1 = balanced)
  moe/expert_load/layer_<i>             histogram over expert ids, weighted by routes received
  moe/expert_bias                       image: L × E aux-loss-free biases (model.moe.bias_update_rate > 0)
  moe/layer_<i>/{dropped_fraction, router_entropy, aux_loss, z_loss, max_load}   scalars
                                        (max_load − 1 is MaxVio, Wang et al. 2024)
  moe/layer_<i>/{remote_routes_per_token, ep_ranks_per_token}   scalars under expert parallelism:
                                        kept routes per token sent to another ep rank, and the ep
                                        ranks a token's routes reach (rank 0's tokens)
  accounting                            text: parameters, FLOPs, KV cache, memory, MFU peak
"""

from __future__ import annotations

import numpy as np

from moetron.launcher.perf import display
from moetron.launcher.perf.flops import human, summary_rows

# Load ratios are drawn from 0 (idle expert) to this (twice its fair share, or more).
_LOAD_RATIO_MAX = 2.0


def custom_scalars_layout(moe: bool) -> dict:
    """Categories → charts → (kind, tag regexes), as `SummaryWriter.add_custom_scalars` takes it."""
    layout = {
        "MFU": {
            "MFU (analytic vs measured)": ["Multiline", ["^mfu$", "^mfu_measured$"]],
            "model TFLOP/s per device": ["Multiline", ["^tflops_per_device$", "^tflops_per_device_measured$"]],
            "tokens/s": ["Multiline", ["^tokens_per_s$"]],
            "step time (s)": ["Multiline", ["^step_time$"]],
            "memory (GiB)": ["Multiline", ["^memory_gib$"]],
        },
        "training": {
            "loss": ["Multiline", ["^loss$", "^val_loss$", "^mtp_loss$"]],
            "learning rate": ["Multiline", ["^lr$"]],
            "grad norm": ["Multiline", ["^grad_norm$"]],
        },
    }
    if moe:
        layout["MoE routing"] = {
            "dropped fraction per layer": ["Multiline", [r"^moe/layer_\d+/dropped_fraction$"]],
            "router entropy per layer (nats)": ["Multiline", [r"^moe/layer_\d+/router_entropy$"]],
            "max / mean expert load per layer": ["Multiline", [r"^moe/layer_\d+/max_load$"]],
            "aux loss per layer": ["Multiline", [r"^moe/layer_\d+/aux_loss$"]],
            "z loss per layer": ["Multiline", [r"^moe/layer_\d+/z_loss$"]],
            "routes per token leaving the ep rank": ["Multiline", [r"^moe/layer_\d+/remote_routes_per_token$"]],
            "ep ranks reached per token": ["Multiline", [r"^moe/layer_\d+/ep_ranks_per_token$"]],
        }
    return layout


def load_ratios(counts_LE: np.ndarray) -> np.ndarray:
    """Routes per expert over the layer's mean: 1 everywhere when perfectly balanced."""
    counts_LE = counts_LE.astype(np.float64)
    mean_L1 = counts_LE.mean(axis=1, keepdims=True)
    return np.divide(counts_LE, mean_L1, out=np.zeros_like(counts_LE), where=mean_L1 > 0)


def expert_load_figure(ratios_LE: np.ndarray, layer_ids: list[int], step: int):
    """The L × E load ratios as a labelled heatmap: layers down, experts across, a colour bar from
    0 (idle) to 2× the fair share (viridis; darker is idler)."""
    fig = _layer_expert_figure(ratios_LE.shape, layer_ids, "load ÷ mean (1 = balanced)", "viridis")
    return show_load(fig, ratios_LE, step)


def show_load(fig, ratios_LE: np.ndarray, step: int):
    """Put step `step`'s load ratios into a figure expert_load_figure made (same L × E)."""
    return _show(fig, ratios_LE, f"expert load / mean load, step {step}", 0.0, _LOAD_RATIO_MAX)


def expert_bias_figure(bias_LE: np.ndarray, layer_ids: list[int], step: int):
    """The aux-loss-free balancing biases, L × E, on a diverging scale symmetric about 0 (red: the
    expert is pushed up, blue: held back); its images over steps show the bias moving."""
    fig = _layer_expert_figure(bias_LE.shape, layer_ids, "bias added to the score", "RdBu_r")
    return show_bias(fig, bias_LE, step)


def show_bias(fig, bias_LE: np.ndarray, step: int):
    """Put step `step`'s biases into a figure expert_bias_figure made (same L × E)."""
    limit = max(float(np.abs(bias_LE).max()), 1e-6)
    return _show(fig, bias_LE, f"expert bias, step {step}", -limit, limit)


def _layer_expert_figure(shape_LE: tuple[int, int], layer_ids: list[int], label: str, cmap: str):
    """Built on a matplotlib Figure of its own, never pyplot, so nothing global is touched."""
    from matplotlib.figure import Figure

    L, E = shape_LE
    fig = Figure(figsize=(min(2.5 + 0.35 * E, 14), 1.4 + 0.3 * L), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(np.zeros(shape_LE), cmap=cmap, aspect="auto", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_xticks(range(E) if E <= 32 else range(0, E, max(E // 16, 1)))
    ax.set_yticks(range(L), [str(i) for i in layer_ids])
    fig.colorbar(im, ax=ax, label=label)
    return fig


def _show(fig, values_LE: np.ndarray, title: str, vmin: float, vmax: float):
    ax = fig.axes[0]
    image = ax.images[0]
    image.set_data(values_LE)
    image.set_clim(vmin, vmax)  # the colour bar follows
    ax.set_title(title, fontsize=9)
    return fig


def figure_rgb(fig) -> np.ndarray:
    """The H × W × 3 uint8 pixels of a matplotlib Figure, rendered by Agg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def accounting_markdown(acct: dict, peak_source: str | None = None) -> str:
    """The `moetron flops` tables as Markdown, for TensorBoard's text tab."""
    lines = ["| field | value | note |", "| --- | ---: | --- |"]
    lines += [f"| {f} | {v} | {n} |" for f, v, n in summary_rows(acct)]
    lines += ["", "| component | params | active | FLOP/token | share |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, c in acct["components"].items():
        share = c["flops_per_token"] / acct["flops_per_token"]
        lines.append(f"| {name} | {human(c['params'])} | {human(c['params_active'])} | "
                     f"{human(c['flops_per_token'])} | {share:.1%} |")
    lines += ["", f"Convention: {acct['convention']}."]
    if peak_source:
        lines.append(f"MFU peak: {peak_source}.")
    return "\n".join(lines)


class Dashboards:
    """Writes the non-scalar panels to a SummaryWriter; a no-op when `writer` is None (off rank 0)."""

    def __init__(self, writer, *, moe: bool):
        self.writer, self.moe = writer, moe
        # tag → (layer ids, Figure): each heatmap is laid out once and redrawn with new values, a
        # fifth of the cost of a new figure (~25 ms against ~130 ms at 2 × 4, ~0.1 s against
        # ~0.37 s at 32 × 64 on a CPU core), which rank 0 spends at every log step while the other
        # ranks wait for it at the next collective.
        self._figures: dict[str, tuple[list[int], object]] = {}

    def write_static(self, accounting_text: str) -> None:
        """Once per run (start): the custom-scalars layout and the accounting table."""
        if self.writer is None:
            return
        self.writer.add_custom_scalars(custom_scalars_layout(self.moe))
        self.writer.add_text("accounting", accounting_text, 0)

    def log_moe(self, step: int, stats: dict) -> None:
        """Per-layer MoE panels from `{layer: MoEStats}` of the step's last micro-batch."""
        if self.writer is None or not stats:
            return
        layers = sorted(stats)
        # NOTE: host-device sync to read the routing statistics.
        counts_LE = np.stack([stats[i].counts_E.detach().float().cpu().numpy() for i in layers])
        ratios_LE = load_ratios(counts_LE)
        self._image("moe/expert_load", ratios_LE, layers, step, expert_load_figure, show_load)
        for row, layer in enumerate(layers):
            s = stats[layer]
            self._expert_histogram(f"moe/expert_load/layer_{layer}", counts_LE[row], step)
            for name, value in (("dropped_fraction", s.dropped_fraction), ("router_entropy", s.entropy),
                                ("aux_loss", s.aux_loss), ("z_loss", s.z_loss)):
                self.writer.add_scalar(f"moe/layer_{layer}/{name}", float(value.detach()), step)
            self.writer.add_scalar(f"moe/layer_{layer}/max_load", float(ratios_LE[row].max()), step)
            if s.remote_routes is not None:
                self.writer.add_scalar(f"moe/layer_{layer}/remote_routes_per_token", float(s.remote_routes), step)
                self.writer.add_scalar(f"moe/layer_{layer}/ep_ranks_per_token", float(s.ranks_per_token), step)

    def log_bias(self, step: int, biases: dict) -> None:
        """`{layer: expert_bias_E}` of aux-loss-free routing, as an image per logged step."""
        if self.writer is None or not biases:
            return
        layers = sorted(biases)
        bias_LE = np.stack([biases[i].detach().float().cpu().numpy() for i in layers])
        self._image("moe/expert_bias", bias_LE, layers, step, expert_bias_figure, show_bias)

    def _expert_histogram(self, tag: str, counts_E: np.ndarray, step: int) -> None:
        """One bucket per expert id, so the histogram tab shows each expert's load over time."""
        ids_E = np.arange(len(counts_E), dtype=np.float64)
        total = float(counts_E.sum())
        if total <= 0:
            return
        used = ids_E[counts_E > 0]
        self.writer.add_histogram_raw(
            tag, min=float(used.min()), max=float(used.max()), num=total, sum=float((ids_E * counts_E).sum()),
            sum_squares=float((ids_E**2 * counts_E).sum()), bucket_limits=(ids_E + 0.5).tolist(),
            bucket_counts=counts_E.tolist(), global_step=step)

    def _image(self, tag: str, values_LE: np.ndarray, layers: list[int], step: int, make, show) -> None:
        """Draw `values_LE` into the tag's figure — made by `make` the first time (and whenever the
        layers change), then laid out once and refilled by `show` — and write its pixels."""
        layers_then, fig = self._figures.get(tag, (None, None))
        if layers_then != layers:
            fig = make(values_LE, layers, step)
            figure_rgb(fig)  # the constrained layout is solved at this first draw, then kept
            fig.set_layout_engine("none")
            self._figures[tag] = (layers, fig)
        # SummaryWriter.add_figure would go through pyplot's global figure manager: the figure is
        # rendered by Agg here and written as a plain H × W × 3 array.
        self.writer.add_image(tag, figure_rgb(show(fig, values_LE, step)), step, dataformats="HWC")


def start_run_dashboards(cfg, metrics, device, bf16: bool, *, world_size: int = 1, console=print):
    """For the trainer: the MFU meter (peak resolved, CPU peak measured or read from the cache) and
    the dashboards, with the layout and accounting text already written → (MfuMeter, Dashboards)."""
    from moetron.launcher.perf.mfu import MfuMeter, config_accounting, device_peak

    peak = device_peak(device, bf16, cfg.train.peak_tflops)
    console(f"MFU is measured against {display.significant(peak.flops / 1e12)} TFLOP/s per device: {peak.source}")
    meter = MfuMeter(cfg.model, cfg.train.seq_len, peak, device=device, world_size=world_size, warn=console)
    dashboards = Dashboards(metrics.tensorboard, moe=cfg.model.moe.enabled)
    dashboards.write_static(accounting_markdown(config_accounting(cfg), peak.source))
    return meter, dashboards

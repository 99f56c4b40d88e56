"""The training dashboard: one PNG that shows how a run, or several runs overlaid, is going.

It reads only the run directory (run_files.py names the files): metrics.jsonl (per-step and
held-out records), data_skips.json (the anomaly monitor's rollbacks) and recipe.yaml (its spike
rule, the gradient clip, tokens per step). Panels, all against the step:

  loss           exponential moving average over the faint raw curve, held-out loss overlaid,
                 loss spikes and rollbacks marked
  learning rate
  gradient norm  the clip threshold, spikes, rollbacks, non-finite steps and fp16 overflows marked
  throughput     global tokens/s (each launch's compile step left out), MFU on the right axis
  data wait      the share of each iteration spent between steps (waiting for data, saving)
and for Mixture-of-Experts runs (training/worker/router_stats.py):
  load balancing the load-balancing loss (1.0 when the experts share the load evenly)
  expert load    each MoE layer's busiest expert over the mean load

A dotted vertical line marks each later launch of the run (a resume, or the restart after a rollback).
"""

import math
import os
import re
from dataclasses import dataclass, field
from statistics import median
from typing import Optional

from ascend_llm_recipes.common.errors import PretrainError, RecipeError
from ascend_llm_recipes.training.worker.metrics import loss_spike, read_jsonl
from ascend_llm_recipes.training.run_files import METRICS, RESOLVED_RECIPE

DASHBOARD = "dashboard.png"
PANELS = ("loss", "learning rate", "gradient norm", "throughput", "data wait")
MOE_PANELS = ("load balancing", "expert load")  # when the runs are Mixture-of-Experts models
# Event markers of a single run; with several runs they take each run's colour (black-edged) instead.
SPIKE_COLOR, ROLLBACK_COLOR, NONFINITE_COLOR = "darkorange", "crimson", "black"


@dataclass
class RunHistory:
    """What the dashboard shows of one run directory."""
    label: str
    train: list                      # per-step records, one per step, in step order
    held_out: list                   # held-out records (val_loss, val_ppl)
    rollbacks: list = field(default_factory=list)  # data_skips.json's entries: spike_step, loss, rolled_back_to
    spike_factor: float = 0.0        # the anomaly monitor's rule, from recipe.yaml (0: off)
    spike_window: int = 20
    clip: Optional[float] = None     # max_grad_norm when gradients are clipped
    tokens_per_step: Optional[int] = None

    def launch_starts(self) -> list:
        """Steps at which a later launch began (its first step compiles the graph)."""
        return [r["step"] for r in self.train[1:] if r.get("compile")]

    def spikes(self) -> list:
        """The records the anomaly monitor found to be loss spikes and that stayed in the run.

        The monitor's window restarts with each launch; a spike that caused a rollback was
        trained again, so it is not among these (see `rollbacks`).
        """
        found, losses = [], []
        for record in self.train:
            if record.get("compile"):
                losses = []
            losses.append(record["loss"])
            if loss_spike(losses, self.spike_factor, self.spike_window) is not None:
                found.append(record)
        return found


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(run_dir: str, log=print) -> tuple:
    """(training records, held-out records) of a run directory; torn lines are dropped with a warning."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        raise PretrainError(f"{path}: no metrics file ({run_dir} is not a run directory, or no step has finished)",
                            hint="pass a run directory (the output_dir of a launch), e.g. runs/tiny_cpu")
    train, held_out = {}, {}
    for record in read_jsonl(path, log=log):
        if not isinstance(record.get("step"), int):
            log(f"{path}: a record without an integer step, ignored: {str(record)[:80]}")
        elif _number(record.get("val_loss")):
            held_out[record["step"]] = record
        elif _number(record.get("loss")):
            train[record["step"]] = record  # a resume rewrites the steps after its checkpoint: the last one holds
        else:
            log(f"{path}: step {record['step']}: neither loss nor val_loss, ignored")
    if not train and not held_out:
        raise PretrainError(f"{path}: no step records to plot", hint="plot after at least one training step")
    return [train[s] for s in sorted(train)], [held_out[s] for s in sorted(held_out)]


def read_run(run_dir: str, label: str = None, log=print) -> RunHistory:
    """A run directory's metrics, rollbacks and the recipe values the dashboard marks."""
    from ascend_llm_recipes.data.loader import SKIPS_FILE, read_skips
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    train, held_out = read_metrics(run_dir, log)
    run = RunHistory(label or os.path.basename(os.path.normpath(run_dir)), train, held_out)
    try:
        run.rollbacks = [r for r in read_skips(run_dir) if _number(r.get("spike_step"))]
    except (OSError, ValueError, KeyError, TypeError) as err:
        log(f"{os.path.join(run_dir, SKIPS_FILE)}: unreadable ({err}); rollbacks are not marked")
    recipe_path = os.path.join(run_dir, RESOLVED_RECIPE)
    if not os.path.isfile(recipe_path):
        log(f"{recipe_path}: missing; loss spikes and the gradient clip are not marked")
        return run
    try:
        recipe = load_recipe(recipe_path, planning=True)  # planning: an Ascend run is plotted on any machine
    except RecipeError as err:
        log(f"{err}; loss spikes and the gradient clip are not marked")
        return run
    run.spike_factor, run.spike_window = recipe.anomaly.spike_factor, recipe.anomaly.spike_window
    run.clip = recipe.runner_wrapper.max_grad_norm if recipe.runner_wrapper.use_clip_grad else None
    run.tokens_per_step = recipe.tokens_per_step
    return run


def run_labels(run_dirs: list) -> list:
    """The shortest path tails that tell the runs apart (runs/a, other/a -> runs/a, other/a; runs/a, runs/b -> a, b)."""
    parts = [os.path.abspath(d).split(os.sep) for d in run_dirs]
    tail = 1
    while tail < max(map(len, parts)) and len({tuple(p[-tail:]) for p in parts}) < len(set(map(tuple, parts))):
        tail += 1
    return ["/".join(p[-tail:]) for p in parts]


def ema(values: list, span: int) -> list:
    """Bias-corrected exponential moving average (TensorBoard's smoothing), weight 2 / (span + 1).

    Non-finite values do not enter the average and come out as NaN (a gap in the line).
    """
    keep = 1 - 2 / (span + 1)
    mean = weight = 0.0
    out = []
    for value in values:
        if not math.isfinite(value):
            out.append(math.nan)
            continue
        mean = keep * mean + (1 - keep) * value
        weight = keep * weight + (1 - keep)
        out.append(mean / weight)
    return out


def default_span(steps: int) -> int:
    """About a twentieth of the run, between 5 and 500 steps."""
    return max(5, min(500, steps // 20))


def _steady(run: RunHistory, key: str) -> list:
    """(step, value) of the steps that did not compile the graph (a compile step's time says nothing of speed)."""
    return [(r["step"], r[key]) for r in run.train if not r.get("compile") and _number(r.get(key))]


def _finite(values) -> list:
    return [v for v in values if _number(v) and math.isfinite(v)]


def run_summary(run: RunHistory, span: int) -> str:
    """One line of figures for the figure's legend."""
    losses = [r["loss"] for r in run.train]
    smoothed = _finite(ema(losses, span)) if losses else []
    parts = [f"{run.train[-1]['step'] if run.train else 0} steps"]
    if run.tokens_per_step and run.train:
        parts[0] += f" ({run.train[-1]['step'] * run.tokens_per_step:,} tokens)"
    if smoothed:
        parts.append(f"loss {_finite(losses)[0]:.3f} → {smoothed[-1]:.3f} (EMA)")
    if run.held_out:
        parts.append(f"held-out {run.held_out[-1]['val_loss']:.3f} at step {run.held_out[-1]['step']}")
    speed = [v for _, v in _steady(run, "tokens_per_s")]
    if speed:
        parts.append(f"{median(speed):,.0f} tokens/s")
    mfu = [v for _, v in _steady(run, "mfu")]
    parts.append(f"MFU {median(mfu):.1%}" if mfu else "MFU n/a")
    wait = [v for _, v in _steady(run, "data_wait")]
    if wait:
        parts.append(f"data wait {median(wait):.1%}")
    events = [f"{len(run.rollbacks)} rollback(s)"] if run.rollbacks else []
    events += [f"{len(run.spikes())} loss spike(s)"] if run.spike_factor and run.spikes() else []
    nonfinite = sum(not math.isfinite(r["loss"]) for r in run.train)
    events += [f"{nonfinite} non-finite step(s)"] if nonfinite else []
    return f"{run.label}: " + ", ".join(parts + events) + " (medians over steady steps)"


def _mark_launches(ax, runs: list, colors: list) -> None:
    for run, color in zip(runs, colors):
        for step in run.launch_starts():
            ax.axvline(step - 0.5, color=color, ls=":", lw=1, alpha=0.8, label=f"{run.label}: relaunch")


def _loss_panel(ax, runs: list, colors: list, span: int) -> None:
    tops, bottoms = [], []
    for run, color in zip(runs, colors):
        steps, losses = [r["step"] for r in run.train], [r["loss"] for r in run.train]
        smoothed = ema(losses, span)
        ax.plot(steps, losses, color=color, lw=0.8, alpha=0.3, label=f"{run.label}: train loss")
        ax.plot(steps, smoothed, color=color, lw=2, label=f"{run.label}: train loss EMA")
        held = [(r["step"], r["val_loss"]) for r in run.held_out]
        if held:
            ax.plot(*zip(*held), "o--", color=color, mfc="white", mew=1.5, ms=5, lw=1,
                    label=f"{run.label}: held-out loss")
        finite = _finite(losses)
        # The smoothed curve and the raw curve's 99th percentile set the scale, so one spike does not flatten
        # the rest; markers of higher losses sit on the panel's top edge.
        tops += _finite(smoothed) + [v for _, v in held] + sorted(finite)[int(0.99 * (len(finite) - 1)):][:1]
        bottoms += finite + [v for _, v in held]
    if tops and bottoms:
        low, high = min(bottoms), max(tops)
        pad = 0.05 * (high - low or 1.0)
        ax.set_ylim(low - pad, high + pad)
    for run, color in zip(runs, colors):
        _mark_events(ax, run, {r["step"]: r["loss"] for r in run.train}, "loss", len(runs) > 1 and color)
    moe = any("lm_loss" in r for run in runs for r in run.train)  # MoE: the loss includes the router terms
    ax.set_ylabel("cross-entropy + router losses (nats/token)" if moe else "cross-entropy (nats/token)")


def _mark_events(ax, run: RunHistory, values: dict, what: str, run_color) -> None:
    """Spikes (kept), rollbacks (the spike step, which was trained again) and non-finite steps on a panel.

    run_color: the run's colour when several runs share the panel, else False (the accent colours).
    """
    spike_color, rollback_color = (run_color, run_color) if run_color else (SPIKE_COLOR, ROLLBACK_COLOR)
    ceiling = ax.get_ylim()[1] if not ax.get_autoscaley_on() else math.inf
    spikes = [(r["step"], min(values[r["step"]], ceiling)) for r in run.spikes() if _finite([values.get(r["step"])])]
    if spikes:
        ax.scatter(*zip(*spikes), marker="^", s=45, color=spike_color, edgecolors="black", linewidths=0.6,
                   zorder=5, clip_on=False, label=f"{run.label}: loss spike")
    for rollback in run.rollbacks:
        step = rollback["spike_step"]
        ax.axvline(step, color=rollback_color, ls="--", lw=1, label=f"{run.label}: rollback")
        if what == "loss" and _finite([rollback.get("loss")]):
            y = min(rollback["loss"], ceiling)
            ax.scatter([step], [y], marker="X", s=70, color=rollback_color, edgecolors="black", linewidths=0.6,
                       zorder=6, clip_on=False, label=f"{run.label}: spike rolled back")
            ax.annotate(f"loss {rollback['loss']:.2f}, rolled back to {rollback.get('rolled_back_to', '?')}",
                        (step, y), xytext=(4, -10 if y == ceiling else 4), textcoords="offset points", fontsize=7,
                        color=rollback_color, annotation_clip=False)
    top = ax.get_xaxis_transform()  # x in steps, y as a fraction of the panel's height
    nonfinite = [s for s, v in values.items() if v is not None and not math.isfinite(v)]
    if nonfinite:
        ax.scatter(nonfinite, [0.96] * len(nonfinite), transform=top, marker="x", color=NONFINITE_COLOR, zorder=6,
                   label=f"{run.label}: non-finite {what}")


def _grad_norm_panel(ax, runs: list, colors: list) -> None:
    positive = []
    for run, color in zip(runs, colors):
        points = [(r["step"], r["grad_norm"]) for r in run.train if _number(r.get("grad_norm"))]
        if points:
            ax.plot(*zip(*points), color=color, lw=1, label=f"{run.label}: gradient norm")
            positive += [v for _, v in points if math.isfinite(v) and v > 0]
        if run.clip:
            ax.axhline(run.clip, color=color, ls="--", lw=1, alpha=0.7, label=f"{run.label}: clip {run.clip:g}")
        _mark_events(ax, run, {s: v for s, v in points}, "gradient norm", len(runs) > 1 and color)
        overflow = [r["step"] for r in run.train if r.get("overflow")]
        if overflow:
            ax.scatter(overflow, [0.04] * len(overflow), transform=ax.get_xaxis_transform(), marker="|", s=80,
                       color=color, label=f"{run.label}: fp16 overflow (update skipped)")
    if positive and max(positive) / min(positive) > 30:
        ax.set_yscale("log")
    ax.set_ylabel("global L2 norm (before clipping)")


def _smoothed_panel(ax, runs: list, colors: list, key: str, span: int, scale: float = 1.0) -> None:
    for run, color in zip(runs, colors):
        points = _steady(run, key)
        if points:
            steps, values = zip(*points)
            values = [v * scale for v in values]
            ax.plot(steps, values, color=color, lw=0.8, alpha=0.3, label=f"{run.label}: {key}")
            ax.plot(steps, ema(values, span), color=color, lw=2, label=f"{run.label}: {key} EMA")
    ax.set_ylim(bottom=0)


def _router_panels(axes: dict, runs: list, colors: list, span: int) -> None:
    """Mixture of Experts (training/worker/router_stats.py): the load-balancing loss and each layer's expert load."""
    _smoothed_panel(axes["load balancing"], runs, colors, "load_balancing_loss", span)
    ax = axes["expert load"]
    styles = ("-", "--", ":", "-.")
    for run, color in zip(runs, colors):
        points = [(r["step"], r["expert_load"]) for r in run.train if r.get("expert_load")]
        for layer in range(len(points[0][1]) if points else 0):
            ax.plot([s for s, _ in points], [v[layer] for _, v in points], color=color, lw=1,
                    ls=styles[layer % len(styles)], label=f"{run.label}: MoE layer {layer + 1}")
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.legend(fontsize=7, loc="best")


def _mfu_axis(ax, runs: list) -> None:
    """MFU on the right axis when one factor turns every plotted run's tokens/s into its MFU."""
    ratios = [r["mfu"] / r["tokens_per_s"] for run in runs for r in run.train
              if not r.get("compile") and _number(r.get("mfu")) and _number(r.get("tokens_per_s"))
              and r["tokens_per_s"] > 0]
    if ratios and max(ratios) <= min(ratios) * 1.01:
        factor = 100 * median(ratios)
        right = ax.secondary_yaxis("right", functions=(lambda t: t * factor, lambda m: m / factor))
        right.set_ylabel("MFU (%)")
    else:
        ax.text(0.99, 0.03, "MFU: see the legend above" if ratios else "MFU not reported (no trusted device peak)",
                transform=ax.transAxes, ha="right", fontsize=7, color="0.4")


def dashboard(runs: list, ema_span: int = None):
    """The dashboard of one run, or the comparison of several (runs overlaid, one colour each), as a Figure."""
    from matplotlib.figure import Figure  # no pyplot: no global figure registry, no GUI backend
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    span = ema_span or default_span(max((len(run.train) for run in runs), default=0))
    colors = [f"C{i % 10}" for i in range(len(runs))]
    moe = any("expert_load" in r for run in runs for r in run.train)
    fig = Figure(figsize=(16, 13 if moe else 9.5), dpi=100, layout="constrained")
    grid = fig.add_gridspec(3 if moe else 2, 3, height_ratios=(1.15, 1, 1) if moe else (1.15, 1))
    loss = fig.add_subplot(grid[0, :2])
    axes = dict(zip(PANELS, [loss, fig.add_subplot(grid[0, 2], sharex=loss)]
                    + [fig.add_subplot(grid[1, i], sharex=loss) for i in range(3)]))
    if moe:
        axes.update(zip(MOE_PANELS, [fig.add_subplot(grid[2, 0], sharex=loss),
                                     fig.add_subplot(grid[2, 1:], sharex=loss)]))
        _router_panels(axes, runs, colors, span)
    _loss_panel(axes["loss"], runs, colors, span)
    for run, color in zip(runs, colors):
        lr = [(r["step"], r["lr"]) for r in run.train if _number(r.get("lr"))]
        if lr:
            axes["learning rate"].plot(*zip(*lr), color=color, lw=1.5, label=f"{run.label}: learning rate")
    axes["learning rate"].yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.1e}"))
    _grad_norm_panel(axes["gradient norm"], runs, colors)
    _smoothed_panel(axes["throughput"], runs, colors, "tokens_per_s", span)
    axes["throughput"].set_ylabel("tokens/s (all devices)")
    _mfu_axis(axes["throughput"], runs)
    _smoothed_panel(axes["data wait"], runs, colors, "data_wait", span, scale=100)
    axes["data wait"].set_ylabel("% of the iteration")
    titles = {"loss": f"loss: raw (faint), EMA over {span} steps (bold), held-out (circles)",
              "learning rate": "learning rate", "gradient norm": "gradient norm",
              "throughput": "throughput (compile steps left out)",
              "data wait": "data wait (between steps: input pipeline, saves)",
              "load balancing": "MoE load-balancing loss (1.0 = even; raw faint, EMA bold)",
              "expert load": "MoE busiest expert / mean load, per layer (1.0 = even)"}
    for name, ax in axes.items():
        ax.set_label(name)
        ax.set_title(titles[name], fontsize=10, loc="left")
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        _mark_launches(ax, runs, colors)
    _marker_legend(axes["loss"], axes["gradient norm"], runs, Line2D)
    # The runs' colours and figures, under the figure's title (a suptitle would overlap an outside legend).
    title = (f"Training dashboard: {runs[0].label}" if len(runs) == 1 else
             "Training runs compared: " + ", ".join(run.label for run in runs))
    fig.legend([Line2D([], [], color=c, lw=3) for c in colors], [run_summary(run, span) for run in runs],
               loc="outside upper left", fontsize=9, frameon=False, title=title, title_fontsize=13,
               alignment="left")
    return fig


def _marker_legend(loss_ax, grad_ax, runs: list, line) -> None:
    """What the line styles and markers mean (colours are the runs, in the figure's legend)."""
    gray = "0.35"

    def accent(color):
        return color if len(runs) == 1 else gray
    styles = [(line([], [], color=gray, lw=0.8, alpha=0.4), "train loss, per step"),
              (line([], [], color=gray, lw=2), "train loss, EMA")]
    if any(run.held_out for run in runs):
        styles.append((line([], [], color=gray, marker="o", ls="--", mfc="white"), "held-out loss"))
    events = []
    if any(run.spike_factor and run.spikes() for run in runs):
        events.append((line([], [], color=accent(SPIKE_COLOR), marker="^", ls="", mec="black", mew=0.6),
                       "loss spike (anomaly monitor)"))
    if any(run.rollbacks for run in runs):
        events.append((line([], [], color=accent(ROLLBACK_COLOR), marker="X", ls="--", mec="black", mew=0.6),
                       "spike rolled back (step retrained)"))
    if any(run.launch_starts() for run in runs):
        events.append((line([], [], color=gray, ls=":"), "relaunch (resume or rollback)"))
    if any(not math.isfinite(r["loss"]) for run in runs for r in run.train):
        events.append((line([], [], color=NONFINITE_COLOR, marker="x", ls=""), "non-finite step"))
    loss_ax.legend(*zip(*(styles + events)), fontsize=8, loc="best")
    grad = [(line([], [], color="0.35", ls="--"), "clip threshold")] if any(run.clip for run in runs) else []
    if any(r.get("overflow") for run in runs for r in run.train):
        grad.append((line([], [], color="0.35", marker="|", ls=""), "fp16 overflow (update skipped)"))
    if grad + events:
        grad_ax.legend(*zip(*(grad + events)), fontsize=7, loc="best")


def output_name(runs: list) -> str:
    """dashboard.png for one run; compare_<a>_<b>.png for several (so it never overwrites a run's own)."""
    if len(runs) == 1:
        return DASHBOARD
    name = "compare_" + "_".join(re.sub(r"[^A-Za-z0-9.+-]+", "-", run.label).strip("-") for run in runs)
    return name[:120] + ".png"


def plot_runs(run_dirs: list, output_dir: str, ema_span: int = None, log=print) -> str:
    """Write the dashboard of one run, or the comparison of several, into output_dir; returns the file."""
    runs = [read_run(d, label, log) for d, label in zip(run_dirs, run_labels(run_dirs))]
    fig = dashboard(runs, ema_span)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, output_name(runs))
    fig.savefig(path, dpi=100)
    return path

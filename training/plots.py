"""PNG plots of one or more runs' metrics.jsonl, runs overlaid, for people who would rather look."""

import os
import sys

from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.training.metrics import read_jsonl
from ascend_llm_recipes.training.run_files import METRICS

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s (global)"),
          ("grad_norm", "gradient norm"), ("data_wait", "data wait (share of iteration)"))


def read_metrics(run_dir: str, log=print) -> tuple:
    """(training records, held-out records) of a run directory; torn lines are dropped with a warning."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        raise PretrainError(f"{path}: no metrics file ({run_dir} is not a run directory, or no step has finished)",
                            hint="pass a run directory (the output_dir of a launch), e.g. runs/tiny_cpu")
    train, held_out = [], []
    for record in read_jsonl(path, log=log):
        if not isinstance(record.get("step"), int):
            log(f"{path}: a record without an integer step, ignored: {str(record)[:80]}")
        else:
            (held_out if "val_loss" in record else train).append(record)
    if not train and not held_out:
        raise PretrainError(f"{path}: no step records to plot", hint="plot after at least one training step")
    return train, held_out


def plot_runs(run_dirs: list, output_dir: str) -> list:
    """One PNG per metric (every run overlaid); returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def warn(message):
        print("warning: " + message, file=sys.stderr)

    runs = {os.path.basename(os.path.normpath(d)) or d: read_metrics(d, log=warn) for d in run_dirs}
    os.makedirs(output_dir, exist_ok=True)
    written = []
    for key, title in PANELS:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, (train, held_out) in runs.items():
            # The first step includes graph compilation: leave it out of speed plots.
            points = [(r["step"], r[key]) for r in train if isinstance(r.get(key), (int, float))
                      and not (key in ("tokens_per_s", "data_wait") and r.get("compile"))]
            if points:
                ax.plot(*zip(*points), label=f"{name} train" if key == "loss" else name)
            held = [(r["step"], r["val_loss"]) for r in held_out if isinstance(r["val_loss"], (int, float))]
            if key == "loss" and held:
                ax.plot(*zip(*held), "o--", label=f"{name} held-out")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        ax.legend(fontsize=8)
        path = os.path.join(output_dir, f"{key}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written

"""PNG plots of one or more runs' metrics.jsonl, runs overlaid, for people who would rather look."""

import json
import os

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s (global)"),
          ("grad_norm", "gradient norm"), ("data_wait", "data wait (share of iteration)"))


def read_metrics(run_dir: str) -> tuple:
    """(training records, held-out records) of a run directory."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a run directory?)")
    train, held_out = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            (held_out if "val_loss" in record else train).append(record)
    return train, held_out


def plot_runs(run_dirs: list, output_dir: str) -> list:
    """One PNG per metric (every run overlaid); returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {os.path.basename(os.path.normpath(d)) or d: read_metrics(d) for d in run_dirs}
    os.makedirs(output_dir, exist_ok=True)
    written = []
    for key, title in PANELS:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, (train, held_out) in runs.items():
            # The first step includes graph compilation: leave it out of speed plots.
            points = [(r["step"], r[key]) for r in train if r.get(key) is not None
                      and not (key in ("tokens_per_s", "data_wait") and r.get("compile"))]
            if points:
                ax.plot(*zip(*points), label=f"{name} train" if key == "loss" else name)
            if key == "loss" and held_out:
                ax.plot([r["step"] for r in held_out], [r["val_loss"] for r in held_out], "o--",
                        label=f"{name} held-out")
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

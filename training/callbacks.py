"""Training callbacks: per-step records, the stop step, and the run summary."""

import json
import time

import mindspore as ms
import numpy as np
from mindspore.train.callback import Callback

from training.errors import LaunchError


def _scalar(value):
    if value is None:
        return None
    return float(np.asarray(value.asnumpy() if hasattr(value, "asnumpy") else value).reshape(-1)[0])


class StepRecorder(Callback):
    """Writes one JSON line per step, enforces graph mode, and stops at runner_config.stop_step."""

    def __init__(self, recipe, metrics_path: str = None):
        super().__init__()
        self.recipe = recipe
        self.metrics_path = metrics_path
        self.stop_step = recipe.runner_config.stop_step
        self.tokens_per_step = recipe.tokens_per_step
        self.want_graph = recipe.context.mode == 0
        self.records: list = []
        self._step_start = 0.0
        self._file = None

    def on_train_begin(self, run_context):
        if self.metrics_path:
            self._file = open(self.metrics_path, "a", encoding="utf-8")

    def on_train_step_begin(self, run_context):
        self._step_start = time.perf_counter()

    def on_train_step_end(self, run_context):
        step_time = time.perf_counter() - self._step_start
        params = run_context.original_args()
        outputs = params.net_outputs
        graph_mode = ms.get_context("mode") == ms.GRAPH_MODE
        if self.want_graph and not graph_mode:
            raise LaunchError("training fell back to PyNative mode although context.mode is 0",
                              hint="build the MindFormers context before the Trainer (training.train does)")
        record = {
            "step": int(params.cur_step_num),
            "loss": _scalar(outputs[0]),
            "overflow": bool(_scalar(outputs[1])),
            "loss_scale": _scalar(outputs[2]),
            "lr": _scalar(outputs[3]),
            "grad_norm": _scalar(outputs[4]) if len(outputs) > 4 else None,
            "step_time": round(step_time, 6),
            "tokens_per_s": round(self.tokens_per_step / step_time, 1),
            "graph_mode": graph_mode,
            "time": round(time.time(), 3),
        }
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self.stop_step and record["step"] >= self.stop_step:
            run_context.request_stop()

    def on_train_end(self, run_context):
        if self._file:
            self._file.close()
            self._file = None

    def summary(self, run_dir: str, checkpoints: list) -> dict:
        """Steps, tokens, first/last loss and steady-state throughput (first step = compile, left out)."""
        steady = self.records[1:] or self.records
        steady_time = sum(r["step_time"] for r in steady)
        return {
            "run_dir": run_dir,
            "steps": len(self.records),
            "last_step": self.records[-1]["step"] if self.records else 0,
            "tokens": len(self.records) * self.tokens_per_step,
            "first_loss": self.records[0]["loss"] if self.records else None,
            "last_loss": self.records[-1]["loss"] if self.records else None,
            "first_step_time": self.records[0]["step_time"] if self.records else None,
            "tokens_per_s": round(len(steady) * self.tokens_per_step / steady_time, 1) if steady_time else None,
            "graph_mode": all(r["graph_mode"] for r in self.records),
            "checkpoint": checkpoints[-1] if checkpoints else None,
        }

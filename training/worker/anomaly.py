"""The anomaly monitor callback: what to do about a non-finite loss or a loss spike (recipe section `anomaly`)."""

import json
import math
import os
import time

from mindspore.train.callback import Callback

from ascend_llm_recipes.training.worker.callbacks import StepRecorder
from ascend_llm_recipes.training.worker.checkpointer import Checkpointer
from ascend_llm_recipes.training.recipe.schema import DynamicLossScaleConfig
from ascend_llm_recipes.common.errors import LaunchError


class AnomalyMonitor(Callback):
    """NaN policy (stop with a post-mortem snapshot, or skip), loss-spike detection, and rollback.

    Runs after StepRecorder, on its StepRecord, and before the Checkpointer, so a step it
    stops for is never saved as a regular checkpoint.

    Loss spike with `anomaly.on_spike: rollback`: the run stops at the spike step without
    saving it, records the blend-order positions of the offending samples in
    RUN_DIR/data_skips.json and its status; the launcher then resumes from the newest
    checkpoint before the spike, and the rebuilt training order leaves those samples out.
    Every rank takes the same spike decision without a collective of its own: the losses it is made
    on are StepRecorder's, which are the same on every rank (all-reduced in its one host all-reduce
    per step under data parallel; the graph's global loss in semi-auto parallel). A rollback waits
    for every rank's saves with one more all-reduce.
    """

    def __init__(self, run_dir: str, world_size: int, recorder: StepRecorder, checkpointer: Checkpointer, recipe,
                 rollbacks: list):
        super().__init__()
        self.run_dir, self.world_size = run_dir, world_size
        self.recorder = recorder
        self.checkpointer = checkpointer
        self.anomaly = recipe.anomaly
        self.global_batch_size = recipe.global_batch_size
        self.rollbacks = list(rollbacks)     # made by earlier launches of this run
        self.skips = checkpointer.skips
        # Positions of the blend order before any skip (skip ranges are disjoint).
        self.order_total = len(checkpointer.order) + sum(end - start for start, end in self.skips)
        self.rollback = None                 # set when this launch stops for a rollback
        self.last_spike = None               # (loss, moving mean) of the last spike
        self.dynamic_scale = isinstance(recipe.runner_wrapper.scale_sense, DynamicLossScaleConfig)

    def on_train_step_end(self, run_context):
        record = self.recorder.last
        step, loss = record.step, record.loss
        params = run_context.original_args()
        if self.scaled_away(record):
            print(f"[loss scale] step {step}: the scaled gradients overflowed; the update was skipped and the loss "
                  f"scale is now {record.loss_scale:g}", flush=True)
        elif record.non_finite:  # on any rank, any pipeline stage: StepRecorder agreed it
            if self.anomaly.on_nan == "stop":
                where = self.checkpointer.save(params, step, kind="nan")
                raise LaunchError(f"step {step}: non-finite loss {loss} / grad norm {record.grad_norm}; "
                                  f"state saved for post-mortem in {where}",
                                  hint="inspect it, then resume from the last good checkpoint with a lower LR, "
                                       "or set anomaly.on_nan: skip")
            print(f"[anomaly] step {step}: non-finite loss/grad norm; the update was skipped "
                  "(anomaly.on_nan: skip)", flush=True)
        if self.spiked(step, loss):
            if self.anomaly.spike_snapshot:
                print(f"[anomaly] snapshot: {self.checkpointer.save(params, step, kind='spike')}", flush=True)
            if self.anomaly.on_spike == "rollback" and self.roll_back(step, loss):
                self.checkpointer.stop_without_saving()
                run_context.request_stop()

    def scaled_away(self, record) -> bool:
        """An overflow dynamic loss scaling handles itself: the loss is finite, the train step skipped the update and
        lowered the scale. At the scale's floor of 1 (mindspore/nn/wrap/loss_scale.py:157, 183-184) it cannot, and a
        non-finite gradient there is an anomaly like any other."""
        return self.dynamic_scale and record.overflow and math.isfinite(record.loss) and record.loss_scale > 1.0

    def spiked(self, step: int, loss: float) -> bool:
        """This step's loss is a spike (on any rank, when several train together); logs it."""
        if not self.anomaly.spike_factor:
            return False
        # The recorder's losses are every rank's (see the class docstring), so is the decision.
        mean = self.recorder.spike(self.anomaly.spike_factor, self.anomaly.spike_window)
        if mean is None:
            return False
        self.last_spike = (loss, mean)
        print(f"[anomaly] step {step}: loss spike {loss:.4f} > {self.anomaly.spike_factor} x moving mean "
              f"{mean:.4f} over {self.anomaly.spike_window} steps", flush=True)
        return True

    def roll_back(self, step: int, loss: float) -> bool:
        """Stop for a rollback past this step's samples; False (only logged) when there is nothing to roll back to."""
        from ascend_llm_recipes.training import checkpoint as ckpt
        from ascend_llm_recipes.data.loader import SKIPS_FILE, skip_range

        if len(self.rollbacks) >= self.anomaly.max_rollbacks:
            print(f"[anomaly] step {step}: not rolling back, anomaly.max_rollbacks ({self.anomaly.max_rollbacks}) "
                  "reached; training goes on", flush=True)
            return False
        self.checkpointer.wait()
        if self.world_size > 1:
            from ascend_llm_recipes.training.worker.collectives import all_reduce_sum
            all_reduce_sum([1.0])  # every rank's saves are on disk before anyone looks for the last good one
        good = [s for s in ckpt.complete_steps(self.run_dir) if s < step]
        if not good:
            print(f"[anomaly] step {step}: no checkpoint before the spike to roll back to; training goes on",
                  flush=True)
            return False
        first = max(step - self.anomaly.rollback_skip_steps + 1, good[-1] + 1)
        positions = skip_range(self.order_total, self.skips, first, step, self.global_batch_size)
        loss_seen, mean = self.last_spike or (loss, None)
        self.rollback = {"spike_step": step, "loss": loss_seen, "moving_mean": mean,
                         "rolled_back_to": good[-1], "skipped_steps": [first, step],
                         "skipped_positions": positions,
                         "skipped_samples": sum(end - start for start, end in positions),
                         "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        # Every rank writes the same content (no shared filesystem assumed); the rename is atomic.
        path = os.path.join(self.run_dir, SKIPS_FILE)
        ckpt.write_atomic(path, json.dumps({"rollbacks": self.rollbacks + [self.rollback]}, indent=1))
        print(f"[anomaly] step {step}: rolling back to step {good[-1]}; the {self.rollback['skipped_samples']} "
              f"samples of steps {first}-{step} (training-order positions {positions}) will be skipped; recorded in "
              f"{path}", flush=True)
        return True

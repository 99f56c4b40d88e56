"""The checkpointer callback: saves every N steps and on a stop request, writes in the background, prunes."""

import json
import os
import shutil
import time
from contextlib import contextmanager

import mindspore as ms
import numpy as np
from mindspore.train.callback import Callback

from ascend_llm_recipes.common.errors import LaunchError
from ascend_llm_recipes.common.files import disk_full, free_bytes
from ascend_llm_recipes.common.units import byte_size
from ascend_llm_recipes.training.run_files import CHECKPOINTS
from ascend_llm_recipes.training.worker.callbacks import StepRecorder


class Checkpointer(Callback):
    """Saves every `every` steps (and on SIGTERM) through training/checkpoint.py, keeping what retention says.

    Runs after StepRecorder (whose StepRecord gives the global step, loss scale and the stop
    agreed between ranks) and after AnomalyMonitor. In async mode the parameters are copied to
    host memory synchronously (the state of this step), and the files, checksums and manifest
    are written by a background thread while training goes on.

    Each save records the data position (samples of the training order consumed) with the ids
    and hash of the samples that come next, and the skip list in force (data/loader.py), so a
    resume can prove it continues with the right samples.
    """

    def __init__(self, run_dir: str, rank: int, world_size: int, recorder: StepRecorder, recipe,
                 state_extra: dict, skips: list):
        super().__init__()
        from ascend_llm_recipes.data.loader import training_order
        from ascend_llm_recipes.training.recipe.loader_spec import loader_spec

        settings = recipe.checkpointing
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.recorder = recorder
        self.prefix = settings.prefix
        self.every = settings.save_checkpoint_steps
        self.keep_last, self.keep_every = settings.keep_checkpoint_max, settings.keep_every
        self.async_save = settings.async_save
        self.global_batch_size = recipe.global_batch_size
        self.state_extra = state_extra
        self.skips = skips
        # flat sample ids, in the order training reads them
        self.order = training_order(loader_spec(recipe, skips=self.skips))[1]
        self.preempted = False
        self.stopped_for_rollback = False
        self.last_saved = None
        self.blocked_time = 0.0  # seconds training waited for saves (benchmark figure)
        self._writer = None
        self._failure = None  # the background writer's error, raised by wait()

    def stop_without_saving(self) -> None:
        """The run stops at this step to roll back (AnomalyMonitor): it must not be saved."""
        self.stopped_for_rollback = True

    def on_train_step_end(self, run_context):
        if self.stopped_for_rollback:
            return
        record = self.recorder.last
        # Under data parallel the stop is agreed (StepRecorder): every rank stops at the same step,
        # otherwise that step's checkpoint is incomplete and the ranks still training wait for the
        # others in the next gradient all-reduce.
        preempted = record.stop
        params = run_context.original_args()
        if (self.every and record.step % self.every == 0) or preempted:
            self.save(params, record.step)
        if preempted:
            self.preempted = True
            print(f"[checkpoint] stop requested (SIGTERM, or the launcher stopping the job): saved step "
                  f"{record.step}, stopping; rerun the same command to resume", flush=True)
            run_context.request_stop()

    def on_train_end(self, run_context):
        step = self.recorder.records[-1]["step"] if self.recorder.records else 0
        if step and self.last_saved != step and not self.stopped_for_rollback:
            self.save(run_context.original_args(), step)
        self.wait()

    def save(self, params, step: int, kind: str = "step") -> str:
        from ascend_llm_recipes.data.loader import describe_next, next_samples_count
        from ascend_llm_recipes.training import checkpoint as ckpt

        start = time.perf_counter()
        self.wait()  # one save in flight at a time
        directory = ckpt.step_dir(self.run_dir, step, kind)
        epoch = int(params.cur_epoch_num)
        name = ckpt.ckpt_name(self.prefix, self.rank, epoch, step)
        loss_scale = self.recorder.last.loss_scale if self.recorder.last else 1.0
        append = {"epoch_num": epoch, "step_num": step, "loss_scale": float(loss_scale),
                  "global_batch_size": self.global_batch_size}
        meta = {"step": step, "epoch": epoch, "rank": self.rank, "world_size": self.world_size, "kind": kind}
        position = step * self.global_batch_size
        state = {"step": step, "epoch": epoch, "global_batch_size": self.global_batch_size,
                 "data_position": position,
                 "next_samples": describe_next(self.order, position, next_samples_count(self.global_batch_size)),
                 "data_skips": [list(r) for r in self.skips], "rng_state": rng_state(), **self.state_extra}
        tensors = ckpt.snapshot(params.train_network)
        rank_dir = os.path.join(directory, f"rank_{self.rank}")
        size = sum(t["data"].nbytes for t in tensors)

        def write():
            with self.naming_a_full_disk(step, rank_dir, size):
                if self.rank == 0:
                    os.makedirs(directory, exist_ok=True)
                    ckpt.write_atomic(os.path.join(directory, ckpt.STATE), json.dumps(state, indent=1))
                ckpt.write_rank(rank_dir, name, tensors, append, meta)
                if kind == "step":
                    ckpt.prune(self.run_dir, self.rank, self.keep_last, self.keep_every)

        with self.naming_a_full_disk(step, rank_dir, size):
            self.recorder.heartbeat.beat("save", step)  # the phase the launcher names if this save fails
        if self.async_save and kind == "step":
            import threading
            self._writer = threading.Thread(target=self._record_failure, args=(write,), name=f"checkpoint-{step}")
            self._writer.start()
        else:
            write()
        self.last_saved = step
        self.blocked_time += time.perf_counter() - start
        self.recorder.pause_ended()
        return directory

    def wait(self) -> None:
        """Wait for the save in flight; its failure (in the background writer) is raised here."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def _record_failure(self, write) -> None:
        try:
            write()
        except Exception as err:  # raised by wait(), in the training thread
            self._failure = err

    @contextmanager
    def naming_a_full_disk(self, step: int, rank_dir: str, checkpoint_bytes: int):
        """A full disk met during the step-N save is raised as disk_full_error's LaunchError."""
        try:
            yield
        except OSError as err:
            if not disk_full(err):
                raise
            raise self.disk_full_error(step, rank_dir, checkpoint_bytes) from err

    def disk_full_error(self, step: int, rank_dir: str, checkpoint_bytes: int) -> LaunchError:
        """What a full disk at the step-N save says: the space free once this rank's incomplete files of the step are
        removed (a resume sets the step aside anyway; the rank's status and error need a little room) and what a
        save takes. The launcher's report adds the step a rerun resumes from."""
        from ascend_llm_recipes.training.checkpoint import MANIFEST

        if not os.path.isfile(os.path.join(rank_dir, MANIFEST)):
            shutil.rmtree(rank_dir, ignore_errors=True)
        where = os.path.join(self.run_dir, CHECKPOINTS)
        return LaunchError(
            f"disk full at the step-{step} save: {byte_size(free_bytes(where))} free on {where}; this rank's "
            f"checkpoint takes about {byte_size(checkpoint_bytes)}, and a save needs room for one more than the "
            f"{self.keep_last} kept (keep_checkpoint_max) until the oldest is pruned",
            hint="free space on that disk, lower keep_checkpoint_max, or point output_dir at a larger disk")


def rng_state() -> list:
    """MindSpore's default generator state (seed and offset), so a resumed run draws the same numbers."""
    return [int(v) for v in np.asarray(ms.get_rng_state().asnumpy()).reshape(-1)]

"""Training callbacks: per-step metrics, heartbeats, held-out loss, a profiler window, the summary."""

import json
import math
import sys
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore.train.callback import Callback

from ascend_llm_recipes.common.errors import LaunchError
from ascend_llm_recipes.training.rank_status import Heartbeat
from ascend_llm_recipes.training.worker.metrics import (device_memory_bytes, host_memory_bytes, loss_spike,
                                                        model_flops_utilisation)


def _scalar(value):
    if value is None:
        return None
    return float(np.asarray(value.asnumpy() if hasattr(value, "asnumpy") else value).reshape(-1)[0])


@dataclass(frozen=True)
class StepRecord:
    """One training step as the callbacks after StepRecorder see it: the train step's outputs, named."""
    step: int
    loss: float                        # mean over micro-batches and over the ranks that compute it (see StepRecorder)
    lr: float
    grad_norm: Optional[float]         # None when the train step does not report one
    loss_scale: float
    overflow: bool
    stop: bool = False                 # a stop was requested (SIGTERM); under data parallel: on any rank
    rank_loss: Optional[float] = None  # this rank's own loss, when `loss` is the mean over ranks
    non_finite: bool = False           # loss or grad norm not finite, on any rank when the step was agreed

    @classmethod
    def from_outputs(cls, step: int, outputs, loss_divisor: int = 1, stop: bool = False) -> "StepRecord":
        """MindFormers' train steps return (loss, overflow, loss scale, learning rate[, global grad norm, ...])."""
        loss, grad_norm = _scalar(outputs[0]) / loss_divisor, _scalar(outputs[4]) if len(outputs) > 4 else None
        return cls(step=step, loss=loss, lr=_scalar(outputs[3]), grad_norm=grad_norm, loss_scale=_scalar(outputs[2]),
                   overflow=bool(_scalar(outputs[1])), stop=stop,
                   non_finite=not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)))


def last_stage_ranks(recipe) -> range:
    """The ranks that compute the loss: all of them, or under pipeline parallelism the last stage's.

    MindSpore numbers a stage's ranks contiguously, stage s holding ranks s x per_stage to
    (s + 1) x per_stage - 1 (MindFormers' _get_pipeline_group, mindformers/core/callback/callback.py:567-577);
    only the last stage's loss is real (callback.py:549-551 warns of it), the others output 0.
    """
    stages = recipe.parallel_config.pipeline_stage if recipe.use_parallel and recipe.parallel.parallel_mode in (1, 2) \
        else 1
    per_stage = recipe.world_size // stages
    return range((stages - 1) * per_stage, recipe.world_size)


def agree(local: StepRecord, sums, reduce_loss: bool, agree_on_stop: bool, computes: bool = True) -> StepRecord:
    """The step every rank takes from the all-reduced [loss x computes, computes, stop, non_finite] (`sums`).

    The loss is the mean over the ranks that compute one (a rank of an earlier pipeline stage adds
    nothing), so a NaN on the last stage reaches every rank; a stop request or a non-finite value on
    any rank is every rank's.
    """
    loss_sum, computing, stop, non_finite = (float(v) for v in sums)
    if reduce_loss and computing:
        local = replace(local, loss=loss_sum / computing, rank_loss=local.loss if computes else None)
    local = replace(local, non_finite=non_finite > 0 or not math.isfinite(local.loss))
    return replace(local, stop=stop > 0) if agree_on_stop else local


class StepRecorder(Callback):
    """One JSON line per step (and a log line), TensorBoard scalars, heartbeats, graph-mode guard, stop step.

    Times per step: `step_time` runs from step begin to step end (the compiled step; the
    first one includes graph compilation); `iteration_gap` from the previous step's end to
    this step's begin (waiting for the next batch, plus other callbacks such as checkpoint
    saves); `data_wait` is the gap's share of the whole iteration.

    Under data parallel (DATA_PARALLEL mode) each rank's loss is the mean over its slice of
    the batch; `loss` is the mean over every rank (all-reduced, so all ranks record and act on
    the same value) and `rank_loss` this rank's own. In semi-auto parallel the graph's loss
    is already global, but with pipeline stages only the last stage computes it: `loss` is then
    the last stage's, all-reduced to every rank (rank 0's metrics, the summary and the launcher's
    line included), and a NaN there is every rank's (AnomalyMonitor stops all of them). Files
    stay open until close(): held-out results of the final step are written after the other
    callbacks' on_train_end.

    `last` is the step's StepRecord for the callbacks that follow. With `agree_on_stop`, a stop
    request (`stop_requested`, set on SIGTERM) is agreed between the ranks in the same host
    all-reduce as the loss: one all-reduce per step, and every rank stops at the same step.
    """

    def __init__(self, recipe, metrics_path: str, heartbeat: Heartbeat, flops_per_token: int,
                 peak_flops: float = None, tensorboard_dir: str = None, initial_step: int = 0,
                 agree_on_stop: bool = False, rank: int = 0):
        super().__init__()
        self.initial_step = initial_step  # the step a resumed run starts after
        self.metrics_path = metrics_path
        self.heartbeat = heartbeat
        self.stop_step = recipe.runner_config.stop_step
        self.tokens_per_step = recipe.tokens_per_step
        self.devices = recipe.world_size
        self.device_target = recipe.context.device_target
        self.want_graph = recipe.context.mode == 0
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.tensorboard_dir = tensorboard_dir
        from ascend_llm_recipes.training.worker.train_step import summed_micro_batches
        self.loss_divisor = summed_micro_batches(recipe)  # the wrapper's loss sums micro-batches
        computing = last_stage_ranks(recipe)
        self.computes_loss = rank in computing
        self.reduce_loss = recipe.world_size > 1 and recipe.use_parallel and (
            recipe.parallel.parallel_mode == 0 or len(computing) < recipe.world_size)
        self.agree_on_stop = agree_on_stop and recipe.world_size > 1
        self.stop_requested = False  # SIGTERM may set it at any moment
        self.final_step = self.stop_step  # the ETA of each log line runs to it
        self.last: Optional[StepRecord] = None
        self.records: list = []
        self._step_start = 0.0
        self._last_end = 0.0
        self._file = None
        self._writer = None
        cfg = recipe.model.model_config
        self.moe = cfg.moe
        self.router_coefs = (cfg.router_aux_loss_coef, cfg.router_z_loss_coef)
        self.collapse_factor = recipe.anomaly.collapse_factor
        self.router_stats = None  # training/worker/router_stats.py, once the network exists
        self.router = None        # the step's RouterRecord

    def on_train_begin(self, run_context):
        if self.moe:
            from ascend_llm_recipes.training.worker.router_stats import router_stats
            self.router_stats = router_stats(run_context.original_args().train_network, self.collapse_factor)
        self._file = open(self.metrics_path, "a", encoding="utf-8")
        if self.tensorboard_dir:
            from tensorboardX import SummaryWriter
            self._writer = SummaryWriter(self.tensorboard_dir)
        self._last_end = time.perf_counter()
        params = run_context.original_args()
        self.final_step = self.stop_step or params.epoch_num * params.batch_num  # or the last epoch's end
        self.heartbeat.beat("compile")

    def on_train_step_begin(self, run_context):
        self._step_start = time.perf_counter()
        step = self.initial_step + len(self.records) + 1
        self.heartbeat.beat("compile" if not self.records else f"step {step}", step)

    def on_train_step_end(self, run_context):
        end = time.perf_counter()
        step_time, gap = end - self._step_start, self._step_start - self._last_end
        self._last_end = end
        params = run_context.original_args()
        graph_mode = ms.get_context("mode") == ms.GRAPH_MODE
        if self.want_graph and not graph_mode:
            raise LaunchError("training fell back to PyNative mode although context.mode is 0",
                              hint="build the MindFormers context before the Trainer (training.worker.train does)")
        record = self.record(self.initial_step + len(self.records) + 1, params.net_outputs, step_time, gap,
                             graph_mode)
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.log(record)
        self.heartbeat.beat("data", record["step"])
        if self.stop_step and record["step"] >= self.stop_step:
            run_context.request_stop()

    def record(self, step: int, outputs, step_time: float, gap: float, graph_mode: bool) -> dict:
        iteration = step_time + gap
        tokens_per_s = self.tokens_per_step / iteration
        mfu, flag = model_flops_utilisation(self.flops_per_token, tokens_per_s, self.peak_flops, self.devices)
        self.last = last = self.agreed(StepRecord.from_outputs(step, outputs, self.loss_divisor,
                                                               self.stop_requested))
        record = {
            "step": step,
            "loss": last.loss,
            "lr": last.lr,
            "grad_norm": last.grad_norm,
            "loss_scale": last.loss_scale,
            "overflow": last.overflow,
            "step_time": round(step_time, 6),
            "iteration_gap": round(gap, 6),
            "data_wait": round(gap / iteration, 6),
            "tokens_per_s": round(tokens_per_s, 1),
            "tokens_per_s_per_device": round(tokens_per_s / self.devices, 1),
            "mfu": None if mfu is None else round(mfu, 6),
            "host_memory": host_memory_bytes(),
            "device_memory": device_memory_bytes(self.device_target),
            "compile": not self.records,  # the first step compiles the graph
            "graph_mode": graph_mode,
            "time": round(time.time(), 3),
        }
        if flag and self.peak_flops:
            record["mfu_flag"] = flag
        if last.rank_loss is not None:
            record["rank_loss"] = last.rank_loss
        if self.router is not None:
            record.update(self.router_fields(last.loss))
        return record

    def router_fields(self, loss: float) -> dict:
        """The MoE routers' numbers (training/worker/router_stats.py), and the loss without their weighted terms."""
        r, (aux, z) = self.router, self.router_coefs
        if r.load_balancing_loss is None:  # MindFormers' MoELayer (Ascend) keeps no unweighted losses
            return {"expert_load": r.expert_load, "dropped_tokens": r.dropped_tokens} if r.expert_load else {}
        layers = len(r.expert_load)
        return {"lm_loss": loss - layers * (aux * r.load_balancing_loss + z * r.router_z_loss),
                "load_balancing_loss": r.load_balancing_loss, "router_z_loss": r.router_z_loss,
                "expert_load": r.expert_load, "dropped_tokens": r.dropped_tokens}

    def agreed(self, local: StepRecord) -> StepRecord:
        """The step as every rank sees it: loss of the ranks computing it, stop and NaN agreed, in one all-reduce."""
        router = self.router_stats.values() if self.router_stats is not None else []
        if not (self.reduce_loss or self.agree_on_stop):
            if self.router_stats is not None:
                self.router = self.router_stats.from_sums(router, 1, self.tokens_per_step, local.step)
            return local
        from ascend_llm_recipes.training.worker.collectives import all_reduce_sum

        computes = self.computes_loss and self.reduce_loss
        sums = all_reduce_sum([local.loss if computes else 0.0, 1.0 if computes else 0.0,
                               1.0 if local.stop else 0.0, 1.0 if local.non_finite else 0.0, *router])
        if self.router_stats is not None:  # every rank's routing counts, summed in the same all-reduce
            self.router = self.router_stats.from_sums(sums[4:], self.devices, self.tokens_per_step, local.step)
        return agree(local, sums[:4], self.reduce_loss, self.agree_on_stop, self.computes_loss)

    def log(self, record: dict) -> None:
        mfu = f"{record['mfu']:.1%}" if record["mfu"] is not None else record.get("mfu_flag", "n/a")
        # One write of the whole line: print() writes the text and its newline separately, which with
        # PYTHONUNBUFFERED are two writes, and output of another process can land between them.
        sys.stdout.write(f"[step {record['step']}] loss {record['loss']:.4f} lr {record['lr']:.3e} grad_norm "
                         f"{record['grad_norm'] if record['grad_norm'] is None else round(record['grad_norm'], 4)} "
                         f"step {record['step_time'] * 1e3:.0f} ms gap {record['iteration_gap'] * 1e3:.0f} ms "
                         f"({record['data_wait']:.1%} wait) {record['tokens_per_s']:,.0f} tok/s, "
                         f"{self.progress(record['step'])}MFU {mfu}"
                         + (f" aux {record['load_balancing_loss']:.3f}" if "load_balancing_loss" in record else "")
                         + (f" load max/mean {max(record['expert_load']):.2f}" if record.get("expert_load") else "")
                         + (f" dropped {record['dropped_tokens']:.1%}" if record.get("dropped_tokens") else "")
                         + (" [includes graph compile]" if record["compile"] else "") + "\n")
        sys.stdout.flush()
        if self._writer is not None:
            for key in ("loss", "lr", "grad_norm", "loss_scale", "step_time", "iteration_gap", "data_wait",
                        "tokens_per_s", "tokens_per_s_per_device", "mfu", "host_memory", "device_memory"):
                if record[key] is not None:
                    self._writer.add_scalar(f"train/{key}", record[key], record["step"])
            for key in ("lm_loss", "load_balancing_loss", "router_z_loss", "dropped_tokens"):
                if key in record:
                    self._writer.add_scalar(f"router/{key}", record[key], record["step"])
            for layer, ratio in enumerate(record.get("expert_load", ())):
                self._writer.add_scalar(f"router/expert_load_max_over_mean/{layer}", ratio, record["step"])

    def progress(self, step: int, window: int = 20) -> str:
        """'35% of 20 steps, ETA 0:00:02, ': the share of the run's steps done at `step` and the time left at the
        mean iteration of the last `window` steps recorded (the first one, which compiles, aside). MindFormers' own
        progress line counts to the epoch's end instead (mindformers/core/callback/callback.py:504-512)."""
        if not self.final_step or step > self.final_step:
            return ""
        recent = [r["step_time"] + r["iteration_gap"] for r in self.records[1:][-window:]]
        left = (self.final_step - step) * sum(recent) / len(recent) if recent else None
        eta = f"ETA {timedelta(seconds=round(left))}, " if left is not None else ""
        return f"{step / self.final_step:.0%} of {self.final_step} steps, {eta}"

    def spike(self, factor: float, window: int):
        """The moving mean the last loss exceeded by `factor`, or None (off when factor is 0)."""
        return loss_spike([r["loss"] for r in self.records[-window - 1:]], factor, window)

    def pause_ended(self) -> None:
        """Work between steps that is not waiting for data (evaluation, profiler analysis) just ended."""
        self._last_end = time.perf_counter()

    def write_eval(self, record: dict) -> None:
        """Held-out results go into the same metrics file and TensorBoard."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        print(f"[eval step {record['step']}] val_loss {record['val_loss']:.4f} val_ppl {record['val_ppl']:.2f}",
              flush=True)
        if self._writer is not None:
            self._writer.add_scalar("eval/loss", record["val_loss"], record["step"])
            self._writer.add_scalar("eval/perplexity", record["val_ppl"], record["step"])

    def close(self) -> None:
        """End of the run, after every callback's on_train_end (the final evaluation writes here too)."""
        self.heartbeat.beat("done", self.records[-1]["step"] if self.records else 0)
        if self._file:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def summary(self, run_dir: str, checkpoints: list) -> dict:
        """Steps, tokens, first/last loss, steady throughput; the compile step reported on its own."""
        steady = self.records[1:] or self.records
        steady_time = sum(r["step_time"] + r["iteration_gap"] for r in steady)
        steady_step = sorted(r["step_time"] for r in steady)[len(steady) // 2] if steady else 0.0
        mfus = [r["mfu"] for r in steady if r["mfu"] is not None]
        first = self.records[0] if self.records else None
        return {
            "run_dir": run_dir,
            "steps": len(self.records),
            "last_step": self.records[-1]["step"] if self.records else 0,
            "tokens": len(self.records) * self.tokens_per_step,
            "first_loss": first["loss"] if first else None,
            "last_loss": self.records[-1]["loss"] if self.records else None,
            "first_step_time": first["step_time"] if first else None,
            "compile_time": round(max(first["step_time"] - steady_step, 0.0), 3) if first else None,
            "tokens_per_s": round(len(steady) * self.tokens_per_step / steady_time, 1) if steady_time else None,
            "mfu": round(sum(mfus) / len(mfus), 6) if mfus else None,
            "data_wait": round(sum(r["data_wait"] for r in steady) / len(steady), 6) if steady else None,
            "graph_mode": all(r["graph_mode"] for r in self.records),
            "checkpoint": checkpoints[-1] if checkpoints else None,
        }


class HeldOutEval(Callback):
    """Loss and perplexity on a held-out dataset every `interval` steps and at the end."""

    def __init__(self, dataset_dir: str, batch_size: int, interval: int, max_batches: int, recorder: StepRecorder,
                 heartbeat: Heartbeat, log_results: bool):
        super().__init__()
        self.dataset_dir = dataset_dir
        self.batch_size = batch_size
        self.interval = interval
        self.max_batches = max_batches
        self.recorder = recorder
        self.heartbeat = heartbeat
        self.log_results = log_results
        self.last_step = 0

    def _dataset(self):
        from ascend_llm_recipes.data.mindrecord_io import read_manifest, shard_files
        import mindspore.dataset as ds

        files = shard_files(self.dataset_dir, read_manifest(self.dataset_dir))
        data = ds.MindDataset(files, columns_list=["input_ids"], shuffle=False)
        return data.batch(self.batch_size, drop_remainder=True)

    def evaluate(self, network, step: int) -> None:
        self.heartbeat.beat("eval", step)
        start = time.perf_counter()
        losses = []
        for i, (batch,) in enumerate(self._dataset().create_tuple_iterator()):
            if self.max_batches and i >= self.max_batches:
                break
            losses.append(float(network(batch).asnumpy()))
        if not losses:
            raise LaunchError(f"eval_dataset {self.dataset_dir}: fewer samples than one batch of {self.batch_size}")
        val_loss = sum(losses) / len(losses)
        self.last_step = step
        if self.log_results:
            self.recorder.write_eval({"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)),
                                      "val_batches": len(losses), "eval_time": round(time.perf_counter() - start, 3),
                                      "time": round(time.time(), 3)})
        self.recorder.pause_ended()

    def on_train_step_end(self, run_context):
        step = self.recorder.records[-1]["step"]
        if step % self.interval == 0:
            self.evaluate(run_context.original_args().train_network.network, step)

    def on_train_end(self, run_context):
        params = run_context.original_args()
        step = self.recorder.records[-1]["step"] if self.recorder.records else 0
        if step and step != self.last_step:
            self.evaluate(params.train_network.network, step)


class ProfileWindow(Callback):
    """A MindSpore Profiler trace of steps [start_step, stop_step] only."""

    def __init__(self, start_step: int, stop_step: int, output_path: str, recorder: StepRecorder):
        super().__init__()
        self.start_step, self.stop_step = start_step, stop_step
        self.output_path = output_path
        self.recorder = recorder
        self.profiler = None

    def on_train_step_begin(self, run_context):
        step = self.recorder.initial_step + len(self.recorder.records) + 1
        if step == self.start_step and self.profiler is None:
            self.profiler = ms.Profiler(start_profile=False, output_path=self.output_path)
            self.profiler.start()

    def on_train_step_end(self, run_context):
        step = self.recorder.records[-1]["step"]
        if step == self.stop_step and self.profiler is not None:
            self.finish()

    def on_train_end(self, run_context):
        if self.profiler is not None:
            self.finish()

    def finish(self) -> None:
        self.profiler.stop()
        self.profiler.analyse()
        self.profiler = None
        print(f"[profile] steps {self.start_step}-{self.stop_step} traced: {self.output_path}", flush=True)
        self.recorder.pause_ended()

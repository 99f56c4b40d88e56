"""A MindFormers train-step wrapper whose overflow check runs on every backend.

`MFTrainOneStepCell` picks its overflow check by device: GPU uses the `FloatStatus`
kernel and anything else the Ascend-only `NPUGetFloatStatusV2`; neither exists on CPU,
so graph compilation fails there. The IsFinite-based check MindSpore uses for Ascend's
INF/NAN mode is built from ordinary operators and works everywhere, so this wrapper
uses it on CPU and keeps MindFormers' own choice on Ascend and GPU.

With gradient clipping on, the CPU check needs no pass of its own: every gradient is
finite exactly when the sum of their squares is (barring a float32 overflow of the sum
itself, > 3.4e38, which is better skipped than applied as a zero update), and the clip
computes that sum anyway. The check builds it from the same ops as the clip
(on CPU ClipGradNormByRows: MindFormers' ClipGradNorm with a faster sum of squares), so graph
compilation merges the two (common subexpressions) and the IsFinite/ReduceAll pass over every
gradient disappears.
"""

from mindspore import context, nn, ops
from mindspore.train.callback import Callback
from mindspore.common import dtype as mstype
from mindspore.nn.wrap.cell_wrapper import _VirtualDatasetCell
from mindspore.nn.wrap.loss_scale import _ascend_grad_overflow
from mindspore.ops import composite as C
from mindspore.ops import functional as F
from mindformers.core.clip_grad import ClipGradNorm, apply_global_norm
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
from mindformers.wrapper import MFTrainOneStepCell

from ascend_llm_recipes.common.errors import LaunchError

WRAPPER_TYPE = "PortableTrainOneStepCell"
PIPELINE_WRAPPER_TYPE = "MFPipelineWithLossScaleCell"


def summed_micro_batches(recipe) -> int:
    """How many micro-batch losses the train step adds up into its loss output (1: it is a mean already).

    In semi-auto/auto parallel with pipeline stages, MindFormers wraps the network in a
    PipelineCell of micro_batch_num micro-batches; without stages but with gradient
    accumulation, in a GradAccumulationCell of gradient_accumulation_steps
    (mindformers/trainer/base_trainer.py:510-529). Both return the SUM of the micro-batch
    losses (mindspore/nn/wrap/cell_wrapper.py:631-640 and 994-1003), and MindFormers' own
    MFLossMonitor divides it back (mindformers/core/callback/callback.py:557-564).
    Outside semi-auto parallel MindFormers resets accumulation to 1 (base_trainer.py:321-327).
    """
    if recipe.parallel.parallel_mode not in (1, 2):
        return 1
    if recipe.parallel_config.pipeline_stage > 1:
        return recipe.parallel_config.micro_batch_num  # accumulation is reset to 1 (base_trainer.py:313-319)
    return recipe.runner_config.gradient_accumulation_steps


def train_step_wrapper(recipe) -> str:
    """The wrapper class MindFormers builds: it replaces runner_wrapper.type by MFPipelineWithLossScaleCell
    whenever micro-batches are summed (base_trainer.py:236,267 and 343-348)."""
    summed = recipe.parallel_config.pipeline_stage > 1 or recipe.runner_config.gradient_accumulation_steps > 1
    if recipe.parallel.parallel_mode in (1, 2) and summed:
        return PIPELINE_WRAPPER_TYPE
    return recipe.runner_wrapper.type


square_sum_by_rows = C.MultitypeFuncGraph("square_sum_by_rows")


@square_sum_by_rows.register("Tensor")
def _square_sum_by_rows(x):
    """sum(x^2) of one gradient, (1,) float32, as MindFormers' get_square_sum (core/clip_grad.py:34-39), summed
    along the last axis first: MindSpore's CPU kernel for a sum over every axis of a large tensor runs ~3x slower
    than a row sum followed by a sum of the row sums (measured at the reference shape's lm_head gradient, 8192 x
    256: 12.5 ms and 4.0 ms). Same value up to float32 summation order."""
    squares = F.square(x)
    if len(x.shape) > 1:
        squares = ops.ReduceSum()(squares, -1)
    return ops.expand_dims(F.cast(ops.ReduceSum()(squares, ()), mstype.float32), 0)


class ClipGradNormByRows(ClipGradNorm):
    """MindFormers' ClipGradNorm (core/clip_grad.py:57-96) with square_sum_by_rows for the norm: used on CPU."""

    def construct(self, x):
        global_norm = F.sqrt(F.addn(self.hyper_map(square_sum_by_rows, x)))
        cond = self.greater_equal(global_norm, self.clip_norm)
        global_norm_clip = F.select(cond, global_norm, self.clip_norm)
        return self.hyper_map(F.partial(apply_global_norm, self.clip_norm, global_norm_clip), x), global_norm


@MindFormerRegister.register(MindFormerModuleType.WRAPPER, alias=WRAPPER_TYPE)
class PortableTrainOneStepCell(MFTrainOneStepCell):
    """`MFTrainOneStepCell` (loss scale, clipping, grad norm) that also compiles on CPU.

    It serves one micro-batch per step (no pipeline stages, no gradient accumulation): for those
    MindFormers builds MFPipelineWithLossScaleCell instead (see train_step_wrapper), and a network
    that sums micro-batch losses is refused here, since this wrapper treats its loss as a mean.
    """

    def __init__(self, network, optimizer, **kwargs):
        # semi-auto parallel wraps the network in _VirtualDatasetCell, which keeps it as _backbone
        # (mindspore/nn/wrap/cell_wrapper.py:520-522)
        inner = network._backbone if isinstance(network, _VirtualDatasetCell) else network
        if isinstance(inner, (nn.GradAccumulationCell, nn.PipelineCell)):
            raise LaunchError(f"{WRAPPER_TYPE} got a {type(inner).__name__}, whose loss is a sum over micro-batches",
                              hint=f"with gradient accumulation or pipeline stages use {PIPELINE_WRAPPER_TYPE} "
                                   "(MindFormers selects it itself in semi-auto parallel)")
        super().__init__(network, optimizer, **kwargs)
        self.cpu_target = context.get_context("device_target") == "CPU"
        if self.cpu_target:
            self.clip_grad_norm = ClipGradNormByRows(max_norm=float(self.clip_grad_norm.clip_norm.asnumpy()[0]))

    def get_overflow_status(self, status, compute_output):
        if not self.cpu_target:
            return super().get_overflow_status(status, compute_output)
        if not self.use_clip_grad:
            return self._get_distributed_overflow_status_on_infnan_mode(_ascend_grad_overflow, compute_output)
        square_sum = ops.addn(self.hyper_map(square_sum_by_rows, compute_output))  # the clip's own sum, shared
        flag = ops.cast(ops.logical_not(ops.isfinite(square_sum)), mstype.float32)
        if self.is_distributed:
            flag = self.allreduce(flag)
        return self.less_equal(self.base, flag).reshape(())


# The dynamic loss scale's state: the wrapper's current scale (TrainOneStepWithLossScaleCell keeps it as the Parameter
# "scale_sense") and DynamicLossScaleUpdateCell's step counters (mindspore/nn/wrap/loss_scale.py:153-154), which
# decide when the scale grows next. Checkpoints hold them (training/checkpoint.py snapshots the train network).
LOSS_SCALE_STATE = ("scale_sense", "current_iterator_step", "last_overflow_iterator_step")


class RestoreLossScale(Callback):
    """On resume, before the first step: the dynamic loss scale and its counters as the checkpoint saved them.

    MindFormers' resume loads the model's and the optimizer's parameters only (trainer/utils.py:759-766) and sets
    the scale from the checkpoint only when a CheckpointMonitor callback is configured (trainer/utils.py:428-434),
    which ours replaces (training/worker/checkpointer.py); without this the resumed run would start again from the
    recipe's initial scale, and with float16 every step after would differ from the uninterrupted run.
    """

    def __init__(self, checkpoint_file: str):
        super().__init__()
        self.checkpoint_file = checkpoint_file

    def on_train_begin(self, run_context):
        import mindspore as ms

        network = run_context.original_args().train_network
        params = {p.name: p for p in network.get_parameters() if p.name in LOSS_SCALE_STATE}
        saved = ms.load_checkpoint(self.checkpoint_file, choice_func=lambda name: name in LOSS_SCALE_STATE)
        missing = [name for name in LOSS_SCALE_STATE if name not in saved]
        if missing:
            print(f"[loss scale] {self.checkpoint_file} holds no {', '.join(missing)} (saved without a dynamic loss "
                  "scale): the scale starts at runner_wrapper.scale_sense.loss_scale_value", flush=True)
            return
        if sorted(params) != sorted(LOSS_SCALE_STATE):
            raise LaunchError(f"the train step has no dynamic loss-scale parameters {sorted(LOSS_SCALE_STATE)} "
                              f"(found {sorted(params)}) to restore from {self.checkpoint_file}",
                              hint="runner_wrapper.scale_sense must be a DynamicLossScaleUpdateCell section")
        for name in LOSS_SCALE_STATE:
            params[name].set_data(ms.Tensor(saved[name].asnumpy(), params[name].dtype))
        scale = float(saved["scale_sense"].asnumpy())
        print(f"[loss scale] restored from the checkpoint: scale {scale:g}, step counter "
              f"{int(saved['current_iterator_step'].asnumpy())}, last overflow at "
              f"{int(saved['last_overflow_iterator_step'].asnumpy())}", flush=True)


def _allreduce_barrier(original):
    """A barrier for CPU, where MindSpore has no Barrier kernel: an all-reduce every rank must join."""
    from ascend_llm_recipes.training.worker.collectives import all_reduce_sum

    def barrier(*args, **kwargs):
        if context.get_context("device_target") != "CPU":
            return original(*args, **kwargs)
        all_reduce_sum([1.0])  # returns only when every rank arrived
        return None

    return barrier


def install_cpu_barrier() -> None:
    """MindFormers calls comm_func.barrier() when resuming under data parallel; make it work on CPU too.

    Patches comm_func and the four MindFormers modules that imported its barrier; called by the
    worker before it builds the Trainer (importing this module changes nothing in MindFormers).
    """
    import importlib
    from mindspore.communication import comm_func

    if hasattr(comm_func.barrier, "__wrapped_cpu__"):
        return
    portable = _allreduce_barrier(comm_func.barrier)
    portable.__wrapped_cpu__ = True
    comm_func.barrier = portable
    for module in ("mindformers.trainer.utils", "mindformers.utils.load_checkpoint_utils",
                   "mindformers.core.callback.callback", "mindformers.version_control"):
        imported = importlib.import_module(module)
        if hasattr(imported, "barrier"):
            imported.barrier = portable


# MindSpore's default actor threads: max(floor(min(runtime_num_threads 30, the host's cores) x 0.18), 1)
# (runtime/graph_scheduler ComputeThreadNums); with one, GraphScheduler::Initialize turns kernel-by-kernel sub-graph
# execution off (default_actor_thread_num_ <= kAsyncLaunchThreadNum 1), and a graph holding the ConditionSwitch of
# the wrappers' `if not overflow:` (MFTrainOneStepCell, MFPipelineWithLossScaleCell: mindformers/wrapper/wrapper.py
# :357) cannot be built at jit_level O0/O1: "Can not build a sub graph which contains ConditionSwitch ... by kbk"
# (graph_scheduler.cc BuildKernelActor). Hosts of fewer than 12 cores get one thread; "The actor thread number: 1"
# in MindSpore's INFO log shows it.
SUBGRAPH_DISPATCH_THREADS = 2


def default_actor_threads(cores: int) -> int:
    return max(int(min(30, cores) * 0.18), 1)


def ensure_subgraph_dispatch(device_target: str) -> None:
    """On Ascend, at least two runtime dispatch threads, so the loss-scale wrappers compile on a small host."""
    import os
    import mindspore as ms

    if device_target == "Ascend" and default_actor_threads(os.cpu_count() or 1) < SUBGRAPH_DISPATCH_THREADS:
        ms.runtime.dispatch_threads_num(SUBGRAPH_DISPATCH_THREADS)

"""A MindFormers train-step wrapper whose overflow check runs on every backend.

`MFTrainOneStepCell` picks its overflow check by device: GPU uses the `FloatStatus`
kernel and anything else the Ascend-only `NPUGetFloatStatusV2`; neither exists on CPU,
so graph compilation fails there. The IsFinite-based check MindSpore uses for Ascend's
INF/NAN mode is built from ordinary operators and works everywhere, so this wrapper
uses it on CPU and keeps MindFormers' own choice on Ascend and GPU.

With gradient clipping on, the CPU check needs no pass of its own: every gradient is
finite exactly when the sum of their squares is (barring a float32 overflow of the sum
itself, > 3.4e38, which is better skipped than applied as a zero update), and the clip
computes that sum anyway. The check builds it from the same ops as MindFormers'
ClipGradNorm, so graph compilation merges the two (common subexpressions) and the
IsFinite/ReduceAll pass over every gradient disappears.
"""

from mindspore import context, ops
from mindspore.common import dtype as mstype
from mindspore.nn.wrap.loss_scale import _ascend_grad_overflow
from mindformers.core.clip_grad import get_square_sum
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
from mindformers.wrapper import MFTrainOneStepCell

WRAPPER_TYPE = "PortableTrainOneStepCell"


@MindFormerRegister.register(MindFormerModuleType.WRAPPER, alias=WRAPPER_TYPE)
class PortableTrainOneStepCell(MFTrainOneStepCell):
    """`MFTrainOneStepCell` (loss scale, clipping, grad norm) that also compiles on CPU."""

    def __init__(self, network, optimizer, **kwargs):
        super().__init__(network, optimizer, **kwargs)
        self.cpu_target = context.get_context("device_target") == "CPU"

    def get_overflow_status(self, status, compute_output):
        if not self.cpu_target:
            return super().get_overflow_status(status, compute_output)
        if not self.use_clip_grad:
            return self._get_distributed_overflow_status_on_infnan_mode(_ascend_grad_overflow, compute_output)
        square_sum = ops.addn(self.hyper_map(get_square_sum, compute_output))  # the clip's own sum, shared
        flag = ops.cast(ops.logical_not(ops.isfinite(square_sum)), mstype.float32)
        if self.is_distributed:
            flag = self.allreduce(flag)
        return self.less_equal(self.base, flag).reshape(())


def _allreduce_barrier(original):
    """A barrier for CPU, where MindSpore has no Barrier kernel: an all-reduce every rank must join."""
    from training.collectives import all_reduce_sum

    def barrier(*args, **kwargs):
        if context.get_context("device_target") != "CPU":
            return original(*args, **kwargs)
        all_reduce_sum([1.0])  # returns only when every rank arrived
        return None

    return barrier


def install_cpu_barrier() -> None:
    """MindFormers calls comm_func.barrier() when resuming under data parallel; make it work on CPU too."""
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


install_cpu_barrier()

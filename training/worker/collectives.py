"""A host-side all-reduce for decisions every rank must take together.

Three places need one: the collective self-test before training, the barrier MindFormers
calls on resume (MindSpore has no CPU Barrier kernel), and anomaly decisions (a loss spike
seen by one data-parallel rank must stop every rank, or the others hang in the next
gradient all-reduce). The functional `comm_func.all_reduce` is PyNative and fails on CPU,
so this is a small graph Cell, compiled once per process, always in a data-parallel context
(the training graph's semi-auto context may not hold communication ops of its own).
"""

import numpy as np

_cell = []


def all_reduce_sum(values) -> np.ndarray:
    """Element-wise sum of a float32 vector over every rank; returns when all ranks have called it."""
    import mindspore as ms
    from mindspore import context, nn, ops

    if not _cell:
        class AllReduceSum(nn.Cell):
            def __init__(self):
                super().__init__()
                self.all_reduce = ops.AllReduce()
                # As MindFormers' AllReduceNet (mindformers/core/callback/callback.py:191).
                self.add_flags(skip_auto_parallel_compile=True)

            def construct(self, x):
                return self.all_reduce(x)

        _cell.append(AllReduceSum())
    # Semi-auto parallel preprocessing refuses a graph with communication ops of its own
    # (ExceptionIfHasCommunicationOp), and data-parallel mode refuses full_batch: compile and
    # run in a data-parallel context, then restore, as MindFormers' MFLossMonitor does around its
    # own host-side reductions (mindformers/core/callback/callback.py:458-462 and 528-529).
    mode = context.get_auto_parallel_context("parallel_mode")
    full_batch = context.get_auto_parallel_context("full_batch")
    context.set_auto_parallel_context(parallel_mode="data_parallel", full_batch=False)
    try:
        return _cell[0](ms.Tensor(np.asarray(values, np.float32).reshape(-1))).asnumpy()
    finally:
        context.set_auto_parallel_context(parallel_mode=mode, full_batch=full_batch)

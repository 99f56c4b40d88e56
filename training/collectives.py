"""A host-side all-reduce for decisions every rank must take together.

Three places need one: the collective self-test before training, the barrier MindFormers
calls on resume (MindSpore has no CPU Barrier kernel), and anomaly decisions (a loss spike
seen by one data-parallel rank must stop every rank, or the others hang in the next
gradient all-reduce). The functional `comm_func.all_reduce` is PyNative and fails on CPU,
so this is a small graph Cell, compiled once per process.
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

            def construct(self, x):
                return self.all_reduce(x)

        _cell.append(AllReduceSum())
    # MindFormers may have set full_batch, which data-parallel mode refuses to compile with.
    full_batch = context.get_auto_parallel_context("full_batch")
    context.set_auto_parallel_context(full_batch=False)
    try:
        return _cell[0](ms.Tensor(np.asarray(values, np.float32).reshape(-1))).asnumpy()
    finally:
        context.set_auto_parallel_context(full_batch=full_batch)

"""PortableTrainOneStepCell on CPU: overflow is read off the clip's gradient norm; a non-finite gradient
skips the update."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops
from mindformers.core.optim import AdamW

from ascend_llm_recipes.training.train_step import PortableTrainOneStepCell


class Weighted(nn.Cell):
    """loss = sum(w * x) + sum(b): the gradient of w is x (non-finite where x is), b's is finite."""

    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.ones(4, np.float32)), name="w")
        self.b = Parameter(Tensor(np.ones(2, np.float32)), name="b")

    def construct(self, x):
        return ops.sum(self.w * x) + ops.sum(self.b)


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("bad", [None, np.inf, np.nan])
def test_non_finite_gradient_is_an_overflow_and_skips_the_update(clip, bad):
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = Weighted()
    step = PortableTrainOneStepCell(net, AdamW(net.trainable_params(), learning_rate=0.1), use_clip_grad=clip,
                                    max_grad_norm=1.0, scale_sense=1.0)
    x = np.full(4, 0.5, np.float32)
    if bad is not None:
        x[2] = bad
    _, overflow, *_ = step(Tensor(x))
    assert bool(overflow.asnumpy()) == (bad is not None)
    moved = not np.allclose(net.w.asnumpy(), 1.0) and not np.allclose(net.b.asnumpy(), 1.0)
    assert moved == (bad is None)


def test_mindformers_is_patched_only_by_the_explicit_call():
    """Importing train_step leaves MindFormers' barrier alone; install_cpu_barrier() replaces it everywhere."""
    import subprocess
    import sys

    code = ("import importlib\n"
            "from mindspore.communication import comm_func\n"
            "from ascend_llm_recipes.training import train_step\n"
            "modules = [importlib.import_module(m) for m in ('mindformers.trainer.utils', "
            "'mindformers.utils.load_checkpoint_utils', 'mindformers.core.callback.callback', "
            "'mindformers.version_control')]\n"
            "patched = lambda: [hasattr(getattr(m, 'barrier', None), '__wrapped_cpu__')\n"
            "                   for m in [comm_func, *modules]]\n"
            "print(patched())\n"
            "train_step.install_cpu_barrier()\n"
            "train_step.install_cpu_barrier()\n"
            "print(patched())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.splitlines()[-2:]
    assert before == "[False, False, False, False, False]"
    assert after == "[True, True, True, True, True]"

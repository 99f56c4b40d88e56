"""PortableTrainOneStepCell on CPU: overflow is read off the clip's gradient norm; a non-finite gradient
skips the update; float16 training with a dynamic loss scale, overflows and a resume, end to end."""

import json
import math
import os
import shutil

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops
from mindformers.core.optim import AdamW

from conftest import TINY_RECIPE
from ascend_llm_recipes.training.worker.train_step import LOSS_SCALE_STATE, PortableTrainOneStepCell


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


def test_the_semi_auto_dataset_wrapper_is_looked_through():
    """Semi-auto parallel hands the wrapper its network inside MindSpore's _VirtualDatasetCell, which keeps it as
    `_backbone` (mindspore/nn/wrap/cell_wrapper.py:520-522): a network inside it trains, and one that sums
    micro-batch losses is refused as it is unwrapped."""
    from mindspore.nn.wrap.cell_wrapper import _VirtualDatasetCell
    from ascend_llm_recipes.common.errors import LaunchError

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = Weighted()
    step = PortableTrainOneStepCell(_VirtualDatasetCell(net), AdamW(net.trainable_params(), learning_rate=0.1),
                                    scale_sense=1.0)
    step(Tensor(np.full(4, 0.5, np.float32)))
    assert not np.allclose(net.w.asnumpy(), 1.0)
    summing = nn.GradAccumulationCell(Weighted(), 2)
    with pytest.raises(LaunchError, match="GradAccumulationCell, whose loss is a sum over micro-batches"):
        PortableTrainOneStepCell(_VirtualDatasetCell(summing), AdamW(summing.trainable_params(), learning_rate=0.1),
                                 scale_sense=1.0)


def test_mindformers_is_patched_only_by_the_explicit_call():
    """Importing train_step leaves MindFormers' barrier alone; install_cpu_barrier() replaces it everywhere."""
    import subprocess
    import sys

    code = ("import importlib\n"
            "from mindspore.communication import comm_func\n"
            "from ascend_llm_recipes.training.worker import train_step\n"
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


INITIAL_SCALE, FP16_STEPS = 2.0 ** 20, 7
# float16 compute; a scale that overflows float16 gradients at the first step and, growing after every 2 clean
# steps (scale_window 2), keeps reaching the overflow threshold again.
FP16 = ["model.model_config.compute_dtype=float16",
        f"runner_wrapper.scale_sense={{type: DynamicLossScaleUpdateCell, loss_scale_value: {INITIAL_SCALE}, "
        "scale_factor: 2, scale_window: 2}", f"runner_config.stop_step={FP16_STEPS}",
        "callbacks.1.save_checkpoint_steps=1", f"callbacks.1.keep_checkpoint_max={FP16_STEPS}"]


def saved_state(run_dir: str, step: int) -> dict:
    """{name: array} of every tensor rank 0 saved at `step`, plus the checkpoint's appended loss_scale."""
    from ascend_llm_recipes.training.checkpoint import MANIFEST, read_json, step_dir

    rank_dir = os.path.join(step_dir(run_dir, step), "rank_0")
    params = ms.load_checkpoint(os.path.join(rank_dir, read_json(os.path.join(rank_dir, MANIFEST))["file"]))
    return {name: value.asnumpy() for name, value in params.items()}


@pytest.mark.drill
def test_float16_overflow_skips_the_update_lowers_the_scale_and_resumes_bit_exactly(tiny_dataset, tmp_path):
    """One drill: float16 training on CPU with DynamicLossScaleUpdateCell. An overflow step leaves weights, moments
    and the optimizer step as they were and halves the scale; clean steps train and grow it again; metrics.jsonl
    and every checkpoint hold the scale; a resume from a step whose scale is not the initial one continues with
    the same scales, counters and losses, bit for bit."""
    from ascend_llm_recipes.training.launcher.cli import launch

    run_dir = str(tmp_path / "run")
    command = [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}", *FP16]
    assert launch(TINY_RECIPE, command, show_progress=False) == 0
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, FP16_STEPS + 1))
    overflows = [r["step"] for r in records if r["overflow"]]
    assert overflows and overflows[0] == 1 and any(step > 1 for step in overflows)
    assert any(not r["overflow"] for r in records if r["step"] > overflows[0])  # training goes on
    assert all(math.isfinite(r["loss"]) for r in records) and records[-1]["loss"] < records[0]["loss"]

    states = {step: saved_state(run_dir, step) for step in range(1, FP16_STEPS + 1)}
    before = INITIAL_SCALE
    for r in records:
        step, scale, state = r["step"], r["loss_scale"], states[r["step"]]
        assert float(state["scale_sense"]) == scale and float(state["loss_scale"]) == scale  # in the checkpoint
        assert scale == (before / 2 if r["overflow"] else before) or (not r["overflow"] and scale == 2 * before)
        before = scale
        if step == 1:
            continue
        kept = [name for name in state if name.startswith(("model.", "lm_head.", "adam_", "global_step"))
                and np.array_equal(state[name], states[step - 1][name])]
        trained = [name for name in state if name.startswith(("model.", "lm_head.", "adam_", "global_step"))]
        if r["overflow"]:
            assert kept == trained, f"step {step} overflowed but changed {sorted(set(trained) - set(kept))}"
        else:
            assert "global_step" not in kept and len(kept) < len(trained) / 2, f"step {step} did not train"
    assert any(b["loss_scale"] == 2 * a["loss_scale"] for a, b in zip(records, records[1:]))  # the scale grew

    # Resume from the newest step whose scale is not the recipe's initial one: a resume that fell back to it
    # (or restarted the step counters) would compute other float16 gradients from there on.
    resume_at = max(r["step"] for r in records[:-1] if r["loss_scale"] != INITIAL_SCALE)
    for step in range(resume_at + 1, FP16_STEPS + 1):
        shutil.rmtree(os.path.join(run_dir, "checkpoints", f"step_{step:08d}"))
    assert launch(TINY_RECIPE, command, show_progress=False) == 0
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        resumed = [json.loads(line) for line in f]
    fields = ("step", "loss", "loss_scale", "overflow", "lr", "grad_norm")
    assert [[r[k] for k in fields] for r in resumed] == [[r[k] for k in fields] for r in records]
    final = saved_state(run_dir, FP16_STEPS)
    for name in (*LOSS_SCALE_STATE, "loss_scale", "global_step", "model.norm.weight"):
        np.testing.assert_array_equal(final[name], states[FP16_STEPS][name], err_msg=name)

"""FoldedAdamW against MindFormers' AdamW: same parameters and gradients give the same updates."""

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn
from mindformers.core import build_lr, build_optim
from mindformers.trainer.optimizer_grouped_parameters import get_optimizer_grouped_parameters

from ascend_llm_recipes.training.worker.optim import OPTIMIZER_TYPE


class TwoShapes(nn.Cell):
    """A matrix (weight decay) and a vector (no weight decay), like a Linear and a norm."""

    def __init__(self, seed: int, dtype=np.float32):
        super().__init__()
        rng = np.random.default_rng(seed)
        # float16 weights start from the rounding of the same float32 draw
        weight = rng.normal(0, 0.02, (24, 16)).astype(np.float32).astype(dtype)
        self.weight = Parameter(Tensor(weight), name="weight")
        self.norm = Parameter(Tensor(np.ones(16, np.float32)), name="norm")


def build(optimizer_type: str, net: nn.Cell):
    """The optimizer as the Trainer builds it: MindFormers' groups, cosine schedule with warm-up."""
    lr = build_lr({"type": "CosineWithWarmUpLR", "learning_rate": 3e-3, "warmup_steps": 2, "total_steps": 8,
                   "lr_end": 1e-4})
    groups = get_optimizer_grouped_parameters(model=net, weight_decay=0.1, dynamic_lr_schedule=lr,
                                              optimizer_type=optimizer_type)
    return build_optim({"type": optimizer_type, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
                       default_args={"params": groups, "learning_rate": lr})


def test_folded_adamw_matches_mindformers_adamw_over_steps():
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ours_net, ref_net = TwoShapes(0), TwoShapes(0)
    ours, ref = build(OPTIMIZER_TYPE, ours_net), build("AdamW", ref_net)
    assert [p.name for p in ours.get_parameters()] == [p.name for p in ref.get_parameters()]  # checkpoint keys
    rng = np.random.default_rng(1)
    for _ in range(8):
        grads = tuple(Tensor(rng.normal(0, 1e-2, p.shape).astype(np.float32)) for p in ours_net.trainable_params())
        ours(grads)
        ref(grads)
        for a, b in zip(ours.get_parameters(), ref.get_parameters()):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-6, atol=1e-7, err_msg=a.name)
    assert int(ours.global_step.asnumpy()) == 8
    moved = np.abs(ours_net.weight.asnumpy() - TwoShapes(0).weight.asnumpy()).max()
    assert moved > 1e-3  # the comparison above is over real updates, not a no-op


def test_16bit_weights_follow_their_float32_masters_where_in_place_updates_stall():
    """A float16 weight under FoldedAdamW is the rounding of a float32 master that moves exactly as a float32
    weight would; MindFormers' AdamW, updating the float16 weight in place, loses updates below half an ulp."""
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    half, in_place = TwoShapes(0, np.float16), TwoShapes(0, np.float16)
    full = TwoShapes(0, np.float16)  # the same starting values, stored in float32
    full.weight = Parameter(Tensor(half.weight.asnumpy().astype(np.float32)), name="weight")
    ours, reference, stalled = build(OPTIMIZER_TYPE, half), build(OPTIMIZER_TYPE, full), build("AdamW", in_place)
    names = [p.name for p in ours.get_parameters()]
    assert "master.weight" in names and "master.norm" not in names and "master_filled" in names
    rng = np.random.default_rng(1)
    start = half.weight.asnumpy().copy()
    for _ in range(8):
        grads = [rng.normal(0, 1e-2, p.shape).astype(np.float32) for p in full.trainable_params()]
        ours(tuple(Tensor(g.astype(np.float16) if g.ndim == 2 else g) for g in grads))
        reference(tuple(Tensor(g.astype(np.float16).astype(np.float32) if g.ndim == 2 else g) for g in grads))
        stalled(tuple(Tensor(g.astype(np.float16) if g.ndim == 2 else g) for g in grads))
        master = [p for p in ours.get_parameters() if p.name == "master.weight"][0].asnumpy()
        np.testing.assert_allclose(master, full.weight.asnumpy(), rtol=1e-6, atol=1e-8)
        np.testing.assert_array_equal(half.weight.asnumpy(), master.astype(np.float16))
    # lr ends at 1e-4 on weights of ~0.02: the last updates are below half a float16 ulp for many weights
    lost = np.mean(np.abs(in_place.weight.asnumpy().astype(np.float32) - full.weight.asnumpy()) >
                   np.abs(half.weight.asnumpy().astype(np.float32) - full.weight.asnumpy()))
    assert lost > 0.2 and not np.array_equal(half.weight.asnumpy(), start)

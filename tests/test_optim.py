"""FoldedAdamW against MindFormers' AdamW: same parameters and gradients give the same updates."""

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn
from mindformers.core import build_lr, build_optim
from mindformers.trainer.optimizer_grouped_parameters import get_optimizer_grouped_parameters

from ascend_llm_recipes.training.optim import OPTIMIZER_TYPE


class TwoShapes(nn.Cell):
    """A matrix (weight decay) and a vector (no weight decay), like a Linear and a norm."""

    def __init__(self, seed: int):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.weight = Parameter(Tensor(rng.normal(0, 0.02, (24, 16)).astype(np.float32)), name="weight")
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

"""MindFormers' AdamW update computed by MindSpore's fused `AdamWeightDecay` kernel.

MindFormers' AdamW is a chain of ~15 element-wise kernels per parameter (its own fused
variant uses `P.AdamW`, which has no CPU kernel); on 2 CPU cores that chain costs
~0.25 s of a ~1 s step at the reference shape. `AdamWeightDecay` has a CPU (and Ascend,
GPU) kernel that does the whole update in one pass, but without bias correction:

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    w = w - lr' (m / (sqrt(v) + eps') + wd' w)

MindFormers' AdamW (bias corrections c1 = 1 - b1^t, c2 = 1 - b2^t) is

    w = w (1 - lr wd) - (lr / c1) m / (sqrt(v / c2) + eps)
      = w - lr' (m / (sqrt(v) + eps sqrt(c2)) + wd (c1 / sqrt(c2)) w),  lr' = lr sqrt(c2) / c1

so feeding the kernel lr' = lr sqrt(c2) / c1, eps' = eps sqrt(c2) and wd' = wd c1 / sqrt(c2)
gives the same update (to float32 rounding). The moments, their names (`adam_m.*`,
`adam_v.*`) and `global_step` are MindFormers' own, so checkpoints written by either
optimizer resume with the other.
"""

from mindspore.common import dtype as mstype
from mindspore.ops import composite as C
from mindspore.ops import functional as F
from mindspore.ops import operations as P
from mindformers.core.optim.adamw import AdamW as MindFormersAdamW
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

OPTIMIZER_TYPE = "FoldedAdamW"

_folded_adamw = C.MultitypeFuncGraph("folded_adamw")


@_folded_adamw.register("Function", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                        "Tensor", "Tensor", "Tensor", "Bool")
def _update(kernel, beta1, beta2, eps, correction, lr, weight_decay, param, grad, exp_avg, exp_avg_sq,
            optim_filter):
    """One parameter: the kernel with lr and weight decay rescaled by the step's bias correction."""
    if optim_filter:
        # lr' = lr * correction and wd' = wd / correction keep lr' * wd' = lr * wd (decoupled decay).
        kernel(param, exp_avg, exp_avg_sq, lr * correction, beta1, beta2, eps, weight_decay / correction,
               P.Cast()(grad, F.dtype(param)))
    return True


@MindFormerRegister.register(MindFormerModuleType.OPTIMIZER, alias=OPTIMIZER_TYPE)
class FoldedAdamW(MindFormersAdamW):
    """MindFormers' AdamW (same arguments, state and checkpoint names) on the fused AdamWeightDecay kernel."""

    def __init__(self, params, learning_rate=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, swap=False):
        super().__init__(params, learning_rate=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay,
                         swap=swap)
        self.kernel = P.AdamWeightDecay()

    def construct(self, gradients):
        weight_decay = self.get_weight_decay()
        lr = self.get_lr()
        self.assignadd(self.global_step, self.global_step_increase_tensor)
        step = F.cast(self.global_step, mstype.float32)
        sqrt_c2 = F.sqrt(1.0 - F.pow(self.beta2, step))
        correction = sqrt_c2 / (1.0 - F.pow(self.beta1, step))  # shape (1,), like beta1
        eps = self.eps * sqrt_c2
        kernel, beta1, beta2 = self.kernel, self.beta1, self.beta2
        if not self.is_group:
            result = self.hyper_map(F.partial(_folded_adamw, kernel, beta1, beta2, eps, correction, lr, weight_decay),
                                    self._parameters, gradients, self.exp_avg, self.exp_avg_sq, self.optim_filter)
        elif self.is_group_lr:
            result = self.hyper_map(F.partial(_folded_adamw, kernel, beta1, beta2, eps, correction),
                                    lr, weight_decay, self._parameters, gradients, self.exp_avg, self.exp_avg_sq,
                                    self.optim_filter)
        else:
            result = self.hyper_map(F.partial(_folded_adamw, kernel, beta1, beta2, eps, correction, lr),
                                    weight_decay, self._parameters, gradients, self.exp_avg, self.exp_avg_sq,
                                    self.optim_filter)
        if self.use_parallel:
            self.broadcast_params(result)
        return result

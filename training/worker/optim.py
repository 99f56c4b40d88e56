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

16-bit weights (model_config.param_dtype) get a float32 master copy here, `master.<name>`:
the update runs on it and the weight becomes its rounding. MindFormers' AdamW instead updates
16-bit weights in place through a float32 temporary (mindformers/core/optim/adamw.py:38-66),
so an update smaller than half a bfloat16 ulp of the weight (2^-9 relative: lr 3e-5 on a
weight of 0.02) is lost, step after step. The masters are cloned with the weight's param_info,
as MindFormers clones the moments (adamw.py:170-189), so optimizer parallel slices them over
DP like the moments: the float32 copy costs 4 bytes / DP per parameter, Megatron's
distributed-optimizer layout. A master starts as zeros and is filled from its weight at the
first update after any start (fresh, weights-only load, or a checkpoint without masters):
`master_filled` says whether that happened, and is saved with them.
"""

from mindspore import Parameter, ParameterTuple, Tensor
from mindspore.common import dtype as mstype
from mindspore.common.initializer import initializer
from mindspore.nn.learning_rate_schedule import LearningRateSchedule
from mindspore.train import Callback
from mindspore.ops import composite as C
from mindspore.ops import functional as F
from mindspore.ops import operations as P
from mindformers.core.optim.adamw import AdamW as MindFormersAdamW
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

from ascend_llm_recipes.training.recipe.schema import START_STEP_LR

OPTIMIZER_TYPE = "FoldedAdamW"
MASTER_PREFIX = "master"          # master.<weight name>: float32 copies of 16-bit weights
MASTER_FILLED = "master_filled"   # 1.0 once the masters hold the weights

_folded_adamw = C.MultitypeFuncGraph("folded_adamw")


@_folded_adamw.register("Function", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                        "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Bool", "Bool")
def _update(kernel, beta1, beta2, eps, correction, lr, weight_decay, fill, param, master, grad, exp_avg, exp_avg_sq,
            optim_filter, has_master):
    """One parameter: the kernel with lr and weight decay rescaled by the step's bias correction.

    With a master copy the kernel updates it in float32 and the weight takes its rounding; `fill`
    (1.0 or 0.0) first sets the master to the weight (exact either way: the other term is x 0).
    """
    if optim_filter:
        # lr' = lr * correction and wd' = wd / correction keep lr' * wd' = lr * wd (decoupled decay).
        if has_master:
            from_weight = P.Cast()(param, mstype.float32)
            master = F.depend(master, F.assign(master, master * (1.0 - fill) + from_weight * fill))
            done = kernel(master, exp_avg, exp_avg_sq, lr * correction, beta1, beta2, eps, weight_decay / correction,
                          P.Cast()(grad, mstype.float32))
            F.assign(param, F.depend(P.Cast()(master, F.dtype(param)), done))
        else:
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
        self.has_master = tuple(p.dtype != mstype.float32 for p in self._parameters)
        # A float32 weight is its own master: the tuple holds the weight itself there (not saved twice).
        self.master = ParameterTuple([self._master_of(p) if keeps else p
                                      for p, keeps in zip(self._parameters, self.has_master)])
        # Only a model with 16-bit weights has masters to fill: float32 checkpoints stay as they were.
        self.master_filled = Parameter(Tensor(0.0, mstype.float32), name=MASTER_FILLED) if any(self.has_master) \
            else None

    def _master_of(self, param):
        master = Parameter(initializer("zeros", param.shape, mstype.float32), name=f"{MASTER_PREFIX}.{param.name}")
        master.param_info = param.param_info.clone()  # optimizer parallel slices it like the weight
        master.param_info.name = f"{MASTER_PREFIX}.{param.name}"
        master.set_data(initializer("zeros", param.shape, mstype.float32))
        return master

    def construct(self, gradients):
        weight_decay = self.get_weight_decay()
        lr = self.get_lr()
        self.assignadd(self.global_step, self.global_step_increase_tensor)
        step = F.cast(self.global_step, mstype.float32)
        sqrt_c2 = F.sqrt(1.0 - F.pow(self.beta2, step))
        correction = sqrt_c2 / (1.0 - F.pow(self.beta1, step))  # shape (1,), like beta1
        eps = self.eps * sqrt_c2
        kernel, beta1, beta2 = self.kernel, self.beta1, self.beta2
        fill = 1.0 - self.master_filled if self.master_filled is not None else Tensor(0.0, mstype.float32)
        states = (self._parameters, self.master, gradients, self.exp_avg, self.exp_avg_sq, self.optim_filter,
                  self.has_master)
        if not self.is_group:
            result = self.hyper_map(F.partial(_folded_adamw, kernel, beta1, beta2, eps, correction, lr, weight_decay,
                                              fill), *states)
        elif self.is_group_lr:
            result = self.hyper_map(F.partial(_folded_adamw, kernel, beta1, beta2, eps, correction),
                                    lr, weight_decay, (fill,) * len(self._parameters), *states)
        else:
            result = self.hyper_map(F.partial(_folded_adamw, kernel, beta1, beta2, eps, correction, lr),
                                    weight_decay, (fill,) * len(self._parameters), *states)
        if self.master_filled is not None:
            result = F.depend(result, F.assign(self.master_filled, Tensor(1.0, mstype.float32)))
        if self.use_parallel:
            self.broadcast_params(result)
        return result


class LoadOptimizerState(Callback):
    """Before the first step: AdamW moments and step of a conversion (recipe load_optimizer_state) into the optimizer.

    The conversion's optimizer/adam_m.safetensors and adam_v.safetensors hold one moment per
    weight under the weight's name; conversion.json records the optimizer step they belong to, so
    the first step's bias correction (and LR-schedule position) continues from there.
    """

    def __init__(self, directory: str):
        super().__init__()
        self.directory = directory

    def on_train_begin(self, run_context):
        import json
        import os

        import mindspore as ms
        from ascend_llm_recipes.common.errors import PretrainError

        cb_params = run_context.original_args()
        optimizer = getattr(cb_params.train_network, "optimizer", None) or cb_params.optimizer
        manifest = os.path.join(self.directory, "conversion.json")
        try:
            with open(manifest, encoding="utf-8") as f:
                entry = json.load(f).get("optimizer") or {}
        except (OSError, ValueError) as err:
            raise PretrainError(f"load_optimizer_state: {manifest}: unreadable ({err})") from None
        if not entry.get("carried"):
            raise PretrainError(f"load_optimizer_state: {self.directory} holds no optimizer state "
                                f"({entry.get('note', 'not a conversion with optimizer state')})",
                                hint="drop load_optimizer_state to restart the optimizer")
        problems = []
        for prefix, moments in (("adam_m", optimizer.exp_avg), ("adam_v", optimizer.exp_avg_sq)):
            path = os.path.join(self.directory, entry["directory"], f"{prefix}.safetensors")
            saved = ms.load_checkpoint(path, format="safetensors")
            for param in moments:
                name = param.name[len(prefix) + 1:]
                if name not in saved:
                    problems.append(f"{path}: {name}: missing")
                elif tuple(saved[name].shape) != tuple(param.shape):
                    problems.append(f"{path}: {name}: shape {tuple(saved[name].shape)}, the optimizer's "
                                    f"{tuple(param.shape)}")
                else:
                    param.set_data(ms.Tensor(saved[name].asnumpy(), param.dtype))
        if problems:
            raise PretrainError("load_optimizer_state: the moments do not fit the model:\n" +
                                "\n".join(f"  - {p}" for p in problems[:20]),
                                hint="load_checkpoint and load_optimizer_state must name the same conversion")
        optimizer.global_step.set_data(ms.Tensor([entry["global_step"]], optimizer.global_step.dtype))
        print(f"[optim] AdamW moments and step {entry['global_step']} loaded from {self.directory}", flush=True)


@MindFormerRegister.register(MindFormerModuleType.LR, alias=START_STEP_LR)
class StartStepLR(LearningRateSchedule):
    """A MindFormers schedule entered at `start_step`: optimizer step s gets the schedule's LR at start_step + s.

    A run continuing another framework's (--write-recipe) keeps that run's whole schedule instead of a
    re-fitted one. LinearWithWarmUpLR decays to 0 whatever lr_end says; here it decays to lr_end, as
    Megatron-LM's linear style decays to min_lr.
    """

    def __init__(self, schedule: str, start_step: int = 0, **kwargs):
        super().__init__()
        self.inner = MindFormerRegister.get_cls(MindFormerModuleType.LR, schedule)(**kwargs)
        self.start_step = float(start_step)
        peak, end = float(kwargs["learning_rate"]), float(kwargs.get("lr_end") or 0.0)
        # past the warm-up MindFormers' linear LR is peak x remaining fraction: rescale it onto [lr_end, peak]
        self.end = end if schedule == "LinearWithWarmUpLR" else 0.0
        self.scale = (peak - self.end) / peak
        self.warmup_steps = float(kwargs.get("warmup_steps") or 0)

    def construct(self, global_step):
        step = F.cast(global_step, mstype.float32) + self.start_step
        lr = self.inner(step)
        if self.end > 0.0 and step >= self.warmup_steps:
            lr = self.end + lr * self.scale
        return lr

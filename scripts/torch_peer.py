"""The PyTorch side of the throughput comparisons (scripts/benchmark_training.py, scripts/profile_step.py).

    TorchTrainer  transformers' model of our recipe's model (the config our converter writes), trained with
                  torch.optim.AdamW, the recipe's clipping and LR schedule
    GemmPeak      float32 1024^3 GEMM FLOP/s of both frameworks, measured between training steps
    TorchGemm     one GEMM form of a training step as PyTorch runs it (training/worker/metrics.py MindSporeGemm's peer)
    module_scopes the model's modules labelled in torch.profiler's trace (scripts/profile_step.py)

Not part of the installed package: torch and transformers are test extras only (tests/test_benchmark.py).
The scripts import it by name (scripts/ is on sys.path when a script in it runs).
"""

import statistics
import time

import numpy as np


class TorchTrainer:
    """transformers' LlamaForCausalLM, float32, eager (or torch.compile), torch.optim.AdamW.

    Same hyper-parameters as the recipe: AdamW betas/eps/weight decay (none on 1-D
    parameters, as MindFormers groups them), gradient clipping at max_grad_norm, the
    same cosine-with-warm-up LR, pad labels excluded from the loss.
    """

    def __init__(self, recipe, compile_model: bool = False):
        import torch
        from transformers import AutoModelForCausalLM

        from ascend_llm_recipes.models.conversion.hf import transformers_config

        m = recipe.model.model_config
        torch.manual_seed(recipe.seed)
        self.name = "torch.compile" if compile_model else "pytorch"
        self.model = AutoModelForCausalLM.from_config(transformers_config(m)).float().train()
        decay = [p for p in self.model.parameters() if p.ndim > 1]
        no_decay = [p for p in self.model.parameters() if p.ndim <= 1]
        opt = recipe.optimizer
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=recipe.lr_schedule.learning_rate, betas=tuple(opt.betas), eps=opt.eps)
        self.max_grad_norm = recipe.runner_wrapper.max_grad_norm
        self.pad_id = m.pad_token_id
        self.vocab = m.vocab_size
        self.lr = cosine_with_warmup(recipe)
        self.steps = 0
        self.forward = torch.compile(self.model) if compile_model else self.model
        self.torch = torch

    def step(self, batch: np.ndarray) -> float:
        torch = self.torch
        ids = torch.from_numpy(batch).long()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(self.steps)
        logits = self.forward(input_ids=ids[:, :-1].clamp(min=0)).logits  # -1 padding (no pad token): masked below
        # The labels name the step's sections in scripts/profile_step.py's profile (free when not profiling).
        with torch.profiler.record_function("step:loss"):
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab), ids[:, 1:].reshape(-1),
                                                     ignore_index=self.pad_id)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        with torch.profiler.record_function("step:clip_grad_norm"):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        return float(loss.detach())


def cosine_with_warmup(recipe):
    """The recipe's CosineWithWarmUpLR as a function of the step (for the PyTorch side)."""
    s = recipe.lr_schedule
    total = s.total_steps if s.total_steps > 0 else recipe.runner_config.stop_step
    warmup = s.warmup_steps if s.warmup_steps else int(total * (s.warmup_ratio or 0.0))

    def lr(step: int) -> float:
        if step < warmup:
            return s.learning_rate * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return s.lr_end + 0.5 * (s.learning_rate - s.lr_end) * (1 + np.cos(np.pi * progress))

    return lr


class GemmPeak:
    """float32 GEMM FLOP/s of each framework, measured between training steps.

    The MindSpore figure is training/worker/metrics.py's measurement (the MFU denominator used by
    our runs); measuring it between steps puts it under the same machine load as the steps.
    """

    def __init__(self):
        import torch
        from ascend_llm_recipes.training.worker.metrics import GEMM_SIZE

        self.size = GEMM_SIZE
        self.a = torch.randn(GEMM_SIZE, GEMM_SIZE)
        self.b = torch.randn(GEMM_SIZE, GEMM_SIZE)
        self.torch = torch
        self.samples = {"mindspore": [], "torch": []}

    def measure(self, repeats: int = 3) -> None:
        from ascend_llm_recipes.training.worker.metrics import measure_cpu_peak_flops

        self.samples["mindspore"].append(measure_cpu_peak_flops(self.size, repeats))
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            self.torch.matmul(self.a, self.b)
            best = min(best, time.perf_counter() - start)
        self.samples["torch"].append(2.0 * self.size ** 3 / best)

    def median(self, framework: str) -> float:
        return statistics.median(self.samples[framework])


class TorchGemm:
    """One GEMM form as PyTorch runs it: torch.matmul on transposed views, as F.linear and autograd do.

    F.linear(x, W) is mm(x, W.t()); its backward is mm(dY, W) and mm(dY.t(), X) (mm_mat1/mm_mat2_backward);
    attention's matmuls and their backward are bmm on transposed views. Same operands and repetitions per
    call as training/worker/metrics.py MindSporeGemm, for a like-for-like comparison.
    """

    def __init__(self, gemm, unroll: int = None):
        import torch
        from ascend_llm_recipes.training.worker.metrics import gemm_operands, gemm_unroll

        self.unroll = unroll or gemm_unroll(gemm)
        a_copies, b = gemm_operands(gemm, self.unroll)

        def stored(x, transposed):
            t = torch.from_numpy(x)
            return t.transpose(-1, -2) if transposed else t

        self.a_copies = [stored(a, gemm.transpose_a) for a in a_copies]
        self.b = stored(b, gemm.transpose_b)
        self.torch = torch
        self.seconds()  # first-call allocations

    def seconds(self, repeats: int = 1) -> float:
        """Best time of one GEMM over `repeats` calls of `unroll` GEMMs."""
        best = float("inf")
        with self.torch.no_grad():
            for _ in range(repeats):
                start = time.perf_counter()
                for a in self.a_copies:
                    self.torch.matmul(a, self.b)
                best = min(best, time.perf_counter() - start)
        return best / self.unroll


def module_scopes(model, torch) -> list:
    """Hooks that label each module's forward with its name ("module:model.layers.0.mlp") in the profile."""
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def enter(_module, _inputs, label=f"module:{name}"):
            _module._profile_scope = torch.profiler.record_function(label)
            _module._profile_scope.__enter__()

        def leave(_module, _inputs, _output):
            _module._profile_scope.__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles

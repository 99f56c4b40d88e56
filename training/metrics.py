"""Numbers a run reports about itself: device peak FLOP/s, MFU, host and device memory."""

import json
import math
import time

import numpy as np

from ascend_llm_recipes.models.arithmetic import flops_per_token

GEMM_SIZE = 1024  # a square float32 GEMM large enough to reach the kernel's steady speed on CPU


def measure_cpu_peak_flops(size: int = GEMM_SIZE, repeats: int = 5) -> float:
    """Best FLOP/s of a float32 size^3 MindSpore MatMul (graph mode), measured now on this host.

    This is the ceiling MFU is measured against on CPU: what the same framework's GEMM
    reaches on these cores, not a datasheet number.
    """
    import mindspore as ms
    from mindspore import nn, ops

    class Gemm(nn.Cell):
        def __init__(self):
            super().__init__()
            self.matmul = ops.MatMul()

        def construct(self, a, b):
            return self.matmul(a, b)

    rng = np.random.default_rng(0)
    a = ms.Tensor(rng.standard_normal((size, size), dtype=np.float32))
    b = ms.Tensor(rng.standard_normal((size, size), dtype=np.float32))
    gemm = Gemm()
    gemm(a, b).asnumpy()  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        gemm(a, b).asnumpy()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size ** 3 / best


def device_peak_flops(recipe) -> tuple:
    """(peak FLOP/s of one device for the recipe's compute dtype or None, where the figure comes from)."""
    if recipe.context.device_target == "CPU":
        peak = measure_cpu_peak_flops()
        return peak, f"measured: float32 {GEMM_SIZE}^3 MindSpore MatMul on this host, {peak / 1e9:.1f} GFLOP/s"
    from ascend_llm_recipes.training.planner import resolve_device

    spec = resolve_device(recipe)
    fp32 = recipe.model.model_config.compute_dtype == "float32"
    peak = spec.peak_flops_fp32 if fp32 else spec.peak_flops_16bit
    return peak, f"{spec.name}: {spec.source}" if peak else f"{spec.name}: no trusted peak figure, MFU not reported"


def model_flops_utilisation(flops_per_token_: int, tokens_per_s: float, peak_per_device: float, devices: int):
    """(MFU as a fraction, or None, and a flag). Above 100% means the peak is wrong: never reported as MFU."""
    if not peak_per_device or not tokens_per_s:
        return None, "no peak"
    value = flops_per_token_ * tokens_per_s / (peak_per_device * devices)
    if value > 1.0:
        return None, f"above 100% ({value:.0%}): the device peak is wrong"
    return value, ""


def training_flops_per_token(recipe) -> int:
    return flops_per_token(recipe.model.model_config)


def host_memory_bytes() -> int:
    """Resident memory of this process."""
    import psutil

    return psutil.Process().memory_info().rss


def device_memory_bytes(target: str):
    """Peak device memory MindSpore allocated, where the backend reports it (Ascend/GPU); None on CPU."""
    if target == "CPU":
        return None
    import mindspore as ms

    try:
        return int(ms.runtime.max_memory_allocated())
    except (RuntimeError, AttributeError):
        return None


def loss_spike(losses: list, factor: float, window: int):
    """The moving mean the last loss exceeds by `factor`, or None: the anomaly monitor's spike rule.

    The mean is over the `window` losses before the last, non-finite ones left out; fewer than
    `window` finite ones (the start of a launch) is never a spike; factor 0 turns the rule off.
    """
    previous = [x for x in losses[-window - 1:-1] if math.isfinite(x)]
    if not factor or len(previous) < window:
        return None
    mean = sum(previous) / len(previous)
    return mean if losses[-1] > factor * mean else None


def read_jsonl(path: str, log=print) -> list:
    """The JSON objects of a .jsonl file; a torn or garbled line (a crash mid-write) is dropped with a warning."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict):
                records.append(record)
            else:
                log(f"{path}:{number}: not a JSON record (torn by a crash?), dropped: {line.strip()[:80]!r}")
    return records

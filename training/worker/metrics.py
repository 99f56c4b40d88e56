"""Numbers a run reports about itself: device peak FLOP/s, MFU, host and device memory."""

import json
import math
import statistics
import time
from typing import Union

import numpy as np

from ascend_llm_recipes.models.arithmetic import Gemm, flops_per_token

GEMM_SIZE = 1024  # a square float32 GEMM large enough to reach the kernel's steady speed on CPU


# A timed call runs its GEMM several times (see MindSporeGemm) until it holds about this many FLOPs: 10-30 ms at
# these CPUs' 30-100 GFLOP/s, against a graph-mode call's fixed cost of 0.5-0.9 ms (mindspore_call_overhead_s).
CALL_FLOPS = 1e9
MAX_UNROLL = 8


def measure_cpu_peak_flops(size: int = GEMM_SIZE, repeats: int = 5) -> float:
    """Best FLOP/s of a float32 size^3 MindSpore MatMul (graph mode), measured now on this host.

    This is the ceiling MFU is measured against on CPU: what the same framework's GEMM
    reaches on these cores, not a datasheet number.
    """
    square = Gemm(f"{size}^3", size, size, size, False, False, 1)
    return square.flops / MindSporeGemm(square).seconds(repeats)


def gemm_unroll(gemm: Gemm) -> int:
    """How many times one timed call runs `gemm`: enough for CALL_FLOPS, at most MAX_UNROLL."""
    return max(1, min(MAX_UNROLL, math.ceil(CALL_FLOPS / gemm.flops)))


def gemm_operands(gemm: Gemm, copies: int, seed: int = 0) -> tuple:
    """([`copies` distinct A arrays], B) in float32, stored as the kernel reads them (see Gemm)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(gemm.a_shape, dtype=np.float32)
    return [a + np.float32(i) for i in range(copies)], rng.standard_normal(gemm.b_shape, dtype=np.float32)


class MindSporeGemm:
    """One GEMM form as our model runs it: a graph-mode Cell with ops.MatMul (BatchMatMul when batched) and the
    form's transpose flags, compiled once, running the GEMM `unroll` times per call.

    Unrolled inside the graph, one call's dispatch and synchronisation are shared by `unroll` GEMMs, as in a
    training step's graph; each repetition reads its own copy of A, because graph-mode common-subexpression
    elimination merges identical MatMuls into one (measured: 4 identical ones timed 4x faster).
    """

    def __init__(self, gemm: Gemm, unroll: int = None):
        import mindspore as ms
        from mindspore import nn, ops

        kernel = (ops.BatchMatMul if gemm.batch else ops.MatMul)(gemm.transpose_a, gemm.transpose_b)
        self.unroll = unroll or gemm_unroll(gemm)

        class Unrolled(nn.Cell):
            def __init__(self, count):
                super().__init__()
                self.kernel = kernel
                self.count = count

            def construct(self, a_copies, b):
                outputs = ()
                for i in range(self.count):
                    outputs = outputs + (self.kernel(a_copies[i], b),)
                return outputs

        a_copies, b = gemm_operands(gemm, self.unroll)
        self.a_copies, self.b = tuple(ms.Tensor(a) for a in a_copies), ms.Tensor(b)
        self.cell = Unrolled(self.unroll)
        self.cell(self.a_copies, self.b)[-1].asnumpy()  # compile

    def seconds(self, repeats: int = 1) -> float:
        """Best time of one GEMM over `repeats` calls (asnumpy waits for the graph to finish; it copies nothing)."""
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            self.cell(self.a_copies, self.b)[-1].asnumpy()
            best = min(best, time.perf_counter() - start)
        return best / self.unroll


def mindspore_call_overhead_s(repeats: int = 20) -> float:
    """Best time of a graph-mode call of a 1x1 MatMul: the fixed cost each timed call adds to its GEMMs."""
    return MindSporeGemm(Gemm("1x1", 1, 1, 1, False, True, 1), unroll=1).seconds(repeats)


class GemmYardstick:
    """The time one training step's GEMMs (models/arithmetic.py step_gemms) take on each framework's own kernels.

    `timers` maps a framework to a factory: gemm -> object whose seconds(repeats) times one GEMM
    (MindSporeGemm; the benchmark adds PyTorch's). Each round times every GEMM form on every framework,
    framework after framework per form (order flipped each round), so load from other work lands on
    both alike; a form's time in a round is its best of `repeats` calls. A round's step GEMM time is
    the sum of count x time, and the yardstick peak is the step's GEMM FLOPs over it.
    """

    def __init__(self, gemms: list, timers: dict):
        self.gemms = gemms
        self.timers = {name: [factory(g) for g in gemms] for name, factory in timers.items()}
        self.rounds = {name: [] for name in timers}  # per round: [seconds of one GEMM, for each form]

    def measure_round(self, repeats: int = 2) -> None:
        done = len(next(iter(self.rounds.values())))
        order = list(self.timers) if done % 2 == 0 else list(self.timers)[::-1]
        times = {name: [] for name in order}
        for i in range(len(self.gemms)):
            for name in order:
                times[name].append(self.timers[name][i].seconds(repeats))
        for name in order:
            self.rounds[name].append(times[name])

    @property
    def step_flops(self) -> int:
        return sum(g.count * g.flops for g in self.gemms)

    def step_seconds(self, name: str) -> list:
        """The step's GEMM time on framework `name`, one value per round."""
        return [sum(g.count * t for g, t in zip(self.gemms, times)) for times in self.rounds[name]]

    def peak(self, name: str) -> tuple:
        """(median, lowest, highest) FLOP/s over the rounds: step GEMM FLOPs / step GEMM time."""
        rates = [self.step_flops / s for s in self.step_seconds(name)]
        return statistics.median(rates), min(rates), max(rates)

    def gemm_flops_per_s(self, name: str) -> list:
        """Per GEMM form, its median FLOP/s over the rounds on framework `name`."""
        return [g.flops / statistics.median(times[i] for times in self.rounds[name])
                for i, g in enumerate(self.gemms)]


class CpuPeak:
    """The CPU's peak FLOP/s: the best rate of a float32 GEMM_SIZE^3 MindSpore MatMul timed on this host.

    A reference timed once can be timed slow: other processes on a shared machine take the cores for a moment, and
    every MFU after it reads high (102% on a busy 2-core machine, where an idle one reads 46%). So it is the best
    of ROUNDS rounds spaced ROUND_GAP_S apart, timed again every RECHECK_STEPS steps, and sooner (at most every
    SUSPECT_STEPS steps) when a step's MFU against it passes SUSPECT_MFU, above what a whole step's matmuls,
    attention and optimizer reach against an idle machine's GEMM (the demo: 46%); the best timing stands. A re-check
    times REPEATS GEMMs (~50 ms on two cores), which the next step's gap carries. When a re-check moves the reference
    by more than STEADY, the machine's load is changing under the run: until a re-check reproduces it, a step past
    SUSPECT_MFU reads n/a, MFU being unreliable on a loaded machine.
    """

    ROUNDS, ROUND_GAP_S, REPEATS = 3, 0.2, 3
    SUSPECT_MFU, SUSPECT_STEPS, RECHECK_STEPS, STEADY = 0.6, 5, 50, 1.05

    def __init__(self, size: int = GEMM_SIZE):
        square = Gemm(f"{size}^3", size, size, size, False, False, 1)
        self.size, self.gemm_flops, self.timer = size, square.flops, MindSporeGemm(square)
        self.flops, self.unsteady = 0.0, False
        for i in range(self.ROUNDS):
            if i:
                time.sleep(self.ROUND_GAP_S)
            self.measure()
        self.since_check = self.SUSPECT_STEPS  # the first suspect step is re-checked at once

    def measure(self) -> float:
        """Time the GEMM once more (best of REPEATS calls); the best rate so far."""
        self.flops = max(self.flops, self.gemm_flops / self.timer.seconds(self.REPEATS))
        self.since_check = 0
        return self.flops

    def utilisation(self, achieved: float) -> tuple:
        """(MFU or None, flag) of a step that ran `achieved` FLOP/s on this device; re-times the reference when due."""
        value = achieved / self.flops
        self.since_check += 1
        if (value > self.SUSPECT_MFU and self.since_check > self.SUSPECT_STEPS) or \
                self.since_check >= self.RECHECK_STEPS:
            before = self.flops
            self.unsteady = self.measure() > self.STEADY * before
            value = achieved / self.flops
        if value > 1.0 or (self.unsteady and value > self.SUSPECT_MFU):
            return None, (f"n/a: {value:.0%} of the reference GEMM, whose timings on this machine move with other "
                          "processes' load; MFU is unreliable on a loaded machine")
        return value, ""

    def describe(self) -> str:
        return (f"measured: float32 {self.size}^3 MindSpore MatMul on this host, {self.flops / 1e9:.1f} GFLOP/s "
                f"(best of {self.ROUNDS} rounds; timed again every {self.RECHECK_STEPS} steps, and when a step's MFU "
                f"passes {self.SUSPECT_MFU:.0%})")


def device_peak_flops(recipe) -> tuple:
    """(peak FLOP/s of one device for the recipe's compute dtype (CpuPeak on CPU) or None, where it comes from)."""
    if recipe.context.device_target == "CPU":
        peak = CpuPeak()
        return peak, peak.describe()
    from ascend_llm_recipes.training.tools.planner import resolve_device

    spec = resolve_device(recipe)
    fp32 = recipe.model.model_config.compute_dtype == "float32"
    peak = spec.peak_flops_fp32 if fp32 else spec.peak_flops_16bit
    return peak, f"{spec.name}: {spec.source}" if peak else f"{spec.name}: no trusted peak figure, MFU not reported"


def model_flops_utilisation(flops_per_token_: int, tokens_per_s: float, peak_per_device: Union[float, CpuPeak, None],
                            devices: int):
    """(MFU as a fraction, or None, and a flag). Above 100% is never reported as MFU: a datasheet peak is wrong; the
    CPU's reference (CpuPeak) is re-timed, and says when the machine's load makes it unreliable."""
    if not peak_per_device or not tokens_per_s:
        return None, "no peak"
    achieved = flops_per_token_ * tokens_per_s / devices
    if isinstance(peak_per_device, CpuPeak):
        return peak_per_device.utilisation(achieved)
    value = achieved / peak_per_device
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

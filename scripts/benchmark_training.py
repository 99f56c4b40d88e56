"""Training throughput of our model (graph mode, the Trainer's wrapper) against PyTorch, side by side.

    python scripts/benchmark_training.py [--steps 6] [--warmup 2] [--shapes reference larger demo]
                                         [--demo-steps 40] [--no-torch-compile] [--no-demo]
    python scripts/benchmark_training.py --shapes moe --no-demo [--moe-dispatch stacked loop]
    python scripts/benchmark_training.py --gemm-only [--shapes reference] [--gemm-rounds 3] [--gemm-repeats 2]

For each shape (reference: hidden 256, 4 layers, 8 heads, MLP 688, vocabulary 8192,
seq_length 256, batch 8; larger: hidden 512, 8 layers, MLP 1376, vocabulary 16384,
seq_length 512, batch 2; demo: the demo recipe's model, vocabulary 2048; moe, not run unless named:
Qwen3-MoE's layout, hidden 512, 4 layers, 8 heads of 64 (4 KV heads), q/k norms, every MLP 8 experts
top-2 of width 256, vocabulary 8192, seq_length 512, batch 2) it trains our
LlamaForCausalLM through PortableTrainOneStepCell with the recipes' optimizer, and
transformers' model of the same config (LlamaForCausalLM, Qwen3MoeForCausalLM for moe: scripts/torch_peer.py;
float32, eager, and under torch.compile when it works)
with torch.optim.AdamW and the same hyper-parameters, alternating their steps in this one
process, and prints steady-state tokens/s, the ratio,
MFU against a float32 GEMM peak measured between the steps, and our compile time. tokens/s
is from the median step; "best" from the fastest step, which is what an idle machine gives
when other work shares the cores (PyTorch's OpenMP loops lose more than MindSpore to that).
The ratio is printed three ways: of the best steps (the headline: closest to an idle
machine), of the medians, and the median of per-round ratios (each round runs both back to
back), with the load average before and after; the medians are flagged when the machine was
busy before the run. Then it
runs the demo recipe end to end through scripts/run_distributed.sh (data loading included)
and prints its throughput, data wait and start-up phases, and a PyTorch loop over the same
dataset.

Both sides train the same shape on the same token batches with the same optimizer
settings (the recipe's AdamW, gradient clipping and LR schedule). Steps of the two are
alternated in one process so that whatever else runs on the machine slows both alike;
warm-up (graph compile, first allocations) is excluded and steady-state tokens/s is the
median over the timed steps.

The moe shape's FLOPs per token are from the active parameters (the top 2 of 8 experts a token reaches),
whatever either side computes. Our MoE layers route with models/moe.py's default dispatch ("sorted": only
the routed tokens); --moe-dispatch adds our model with the other variants ("stacked", "loop": every expert on
every token) as rows "mindspore[variant]" in the same alternation, with their ratio to the default.

MFU (analytic FLOPs per token, models/arithmetic.py, x tokens/s) is given against two
yardsticks, both measured between the timed steps (one round after
each round of steps, under the steps' load): a float32 1024^3 GEMM, and each framework's own
GEMMs at the model's shapes. The second takes the GEMMs one training step runs
(models/arithmetic.py step_gemms: q/k/v/o, gate/up/down, lm_head and attention's BatchMatMuls,
forward and both backward GEMMs, with the transposes each framework's autodiff uses), times
each on MindSpore (graph mode, training/worker/metrics.py MindSporeGemm) and on PyTorch (torch.matmul
on transposed views), form by form alternating the frameworks, and sums count x time: the
time this step's GEMMs need on that framework's kernels. Its peak is the step's GEMM FLOPs
over that time (median over rounds, with the range). --gemm-only prints that yardstick alone,
one row per GEMM form with both frameworks' GFLOP/s, without training.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from ascend_llm_recipes.models.arithmetic import flops_per_token
from ascend_llm_recipes.training.run_files import METRICS, RESOLVED_RECIPE, SUMMARY
from torch_peer import GemmPeak, TorchGemm, TorchTrainer  # scripts/ is on sys.path when a script in it runs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Importing MindFormers creates ./output/log unless told where to log (it is imported lazily, below).
os.environ.setdefault("LOCAL_DEFAULT_PATH", tempfile.mkdtemp(prefix="mindformers-log-"))
BUSY_LOAD_PER_CORE = 0.25  # 1-minute load average per core above which other work distorts the medians

DEMO_RECIPE = os.path.join(REPO_ROOT, "recipes", "demo_cpu.yaml")


@dataclass
class Shape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    seq_length: int
    batch_size: int
    num_kv_heads: int = None
    head_dim: int = None      # Qwen3's explicit head width (else hidden / heads)
    qk_norm: bool = False
    num_experts: int = 0      # > 0: every layer's MLP is models/moe.py's MoE (Qwen3-MoE with qk_norm)
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = None

    def overrides(self) -> tuple:
        """The recipe overrides that give the demo recipe this shape."""
        m = "model.model_config."
        moe = dict(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                   moe_intermediate_size=self.moe_intermediate_size) if self.num_experts else {}
        extra = {"head_dim": self.head_dim, "qk_norm": self.qk_norm or None, **moe}
        return (f"{m}hidden_size={self.hidden_size}", f"{m}num_layers={self.num_layers}",
                f"{m}num_heads={self.num_heads}", f"{m}num_kv_heads={self.num_kv_heads or self.num_heads}",
                f"{m}intermediate_size={self.intermediate_size}", f"{m}vocab_size={self.vocab_size}",
                f"{m}seq_length={self.seq_length}", f"runner_config.batch_size={self.batch_size}") + tuple(
                    f"{m}{name}={value}" for name, value in extra.items() if value is not None)

    def describe(self) -> str:
        """The shape's line in the output."""
        heads = f"{self.num_heads} heads" + (f" ({self.num_kv_heads} KV)" if self.num_kv_heads else "") + (
            f" of {self.head_dim}" if self.head_dim else "") + (", q/k norms" if self.qk_norm else "")
        mlp = (f"{self.num_experts} experts top-{self.num_experts_per_tok} of width {self.moe_intermediate_size}"
               if self.num_experts else f"MLP {self.intermediate_size}")
        return (f"hidden {self.hidden_size}, {self.num_layers} layers, {heads}, {mlp}, vocab {self.vocab_size}, "
                f"seq {self.seq_length}, batch {self.batch_size}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_length


# The reference shape, and a wider/deeper one (Llama-style 8/3 MLP ratio, 16-aligned).
REFERENCE = Shape("reference", 256, 4, 8, 688, 8192, 256, 8)
LARGER = Shape("larger", 512, 8, 8, 1376, 16384, 512, 2)
DEMO = Shape("demo", 256, 4, 8, 688, 2048, 256, 8)  # recipes/demo_cpu.yaml's model
SMOKE = Shape("smoke", 64, 2, 4, 176, 512, 32, 2)
# Qwen3-MoE's layout (qk_norm, head_dim 64, GQA, every layer MoE, top-2 of 8 renormalised: Qwen3-30B-A3B routes to
# 8 of 128 with norm_topk_prob) at a size two CPU cores train in seconds per step; transformers' peer is
# Qwen3MoeForCausalLM. intermediate_size is unused (no dense layer) but the recipe requires one.
MOE = Shape("moe", 512, 4, 8, 1376, 8192, 512, 2, num_kv_heads=4, head_dim=64, qk_norm=True, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=256)
SMOKE_MOE = Shape("smoke_moe", 64, 2, 4, 176, 512, 32, 2, num_kv_heads=2, head_dim=16, qk_norm=True, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=48)
SHAPES = {s.name: s for s in (REFERENCE, LARGER, DEMO, SMOKE, MOE, SMOKE_MOE)}


@dataclass
class Timings:
    name: str
    first_step_s: float = 0.0          # the first step (graph compile for ours)
    step_s: list = field(default_factory=list)
    losses: list = field(default_factory=list)

    def median_step(self) -> float:
        return statistics.median(self.step_s)

    def best_step(self) -> float:
        """The fastest timed step: close to what an idle machine gives when others share the cores."""
        return min(self.step_s)


def batches(shape: Shape, count: int, seed: int = 0) -> np.ndarray:
    """Random token rows of seq_length + 1 (inputs and shifted labels), the same for every framework."""
    rng = np.random.default_rng(seed)
    return rng.integers(4, shape.vocab_size, size=(count, shape.batch_size, shape.seq_length + 1), dtype=np.int32)


def load_shape_recipe(shape: Shape, total_steps: int):
    """The demo recipe (its optimizer, clipping, LR schedule, wrapper) at this model shape."""
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    return load_recipe(DEMO_RECIPE, overrides=shape.overrides() + (f"runner_config.stop_step={total_steps}",))


class MindSporeTrainer:
    """Our model in graph mode, wrapped exactly as MindFormers' Trainer wraps it for our recipes.

    Optimizer groups, LR schedule, AdamW and the train-step wrapper are built by the same
    MindFormers functions the Trainer calls (base_trainer.create_optimizer_scheduler and
    create_model_wrapper), from the recipe's sections.
    """

    name = "mindspore"

    def __init__(self, recipe, run_dir: str, moe_dispatch: str = None):
        import mindspore as ms
        from mindformers import MindFormerConfig
        from mindformers.core import build_lr, build_optim
        from mindformers.trainer.optimizer_grouped_parameters import get_optimizer_grouped_parameters
        from mindformers.wrapper import build_wrapper

        from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
        from ascend_llm_recipes.models.moe import MoE
        import ascend_llm_recipes.training.worker.train_step  # noqa: F401  (registers the portable wrapper)
        import ascend_llm_recipes.training.worker.optim  # noqa: F401  (registers FoldedAdamW)
        from ascend_llm_recipes.training.worker.train import mindformers_config

        cfg = MindFormerConfig(**mindformers_config(recipe, run_dir))
        ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
        ms.set_seed(recipe.seed)
        model_cfg = {k: v for k, v in cfg.model.model_config.items() if k != "type"}
        self.network = LlamaForCausalLM(LlamaConfig(**model_cfg))
        if moe_dispatch:  # read when the graph compiles, at the first step
            self.name = f"mindspore[{moe_dispatch}]"
            for _, cell in self.network.cells_and_names():
                if isinstance(cell, MoE):
                    cell.dispatch = moe_dispatch
        lr = build_lr(cfg.lr_schedule)
        groups = get_optimizer_grouped_parameters(model=self.network, weight_decay=cfg.optimizer.weight_decay,
                                                  dynamic_lr_schedule=lr, optimizer_type=cfg.optimizer.type)
        optimizer = build_optim(cfg.optimizer, default_args={"params": groups, "learning_rate": lr})
        self.step_cell = build_wrapper(cfg.runner_wrapper, default_args={
            "network": self.network, "optimizer": optimizer, "parallel_config": cfg.parallel_config})
        self.step_cell.set_train(True)
        self.ms = ms

    def step(self, batch: np.ndarray) -> float:
        outputs = self.step_cell(self.ms.Tensor(batch))
        return float(outputs[0].asnumpy())


def gemm_yardstick(recipe, shape: Shape):
    """training/worker/metrics.py GemmYardstick over this shape's step GEMMs, for MindSpore (graph mode) and PyTorch."""
    from ascend_llm_recipes.models.arithmetic import step_gemms
    from ascend_llm_recipes.training.worker.metrics import GemmYardstick, MindSporeGemm

    gemms = step_gemms(recipe.model.model_config, shape.batch_size, shape.seq_length)
    return GemmYardstick(gemms, {"mindspore": MindSporeGemm, "torch": TorchGemm})


def alternate(trainers: list, data: np.ndarray, warmup: int, steps: int, between: tuple = ()) -> dict:
    """Run one step of each trainer in turn (order flipped every round); the first `warmup` are not timed.

    Each of `between` is called after every timed round of steps (the GEMM measurements, under the steps' load).
    """
    timings = {t.name: Timings(t.name) for t in trainers}
    for i in range(warmup + steps):
        batch = data[i % len(data)]
        for trainer in trainers if i % 2 == 0 else reversed(trainers):
            start = time.perf_counter()
            loss = trainer.step(batch)
            elapsed = time.perf_counter() - start
            record = timings[trainer.name]
            record.losses.append(loss)
            if i == 0:
                record.first_step_s = elapsed
            if i >= warmup:
                record.step_s.append(elapsed)
        if i >= warmup:
            for measure in between:
                measure()
    return timings


def compare_shape(shape: Shape, warmup: int, steps: int, torch_compile: bool, run_dir: str,
                  moe_dispatch: tuple = ()) -> dict:
    """Train our model and the PyTorch peers at `shape`, alternating; returns the figures.

    With MoE layers, `moe_dispatch` names models/moe.py MoE.dispatch variants trained beside our default
    ("mindspore"); each is a row "mindspore[variant]" and a ratio "ours / mindspore[variant]".
    """
    load_before = os.getloadavg()[0]  # other work on the machine, before ours starts
    recipe = load_shape_recipe(shape, total_steps=warmup + steps + 1)
    trainers = [MindSporeTrainer(recipe, run_dir)]
    trainers += [MindSporeTrainer(recipe, run_dir, variant) for variant in moe_dispatch if shape.num_experts]
    trainers.append(TorchTrainer(recipe))
    compile_error = None
    if torch_compile:
        compiled = TorchTrainer(recipe, compile_model=True)
        try:
            compiled.step(batches(shape, 1, seed=1)[0])  # compiles; a failure is reported, not fatal
            trainers.append(compiled)
        except Exception as err:  # noqa: BLE001 (any backend failure means "not available here")
            compile_error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    peak = GemmPeak()
    yardstick = gemm_yardstick(recipe, shape)
    timings = alternate(trainers, batches(shape, 8), warmup, steps, (peak.measure, yardstick.measure_round))
    fpt = flops_per_token(recipe.model.model_config)
    result = {"shape": shape, "flops_per_token": fpt, "timings": timings, "torch_compile_error": compile_error,
              "peak": {name: peak.median(name) for name in peak.samples},
              "peak_range": {name: (min(v), max(v)) for name, v in peak.samples.items()},
              "yardstick": {name: yardstick.peak(name) for name in yardstick.rounds},
              "gemm_step_s": {name: yardstick.step_seconds(name) for name in yardstick.rounds}, "rows": {}}
    for name, t in timings.items():
        tps = shape.tokens_per_step / t.median_step()
        own = "mindspore" if name.startswith("mindspore") else "torch"
        median, low, high = result["yardstick"][own]
        result["rows"][name] = {"tokens_per_s": tps, "step_s": t.median_step(), "first_step_s": t.first_step_s,
                                "best_tokens_per_s": shape.tokens_per_step / t.best_step(),
                                "mfu": fpt * tps / result["peak"]["mindspore"],
                                "mfu_own_gemm": fpt * tps / result["peak"][own],
                                "mfu_shapes": fpt * tps / median,
                                "mfu_shapes_range": (fpt * tps / high, fpt * tps / low),
                                # Paired per round (the GEMM round runs right after that round's steps):
                                # model FLOPs per step / step time over the yardstick of that round.
                                "mfu_shapes_per_round": [
                                    fpt * shape.tokens_per_step * gemm_s / (step_s * yardstick.step_flops)
                                    for step_s, gemm_s in zip(t.step_s, result["gemm_step_s"][own])],
                                "loss_first": t.losses[0], "loss_last": t.losses[-1]}
    ours = result["rows"]["mindspore"]["tokens_per_s"]
    best = result["rows"]["mindspore"]["best_tokens_per_s"]
    result["ratio"] = {name: ours / row["tokens_per_s"] for name, row in result["rows"].items() if name != "mindspore"}
    result["best_ratio"] = {name: best / row["best_tokens_per_s"] for name, row in result["rows"].items()
                            if name != "mindspore"}
    # Each round runs one step of every trainer back to back, under about the same load: the
    # median of the per-round ratios follows load changes that shift the two medians apart.
    ours_steps = timings["mindspore"].step_s
    result["paired_ratio"] = {name: statistics.median(theirs / mine for theirs, mine in zip(t.step_s, ours_steps))
                              for name, t in timings.items() if name != "mindspore"}
    result["load_average"] = (load_before, os.getloadavg()[0])
    return result


def run_demo(steps: int, out_dir: str, dataset_dir: str = None) -> dict:
    """The demo recipe end to end through the real launcher (data loading, callbacks, Trainer).

    Returns the run's summary.json plus steady-state figures from metrics.jsonl (the first
    `skip` steps excluded) and the start-up phases measured from the launch.
    """
    import json
    import subprocess

    import yaml

    repo = os.path.dirname(os.path.dirname(DEMO_RECIPE))
    cmd = ["bash", os.path.join(repo, "scripts", "run_distributed.sh"), DEMO_RECIPE,
           "--set", f"output_dir={out_dir}", "--set", f"runner_config.stop_step={steps}",
           "--set", "monitoring.tensorboard=False"]
    if dataset_dir:
        cmd += ["--set", f"train_dataset.data_loader.dataset_dir={dataset_dir}"]
    launched = time.time()
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"demo run failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(os.path.join(out_dir, SUMMARY), encoding="utf-8") as f:
        summary = json.load(f)
    with open(os.path.join(out_dir, RESOLVED_RECIPE), encoding="utf-8") as f:
        dataset_dir = yaml.safe_load(f)["train_dataset"]["data_loader"]["dataset_dir"]  # absolute once resolved
    with open(os.path.join(out_dir, METRICS), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if '"loss"' in line]
    skip = min(3, len(records) - 1)
    steady = records[skip:]
    iteration = [r["step_time"] + r["iteration_gap"] for r in steady]
    tokens = summary["tokens"] / summary["steps"]
    startup = dict(summary.get("startup", {}))
    if startup:
        startup["launch_to_worker"] = round(startup["worker_start"] - launched, 3)
        startup["launch_to_first_step_end"] = round(startup["first_step_end"] - launched, 3)
    return {"summary": summary, "startup": startup, "records": records, "dataset_dir": dataset_dir,
            "tokens_per_s": tokens / statistics.median(iteration),
            "step_s": statistics.median(r["step_time"] for r in steady),
            "data_wait": statistics.mean(r["data_wait"] for r in steady),
            "gap_s": statistics.median(r["iteration_gap"] for r in steady),
            "mfu": statistics.median(r["mfu"] for r in steady if r["mfu"] is not None),
            "wall_s": time.time() - launched}


def torch_demo(steps: int, dataset_dir: str) -> dict:
    """The PyTorch peer at the demo's shape, reading the demo's MindRecord dataset (batch time included)."""
    import mindspore.dataset as ds
    from ascend_llm_recipes.data.mindrecord_io import read_manifest, shard_files
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    recipe = load_recipe(DEMO_RECIPE, overrides=(f"runner_config.stop_step={steps}",))
    files = shard_files(dataset_dir, read_manifest(dataset_dir))
    dataset = ds.MindDataset(files, columns_list=["input_ids"], shuffle=True, num_parallel_workers=1)
    dataset = dataset.batch(recipe.runner_config.batch_size, drop_remainder=True)
    trainer = TorchTrainer(recipe)
    iterations, waits = [], []
    rows = dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)
    last = time.perf_counter()
    for i, (batch,) in enumerate(rows):
        got = time.perf_counter()
        trainer.step(batch.astype(np.int32))
        end = time.perf_counter()
        if i >= 3:
            iterations.append(end - last)
            waits.append((got - last) / (end - last))
        last = end
        if i + 1 >= steps:
            break
    tokens = recipe.tokens_per_step
    return {"tokens_per_s": tokens / statistics.median(iterations), "data_wait": statistics.mean(waits)}


def print_shape(result: dict) -> None:
    s = result["shape"]
    peak, low_high = result["peak"], result["peak_range"]
    active = " from the active parameters (models/arithmetic.py)" if s.num_experts else ""
    print(f"\n== {s.name}: {s.describe()} ({result['flops_per_token'] / 1e6:.1f} MFLOP/token{active}); "
          f"CPU: {cpu_model()}, {os.cpu_count()} cores")
    for name in ("mindspore", "torch"):
        lo, hi = low_high[name]
        median, low, high = result["yardstick"][name]
        step_s = result["gemm_step_s"][name]
        print(f"   {name:9s} GEMMs at this shape (yardstick): {median / 1e9:5.1f} GFLOP/s (median; {low / 1e9:.0f}-"
              f"{high / 1e9:.0f} between steps): the step's GEMMs need {statistics.median(step_s):.3f} s "
              f"({min(step_s):.3f}-{max(step_s):.3f}); 1024^3 GEMM {peak[name] / 1e9:5.1f} GFLOP/s "
              f"({lo / 1e9:.0f}-{hi / 1e9:.0f})")
    print("   MFU: vs MindSpore's 1024^3 GEMM | vs the framework's own 1024^3 GEMM | vs its own GEMMs at this "
          "shape (median yardstick, range over rounds; per round: paired with the GEMM round after each step)")
    print(f"   {'':18s} {'tokens/s':>9s} {'best':>6s} {'step s':>7s} {'MFU':>6s} {'MFU/own GEMM':>13s} "
          f"{'MFU/own GEMMs at shape':>23s} {'per round':>17s} {'first step s':>13s} {'loss first->last':>17s}")
    for name, row in result["rows"].items():
        low, high = row["mfu_shapes_range"]
        shapes = f"{row['mfu_shapes']:.1%} ({low:.0%}-{high:.0%})"
        rounds = row["mfu_shapes_per_round"]
        paired = f"{statistics.median(rounds):.1%} ({min(rounds):.0%}-{max(rounds):.0%})"
        print(f"   {name:18s} {row['tokens_per_s']:9.0f} {row['best_tokens_per_s']:6.0f} {row['step_s']:7.3f} "
              f"{row['mfu']:6.1%} {row['mfu_own_gemm']:13.1%} {shapes:>23s} {paired:>17s} "
              f"{row['first_step_s']:13.2f} {row['loss_first']:8.4f}->{row['loss_last']:.4f}")
    ours = result["rows"]["mindspore"]
    print(f"   ours: compile ~{ours['first_step_s'] - ours['step_s']:.1f} s (first step minus a steady step); "
          f"MFU {ours['mfu']:.1%} = {ours['mfu']:.0%} of the MindSpore 1024^3 GEMM peak, "
          f"{ours['mfu_shapes']:.0%} of MindSpore's own GEMMs at this shape")
    for name, ratio in result["ratio"].items():
        print(f"   ratio (ours / {name}): best steps {result['best_ratio'][name]:.2f} | medians {ratio:.2f} | "
              f"per-round median {result['paired_ratio'][name]:.2f}")
    before, after = result["load_average"]
    print(f"   load average {before:.2f} before, {after:.2f} at the end, on {os.cpu_count()} cores")
    if before > BUSY_LOAD_PER_CORE * os.cpu_count():
        print("   the machine was busy before the run: other work slows the two frameworks unevenly (PyTorch's "
              "OpenMP loops usually more), so the medians are skewed; the best-step ratio is the closest to idle")
    if result["torch_compile_error"]:
        print(f"   torch.compile not available here: {result['torch_compile_error']}")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string elsewhere."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or "unknown"


def gemm_only(shape: Shape, rounds: int, repeats: int) -> dict:
    """The yardstick alone: this shape's step GEMMs on both frameworks, `rounds` interleaved rounds."""
    import mindspore as ms
    from ascend_llm_recipes.training.worker.metrics import mindspore_call_overhead_s

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    load_before = os.getloadavg()[0]
    yardstick = gemm_yardstick(load_shape_recipe(shape, total_steps=1), shape)
    peak = GemmPeak()
    for _ in range(rounds):
        yardstick.measure_round(repeats)
        peak.measure()
    return {"shape": shape, "yardstick": yardstick, "peak": peak, "overhead_s": mindspore_call_overhead_s(),
            "repeats": repeats, "load_average": (load_before, os.getloadavg()[0])}


def print_gemm_table(result: dict) -> None:
    s, yardstick, peak = result["shape"], result["yardstick"], result["peak"]
    rounds = len(yardstick.rounds["mindspore"])
    print(f"\n== {s.name}: the GEMMs of one training step (hidden {s.hidden_size}, {s.num_layers} layers, "
          f"{s.num_heads} heads, MLP {s.intermediate_size}, vocab {s.vocab_size}, {s.batch_size} x {s.seq_length} "
          f"tokens), float32; {rounds} rounds interleaving the frameworks, best of {result['repeats']} calls per "
          "GEMM and round, median over rounds")
    print("   form: N/T = the kernel reads A, B as stored / transposed (MindSpore transpose_a/_b; torch .t() views)")
    ms_rates, torch_rates = yardstick.gemm_flops_per_s("mindspore"), yardstick.gemm_flops_per_s("torch")
    ms_times = [g.count * g.flops / r for g, r in zip(yardstick.gemms, ms_rates)]
    print(f"   {'GEMM':38s} {'form':4s} {'[batch x] m x n x k':>22s} {'count':>5s} {'MindSpore GFLOP/s':>17s} "
          f"{'torch GFLOP/s':>13s} {'ratio':>6s} {'MS step share':>13s}")
    for gemm, ms_rate, torch_rate, ms_time in zip(yardstick.gemms, ms_rates, torch_rates, ms_times):
        dims = "x".join(str(d) for d in gemm.batch + (gemm.m, gemm.n, gemm.k))
        print(f"   {gemm.name:38s} {gemm.form:4s} {dims:>22s} {gemm.count:5d} {ms_rate / 1e9:17.3g} "
              f"{torch_rate / 1e9:13.3g} {ms_rate / torch_rate:6.3g} {ms_time / sum(ms_times):13.1%}")
    print(f"   one step runs {yardstick.step_flops / 1e9:.3g} GFLOP of GEMMs; its GEMM time is the sum of count x time "
          "over the rows above")
    for name in ("mindspore", "torch"):
        step_s = yardstick.step_seconds(name)
        median, low, high = yardstick.peak(name)
        lo, hi = min(peak.samples[name]), max(peak.samples[name])
        print(f"   {name:9s} step GEMM time {statistics.median(step_s):.3f} s ({min(step_s):.3f}-{max(step_s):.3f}) "
              f"-> yardstick {median / 1e9:.1f} GFLOP/s ({low / 1e9:.1f}-{high / 1e9:.1f}); 1024^3 GEMM "
              f"{peak.median(name) / 1e9:.1f} GFLOP/s ({lo / 1e9:.0f}-{hi / 1e9:.0f})")
    overhead = result["overhead_s"]
    calls = [timer.unroll * gemm.flops / rate for timer, gemm, rate in
             zip(yardstick.timers["mindspore"], yardstick.gemms, ms_rates)]
    print(f"   MindSpore graph-mode call overhead {overhead * 1e3:.2f} ms (a 1x1 MatMul cell); each timed call runs "
          f"its GEMM up to {max(t.unroll for t in yardstick.timers['mindspore'])} times, so the overhead is at most "
          f"{max(overhead / c for c in calls):.1%} of a row's call")
    before, after = result["load_average"]
    print(f"   load average {before:.2f} before, {after:.2f} at the end, on {os.cpu_count()} cores")


def print_demo(ours: dict, peer: dict) -> None:
    s, st = ours["summary"], ours["startup"]
    print(f"\n== demo recipe end to end (scripts/run_distributed.sh recipes/demo_cpu.yaml, {s['steps']} steps)")
    print(f"   ours    {ours['tokens_per_s']:7.0f} tokens/s (step {ours['step_s']:.3f} s + gap {ours['gap_s']:.3f} s, "
          f"data wait {ours['data_wait']:.1%}, MFU {ours['mfu']:.1%} vs the run's own start-up GEMM measurement); "
          f"loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}; whole run {ours['wall_s']:.1f} s")
    print(f"   pytorch {peer['tokens_per_s']:7.0f} tokens/s (same dataset via MindDataset, data wait "
          f"{peer['data_wait']:.1%}; run after ours, not interleaved); "
          f"ratio {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}")
    if st:
        print(f"   start-up, launch -> first step done {st['launch_to_first_step_end']:.1f} s: launcher until "
              f"the worker starts {st['launch_to_worker']:.1f} s, imports {st['imports']:.1f} s, setup "
              f"{st['setup']:.1f} s, of which data {st.get('data', 0.0):.1f} s, build (model, optimizer) "
              f"{st['build']:.1f} s, first step (graph compile) {st['first_step']:.1f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per framework and shape")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile, allocations)")
    parser.add_argument("--shapes", nargs="+", default=["reference", "larger", "demo"],
                        choices=sorted(SHAPES))
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--moe-dispatch", nargs="*", default=[], choices=["stacked", "loop"],
                        help="MoE shapes: also train our model with these models/moe.py dispatch variants beside the "
                             "default (sorted), one row each")
    parser.add_argument("--no-demo", action="store_true")
    parser.add_argument("--demo-steps", type=int, default=40)
    parser.add_argument("--demo-dataset", help="dataset directory for the demo (default: the recipe's)")
    parser.add_argument("--gemm-only", action="store_true",
                        help="print only the GEMM yardstick table per shape (no training)")
    parser.add_argument("--gemm-rounds", type=int, default=3, help="interleaved rounds of --gemm-only")
    parser.add_argument("--gemm-repeats", type=int, default=2, help="calls per GEMM and round (the best is kept)")
    args = parser.parse_args(argv)
    counts = {"--steps": (args.steps, 1), "--warmup": (args.warmup, 1), "--demo-steps": (args.demo_steps, 5),
              "--gemm-rounds": (args.gemm_rounds, 1), "--gemm-repeats": (args.gemm_repeats, 1)}
    for flag, (value, least) in counts.items():
        if value < least:  # the first step compiles the graph; the demo's first 3 are not steady state
            parser.error(f"{flag} must be at least {least}, got {value}")
    if args.demo_dataset and not args.no_demo and not os.path.isdir(args.demo_dataset):
        parser.error(f"--demo-dataset {args.demo_dataset}: no such directory (a dataset scripts/prepare_data.py "
                     "wrote); leave it out to use the demo recipe's own")
    if args.gemm_only:
        for name in args.shapes:
            print_gemm_table(gemm_only(SHAPES[name], args.gemm_rounds, args.gemm_repeats))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            print_shape(compare_shape(SHAPES[name], args.warmup, args.steps, not args.no_torch_compile,
                                      os.path.join(tmp, name), tuple(args.moe_dispatch)))
        if not args.no_demo:
            ours = run_demo(args.demo_steps, os.path.join(tmp, "demo"), args.demo_dataset)
            print_demo(ours, torch_demo(args.demo_steps, ours["dataset_dir"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training throughput of our model (graph mode, the Trainer's wrapper) against PyTorch, side by side.

    python scripts/benchmark_training.py [--steps 6] [--warmup 2] [--shapes reference larger demo]
                                         [--demo-steps 40] [--no-torch-compile] [--no-demo]

For each shape (reference: hidden 256, 4 layers, 8 heads, MLP 688, vocabulary 8192,
seq_length 256, batch 8; larger: hidden 512, 8 layers, MLP 1376, vocabulary 16384,
seq_length 512, batch 2; demo: the demo recipe's model, vocabulary 2048) it trains our
LlamaForCausalLM through PortableTrainOneStepCell with the recipes' optimizer, and
transformers' LlamaForCausalLM (float32, eager; and under torch.compile when that works here)
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
"""

import argparse
import os
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Importing MindFormers creates ./output/log unless told where to log.
os.environ.setdefault("LOCAL_DEFAULT_PATH", tempfile.mkdtemp(prefix="mindformers-log-"))

from ascend_llm_recipes.training import benchmark  # noqa: E402  (after the log-directory default)

BUSY_LOAD_PER_CORE = 0.25  # 1-minute load average per core above which other work distorts the medians


def print_shape(result: dict) -> None:
    s = result["shape"]
    peak, low_high = result["peak"], result["peak_range"]
    print(f"\n== {s.name}: hidden {s.hidden_size}, {s.num_layers} layers, {s.num_heads} heads, MLP "
          f"{s.intermediate_size}, vocab {s.vocab_size}, seq {s.seq_length}, batch {s.batch_size} "
          f"({result['flops_per_token'] / 1e6:.1f} MFLOP/token)")
    for name in ("mindspore", "torch"):
        lo, hi = low_high[name]
        print(f"   GEMM peak {name:9s} {peak[name] / 1e9:6.1f} GFLOP/s (median; {lo / 1e9:.0f}-{hi / 1e9:.0f} "
              f"between steps)")
    print(f"   {'':14s} {'tokens/s':>9s} {'best':>6s} {'step s':>7s} {'MFU':>6s} {'MFU/own GEMM':>13s} "
          f"{'first step s':>13s} {'loss first->last':>17s}")
    for name, row in result["rows"].items():
        print(f"   {name:14s} {row['tokens_per_s']:9.0f} {row['best_tokens_per_s']:6.0f} {row['step_s']:7.3f} "
              f"{row['mfu']:6.1%} "
              f"{row['mfu_own_gemm']:13.1%} {row['first_step_s']:13.2f} "
              f"{row['loss_first']:8.4f}->{row['loss_last']:.4f}")
    ours = result["rows"]["mindspore"]
    print(f"   ours: compile ~{ours['first_step_s'] - ours['step_s']:.1f} s (first step minus a steady step); "
          f"MFU {ours['mfu']:.1%} = {ours['mfu']:.0%} of the MindSpore GEMM peak")
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
        print(f"   start-up, launch -> first step done {st['launch_to_first_step_end']:.1f} s: launcher+msrun "
              f"{st['launch_to_worker']:.1f} s, imports {st['imports']:.1f} s, setup {st['setup']:.1f} s, "
              f"of which data {st.get('data', 0.0):.1f} s, build (model, optimizer) {st['build']:.1f} s, "
              f"first step (graph compile) {st['first_step']:.1f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per framework and shape")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile, allocations)")
    parser.add_argument("--shapes", nargs="+", default=["reference", "larger", "demo"],
                        choices=sorted(benchmark.SHAPES))
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--no-demo", action="store_true")
    parser.add_argument("--demo-steps", type=int, default=40)
    parser.add_argument("--demo-dataset", help="dataset directory for the demo (default: the recipe's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            print_shape(benchmark.compare_shape(benchmark.SHAPES[name], args.warmup, args.steps,
                                                not args.no_torch_compile, os.path.join(tmp, name)))
        if not args.no_demo:
            ours = benchmark.run_demo(args.demo_steps, os.path.join(tmp, "demo"), args.demo_dataset)
            print_demo(ours, benchmark.torch_demo(args.demo_steps, ours["dataset_dir"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

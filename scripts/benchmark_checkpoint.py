"""Time training is blocked by checkpoint saves: synchronous against asynchronous, side by side.

    python scripts/benchmark_checkpoint.py [--hidden 512 --layers 8 --steps 20 --every 5]

Trains the same model twice through the launcher (tiny recipe's data, a wider model so a
checkpoint is a few hundred MB), saving every `every` steps, once with
`callbacks.1.async_save=False` and once with `=True`, and prints the seconds each run spent
blocked in saves (summary.json `checkpoint_blocked_s`), per save, and the end-to-end tokens/s.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from ascend_llm_recipes.training.run_files import SUMMARY

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(out: str, async_save: bool, args) -> dict:
    cmd = ["bash", os.path.join(REPO_ROOT, "scripts", "run_distributed.sh"),
           os.path.join(REPO_ROOT, "recipes", "tiny_cpu.yaml"), "--set", f"output_dir={out}",
           "--set", f"model.model_config.hidden_size={args.hidden}",
           "--set", f"model.model_config.num_layers={args.layers}",
           "--set", "model.model_config.num_heads=8", "--set", "model.model_config.num_kv_heads=8",
           "--set", f"model.model_config.intermediate_size={args.hidden * 8 // 3 // 16 * 16}",
           "--set", f"runner_config.stop_step={args.steps}", "--set", f"callbacks.1.save_checkpoint_steps={args.every}",
           "--set", f"callbacks.1.keep_checkpoint_max={args.steps // args.every}",
           "--set", f"callbacks.1.async_save={async_save}", "--set", "monitoring.tensorboard=False"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    with open(os.path.join(out, SUMMARY), encoding="utf-8") as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for mode in (False, True):
            summary = run(os.path.join(tmp, "async" if mode else "sync"), mode, args)
            ckpt = summary["checkpoint"]
            saves = args.steps // args.every
            rows.append(("async" if mode else "sync", summary["checkpoint_blocked_s"],
                         summary["checkpoint_blocked_s"] / saves, summary["tokens_per_s"],
                         os.path.getsize(ckpt) / 2 ** 20))
    print(f"{'mode':6} {'blocked s':>10} {'per save s':>11} {'tokens/s':>9} {'ckpt MB':>8}")
    for mode, blocked, per_save, tps, size in rows:
        print(f"{mode:6} {blocked:10.3f} {per_save:11.3f} {tps:9.0f} {size:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

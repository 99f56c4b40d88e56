"""Train a tiny recipe 20 steps on CPU and write its losses as the golden curve tests/test_train.py asserts.

    python tests/make_golden_losses.py [--recipe RECIPE] [OUT_JSON]
        RECIPE: recipes/tiny_cpu.yaml (default) or recipes/tiny_moe_cpu.yaml; OUT_JSON: that recipe's file in GOLDEN

The run is the tiny_run fixture's (tests/conftest.py): the recipe as shipped, on the dataset
tests/conftest.py prepares from the shipped corpus tests/data/tiny_corpus (60 standard-library
modules of CPython 3.11.7, the same text on every machine), so the fixture's 20 losses are compared
with these (the MoE recipe: its own run in tests/test_train.py, on the same dataset). Regenerate only
for an intended numerical change, and say which in the commit.
"""

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib.metadata import version

from conftest import TINY_CORPUS, prepare_tiny_dataset, tiny_corpus_files

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# recipe (relative to the repository) -> its golden curve
GOLDEN = {"recipes/tiny_cpu.yaml": os.path.join(REPO_ROOT, "tests", "data", "golden_tiny_losses.json"),
          "recipes/tiny_moe_cpu.yaml": os.path.join(REPO_ROOT, "tests", "data", "golden_tiny_moe_losses.json")}


def corpus_sha256(count: int) -> str:
    """One hash over the first COUNT files of the shipped corpus the tiny dataset is built from: equal hashes mean
    equal training data."""
    digest = hashlib.sha256()
    for path in tiny_corpus_files()[:count]:
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def vector_flags() -> list:
    """The CPU's AVX extensions (float32 kernels pick their code path by them)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return []
    return sorted(flag for flag in flags if flag.startswith("avx"))


def main(argv) -> int:
    from ascend_llm_recipes.training.launcher.cli import launch
    from ascend_llm_recipes.training.recipe.loading import load_recipe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/tiny_cpu.yaml", choices=sorted(GOLDEN))
    parser.add_argument("out_json", nargs="?")
    args = parser.parse_args(argv)
    out_json = args.out_json or GOLDEN[args.recipe]
    recipe_path = os.path.join(REPO_ROOT, args.recipe)
    recipe = load_recipe(recipe_path)
    steps = recipe.runner_config.stop_step
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        dataset, run_dir = os.path.join(tmp, "tiny"), os.path.join(tmp, "run")
        prepare_tiny_dataset(dataset)
        if launch(recipe_path, [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={dataset}"],
                  show_progress=False) != 0:
            print(f"training failed: see {run_dir}/logs", file=sys.stderr)
            return 1
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            losses = [r["loss"] for r in map(json.loads, f) if "val_loss" not in r]
    assert len(losses) == steps, losses
    golden = {
        "recipe": args.recipe,
        "command": "python tests/make_golden_losses.py" + ("" if args.recipe == "recipes/tiny_cpu.yaml"
                                                            else f" --recipe {args.recipe}"),
        "losses": losses,
        "corpus": os.path.relpath(TINY_CORPUS, REPO_ROOT),
        "corpus_documents": recipe.data_preparation.max_documents,
        "corpus_sha256": corpus_sha256(recipe.data_preparation.max_documents),
        "python": platform.python_version(),
        "mindspore": version("mindspore"),
        "mindformers": version("mindformers"),
        "cpu": cpu_model(),
        "cpu_vector_flags": vector_flags(),
    }
    with open(out_json, "w", encoding="utf-8") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    print(f"wrote {out_json}: {steps} losses, {losses[0]:.6f} -> {losses[-1]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

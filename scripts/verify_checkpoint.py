"""Check checkpoints the way a resume does: files against their manifests, tensors against a recipe.

    python scripts/verify_checkpoint.py RUN_DIR_OR_STEP_DIR [--recipe recipes/x.yaml] [--set key=value ...]

Exit code 0 when every checked step is valid, 1 otherwise (each problem names its file/tensor).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.checkpoint import CHECKPOINTS, MANIFEST, read_json, verify_step  # noqa: E402
from training.errors import PretrainError  # noqa: E402


def step_dirs(path: str) -> list:
    root = os.path.join(path, CHECKPOINTS)
    if os.path.isdir(root):
        return [os.path.join(root, e) for e in sorted(os.listdir(root))]
    return [path]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a run directory or one checkpoint step directory")
    parser.add_argument("--recipe", help="also check tensor names and shapes against this recipe's model")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    shapes = None
    try:
        if args.recipe:
            from models.shapes import parameter_shapes
            from training.recipe import load_recipe
            recipe = load_recipe(args.recipe, tuple(args.overrides), planning=True)
            shapes = parameter_shapes(recipe.model.model_config, recipe.parallel_config.model_parallel)
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    bad = 0
    for directory in step_dirs(args.path):
        ranks = sorted(e for e in os.listdir(directory) if e.startswith("rank_")) if os.path.isdir(directory) else []
        manifests = [os.path.join(directory, r, MANIFEST) for r in ranks]
        world = next((read_json(m)["world_size"] for m in manifests if os.path.isfile(m)), len(ranks))
        problems = verify_step(directory, world, shapes, need_optimizer=not os.path.basename(directory).startswith(
            ("nan_", "spike_")))
        bad += bool(problems)
        print(f"{'OK  ' if not problems else 'BAD '} {directory}" + "".join(f"\n     - {p}" for p in problems))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

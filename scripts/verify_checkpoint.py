"""Check checkpoints the way a resume does: files against their manifests, tensors against a recipe.

    python scripts/verify_checkpoint.py PATH [--recipe recipes/x.yaml] [--set key=value ...]

PATH is a run directory (every step in RUN_DIR/checkpoints/), one step directory, or a rank's
.ckpt (or rank_N folder) inside a step directory, which verifies that whole step: a .ckpt is
checked against the manifest.json written beside it, so one without it is refused.
Each verified step is named with its ranks, tensors and data position; each problem names its
file or tensor. Steps set aside by a launch (checkpoints/invalid/) are listed with their reason.

Exit code: 0 when at least one complete checkpoint was verified and none is bad; 1 when a step
is bad or none verified; 2 when PATH (or the recipe) is not something to verify.
"""

import argparse
import os
import sys


from ascend_llm_recipes.training.checkpoint import describe_step, step_world_size, steps_to_verify, verify_step
from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.training.run_files import CHECKPOINTS, INVALID, REASON


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a run directory, one checkpoint step directory, or a rank's .ckpt in one")
    parser.add_argument("--recipe", help="also check tensor names and shapes against this recipe's model")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    shapes = None
    try:
        if args.recipe:
            from ascend_llm_recipes.training.checkpoint import rank_shapes
            from ascend_llm_recipes.training.recipe.loading import load_recipe
            recipe = load_recipe(args.recipe, tuple(args.overrides), planning=True)
            shapes = rank_shapes(recipe)
            if shapes is None:
                print(f"note: {args.recipe} slices tensors by its strategy files (tensor or pipeline parallel): tensor "
                      "names and shapes are not checked here (MindSpore checks them at load); files, hashes and "
                      "manifests are")
        directories = steps_to_verify(args.path)
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if os.path.isfile(args.path) or os.path.basename(os.path.normpath(args.path)).startswith("rank_"):
        print(f"{args.path} is one rank's part of {directories[0]}: verifying that whole step")
    good, bad = [], []
    for directory in directories:
        world = step_world_size(directory)
        resumable = not os.path.basename(directory).startswith(("nan_", "spike_"))  # post-mortem snapshots
        problems = verify_step(directory, world, shapes, need_optimizer=resumable)
        (bad if problems else good).append(directory)
        print(f"BAD  {directory}" + "".join(f"\n     - {p}" for p in problems) if problems
              else f"OK   {directory}: {describe_step(directory, world)}")
    invalid = os.path.join(os.path.dirname(directories[0]), INVALID)
    if os.path.basename(os.path.dirname(directories[0])) == CHECKPOINTS and os.path.isdir(invalid):
        for entry in sorted(os.listdir(invalid)):
            print(f"SET ASIDE {os.path.join(invalid, entry)} by a launch (reasons in its {REASON})")
    resumable = [d for d in good if os.path.basename(d).startswith("step_")]
    print(f"verified {len(good)} complete checkpoint(s), {len(bad)} bad"
          + (f"; a resume continues from {resumable[-1]}" if resumable else "; none to resume from"))
    return 0 if good and not bad else 1


if __name__ == "__main__":
    sys.exit(main())

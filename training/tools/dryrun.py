"""`--check --dry-run`: compile the recipe's graph under MindSpore's DryRun (MS_SIMULATION_LEVEL)."""

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dry_run_compile(recipe, recipe_path: str) -> int:
    """`--check --dry-run`: compile one rank per pipeline stage under MindSpore's DryRun (MS_SIMULATION_LEVEL=1).

    DryRun needs MindSpore's Ascend plugin, which needs CANN; without it, say so in one line.
    """
    from ascend_llm_recipes.training.launcher.resume import prepare_run_dir
    from ascend_llm_recipes.training.launcher.versions import cann_version

    version, where = cann_version(dict(os.environ))
    if version is None:
        print(f"dry-run: not run: MindSpore's DryRun (MS_SIMULATION_LEVEL) needs CANN and none is installed here "
              f"({where})")
        return 2
    p = recipe.parallel_config
    per_stage = recipe.world_size // p.pipeline_stage
    recipe.runner_config.stop_step = 1
    recipe.output_dir = os.path.join(recipe.output_dir, "dryrun")
    run_dir = prepare_run_dir(recipe, recipe_path)
    failed = []
    for stage in range(p.pipeline_stage):
        rank = stage * per_stage
        env = dict(os.environ, MS_SIMULATION_LEVEL="1", RANK_SIZE=str(recipe.world_size), RANK_ID=str(rank),
                   LOCAL_DEFAULT_PATH=run_dir)
        code = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", "train.py"), "--run-dir", run_dir],
                              env=env).returncode
        print(f"dry-run: stage {stage} (rank {rank} of {recipe.world_size}): "
              f"{'compiled' if code == 0 else f'failed (exit {code})'}", flush=True)
        if code:
            failed.append(stage)
    return 1 if failed else 0


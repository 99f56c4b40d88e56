"""Checkpoints across parallel layouts, through the strategy files MindSpore writes in semi-auto parallel.

Under tensor or pipeline parallelism a rank's checkpoint holds its slice or its stage only; which
one is recorded in the parallel strategy file each rank writes when MindSpore compiles a
semi-auto-parallel graph. Three uses, each done the way MindFormers 1.9 does it:
- every semi-auto run saves its strategy files in RUN_DIR/strategy/ (strategy_config);
- a resume at another layout (DP/TP/PP) re-slices the checkpoint at load through MindFormers'
  auto_trans_ckpt (check_relayout and keep_source_strategy in the launcher, mindformers_keys in the worker);
- `--to-hf` of a semi-auto (TP/PP) run merges its shards into one unsliced checkpoint with MindSpore's
  transform_checkpoints (export_source), then converts that.
None of it has executed here: semi-auto parallel does not run on CPU (`Invalid backend: CPU`), so no
strategy file can exist on a CPU machine; every path that needs one refuses and says so.
MindFormers/MindSpore references are to the installed mindformers 1.9.0 / mindspore 2.9.0 (site-packages).
"""

import json
import os
import shutil

from ascend_llm_recipes.common.errors import ConversionError, LaunchError
from ascend_llm_recipes.training.recipe.mindformers import semi_auto
from ascend_llm_recipes.training.run_files import CHECKPOINTS, LAYOUT_FILE, MERGED_DIR, RESOLVED_RECIPE, STRATEGY_DIR

# MindFormers saves a rank's strategy as get_output_root_path()/strategy/ckpt_strategy_rank_N.ckpt:
# mindformers/utils/file_utils.py:53-65 (set_strategy_save_path) from the "./ckpt_strategy.ckpt" default of
# mindformers/tools/register/template.py:416; the worker sets LOCAL_DEFAULT_PATH (the output root) to RUN_DIR.
NO_STRATEGY_ON_CPU = ("strategy files are written only by the compile of a semi-auto-parallel graph, which MindSpore "
                      "does not run on CPU (Invalid backend: CPU), so none can exist on this machine")


def strategy_file(run_dir: str, rank: int) -> str:
    return os.path.join(os.path.realpath(run_dir), STRATEGY_DIR, f"ckpt_strategy_rank_{rank}.ckpt")


def layout(recipe) -> dict:
    """The degrees, and whether each rank's file follows a strategy file (semi-auto) or holds whole tensors.

    In semi-auto parallel even a TP1 PP1 rank may hold slices (optimizer parallel splits weights and
    optimizer state over data parallel from level1 on: mindspore/context.py:1104-1110), so every semi-auto
    checkpoint is re-sliced through its strategy files.
    """
    p = recipe.parallel_config
    return {"data_parallel": p.data_parallel, "model_parallel": p.model_parallel, "pipeline_stage": p.pipeline_stage,
            "semi_auto": semi_auto(recipe)}


def describe(lay: dict) -> str:
    return (f"DP{lay['data_parallel']} x TP{lay['model_parallel']} x PP{lay['pipeline_stage']}"
            + ("" if lay.get("semi_auto", True) else " (data-parallel mode)"))


def devices(lay: dict) -> int:
    return lay["data_parallel"] * lay["model_parallel"] * lay["pipeline_stage"]


def strategy_config(recipe, run_dir: str, rank: int) -> dict:
    """The `parallel:` keys that make a semi-auto run save its strategy file in RUN_DIR/strategy/ ({} otherwise).

    MindFormers' configs ask for `strategy_ckpt_config: {save_file, only_trainable_params: False}` (all
    parameters, optimizer moments included, so checkpoints re-slice and merge whole), and
    set_strategy_save_path (mindformers/utils/file_utils.py:60-64) adds `strategy_ckpt_save_file` per rank
    under the output root. Both name the same per-rank file here, so the order in which
    mindspore.set_auto_parallel_context applies them (_auto_parallel_context.py:658,676) does not matter.
    Data parallel and stand-alone runs have no strategy (MindFormers says so: trainer/utils.py:502-505).
    """
    if not semi_auto(recipe):
        return {}
    path = strategy_file(run_dir, rank)
    return {"strategy_ckpt_config": {"save_file": path, "only_trainable_params": False},
            "strategy_ckpt_save_file": path}


def checkpoint_layout(previous, step_dir: str) -> dict:
    """The layout a step's shards were written at: its layout.json once kept for a relayout, else the run's recipe."""
    path = os.path.join(step_dir, LAYOUT_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return layout(previous)


def source_strategy_dir(run_dir: str, step_dir: str) -> str:
    """Where the strategy files of a step's layout are: kept beside it after a relayout, else the run's own."""
    kept = os.path.join(step_dir, STRATEGY_DIR)
    return kept if os.path.isdir(kept) else os.path.join(run_dir, STRATEGY_DIR)


def missing_strategy_files(directory: str, world_size: int, also_in: str = None) -> list:
    """The ranks' strategy files not in `directory` (nor in `also_in`, where an interrupted move left some)."""
    names = [f"ckpt_strategy_rank_{r}.ckpt" for r in range(world_size)]
    return [os.path.join(directory, n) for n in names
            if not any(d and os.path.isfile(os.path.join(d, n)) for d in (directory, also_in))]


def check_relayout(previous, recipe, run_dir: str, step_dir: str) -> None:
    """A resume at another layout than its checkpoint's: allowed only through MindFormers' auto_trans_ckpt.

    Changes between data-parallel-mode layouts need nothing (every rank's file holds whole tensors).
    A semi-auto checkpoint's shards follow its strategy files and must be re-sliced: the user asks for
    it with `auto_trans_ckpt: True` (and --amend, as for any recipe change), the new layout is semi-auto
    too (its compile writes the destination strategy), and the strategy files of the checkpoint's
    layout are in the run directory. Checks only; keep_source_strategy moves files.
    """
    old, new = checkpoint_layout(previous, step_dir), layout(recipe)
    if old == new or not (old["semi_auto"] or new["semi_auto"]):
        return
    where = (f"resume from {step_dir}: the checkpoint was saved at {describe(old)} ({devices(old)} devices), this "
             f"recipe runs {describe(new)}")
    if recipe.runs_on_cpu:
        raise LaunchError(f"{where}; re-slicing needs the strategy files of the layout that saved it, and "
                          + NO_STRATEGY_ON_CPU, hint="resume at the checkpoint's layout on the Ascend node")
    if not old["semi_auto"]:
        raise LaunchError(f"{where}; its ranks' files hold whole tensors without a strategy file, which MindFormers' "
                          "auto_trans_ckpt does not take as a distributed checkpoint",
                          hint="start a new run from one rank's file (load_checkpoint: STEP_DIR/rank_0/FILE, "
                               "without resume_training)")
    if not new["semi_auto"]:
        raise LaunchError(f"{where}; re-slicing loads into a semi-auto-parallel graph, whose compile writes the new "
                          "layout's strategy files (MindFormers' destination strategy)",
                          hint="keep parallel.parallel_mode: 1 (semi-auto parallel)")
    if not recipe.auto_trans_ckpt:
        raise LaunchError(f"{where}; each rank's file holds its slice (tensor, pipeline stage or optimizer shard) "
                          "as the checkpoint's strategy files describe, so it must be re-sliced for the new layout",
                          hint="set auto_trans_ckpt: True in the recipe (MindFormers re-slices the checkpoint at "
                               f"load with the strategy files in {os.path.join(run_dir, STRATEGY_DIR)}) and pass "
                               f"--amend; or resume at {describe(old)}")
    if devices(old) != devices(new):
        raise LaunchError(f"{where}; a relayout keeps the device count ({devices(old)}): the launcher verifies, "
                          "resumes and truncates the checkpoint per rank",
                          hint=f"choose degrees whose product is {devices(old)}")
    directory = source_strategy_dir(run_dir, step_dir)
    missing = missing_strategy_files(directory, devices(old), os.path.join(step_dir, STRATEGY_DIR + ".partial"))
    if missing:
        raise LaunchError(f"{where}; re-slicing needs the strategy file of every rank of {describe(old)}, and "
                          f"{len(missing)} are missing: {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}",
                          hint="they are written by the semi-auto-parallel compile of the run that saved the "
                               "checkpoint; restore them from that node, or resume at " + describe(old))


def keep_source_strategy(previous, recipe, run_dir: str, step_dir: str) -> None:
    """Before a relayout starts, move the checkpoint's strategy files beside it.

    With auto_trans_ckpt MindFormers empties RUN_DIR/strategy/ at start and refuses it as
    src_strategy_path_or_dir (mindformers/utils/file_utils.py:179-212, from trainer/trainer.py:1471-1491);
    the new layout's compile then writes its own files there (the destination strategy).
    """
    old = checkpoint_layout(previous, step_dir)
    if old == layout(recipe) or not (old["semi_auto"] and layout(recipe)["semi_auto"]) or not recipe.auto_trans_ckpt:
        return
    from ascend_llm_recipes.training.checkpoint import write_atomic

    kept = os.path.join(step_dir, STRATEGY_DIR)
    if not os.path.isdir(kept):
        partial = kept + ".partial"  # an interrupted earlier move left part of the files here
        os.makedirs(partial, exist_ok=True)
        for rank in range(devices(old)):
            source = strategy_file(run_dir, rank)
            if os.path.isfile(source):
                shutil.move(source, os.path.join(partial, os.path.basename(source)))
        os.replace(partial, kept)
    write_atomic(os.path.join(step_dir, LAYOUT_FILE), json.dumps(old))  # the files' layout, once they left
    print(f"[launch] relayout {describe(old)} -> {describe(layout(recipe))}: MindFormers re-slices {step_dir} at load "
          f"(auto_trans_ckpt) with the strategy files in {kept}", flush=True)


def pending_source_strategy(recipe):
    """src_strategy_path_or_dir when this launch resumes a checkpoint of another layout, else None.

    As MindFormers' TransformCkpt wants it (tools/ckpt_transform/transform_checkpoint.py:163-174): the
    directory of all ranks' files with pipeline stages (it merges them with merge_pipeline_strategys,
    :433-449), any one rank's file without.
    """
    step_dir = recipe.load_checkpoint
    if not (recipe.auto_trans_ckpt and recipe.resume_training and step_dir
            and os.path.isfile(os.path.join(step_dir, LAYOUT_FILE))):
        return None
    old = checkpoint_layout(None, step_dir)
    if old == layout(recipe):
        return None
    kept = os.path.join(step_dir, STRATEGY_DIR)
    return kept if old["pipeline_stage"] > 1 else os.path.join(kept, "ckpt_strategy_rank_0.ckpt")


def mindformers_keys(recipe, run_dir: str, rank: int) -> dict:
    """Top-level and `parallel:` keys of the worker's MindFormers config for strategy files and re-slicing.

    auto_trans_ckpt is True only on the launch that resumes at another layout: MindFormers then
    compiles, writes this layout's strategy files, transforms the checkpoint into
    RUN_DIR/transformed_checkpoint/ and loads that (trainer/utils.py:507-524,
    tools/ckpt_transform/transform_checkpoint.py:186-244); True on any other launch would re-slice for nothing.
    """
    source = pending_source_strategy(recipe)
    keys = {"auto_trans_ckpt": source is not None, "parallel": strategy_config(recipe, run_dir, rank)}
    if source is not None:
        keys["src_strategy_path_or_dir"] = source
    return keys


def export_source(source: str, model_config: str = None) -> tuple:
    """(checkpoint, model section) for `--to-hf SOURCE`: a semi-auto run's newest step merged into one unsliced file.

    Anything else (a converted directory, a file, a data-parallel-mode run) is returned as it is.
    The merge follows MindFormers' ckpt_transform: merge_pipeline_strategys for pipeline stages
    (transform_checkpoint.py:433-449), then mindspore.transform_checkpoints with no destination
    strategy, i.e. unsliced (mindspore/parallel/checkpoint_transform.py:578-669).
    """
    from ascend_llm_recipes.training.checkpoint import scan_steps

    run_dir = os.path.abspath(source)
    if os.path.basename(run_dir) == CHECKPOINTS:
        run_dir = os.path.dirname(run_dir)
    if not (os.path.isdir(os.path.join(run_dir, CHECKPOINTS))
            and os.path.isfile(os.path.join(run_dir, RESOLVED_RECIPE))):
        return source, model_config
    from ascend_llm_recipes.training.tools.export import run_recipe

    recipe = run_recipe(run_dir)
    if not semi_auto(recipe):
        return source, model_config
    (step, step_dir), invalid = scan_steps(run_dir)
    if step is None:
        raise ConversionError(f"{run_dir}: no complete, verified checkpoint step of {describe(layout(recipe))}"
                              + "".join(f"; {d}: {'; '.join(p)}" for d, p in invalid[:2]))
    lay = checkpoint_layout(recipe, step_dir)
    if not lay["semi_auto"]:
        return source, model_config
    strategies = source_strategy_dir(run_dir, step_dir)
    missing = missing_strategy_files(strategies, devices(lay))
    if missing:
        raise ConversionError(f"{step_dir}: a {describe(lay)} checkpoint holds each rank's slice (tensor, pipeline "
                              f"stage or optimizer shard); merging the shards needs every rank's strategy file, and "
                              f"{len(missing)} are "
                              f"missing: {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}",
                              hint="they are written in RUN_DIR/strategy/ by the semi-auto-parallel compile of the "
                                   "run (on the Ascend node); copy them with the run directory, or export there")
    merged = os.path.join(run_dir, MERGED_DIR, f"step_{step:08d}")
    file = os.path.join(merged, "rank_0", "merged_0.ckpt")
    if not os.path.isfile(file):
        _merge(step_dir, strategies, lay, merged)
    print(f"[convert] merged the {devices(lay)} shards of step {step} ({describe(lay)}) with {strategies} into {file}",
          flush=True)
    return file, model_config or os.path.join(run_dir, RESOLVED_RECIPE)


def _merge(step_dir: str, strategies: str, lay: dict, merged: str) -> None:
    import mindspore as ms

    partial = merged + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        if lay["pipeline_stage"] > 1:
            strategy = os.path.join(partial, "merged_ckpt_strategy.ckpt")
            ms.merge_pipeline_strategys(strategies, strategy)
        else:
            strategy = os.path.join(strategies, "ckpt_strategy_rank_0.ckpt")
        ms.transform_checkpoints(step_dir, partial, "merged_", strategy, None)
    except (ValueError, TypeError, RuntimeError, OSError) as err:
        shutil.rmtree(partial, ignore_errors=True)
        raise ConversionError(f"{step_dir}: MindSpore could not merge the shards with the strategy files in "
                              f"{strategies}: {err}",
                              hint="check that the strategy files are the ones the run that saved this step wrote") \
            from None
    os.replace(partial, merged)

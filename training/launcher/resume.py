"""Resume: continue the run a run directory holds, from its newest valid checkpoint, at the same data position.

The same launch command again continues the run; a changed recipe is refused naming the keys (or,
with --amend, recorded in RUN_DIR/amendments.jsonl).
"""
import fnmatch
import json
import math
import os
import shutil
import time

from ascend_llm_recipes.common.errors import LaunchError
from ascend_llm_recipes.training.launcher.datasets import data_steps, last_step
from ascend_llm_recipes.training.recipe.schema import Recipe
from ascend_llm_recipes.training.tools.relayout import check_relayout, keep_source_strategy
from ascend_llm_recipes.training.run_files import (AMENDMENTS, CHECKPOINTS, HEARTBEAT, METRICS, METRICS_PATTERN,
                                                   RESOLVED_RECIPE, RESUME_LINKS, STATUS)
from ascend_llm_recipes.training.worker.train import dataset_manifest_sha256


def prepare_run_dir(recipe: Recipe, recipe_path: str, amend: bool = False) -> str:
    """Create the run directory (or continue the run it holds) and save the resolved recipe in it.

    A finished run is left exactly as it is (nothing rewritten); see continue_run for resumes.
    """
    run_dir = recipe.output_dir  # absolute: every path was resolved at load (training/recipe/loading.py resolve_paths)
    if os.path.exists(os.path.join(run_dir, RESOLVED_RECIPE)) and not continue_run(recipe, run_dir, amend):
        return run_dir
    leftovers = [n for n in (CHECKPOINTS, METRICS) if os.path.exists(os.path.join(run_dir, n))]
    if not os.path.exists(os.path.join(run_dir, RESOLVED_RECIPE)) and leftovers:
        raise LaunchError(f"output_dir {run_dir} holds a run's {' and '.join(leftovers)} but no {RESOLVED_RECIPE}: "
                          "starting over would overwrite them, and resuming needs the recipe that wrote them",
                          hint=f"restore {os.path.join(run_dir, RESOLVED_RECIPE)} to resume, or set another "
                               "output_dir")
    os.makedirs(run_dir, exist_ok=True)
    from ascend_llm_recipes.common.files import write_atomic
    write_atomic(os.path.join(run_dir, RESOLVED_RECIPE),
                 f"# resolved from {os.path.abspath(recipe_path)}\n" + recipe.to_yaml())
    return run_dir


# Not training settings: where the run lives (a run directory may be moved) and the checkpoint
# the launcher itself sets on resume.
NOT_SETTINGS = ("output_dir", "load_checkpoint", "resume_training")
# model_config keys that weigh the MoE training terms, not the model: a run resumes with them changed (--amend),
# as with any other training setting
TRAINING_TERMS = ("router_aux_loss_coef", "router_aux_loss_scope", "router_z_loss_coef", "capacity_factor",
                  "token_drop_policy", "expert_bias_update_rate")


def continue_run(recipe: Recipe, run_dir: str, amend: bool = False) -> bool:
    """The same launch command again: resume from the newest valid checkpoint, never mix two models.

    Returns False when the run is already complete (then nothing in run_dir was touched).
    A resolved recipe that differs from RUN_DIR/recipe.yaml is refused naming the keys, or
    with `amend` recorded in RUN_DIR/amendments.jsonl. Everything is checked before anything
    is written; then invalid step directories are moved to checkpoints/invalid/ (so retention
    counts valid checkpoints only) and the metrics are cut back to the resumed step.
    """
    from ascend_llm_recipes.training.checkpoint import MANIFEST, rank_shapes, read_json, scan_steps, set_aside

    previous = saved_recipe(run_dir)
    changed = [k for k, v in vars(recipe.model.model_config).items()
               if getattr(previous.model.model_config, k) != v and k not in TRAINING_TERMS]
    if previous.model.arch != recipe.model.arch or changed:
        raise LaunchError(f"output_dir {run_dir} holds a run of another model (changed: "
                          f"{', '.join('model.model_config.' + k for k in changed) or 'model'})",
                          hint="a changed model cannot resume these checkpoints; choose a new output_dir")
    (step, directory), invalid = scan_steps(run_dir, rank_shapes(previous))
    if step is not None:
        recipe.load_checkpoint = directory
        recipe.resume_training = read_json(os.path.join(directory, "rank_0", MANIFEST))["file"]
        check_data_position(recipe, run_dir, previous)
        check_relayout(previous, recipe, run_dir, directory)
    changes = recipe_changes(previous, recipe)
    if changes and not amend:
        raise LaunchError(f"output_dir {run_dir} holds a run trained with other settings; this launch changes "
                          + ", ".join(f"{key} ({old!r} -> {new!r})" for key, old, new in changes),
                          hint="restore those settings to continue the run, or pass --amend to continue it with the "
                               f"change recorded in {os.path.join(run_dir, AMENDMENTS)}, or choose a new output_dir")
    if step is not None and 0 < last_step(recipe)[0] <= step:
        if changes:  # --amend given, but there is no step left for the change to apply to
            print(f"[launch] note: the run is complete at step {step}, so --amend applies nothing and records "
                  "nothing (" + ", ".join(key for key, _, _ in changes) + "); raise runner_config.stop_step to "
                  "continue it with the change", flush=True)
        return False  # already complete: the launcher says so, and the run's record stays as it is
    lr = lr_change(previous, recipe, step) if step is not None and changes else None
    record_amendments(run_dir, step or 0, changes, lr)
    if step is not None:
        keep_source_strategy(previous, recipe, run_dir, directory)
    for bad, problems in invalid:
        print(f"[launch] warning: skipping invalid checkpoint {bad} (set aside as {set_aside(bad, problems)}): "
              + "; ".join(problems), flush=True)
    if step is None:
        print(f"[launch] {run_dir} holds a run but no valid checkpoint: starting it over", flush=True)
    else:
        print(f"[launch] resuming {run_dir} from step {step} ({directory})", flush=True)
    truncate_metrics(run_dir, step or 0)
    for stale in (STATUS, HEARTBEAT, RESUME_LINKS):
        shutil.rmtree(os.path.join(run_dir, stale), ignore_errors=True)
    return True


def saved_recipe(run_dir: str) -> Recipe:
    """RUN_DIR/recipe.yaml, the recipe the run was trained with."""
    import yaml
    from ascend_llm_recipes.training.recipe.loading import recipe_from_dict

    path = os.path.join(run_dir, RESOLVED_RECIPE)
    try:
        with open(path, encoding="utf-8") as f:
            return recipe_from_dict(yaml.safe_load(f), path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise LaunchError(f"{path}: unreadable ({err.__class__.__name__}); the run's record is damaged",
                          hint="restore it from a checkpoint's recipe (state.json names its sha256), or choose "
                               "a new output_dir") from None


def recipe_changes(previous: Recipe, recipe: Recipe) -> list:
    """(dotted key, old, new) for every value that differs between two resolved recipes."""
    old, new = _flatten(previous.to_dict()), _flatten(recipe.to_dict())
    keys = [k for k in new if k not in old] + list(old)
    return [(k, old.get(k), new.get(k)) for k in keys
            if old.get(k) != new.get(k) and k.split(".")[0] not in NOT_SETTINGS]


def _flatten(value, prefix: str = "") -> dict:
    """{'a.b.0.c': leaf}: the dotted paths `--set` uses, list items by index."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list) and value:
        items = enumerate(value)
    else:
        return {prefix: value}
    flat = {}
    for key, item in items:
        flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def record_amendments(run_dir: str, step: int, changes: list, lr: dict = None) -> None:
    """Append accepted recipe changes to RUN_DIR/amendments.jsonl, then show the run's whole amendment history.

    `lr` (lr_change) is the learning rate the changes move the next step to: recorded with the first change.
    """
    path = os.path.join(run_dir, AMENDMENTS)
    if changes:
        when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        records = [{"time": when, "step": step, "key": key, "old": old, "new": new} for key, old, new in changes]
        if lr is not None:
            records[0]["lr"] = lr
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
            f.flush()
            os.fsync(f.fileno())
    from ascend_llm_recipes.training.worker.metrics import read_jsonl

    history = read_jsonl(path, log=lambda m: print("[launch] warning: " + m, flush=True)) \
        if os.path.isfile(path) else []
    if history:
        print(f"[launch] this run's recipe was amended ({path}):\n" + "\n".join(
            f"  from step {a['step']}: {a['key']} {a['old']!r} -> {a['new']!r} ({a['time']})"
            + (f"; the LR of step {a['lr']['step']}: {a['lr']['old']:.3e} -> {a['lr']['new']:.3e}" if "lr" in a else "")
            for a in history),
            flush=True)


def schedule_steps(recipe: Recipe) -> int:
    """The steps the LR schedule is sized to: lr_schedule.total_steps, else runner_config.stop_step (training/recipe/
    mindformers.py lr_schedule_block), else the steps the data holds (MindFormers sizes -1 to the dataset)."""
    from ascend_llm_recipes.training.recipe.mindformers import lr_schedule_block

    total = lr_schedule_block(recipe)["total_steps"]
    return total if total > 0 else data_steps(recipe)


def schedule_lr(recipe: Recipe, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based: it trains run step step + 1) under the recipe's schedule.

    MindFormers' CosineWithWarmUpLR, LinearWithWarmUpLR and ConstantWarmUpLR (mindformers/core/lr/lr_schedule.py)
    sized to schedule_steps, entered at lr_schedule.start_step and linear decaying to lr_end (training/worker/optim.py
    StartStepLR). tests/test_run_length.py holds it against those classes.
    """
    s, total = recipe.lr_schedule, schedule_steps(recipe)
    warmup = int(total * s.warmup_ratio) if s.warmup_ratio is not None else s.warmup_steps or 0
    peak, end, t = s.learning_rate, s.lr_end, float(step + s.start_step)
    if warmup and t < warmup:
        return peak * t / warmup
    if s.type == "ConstantWarmUpLR":
        return peak
    if s.type == "LinearWithWarmUpLR":
        return end + (peak - end) * max(0.0, (total - t) / max(1, total - warmup))
    if t >= total:
        return end
    return end + (peak - end) * max(0.0, 0.5 * (1.0 + math.cos(math.pi * (t - warmup) / max(1, total - warmup))))


def lr_change(previous: Recipe, recipe: Recipe, step: int):
    """{step, old, new}: the LR of the first resumed step (step + 1) under the schedule the run trained with and under
    the amended recipe's, when they differ; also printed, with the --set keys that continue the trained schedule."""
    from ascend_llm_recipes.common.errors import DataError

    try:
        old, new = schedule_lr(previous, step), schedule_lr(recipe, step)
        before, after = schedule_steps(previous), schedule_steps(recipe)
    except DataError:
        return None  # the trained schedule's data is gone: nothing to compare with
    if math.isclose(old, new, rel_tol=1e-3):
        return None
    text = (f"[launch] warning: this amendment moves the learning rate of step {step + 1} from {old:.3e} (the "
            f"schedule the run trained with) to {new:.3e}")
    trained = previous.lr_schedule
    if before != after and trained.total_steps == -1 and recipe.lr_schedule.total_steps == -1:
        text += (f": lr_schedule.total_steps -1 sizes the schedule to the run ({before} steps before, {after} now). "
                 "To continue the trained schedule instead, stop now (Ctrl-C) and rerun with --amend and:\n"
                 f"  --set lr_schedule.total_steps={before}   (the schedule as trained: {trained.type} to lr_end "
                 f"{trained.lr_end:g} by step {before}, then lr_end)")
        if old > trained.lr_end and trained.type != "ConstantWarmUpLR":
            text += (f"\n  --set lr_schedule.learning_rate={old:.4g} --set lr_schedule.warmup_steps="
                     f"{step + trained.start_step}" + (" --set lr_schedule.warmup_ratio=null"
                                                       if trained.warmup_ratio is not None else "")
                     + f"   (a new {trained.type} from the current LR {old:.3e} to lr_end by the new end)")
    print(text, flush=True)
    return {"step": step + 1, "old": old, "new": new}


DATA_ORDER_KEYS = ("seed", "train_dataset.data_loader.shuffle", "train_dataset.blend", "runner_config.epochs",
                   "train_dataset.repeat")
# What makes up the global batch (Recipe.global_batch_size): a resume must keep their product.
GLOBAL_BATCH_KEYS = ("runner_config.batch_size", "parallel_config.data_parallel",
                     "runner_config.gradient_accumulation_steps", "parallel_config.micro_batch_num",
                     "parallel_config.pipeline_stage")


def check_data_position(recipe: Recipe, run_dir: str, previous: Recipe = None) -> None:
    """A resume must continue the training order where the checkpoint left it (data/loader.py).

    The checkpoint's state.json names its data position and the ids and hash of the samples
    that come next; the resumed recipe must give the same ones (with the same skips), at the
    same global batch (another one would renumber the steps: not supported).
    """
    from ascend_llm_recipes.data.loader import SKIPS_FILE, next_samples, read_skips, skip_ranges
    from ascend_llm_recipes.training.checkpoint import STATE, CheckpointError, read_json, resumed_steps, state_problems

    state_path = os.path.join(recipe.load_checkpoint, STATE)
    if not os.path.isfile(state_path):
        return  # not one of ours (e.g. converted weights): MindFormers resumes it as it is
    problems = state_problems(recipe.load_checkpoint)
    if problems:
        raise CheckpointError("; ".join(problems), hint="resume from another step directory (its state.json is "
                                                        "intact), or start a new output_dir")
    state = read_json(state_path)
    position, step, saved = state["data_position"], state["step"], state.get("next_samples")
    if state["global_batch_size"] != recipe.global_batch_size:
        changed = [key for key in GLOBAL_BATCH_KEYS
                   if previous is not None and _get(previous, key) != _get(recipe, key)]
        raise LaunchError(f"resume from step {step}: the checkpoint was trained at global batch "
                          f"{state['global_batch_size']} ({position} samples consumed), this recipe's global batch is "
                          f"{recipe.global_batch_size} (changed: "
                          f"{', '.join(changed) or ' x '.join(GLOBAL_BATCH_KEYS[:3])}); changing the global batch "
                          "on resume is not supported (steps, LR schedule and checkpoints are numbered in batches)",
                          hint="restore those settings (data_parallel may change when batch_size x data_parallel "
                               "stays the same), or start a new output_dir from these weights (load_checkpoint "
                               "without resume_training)")
    resumed_steps(state, recipe.global_batch_size)
    if saved is None:
        return
    skips = [tuple(r) for r in state.get("data_skips", [])]
    listed = skip_ranges(read_skips(run_dir))
    lost = [list(r) for r in skips if r not in listed]
    if lost:
        raise LaunchError(f"resume from step {step}: the checkpoint was trained without the samples at training-order "
                          f"positions {lost}, which {os.path.join(run_dir, SKIPS_FILE)} does not list",
                          hint=f"restore {SKIPS_FILE} (the rollback record this run wrote), or start a new output_dir")
    from ascend_llm_recipes.training.recipe.loader_spec import loader_spec
    now = next_samples(loader_spec(recipe, skips=skips), position, saved["count"])
    if now["sha256"] != saved["sha256"]:
        changed = []
        if previous is not None:
            changed = [key for key in DATA_ORDER_KEYS if _get(previous, key) != _get(recipe, key)]
        if state.get("dataset_manifest_sha256") and state["dataset_manifest_sha256"] != dataset_manifest_sha256(recipe):
            changed.append(f"the dataset in {recipe.dataset_dir} (its manifest.json differs)")
        raise LaunchError(f"resume from step {step}: the training data order changed: after sample {position} the "
                          f"checkpoint expects samples {saved['first_ids']}..., this recipe gives "
                          f"{now['first_ids']}... (changed: {', '.join(changed) or 'the datasets or their order'})",
                          hint="restore those settings to continue this run (a resume must not replay or skip "
                               "data), or start a new run with another output_dir")


def _get(recipe: Recipe, dotted: str):
    value = recipe
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def resumed_step(recipe: Recipe) -> int:
    from ascend_llm_recipes.training.checkpoint import MANIFEST, read_json

    manifest = os.path.join(recipe.load_checkpoint, "rank_0", MANIFEST)
    return read_json(manifest)["step"] if os.path.isfile(manifest) else 0


def truncate_metrics(run_dir: str, step: int) -> None:
    """Drop per-step records after `step` (and torn lines, with a warning): the resumed run writes them again."""
    from ascend_llm_recipes.common.files import write_atomic
    from ascend_llm_recipes.training.worker.metrics import read_jsonl

    for name in sorted(os.listdir(run_dir)):
        if fnmatch.fnmatch(name, METRICS_PATTERN):
            path = os.path.join(run_dir, name)
            records = read_jsonl(path, log=lambda m: print("[launch] warning: " + m, flush=True))
            write_atomic(path, "".join(json.dumps(r) + "\n" for r in records if r.get("step", 0) <= step))

"""One training worker: the resolved recipe -> MindFormers' Trainer, in graph mode.

Started by the launcher as `python scripts/train.py --run-dir RUN_DIR`: through msrun, or for a one-process
CPU run directly (training/launcher/cluster.py starts_worker_directly), without MS_ROLE.
Each rank records its state in RUN_DIR/status/rank_N.json (training/rank_status.py) so the launcher
can name the rank that failed; rank 0 writes per-step metrics and the final summary.
"""

import argparse
import glob
import json
import os
import signal
import sys
import time
import traceback

import yaml

from ascend_llm_recipes.common.errors import LaunchError, PretrainError
from ascend_llm_recipes.training.rank_status import Heartbeat, write_status
from ascend_llm_recipes.training.launcher.job import stop_orphan, watch_launcher, watch_launcher_from_a_child
from ascend_llm_recipes.training.recipe.loading import recipe_from_dict
from ascend_llm_recipes.training.recipe.mindformers import worker_config
from ascend_llm_recipes.training.recipe.schema import DynamicLossScaleConfig, Recipe
from ascend_llm_recipes.training.run_files import (CHECKPOINTS, PROFILE, RESOLVED_RECIPE, SUMMARY, TENSORBOARD,
                                                   metrics_file)


def rank_id() -> int:
    return int(os.environ.get("RANK_ID", "0"))


def mindformers_config(recipe: Recipe, run_dir: str) -> dict:
    """The recipe as this rank's MindFormers 1.9 Trainer reads it (training/recipe/mindformers.py worker_config)."""
    cfg = worker_config(recipe, run_dir)
    # Strategy files in RUN_DIR/strategy/, and MindFormers' re-slicing on a resume at another layout.
    from ascend_llm_recipes.training.tools.relayout import mindformers_keys
    keys = mindformers_keys(recipe, run_dir, rank_id())
    cfg["parallel"].update(keys.pop("parallel"))
    cfg.update(keys)
    if recipe.resume_training and borrows_rank_file(recipe.load_checkpoint, rank_id()):
        cfg["load_checkpoint"] = link_rank_file(recipe, run_dir, rank_id())
    return cfg


def link_rank_file(recipe: Recipe, run_dir: str, rank: int) -> str:
    """A directory holding, as rank_R/<this rank's file name>, a link to the file this rank resumes from.

    MindFormers 1.9 resumes rank R from LOAD_DIR/rank_R/<resume_training with rank_R> (trainer/utils.py:387-389,
    utils/resume_ckpt_utils.py:35-41) and refuses a file as load_checkpoint when it loads optimizer state
    (trainer/utils.py:784-786, checkpoint/utils.py:468). A symbolic link holds no data, so the step's
    retention still frees its space; the launcher removes the links at every start (resume.continue_run).
    """
    from ascend_llm_recipes.training.run_files import RESUME_LINKS

    source = loaded_checkpoint_files(recipe, rank)[0][0]
    step = os.path.basename(os.path.normpath(recipe.load_checkpoint))
    links = os.path.join(run_dir, RESUME_LINKS, step)
    rank_dir = os.path.join(links, f"rank_{rank}")
    os.makedirs(rank_dir, exist_ok=True)
    from mindformers.tools.utils import replace_rank_id_in_ckpt_name
    link = os.path.join(rank_dir, replace_rank_id_in_ckpt_name(os.path.basename(source), rank))
    partial = link + ".partial"
    if os.path.lexists(partial):
        os.remove(partial)
    os.symlink(source, partial)
    os.replace(partial, link)
    return links


def borrows_rank_file(step_dir: str, rank: int) -> bool:
    """This rank resumes a step of ours that was saved by fewer ranks, from another rank's file (resume_rank)."""
    from ascend_llm_recipes.training.checkpoint import STATE, resume_rank

    return (bool(step_dir) and os.path.isfile(os.path.join(step_dir, STATE))
            and resume_rank(step_dir, rank) != rank)


def loaded_checkpoint_files(recipe: Recipe, rank: int) -> tuple:
    """(files, per_rank) MindFormers 1.9 loads for `load_checkpoint` on `rank`, by its own rule.

    A file is loaded as it is; a directory with rank_N folders gives rank N's checkpoint (the
    one resume_training names, else the one its manifest.json names, else the newest; a step of
    ours saved by fewer ranks gives rank 0's to the others: resume_rank); a directory of files
    gives all of them (complete weights, loaded into every rank).
    """
    from ascend_llm_recipes.training.checkpoint import MANIFEST, read_json, resume_rank

    path, suffix = recipe.load_checkpoint, "." + recipe.load_ckpt_format
    if os.path.isfile(path):
        return [path], os.path.basename(os.path.dirname(path)).startswith("rank_")
    flat = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(suffix))
    if recipe.resume_training and borrows_rank_file(path, rank):
        rank = resume_rank(path, rank)
    rank_dir = os.path.join(path, f"rank_{rank}")
    if any(f.startswith("rank_") for f in os.listdir(path)) and not (flat and suffix == ".ckpt"):
        if isinstance(recipe.resume_training, str):
            # MindFormers renames the file for each rank (trainer/utils.py:388, tools/utils.py:574).
            from mindformers.tools.utils import replace_rank_id_in_ckpt_name
            return [os.path.join(rank_dir, replace_rank_id_in_ckpt_name(recipe.resume_training, rank))], True
        if os.path.isfile(os.path.join(rank_dir, MANIFEST)):
            return [os.path.join(rank_dir, read_json(os.path.join(rank_dir, MANIFEST))["file"])], True
        found = glob.glob(os.path.join(rank_dir, "*" + suffix))
        return [max(found, key=os.path.getmtime)] if found else [], True
    return flat, False


def check_checkpoint_parameters(recipe: Recipe, rank: int) -> None:
    """Every parameter of the model must come from load_checkpoint, and every weight in it must be used.

    MindFormers loads by name and only logs the parameters it did not find ("not loaded"), which
    then train from their random initialisation (e.g. lm_head of a tied-embedding checkpoint
    loaded into an untied model); weights it does not use are dropped without a word. A MoE model's parameters
    are its experts stacked where MindFormers' MoELayer runs them (Ascend), per expert where ours does (CPU): a
    checkpoint in the other layout is named as such, with the command that converts it.
    """
    from ascend_llm_recipes.models.conversion.formats import tensor_layouts
    from ascend_llm_recipes.models.shapes import STATISTICS
    from ascend_llm_recipes.common.errors import ConversionError
    from ascend_llm_recipes.training.checkpoint import RankShapes, held_note, model_shapes, rank_shapes
    from ascend_llm_recipes.training.tools.relayout import pending_source_strategy

    if not recipe.load_checkpoint:
        return
    files, per_rank = loaded_checkpoint_files(recipe, rank)
    # A rank's own file holds what the rank keeps (its slices under optimizer parallel); a file of complete
    # weights (a conversion) is sliced by MindSpore at load and holds whole tensors.
    model = rank_shapes(recipe) if per_rank else RankShapes(model_shapes(recipe))
    if model is None or (per_rank and pending_source_strategy(recipe)):
        return  # TP/PP slices and stages, or re-sliced at load: MindSpore checks those against the strategy
    where = f"load_checkpoint {recipe.load_checkpoint}"
    if not files:
        raise LaunchError(f"{where}: no {recipe.load_ckpt_format} checkpoint file for rank {rank} in it",
                          hint="point load_checkpoint at a converted directory or a run's step directory, and "
                               "set load_ckpt_format to the format of its files")
    found = {}
    try:
        for path in files:
            found.update(tensor_layouts(path))
    except (OSError, ConversionError) as err:
        raise LaunchError(f"{where}: {err}") from None
    problems = [f"{name}: not in the checkpoint (would train from its random initialisation)"
                for name in model if name not in found]
    for name in model:
        if name in found:
            shape, size = found[name]
            need = model.shape(name, size or 4)
            if shape != need:
                problems.append(f"{name}: checkpoint shape {shape}, rank {rank} of the recipe's model holds {need}"
                                + held_note(model, name))
    problems += [f"{name}: in the checkpoint but not a parameter of the recipe's model (would be dropped)"
                 for name in found if name not in model and name.startswith(("model.", "lm_head."))
                 and not name.endswith(STATISTICS)]  # MoE counters: saved with a run, not weights
    if problems:
        check_expert_layout(recipe, found, files)
        raise LaunchError(f"{where} ({', '.join(os.path.basename(f) for f in files)}) does not fit the recipe's "
                          f"model: {len(problems)} parameter problem(s):\n" + "\n".join(f"  - {p}" for p in problems),
                          hint="use the model: section the checkpoint was made with (model_config.yaml of a "
                               "conversion, recipe.yaml of a run), e.g. the same tie_word_embeddings")


def check_expert_layout(recipe: Recipe, found: dict, files: list) -> None:
    """Refuse a MoE checkpoint holding the parameters of the other expert layout, saying so."""
    from ascend_llm_recipes.models.conversion.ours import PER_EXPERT, STACKED, stacked_shapes
    from ascend_llm_recipes.models.shapes import parameter_shapes
    from ascend_llm_recipes.training.recipe.mindformers import runs_mindformers_moe
    from ascend_llm_recipes.training.tools.export import relayout_command

    cfg = recipe.model.model_config
    if not cfg.moe:
        return
    stacked = runs_mindformers_moe(recipe)
    whole = parameter_shapes(cfg, recipe.parallel_config.model_parallel)
    other = whole if stacked else stacked_shapes(whole, cfg)
    if any(name not in found for name in other):
        return  # not merely the other layout: the list of problems says what differs
    example = next(name for name in other if ".experts." in name)
    held = (f"per expert ({example}, ...: our CPU model's layout)" if stacked else
            f"stacked ({example}, ...: MindFormers' MoELayer's layout)")
    runs = (f"as MindFormers' MoELayer (context.device_target {recipe.context.device_target}), which loads them "
            "stacked (mlp.router.weight, mlp.experts.weight1, mlp.experts.weight2)" if stacked else
            "as our MoE (context.device_target CPU), which loads them per expert (mlp.gate.weight, "
            "mlp.experts.{e}.gate_proj.weight, ...)")
    wanted = STACKED if stacked else PER_EXPERT
    raise LaunchError(f"load_checkpoint {recipe.load_checkpoint} ({', '.join(os.path.basename(f) for f in files)}) "
                      f"holds the Mixture-of-Experts layers {held}; the recipe runs them {runs}",
                      hint=f"convert it into the {wanted} layout and load that: "
                           f"{relayout_command(recipe.load_checkpoint, files[0], wanted)}")


def resume_step(recipe: Recipe) -> int:
    """The step a resumed run continues after (0 for a fresh run), with its data position checked."""
    from ascend_llm_recipes.training.checkpoint import MANIFEST, STATE, read_json, resume_rank, resumed_steps

    if not recipe.resume_training or not recipe.load_checkpoint:
        return 0
    rank = resume_rank(recipe.load_checkpoint, rank_id())
    if not os.path.isfile(os.path.join(recipe.load_checkpoint, f"rank_{rank}", MANIFEST)):
        return 0  # not one of ours: MindFormers resumes it and counts steps itself
    return resumed_steps(read_json(os.path.join(recipe.load_checkpoint, STATE)), recipe.global_batch_size)


def build_callbacks(recipe: Recipe, run_dir: str, heartbeat, initial_step: int) -> tuple:
    """(StepRecorder, Checkpointer or None, AnomalyMonitor or None, every callback to pass to the Trainer)."""
    from ascend_llm_recipes.data.loader import read_skips, skip_ranges
    from ascend_llm_recipes.training.worker.anomaly import AnomalyMonitor
    from ascend_llm_recipes.training.worker.callbacks import HeldOutEval, ProfileWindow, StepRecorder
    from ascend_llm_recipes.training.worker.checkpointer import Checkpointer
    from ascend_llm_recipes.training.worker.metrics import device_peak_flops, training_flops_per_token

    rank = rank_id()
    peak, peak_source = device_peak_flops(recipe)
    print(f"[rank {rank}] MFU peak per device: {peak_source}", flush=True)
    tensorboard = os.path.join(run_dir, TENSORBOARD) if recipe.monitoring.tensorboard and rank == 0 else None
    recorder = StepRecorder(recipe, os.path.join(run_dir, metrics_file(rank)), heartbeat,
                            training_flops_per_token(recipe), peak, tensorboard, initial_step,
                            agree_on_stop=recipe.checkpointing is not None, rank=rank)
    callbacks = [recorder]
    if recipe.load_optimizer_state:
        from ascend_llm_recipes.training.worker.optim import LoadOptimizerState
        callbacks.insert(0, LoadOptimizerState(recipe.load_optimizer_state))
    if initial_step and isinstance(recipe.runner_wrapper.scale_sense, DynamicLossScaleConfig):
        from ascend_llm_recipes.training.worker.train_step import RestoreLossScale  # MindFormers restores weights only
        callbacks.insert(0, RestoreLossScale(loaded_checkpoint_files(recipe, rank)[0][0]))
    if recipe.do_eval:
        callbacks.append(HeldOutEval(recipe.eval_dataset.data_loader.dataset_dir, recipe.runner_config.batch_size,
                                     recipe.eval_step_interval, recipe.eval_dataset.max_batches, recorder,
                                     heartbeat, log_results=True))
    if recipe.profile is not None:
        callbacks.append(ProfileWindow(recipe.profile.start_step, recipe.profile.stop_step,
                                       os.path.join(run_dir, PROFILE, f"rank_{rank}"), recorder))
    checkpointer = monitor = None
    if recipe.checkpointing is not None:
        rollbacks = read_skips(run_dir)
        checkpointer = Checkpointer(run_dir, rank, recipe.world_size, recorder, recipe, state_hashes(recipe, run_dir),
                                    skip_ranges(rollbacks))
        monitor = AnomalyMonitor(run_dir, recipe.world_size, recorder, checkpointer, recipe, rollbacks)
        callbacks += [monitor, checkpointer]  # the monitor decides before the checkpointer saves
    return recorder, checkpointer, monitor, callbacks


def state_hashes(recipe: Recipe, run_dir: str) -> dict:
    """What a checkpoint was trained with: the resolved recipe and the dataset manifest, by sha256."""
    from ascend_llm_recipes.common.files import file_sha256

    return {"recipe_sha256": file_sha256(os.path.join(run_dir, RESOLVED_RECIPE)),
            "dataset_manifest_sha256": dataset_manifest_sha256(recipe)}


def dataset_manifest_sha256(recipe: Recipe) -> str:
    """sha256 of the training dataset's manifest.json: a checkpoint records it, a resume compares it."""
    from ascend_llm_recipes.data.mindrecord_io import MANIFEST as DATA_MANIFEST
    from ascend_llm_recipes.common.files import file_sha256

    return file_sha256(os.path.join(recipe.dataset_dir, DATA_MANIFEST))


def run(run_dir: str, started: float = None) -> dict:
    """Train from RUN_DIR/recipe.yaml; returns the summary (rank 0 also writes it).

    `started` is when the worker process began (time.time()); the summary's `startup`
    section gives the wall-clock time of each start-up phase from it, so the time to the
    first step can be split into imports, building (data, model, optimizer) and compile.
    """
    started = time.time() if started is None else started
    with open(os.path.join(run_dir, RESOLVED_RECIPE), encoding="utf-8") as f:
        recipe = recipe_from_dict(yaml.safe_load(f), os.path.join(run_dir, RESOLVED_RECIPE))
    # The launcher's dataset checks, on the same resolved recipe: the two cannot disagree. A DryRun
    # compile (MS_SIMULATION_LEVEL, training/tools/dryrun.py) reads no data.
    from ascend_llm_recipes.training.launcher.datasets import check_datasets
    simulated = bool(os.environ.get("MS_SIMULATION_LEVEL"))
    datasets = {"blend": None} if simulated else check_datasets(recipe)

    # MindFormers writes logs under LOCAL_DEFAULT_PATH (default ./output) from import time on.
    os.environ["LOCAL_DEFAULT_PATH"] = run_dir
    from mindformers import MindFormerConfig, Trainer
    from mindformers.core.context import build_context
    import ascend_llm_recipes.models.llama  # noqa: F401  (registers the model with MindFormers)
    from ascend_llm_recipes.training.worker.train_step import (  # registers the train-step wrapper
        ensure_subgraph_dispatch, install_cpu_barrier)
    import ascend_llm_recipes.training.worker.optim  # noqa: F401  (registers FoldedAdamW)
    from ascend_llm_recipes.data.loader import build_train_dataset, read_skips, simulated_train_dataset, skip_ranges
    from ascend_llm_recipes.training.recipe.loader_spec import loader_spec
    install_cpu_barrier()  # before the Trainer: it calls MindFormers' barrier when resuming under data parallel
    imported = time.time()

    heartbeat = Heartbeat(run_dir, rank_id())
    heartbeat.beat("setup")
    config = MindFormerConfig(**mindformers_config(recipe, run_dir))
    # Without an explicit context MindFormers starts in PyNative mode whatever the recipe says.
    build_context(config)
    ensure_subgraph_dispatch(recipe.context.device_target)
    if not recipe.use_parallel and "MS_ROLE" in os.environ:
        # A single worker under msrun (Ascend) still joins the cluster so the scheduler can finish; one started
        # without msrun has no MS_ROLE and no scheduler.
        from mindspore.communication import init
        init()
    if recipe.world_size > 1 and not simulated:
        # Under DryRun tensor values are not computed (mindspore/utils/dryrun.py:37-57): the sum could
        # only fail, whatever the cluster does.
        collective_self_test()
    check_checkpoint_parameters(recipe, rank_id())
    initial_step = resume_step(recipe)
    recorder, checkpointer, monitor, callbacks = build_callbacks(recipe, run_dir, heartbeat, initial_step)
    if checkpointer is not None:
        # Preemption: save at the end of the current step, then stop cleanly.
        signal.signal(signal.SIGTERM, lambda *_: setattr(recorder, "stop_requested", True))
    # One seeded order on every rank, each data-parallel rank its own slice; a resumed run's
    # MindFormers skips `initial_step` batches of it (set_init_step), i.e. data_position samples.
    # Samples a loss-spike rollback removed stay out of it (RUN_DIR/data_skips.json).
    data_start = time.time()
    if simulated:
        train_dataset = simulated_train_dataset(loader_spec(recipe, rank_id()), recipe.runner_config.stop_step or 1)
    else:
        train_dataset = build_train_dataset(loader_spec(recipe, rank_id(), skip_ranges(read_skips(run_dir))))
    data_seconds = time.time() - data_start
    trainer = Trainer(args=config, callbacks=callbacks, train_dataset=train_dataset)
    setup_done = time.time()
    trainer.train()
    recorder.close()
    summary = recorder.summary(run_dir, find_checkpoints(run_dir))
    summary["startup"] = startup_phases(started, imported, setup_done, recorder.records, data_seconds)
    summary["resumed_from_step"] = initial_step
    summary["preempted"] = bool(checkpointer and (checkpointer.preempted or recorder.stop_requested))
    summary["checkpoint_blocked_s"] = round(checkpointer.blocked_time, 3) if checkpointer else 0.0
    summary["rollback"] = monitor.rollback if monitor else None
    summary["blend"] = datasets["blend"]  # per member: samples, share of draws, expected repeats per pass
    if rank_id() == 0:
        with open(os.path.join(run_dir, SUMMARY), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return summary


def startup_phases(started: float, imported: float, setup_done: float, records: list,
                   data_seconds: float = 0.0) -> dict:
    """Seconds spent in each phase from worker start to the end of the first step.

    imports: Python, MindSpore and MindFormers; setup: context, MFU peak measurement,
    callbacks, Trainer object, and `data` (the training order and MindRecord dataset, also
    given on its own); build: what Trainer.train() does before the first step (network,
    optimizer, wrapper, first batch); first_step: graph compile plus one step.
    `first_step_end` is absolute (time.time()), to measure from the launch.
    """
    if not records:
        return {}
    first = records[0]
    first_end = first["time"]
    first_begin = first_end - first["step_time"]
    return {"worker_start": round(started, 3), "imports": round(imported - started, 3),
            "setup": round(setup_done - imported, 3), "data": round(data_seconds, 3),
            "build": round(first_begin - setup_done, 3), "first_step": round(first["step_time"], 3),
            "first_step_end": first_end}


def collective_self_test() -> None:
    """All-reduce rank + 1 over every rank and check the sum, before any real work.

    A wrong world size, a rank on the wrong network or a broken HCCL/MCCL setup shows up
    here in seconds, with the rank named, instead of as a hang inside the first step.
    """
    from mindspore.communication import get_group_size, get_rank
    from ascend_llm_recipes.training.worker.collectives import all_reduce_sum

    rank, size = get_rank(), get_group_size()
    got = all_reduce_sum([rank + 1.0] * 8)
    expected = size * (size + 1) / 2
    if not (got == expected).all():
        raise LaunchError(f"rank {rank}: collective self-test failed: all-reduce of rank+1 over {size} ranks "
                          f"gave {got.tolist()}, expected {expected}",
                          hint="check that every node runs the same recipe and node count, and the network")
    print(f"[rank {rank}] collective self-test passed: all-reduce over {size} ranks = {expected:g}", flush=True)


def find_checkpoints(run_dir: str) -> list:
    """This rank's complete checkpoint files (of regular steps), oldest first."""
    from ascend_llm_recipes.training.checkpoint import MANIFEST, read_json

    manifests = sorted(glob.glob(os.path.join(run_dir, CHECKPOINTS, "step_*", f"rank_{rank_id()}", MANIFEST)))
    return [os.path.join(os.path.dirname(m), read_json(m)["file"]) for m in manifests]


def main(argv=None) -> int:
    started = time.time()
    parser = argparse.ArgumentParser(description="Training worker (started by scripts/run_distributed.sh).")
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        # msrun runs this script once more as its scheduler; init() makes it serve the
        # workers and return when they are done, instead of training a second copy.
        from mindspore.communication import init
        watch_launcher_from_a_child("scheduler")
        init()
        return 0
    run_dir = os.path.abspath(args.run_dir)
    # Workers run in sessions of their own: nothing else stops them when the launcher is killed.
    watch_launcher(lambda pid: stop_orphan(f"rank {rank_id()}", pid, graceful=True))
    write_status(run_dir, rank_id(), "running")
    try:
        Heartbeat(run_dir, rank_id()).beat("start")
        summary = run(run_dir, started)
    except PretrainError as err:
        print(f"rank {rank_id()}: error: {err}", file=sys.stderr, flush=True)
        write_status(run_dir, rank_id(), "failed", error=str(err))
        return 1
    except BaseException as err:  # the launcher reports the rank; the traceback goes to its log
        traceback.print_exc()
        write_status(run_dir, rank_id(), "failed", error=f"{type(err).__name__}: {err}")
        return 1
    write_status(run_dir, rank_id(), "done", preempted=summary["preempted"], rollback=summary["rollback"])
    return 0

"""Dataset checks before a run starts: the recipe's datasets exist (or are prepared), fit the model and each other.

Run by the launcher before any worker starts, and (check_datasets) by each worker on the same resolved recipe.
"""
import os
import re
import shlex

from ascend_llm_recipes.common.errors import DataError, LaunchError, PretrainError
from ascend_llm_recipes.training.recipe.schema import Recipe

BLEND_REPEAT_WARNING = 10  # a blend member read more often than this per pass is mostly memorised


def ensure_dataset(recipe: Recipe, show_progress: bool = True) -> dict:
    """Build the recipe's own dataset (data_preparation.output_dir) when missing, then check every dataset it uses.

    Any other missing dataset directory (a typo, an override) is refused with the command
    that builds it: a mistyped path must never silently become a new dataset.
    """
    from ascend_llm_recipes.data.mindrecord_io import MANIFEST
    from ascend_llm_recipes.data.prepare import prepare_dataset, summary

    model = recipe.model.model_config
    dataset_dir = recipe.dataset_dir
    prep = recipe.data_preparation
    if prep is not None and prep.output_dir == dataset_dir and not os.path.exists(dataset_dir) \
            and not os.path.isfile(os.path.join(dataset_dir, MANIFEST)):
        print(f"[launch] dataset {dataset_dir} not found: preparing it from {prep.source} "
              f"(vocabulary {prep.vocab_size}, seq_length {model.seq_length}); later runs reuse it", flush=True)
        manifest = prepare_dataset(dataset_dir, model.seq_length, prep.vocab_size, source=prep.source,
                                   max_documents=prep.max_documents, show_progress=show_progress)
        print("[launch] " + summary(dataset_dir, manifest), flush=True)
    checked = check_datasets(recipe)
    for warning in checked["warnings"]:
        print(f"[launch] warning: {warning}", flush=True)
    for member in checked["blend"]:
        print(f"[launch] blend: {member['dataset_dir']}: weight {member['share']:.1%} of the samples, "
              f"{member['samples']:,} samples, read ~{member['repeats_per_pass']:.2f} times per pass", flush=True)
    # shard contents: full sha256 on first use, then cached
    from ascend_llm_recipes.data.loader import verify_datasets
    from ascend_llm_recipes.training.recipe.loader_spec import dataset_dirs
    print("\n".join(f"[launch] {line}" for line in verify_datasets(dataset_dirs(recipe))), flush=True)
    return checked["manifest"]


def check_datasets(recipe: Recipe) -> dict:
    """Every dataset the recipe reads (train, blend members, eval) fits the model and the others.

    Run by the launcher before anything starts and by each worker on the same resolved
    recipe. Returns {manifest: the training dataset's, blend: [per-member expected repeats
    per pass], warnings: [...]}; raises DataError naming the recipe key otherwise.
    """
    model = recipe.model.model_config
    warnings = []
    keyed = [("train_dataset.data_loader.dataset_dir", recipe.dataset_dir)]
    if recipe.do_eval and recipe.eval_dataset is not None:
        keyed.append(("eval_dataset.data_loader.dataset_dir", recipe.eval_dataset.data_loader.dataset_dir))
    manifests = {}
    for key, dataset_dir in keyed:
        manifests[key] = _checked_manifest(recipe, key, dataset_dir)
    train = manifests["train_dataset.data_loader.dataset_dir"]
    tokenizer = train["tokenizer"]
    eval_key = "eval_dataset.data_loader.dataset_dir"
    if eval_key in manifests:
        held_out = manifests[eval_key]
        if held_out["tokenizer"].get("sha256") != tokenizer.get("sha256"):  # None: ids imported without one
            raise DataError(f"{eval_key}: {keyed[1][1]} was tokenised with another tokenizer than "
                            f"train_dataset.data_loader.dataset_dir (tokenizer sha256 "
                            f"{str(held_out['tokenizer'].get('sha256'))[:12]}... vs "
                            f"{str(tokenizer.get('sha256'))[:12]}...); its loss would be measured on other tokens",
                            hint="prepare the held-out set with the training set's tokenizer: --tokenizer "
                                 f"{os.path.join(recipe.dataset_dir, tokenizer.get('file', 'tokenizer.model'))}, or "
                                 "with --val-fraction when building the training set")
        batch = recipe.runner_config.batch_size
        if held_out["samples"] < batch:
            raise DataError(f"{eval_key}: {keyed[1][1]} holds {held_out['samples']} sample(s), fewer than one "
                            f"batch (runner_config.batch_size {batch}); the evaluation would read nothing",
                            hint="prepare a larger held-out set (e.g. a larger --val-fraction), or lower the batch")
    if model.vocab_size > tokenizer["vocab_size"]:
        unused = model.vocab_size - tokenizer["vocab_size"]
        warnings.append(f"model.model_config.vocab_size {model.vocab_size} is larger than the tokenizer's "
                        f"{tokenizer['vocab_size']} ({recipe.dataset_dir}): {unused} embedding rows are never trained")
    length = run_length_problem(recipe)
    if length is not None:
        raise length
    blend = check_blend(recipe) if recipe.train_dataset.blend else []
    for member in blend:
        if member["repeats_per_pass"] > BLEND_REPEAT_WARNING:
            warnings.append(f"{member['key']}: {member['dataset_dir']} ({member['samples']:,} samples at "
                            f"{member['share']:.1%} of the blend) is read ~{member['repeats_per_pass']:.0f} times per "
                            f"pass (more than {BLEND_REPEAT_WARNING}); lower its weight or add data to it")
    return {"manifest": train, "blend": blend, "warnings": warnings}


def data_steps(recipe: Recipe) -> int:
    """Optimizer steps the training data holds: runner_config.epochs x train_dataset.repeat passes over the datasets,
    less what loss-spike rollbacks removed, in global batches. Reads manifests only; DataError when one is missing."""
    samples, skipped, batch = _data_size(recipe)
    return max(0, recipe.runner_config.epochs * recipe.train_dataset.repeat * samples - skipped) // batch


def _data_size(recipe: Recipe) -> tuple:
    """(samples in one pass: a blend's pass draws the sum of its members' samples (data/loader.py), samples removed by
    rollbacks (RUN_DIR/data_skips.json), samples per optimizer step over all ranks)."""
    from ascend_llm_recipes.data.loader import read_skips, skip_ranges
    from ascend_llm_recipes.data.mindrecord_io import read_manifest
    from ascend_llm_recipes.training.recipe.loader_spec import dataset_sources, loader_spec

    samples = sum(read_manifest(d)["samples"] for d, _, _ in dataset_sources(recipe))
    rollbacks = read_skips(recipe.output_dir) if os.path.isdir(recipe.output_dir) else []
    skipped = sum(end - start for start, end in skip_ranges(rollbacks))
    return samples, skipped, loader_spec(recipe).global_batch


def last_step(recipe: Recipe) -> tuple:
    """(the step the run ends at, what sets it): runner_config.stop_step, or (0) the last step its data holds."""
    if recipe.runner_config.stop_step:
        return recipe.runner_config.stop_step, f"runner_config.stop_step {recipe.runner_config.stop_step}"
    steps = data_steps(recipe)
    return steps, f"the {steps} steps its data holds; runner_config.stop_step 0 runs every epoch"


def run_length_problem(recipe: Recipe):
    """A DataError when runner_config.stop_step is more steps than the training data holds, else None.

    The data is never cycled silently (the run would end early, its LR schedule sized for stop_step): more passes
    are runner_config.epochs, each reshuffled, as Megatron-LM's --train-iters cycles epochs.
    """
    stop, steps = recipe.runner_config.stop_step, data_steps(recipe)
    if not stop or stop <= steps:
        return None
    samples, skipped, batch = _data_size(recipe)
    repeat = recipe.train_dataset.repeat
    epochs = -(-(stop * batch + skipped) // (samples * repeat))  # passes that hold stop_step batches, in epochs
    removed = f", less {skipped:,} samples loss-spike rollbacks removed" if skipped else ""
    data = "the blend (train_dataset.blend)" if recipe.train_dataset.blend else recipe.dataset_dir
    return DataError(f"runner_config.stop_step: {stop} is more steps than the training data holds: "
                     f"{data} gives {steps} global batches of {batch} ({samples:,} samples x "
                     f"runner_config.epochs {recipe.runner_config.epochs} x train_dataset.repeat {repeat}{removed}); "
                     f"the run would end at step {steps} with its learning rate schedule sized for {stop} steps",
                     hint=f"set runner_config.stop_step to at most {steps}, or repeat the data: runner_config.epochs "
                          f"{epochs} (each epoch reshuffled; on an existing run directory with --amend), or prepare "
                          "more data")


def _checked_manifest(recipe: Recipe, key: str, dataset_dir: str) -> dict:
    """check_dataset for one recipe key, its errors naming that key (and what data_preparation would build)."""
    from ascend_llm_recipes.data.prepare import check_dataset

    model = recipe.model.model_config
    try:
        return check_dataset(dataset_dir, model.seq_length, model.vocab_size, model.pad_token_id,
                             model.eos_token_id)
    except DataError as err:
        message = err.message.replace("train_dataset.data_loader.dataset_dir", key)
        hint = err.hint
        prep = recipe.data_preparation
        if not os.path.exists(dataset_dir) and prep is not None:
            hint = (f"{hint}; data_preparation builds only its output_dir {prep.output_dir}, never another "
                    "missing path (check the path for a typo)")
        raise DataError(message, hint) from None


def check_blend(recipe: Recipe) -> list:
    """Every blended dataset must fit the model, and all must share one tokenizer (data/loader.py).

    Returns per member: its recipe key, directory, samples, share of the draws and how many
    times a pass (sum of the members' sizes drawn by weight) is expected to read each sample.
    """
    from ascend_llm_recipes.data.loader import load_sources
    from ascend_llm_recipes.training.recipe.loader_spec import dataset_sources

    for dataset_dir, _, key in dataset_sources(recipe):
        _checked_manifest(recipe, key, dataset_dir)
    sources = load_sources(dataset_sources(recipe))
    total_weight = sum(s.weight for s in sources)
    drawn = sum(s.samples for s in sources)
    members = []
    for (_, _, key), source in zip(dataset_sources(recipe), sources):
        share = source.weight / total_weight
        members.append({"key": key, "dataset_dir": source.dataset_dir, "samples": source.samples,
                        "weight": source.weight, "share": round(share, 6),
                        "repeats_per_pass": round(share * drawn / source.samples, 3)})
    return members


def check_load_checkpoint(recipe: Recipe) -> None:
    """A `load_checkpoint` that is set must exist and fit the recipe's model (MindFormers would load it anyway).

    The architecture the checkpoint recorded (a conversion's model_config.yaml, a run's recipe.yaml)
    must equal the recipe's, key by key, and every parameter must be in the checkpoint.
    """
    from ascend_llm_recipes.models.conversion.ours import architecture_differences
    from ascend_llm_recipes.training.tools.export import read_model_section, recorded_model_section
    from ascend_llm_recipes.training.worker.train import check_checkpoint_parameters

    if not recipe.load_checkpoint:
        return
    problem = load_checkpoint_problem(recipe)
    if problem is not None:
        raise problem
    path = recipe.load_checkpoint = os.path.abspath(recipe.load_checkpoint)  # workers run inside the run directory
    section = recorded_model_section(path)
    if section is not None:
        try:
            recorded, _ = read_model_section(section)
        except PretrainError as err:
            raise LaunchError(f"load_checkpoint {path}: its recorded model cannot be read: {err}") from None
        differences = architecture_differences(recorded, recipe.model.model_config)
        if differences:
            raise LaunchError(f"load_checkpoint {path} was made for another architecture than the recipe's model "
                              f"(recorded in {section}):\n" + "\n".join(f"  - {d}" for d in differences),
                              hint=f"use the model: section of {section} in the recipe (or --set those keys to "
                                   "the checkpoint's values)")
    check_checkpoint_parameters(recipe, 0)


def load_checkpoint_problem(recipe: Recipe):
    """A LaunchError when `load_checkpoint` is set but missing, or holds another framework's checkpoint; else None."""
    path = os.path.abspath(recipe.load_checkpoint)
    if not os.path.exists(path):
        return LaunchError(f"load_checkpoint: {path} does not exist",
                           hint="fix the path, or convert a HuggingFace model first: python "
                                "scripts/convert_checkpoint.py --from-hf HF_DIR --output DIR")
    foreign = foreign_checkpoint(path)
    if foreign is None:
        return None
    what, option, source = foreign
    out = os.path.splitext(source)[0] if os.path.isfile(source) else source.rstrip(os.sep)
    command = shlex.join(["python", "scripts/convert_checkpoint.py", option, source,
                          *(["--model-config", "CONFIG.json"] if option == "--from-torch" else []),
                          "--output", out + "-converted"])
    return LaunchError(f"load_checkpoint: {path} is {what}, not a checkpoint MindFormers loads: its tensors have other "
                       "names and layouts (the load would fail on their shapes, or train from random weights)",
                       hint=f"this is {what}: convert it with scripts/convert_checkpoint.py {option} first: {command} "
                            f"(then load_checkpoint: {out}-converted, load_ckpt_format: safetensors, and the model: "
                            "section of its model_config.yaml)")


def foreign_checkpoint(path: str):
    """(what it is, the convert_checkpoint.py option, the path to convert) when `path` holds a checkpoint of another
    framework: a HuggingFace model directory (config.json beside its weights), a Megatron-LM save (legacy or
    torch_dist) or a torch.save file; None for ours (a conversion, a run's step) and anything else."""
    from ascend_llm_recipes.models.conversion.megatron_files import LATEST_FILE
    from ascend_llm_recipes.training.tools.export import recorded_model_section

    if recorded_model_section(path) is not None:
        return None  # ours: a conversion's model_config.yaml, or a run's recipe.yaml above its checkpoints
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    names = os.listdir(directory)
    if "config.json" in names and any(n.endswith((".safetensors", ".bin", ".index.json")) for n in names):
        return "a HuggingFace model directory", "--from-hf", directory
    if os.path.isfile(path):
        return ("a torch.save file", "--from-torch", path) if path.endswith((".pt", ".pth", ".bin")) else None
    # a save directory (latest_checkpointed_iteration.txt), or one iteration's: legacy rank folders, torch_dist files
    megatron = LATEST_FILE in names or any(re.fullmatch(r"iter_\d{7}|mp_rank_\d\d(_\d\d\d){0,2}", n) or
                                           n.endswith(".distcp") for n in names)
    return ("a Megatron-LM checkpoint", "--from-megatron", path) if megatron else None

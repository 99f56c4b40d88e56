"""Exports that start from a training run: a run or converted directory, a recipe, a recipe to write.

models/conversion/ (hf.py, megatron.py, torch_state.py) converts checkpoint files for a given ModelConfig and know
nothing of runs or recipes; this module resolves what a user names (a run directory's newest
verified step and its recorded recipe, a recipe given as --model-config, the run dataset's
tokenizer) into those plain values, and writes recipes that continue a converted run
(--write-recipe). scripts/convert_checkpoint.py calls it.
"""

import json
import math
import os
import shlex
import sys

import yaml

from ascend_llm_recipes.common.errors import ConversionError, PretrainError
from ascend_llm_recipes.common.files import file_sha256
from ascend_llm_recipes.common.schema import to_plain
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.conversion.ours import (CHECKPOINT_FILE, MANIFEST_FILE, MODEL_SECTION_FILE,
                                                       OPTIMIZER_DIR, PER_EXPERT, hf_source, model_section,
                                                       read_model_yaml)
from ascend_llm_recipes.models.conversion.hf import write_hf
from ascend_llm_recipes.models.conversion.megatron import from_megatron, source_manifest
from ascend_llm_recipes.models.conversion.megatron import to_megatron as _to_megatron
from ascend_llm_recipes.models.conversion.torch_state import from_torch as _from_torch
from ascend_llm_recipes.training.run_files import CHECKPOINTS
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.run_files import RESOLVED_RECIPE as RUN_RECIPE


def read_model_section(path: str) -> tuple:
    """(ModelConfig, tensor-parallel degree) from a model_config.yaml or from a recipe."""
    data = read_model_yaml(path)
    if set(data) != {"model"}:  # a whole recipe: resolve and validate it like the launcher does
        recipe = load_recipe(path)
        return recipe.model.model_config, recipe.parallel_config.model_parallel
    return model_section(data, path), 1


def recorded_model_section(path: str):
    """The model section a checkpoint was made with, found beside or above `path`; None when there is none.

    A conversion keeps model_config.yaml beside its weights; a run keeps recipe.yaml in RUN_DIR,
    above RUN_DIR/checkpoints/step_N/rank_R/<file>.ckpt.
    """
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    for _ in range(4):
        if os.path.isfile(os.path.join(directory, MODEL_SECTION_FILE)):
            return os.path.join(directory, MODEL_SECTION_FILE)
        if os.path.isfile(os.path.join(directory, RUN_RECIPE)) and os.path.isdir(os.path.join(directory, CHECKPOINTS)):
            return os.path.join(directory, RUN_RECIPE)
        directory = os.path.dirname(directory)
    return None


def run_recipe(run_dir: str):
    """RUN_DIR/recipe.yaml as recorded; read for planning (an Ascend run's record also loads on this CPU)."""
    from ascend_llm_recipes.training.recipe.loading import recipe_from_dict

    path = os.path.join(run_dir, RUN_RECIPE)
    try:
        with open(path, encoding="utf-8") as f:
            return recipe_from_dict(yaml.safe_load(f), path, planning=True)
    except (OSError, yaml.YAMLError) as err:
        raise ConversionError(f"{path}: cannot read the run's recipe ({err})") from None


def _newest_valid_checkpoint(run_dir: str, model_config: str = None) -> tuple:
    """(rank 0's file, model section, notes) of a run's newest verified step, by the resume rule."""
    from ascend_llm_recipes.models.shapes import parameter_shapes
    from ascend_llm_recipes.training.checkpoint import MANIFEST, model_shapes, newest_valid_step, read_json

    section = model_config or os.path.join(run_dir, RUN_RECIPE)
    cfg, tensor_parallel = read_model_section(section)
    # the run's own parameters: a MoE run on Ascend saved its experts stacked (MindFormers' MoELayer)
    shapes = parameter_shapes(cfg, tensor_parallel) if model_config else model_shapes(run_recipe(run_dir))
    notes = []
    step, directory = newest_valid_step(run_dir, shapes, log=notes.append)
    if step is None:
        others = sorted(e for e in os.listdir(os.path.join(run_dir, CHECKPOINTS)) if not e.startswith("step_"))
        raise ConversionError(f"{run_dir}: no complete, verified checkpoint step"
                              + (f" ({'; '.join(notes)})" if notes else "")
                              + (f"; post-mortem snapshots are never taken implicitly: {', '.join(others)}"
                                 if others else ""),
                              hint="name a checkpoint file (.ckpt) explicitly to export it anyway")
    file = os.path.join(directory, "rank_0", read_json(os.path.join(directory, "rank_0", MANIFEST))["file"])
    return file, section, {"step": step, "skipped": notes}


def find_our_checkpoint(source: str, model_config: str = None) -> tuple:
    """(checkpoint file, model section file, notes) for a converted dir, a run dir or a checkpoint file.

    A run directory (or its checkpoints/ folder) gives its newest complete step whose manifests
    verify, the rule resume uses: never a half-written `.partial-` file nor a nan_/spike_
    post-mortem snapshot. Those are exported only when named as a file.
    """
    source = os.path.abspath(source)
    notes: dict = {}
    if os.path.isdir(source) and os.path.basename(source) == CHECKPOINTS \
            and os.path.isfile(os.path.join(os.path.dirname(source), RUN_RECIPE)):
        source = os.path.dirname(source)
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, CHECKPOINT_FILE)):
        ckpt = os.path.join(source, CHECKPOINT_FILE)
    elif os.path.isdir(os.path.join(source, CHECKPOINTS)) and os.path.isfile(os.path.join(source, RUN_RECIPE)):
        return _newest_valid_checkpoint(source, model_config)
    elif os.path.isfile(source) and source.endswith((".ckpt", ".safetensors")):
        ckpt = source
        _check_against_manifest(ckpt)
    elif not os.path.exists(source):
        raise ConversionError(f"{source}: does not exist")
    else:
        raise ConversionError(f"{source}: neither a converted directory (with {CHECKPOINT_FILE}), a run directory "
                              f"(with {RUN_RECIPE} and {CHECKPOINTS}/), nor a .ckpt or .safetensors file",
                              hint="pass one of those; for another checkpoint, name its file")
    section = model_config or recorded_model_section(ckpt)
    if section is None:
        raise ConversionError(f"{ckpt}: no {MODEL_SECTION_FILE} or run {RUN_RECIPE} found beside it or above it",
                              hint="pass --model-config with the recipe (or model_config.yaml) it was trained with")
    return ckpt, section, notes


def _check_against_manifest(ckpt: str) -> None:
    """A checkpoint file named directly is still checked against the manifest.json a save wrote beside it."""
    from ascend_llm_recipes.training.checkpoint import MANIFEST, read_json

    manifest = os.path.join(os.path.dirname(ckpt), MANIFEST)
    if not os.path.isfile(manifest):
        return
    try:
        recorded = read_json(manifest)
    except (OSError, ValueError) as err:
        raise ConversionError(f"{manifest}: unreadable ({err})", hint="check the checkpoint with "
                              "scripts/verify_checkpoint.py, or export another step") from None
    if recorded.get("file") == os.path.basename(ckpt) and recorded.get("sha256") != file_sha256(ckpt):
        raise ConversionError(f"{ckpt}: sha256 differs from {manifest} (the file is corrupt)",
                              hint="export another step (give the run directory to take its newest valid one)")


def run_tokenizer(section_path: str) -> tuple:
    """((tokenizer file, its manifest entry) to copy or None, a note for the manifest) from a run's dataset."""
    from ascend_llm_recipes.data.mindrecord_io import MANIFEST as DATA_MANIFEST

    if os.path.basename(section_path) != RUN_RECIPE:
        return None, "not copied: the source is not a training run (no dataset names a tokenizer)"
    try:
        dataset_dir = run_recipe(os.path.dirname(section_path)).dataset_dir
        with open(os.path.join(dataset_dir, DATA_MANIFEST), encoding="utf-8") as f:
            entry = json.load(f)["tokenizer"]
    except (OSError, ValueError, KeyError, PretrainError) as err:
        return None, f"not copied: the run's dataset manifest cannot be read ({err})"
    path = os.path.join(dataset_dir, entry.get("file", "tokenizer.model"))
    if not os.path.isfile(path) or file_sha256(path) != entry.get("sha256"):
        return None, f"not copied: {path} is missing or differs from its dataset manifest"
    return (path, entry), f"copied from {path}"


def relayout_command(checkpoint: str, file: str, expert_layout: str) -> str:
    """The command(s) writing `checkpoint` (its file `file`) again with its MoE layers in `expert_layout`: its
    conversion again from the same source, or a run's weights through Hugging Face's format."""
    script, layout = "python scripts/convert_checkpoint.py", f"--expert-layout {expert_layout}"
    out = shlex.quote(f"{os.path.normpath(os.path.abspath(checkpoint))}-{expert_layout}")
    manifest = source_manifest(checkpoint) if os.path.isdir(checkpoint) else {}
    source, direction = manifest.get("source") or {}, manifest.get("direction")
    # the source again, while it is still there and readable as given (a Megatron release/ folder is not: its
    # parent is, with no iteration to name), else the converted weights themselves through Hugging Face's format
    again = os.path.exists(source.get("path", "")) and not (
        direction == "from-megatron" and not os.path.basename(os.path.normpath(source["path"])).startswith("iter_"))
    if again and direction in ("from-hf", "from-megatron"):
        return f"{script} --{direction} {shlex.quote(source['path'])} --output {out} {layout}"
    if again and direction == "from-torch":
        key_map = f" --key-map {shlex.quote(source['key_map'])}" if source.get("key_map") else ""
        return (f"{script} --from-torch {shlex.quote(source['path'])} --model-config "
                f"{shlex.quote(source['model_config'])}{key_map} --output {out} {layout}")
    hf = shlex.quote(f"{os.path.normpath(os.path.abspath(checkpoint))}-hf")
    ours = checkpoint if manifest else file  # a conversion directory, else the run's checkpoint file
    return (f"{script} --to-hf {shlex.quote(ours)} --output {hf} && {script} --from-hf {hf} --output {out} {layout} "
            "(the weights: optimizer state does not carry over)")


def to_hf(source: str, out_dir: str, model_config: str = None, show_progress: bool = True) -> dict:
    """Convert one of our checkpoints (converted dir, run dir, file) to OUT_DIR/config.json + model.safetensors."""
    ckpt_path, section_path, notes = find_our_checkpoint(source, model_config)
    cfg, tensor_parallel = read_model_section(section_path)
    tokenizer, tokenizer_note = run_tokenizer(section_path)
    source = {"path": ckpt_path, "model_section": section_path, **notes}
    return write_hf(ckpt_path, cfg, out_dir, tensor_parallel, source, tokenizer, tokenizer_note, show_progress,
                    origin=weights_origin(ckpt_path))


def weights_origin(ckpt_path: str) -> dict:
    """The HuggingFace source (ours.hf_source) of these weights: the conversion they are, or the one the run that
    trained them started from (its recipe's load_checkpoint, through runs started from another run's checkpoint);
    None when there is none. A resumed run's recipe names its own checkpoint, where the search ends."""
    path, seen = os.path.abspath(ckpt_path), set()
    while path and path not in seen:
        seen.add(path)
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        if os.path.isfile(os.path.join(directory, MANIFEST_FILE)):
            return hf_source(directory)
        section = recorded_model_section(path)
        if section is None or os.path.basename(section) != RUN_RECIPE:
            return None
        path = run_recipe(os.path.dirname(section)).load_checkpoint
    return None


def from_torch(path: str, out_dir: str, model_config: str, key_map: str = None, seq_length: int = None,
               verify: bool = False, show_progress: bool = True, expert_layout: str = PER_EXPERT) -> dict:
    """A torch.save'd state dict -> OUT_DIR, for the model --model-config names (JSON, model section or recipe)."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ConversionError(f"{path}: no such file (expected a torch.save'd state dict)")
    if model_config is None:
        raise ConversionError(f"{path}: a state dict does not say which model it holds",
                              hint="pass --model-config with a HuggingFace config.json, Meta's params.json, a "
                                   "model_config.yaml or a recipe")
    cfg = None if model_config.endswith(".json") else read_model_section(model_config)[0]
    return _from_torch(path, out_dir, model_config, cfg, key_map, seq_length, verify, show_progress, expert_layout)


def to_megatron(source: str, out_dir: str, tp: int = 1, pp: int = 1, iteration: int = None,
                model_config: str = None, show_progress: bool = True, ep: int = 1, grouped_gemm: bool = False) -> dict:
    """Megatron-LM legacy files for TP x PP (x EP for a MoE model; grouped_gemm: its experts as GroupedMLP's) from a
    converted directory, a run directory or a checkpoint file."""
    ckpt_path, section_path, _ = find_our_checkpoint(source, model_config)
    cfg, _ = read_model_section(section_path)
    return _to_megatron(ckpt_path, cfg, out_dir, tp, pp, iteration, source, section_path, show_progress, ep,
                        grouped_gemm)


# --- A recipe continuing a converted run --------------------------------------------------------

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASCEND_BASE = os.path.join(REPO_ROOT, "recipes", "base", "ascend.yaml")
LR_SCHEDULES = {"cosine": "CosineWithWarmUpLR", "linear": "LinearWithWarmUpLR", "constant": "ConstantWarmUpLR"}
DATASET_PLACEHOLDER = "datasets/CHANGE_ME"


def megatron_lr(args: dict, iteration: int) -> float:
    """Megatron-LM's learning rate at `iteration` (OptimizerParamScheduler: linear warm-up, then decay)."""
    peak, low = args["lr"], args.get("min_lr", 0.0)
    warmup, decay = args.get("lr_warmup_iters", 0) or 0, args.get("lr_decay_iters") or args.get("train_iters")
    if warmup and iteration <= warmup:
        return peak * iteration / warmup
    if args.get("lr_decay_style") == "constant":
        return peak
    if iteration > decay:
        return low
    ratio = (iteration - warmup) / max(1, decay - warmup)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if args.get("lr_decay_style") == "cosine" else 1.0 - ratio
    return low + coeff * (peak - low)


def write_recipe(path: str, converted_dir: str, devices: int = None, dataset_dir: str = None) -> dict:
    """A recipe on base/ascend.yaml training from converted_dir, with a Megatron run's hyper-parameters.

    Validated with the strict loader (planning mode) and the planner before it appears. Returns
    {"path", "notes", "plan"}.
    """
    from ascend_llm_recipes.common.errors import RecipeError
    from ascend_llm_recipes.training.tools.plan_report import verdict
    from ascend_llm_recipes.training.tools.planner import plan

    converted_dir = os.path.abspath(converted_dir)
    cfg, _ = read_model_section(os.path.join(converted_dir, MODEL_SECTION_FILE))
    source = source_manifest(converted_dir).get("source", {})
    args = source.get("megatron_args") or {}
    model_config = {k: v for k, v in to_plain(cfg).items() if k not in ("compute_dtype", "param_dtype")}
    data = {"base": os.path.relpath(ASCEND_BASE, os.path.dirname(os.path.abspath(path))),
            "output_dir": f"runs/{os.path.splitext(os.path.basename(path))[0]}",
            "load_checkpoint": converted_dir, "load_ckpt_format": "safetensors",
            "model": {"model_config": model_config},
            "train_dataset": {"data_loader": {"dataset_dir": dataset_dir or DATASET_PLACEHOLDER}}}
    notes = [f"weights: {converted_dir} ({source.get('format', 'converted')})"]
    if args:
        notes += _continue_megatron_run(data, args, source.get("iteration", 0), devices, cfg, converted_dir,
                                        source_manifest(converted_dir).get("optimizer") or {})
    else:
        data["runner_config"] = {"batch_size": 1}
        data["parallel_config"] = {"data_parallel": devices or 1}
        data["use_parallel"] = True
        notes.append("hyper-parameters: base/ascend.yaml's (the source records no training run)")
    if cfg.moe:
        notes += _expert_parallel(data, cfg, args, converted_dir)
    if not dataset_dir:
        notes.append(f"train_dataset.data_loader.dataset_dir is {DATASET_PLACEHOLDER}: point it at a dataset made "
                     "by scripts/prepare_data.py before launching")
    lines = ["Continues a run from converted weights (scripts/convert_checkpoint.py --write-recipe).", *notes]
    header = "".join(f"# {line}\n" for line in lines)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.partial-{os.getpid()}"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(header + yaml.safe_dump(data, sort_keys=False))
    try:
        recipe = load_recipe(partial, planning=True)
        result = plan(recipe)
    except RecipeError as err:
        os.remove(partial)
        raise ConversionError(f"{path}: the proposed recipe does not validate:\n{err.message}",
                              hint="pass --devices with a device count the run's parallel layout fits") from None
    os.replace(partial, path)
    return {"path": os.path.abspath(path), "notes": notes, "plan": verdict(result)}


def _expert_parallel(data: dict, cfg: ModelConfig, args: dict, converted_dir: str) -> list:
    """A MoE model trained on Ascend (MindFormers' MoELayer, models/expert_parallel.py): the largest expert-parallel
    degree the rules allow (models/parallel.py expert_problems), and whether the conversion's experts are in the
    layout that layer loads; notes."""
    from ascend_llm_recipes.models.conversion.ours import STACKED, expert_layout
    from ascend_llm_recipes.models.conversion.formats import tensor_shapes
    from ascend_llm_recipes.models.parallel import expert_problems

    p = data["parallel_config"]
    dp, tp = p["data_parallel"], p.get("model_parallel", 1)
    fits = [ep for ep in range(min(cfg.num_experts, dp * tp), 0, -1) if not expert_problems(cfg, dp, tp, ep)]
    theirs = args.get("expert_model_parallel_size")
    ep = theirs if theirs in fits else (fits[0] if fits else 1)
    p["expert_parallel"] = ep
    notes = [f"expert parallel {ep}" + (f" (Megatron ran EP {theirs})" if theirs else "") + ": each device holds "
             f"{cfg.num_experts // ep} of every MoE layer's {cfg.num_experts} experts"]
    names = tensor_shapes(os.path.join(converted_dir, CHECKPOINT_FILE))
    if expert_layout(names, cfg) != STACKED:
        notes.append(f"{converted_dir} holds the experts per expert (our CPU model's layout); on Ascend the MoE layers "
                     "are MindFormers' MoELayer, which loads them stacked: convert again with --expert-layout "
                     "stacked before launching (the launch's load check refuses this one)")
    return notes


def _continue_megatron_run(data: dict, args: dict, iteration: int, devices: int, cfg: ModelConfig,
                           converted_dir: str, optimizer: dict) -> list:
    """Fill data with the Megatron run's batch, optimizer, LR schedule and parallel layout; returns notes."""
    from ascend_llm_recipes.models.parallel import layout_problems

    notes = []
    micro, global_batch = args.get("micro_batch_size") or 1, args.get("global_batch_size") or 1
    tp0, pp0 = args.get("tensor_model_parallel_size", 1), args.get("pipeline_model_parallel_size", 1)
    devices = devices or args.get("world_size") or tp0 * pp0 * (args.get("data_parallel_size") or 1)
    layout = None
    for tp, pp in dict.fromkeys([(tp0, pp0), (tp0, 1), (1, pp0), (1, 1)]):
        if devices % (tp * pp) or global_batch % (micro * (devices // (tp * pp))):
            continue
        accumulation = global_batch // (micro * (devices // (tp * pp)))
        if not layout_problems(cfg, devices // (tp * pp), tp, pp, accumulation if pp > 1 else 1):
            layout = (devices // (tp * pp), tp, pp, accumulation)
            break
    if layout is None:
        raise ConversionError(f"--devices {devices}: no layout keeps the run's global batch {global_batch} with "
                              f"micro-batch {micro} (TP {tp0} x PP {pp0} tried, then smaller)",
                              hint="pass --devices with a count that divides the global batch / micro-batch")
    dp, tp, pp, accumulation = layout
    data["use_parallel"] = True
    data["parallel_config"] = {"data_parallel": dp, "model_parallel": tp, "pipeline_stage": pp,
                               "micro_batch_num": accumulation if pp > 1 else 1}
    data["runner_config"] = {"batch_size": micro, "gradient_accumulation_steps": 1 if pp > 1 else accumulation}
    notes.append(f"parallel layout for {devices} devices: DP {dp} x TP {tp} x PP {pp} (Megatron ran TP {tp0} x "
                 f"PP {pp0}); global batch {global_batch} = micro-batch {micro} x DP {dp} x {accumulation}")
    train_iters = args.get("train_iters")
    if train_iters:
        data["runner_config"]["stop_step"] = max(1, train_iters - iteration)
    data["optimizer"] = {"betas": [args.get("adam_beta1", 0.9), args.get("adam_beta2", 0.999)],
                         "eps": args.get("adam_eps", 1e-8), "weight_decay": args.get("weight_decay", 0.01)}
    clip = args.get("clip_grad", 1.0)
    data["runner_wrapper"] = {"use_clip_grad": bool(clip), **({"max_grad_norm": clip} if clip else {})}
    style = args.get("lr_decay_style", "linear")
    if style not in LR_SCHEDULES:
        raise ConversionError(f"lr_decay_style: {style!r} has no counterpart here ({', '.join(LR_SCHEDULES)})")
    warmup = args.get("lr_warmup_iters", 0) or 0
    decay = args.get("lr_decay_iters") or train_iters or iteration + 1
    carried = optimizer.get("carried") and tp == pp == 1
    # MindFormers evaluates the schedule at the optimizer's step: it starts at the carried step, else at 0
    start = iteration - (optimizer["global_step"] if carried else 0)
    if args.get("lr") is None:  # model arguments only (as --to-megatron writes them): no schedule to continue
        notes.append("LR: the checkpoint's arguments have no lr (not a Megatron training run's): the recipe keeps "
                     "its base's lr_schedule; set it before training")
    else:
        data["lr_schedule"] = {"type": LR_SCHEDULES[style], "learning_rate": args["lr"],
                               "lr_end": args.get("min_lr", 0.0), "warmup_steps": warmup, "warmup_ratio": None,
                               "total_steps": max(1, decay), "start_step": start}
        notes.append(f"LR: Megatron's own schedule ({style}, warm-up {warmup}, decay to min_lr "
                     f"{args.get('min_lr', 0.0):g} at iteration {decay}), entered at iteration {iteration} "
                     f"(lr_schedule.start_step {start}): the first step's LR is {megatron_lr(args, iteration):.6g}")
    if optimizer.get("carried") and tp == pp == 1:
        data["load_optimizer_state"] = converted_dir
        notes.append(f"continues Megatron iteration {iteration} with its AdamW moments and step "
                     f"{optimizer['global_step']} (load_optimizer_state)")
    else:
        why = optimizer.get("note", "") if not optimizer.get("carried") else \
            f"training restarts the optimizer: the moments in {OPTIMIZER_DIR}/ load under data parallelism only"
        notes.append(f"continues Megatron iteration {iteration}; {why}")
    return notes


def run_cli(parser, args) -> int:
    """scripts/convert_checkpoint.py for --from-megatron, --from-torch, --to-megatron and --write-recipe."""
    from ascend_llm_recipes.models.conversion.hf import from_hf
    from ascend_llm_recipes.models.conversion.write import summary

    if args.key_map and not args.from_torch:
        parser.error("--key-map applies to --from-torch")
    if args.write_recipe and args.to_megatron or args.write_recipe and args.to_hf:
        parser.error("--write-recipe applies to --from-megatron, --from-hf and --from-torch")
    if args.verify and args.to_megatron:
        parser.error("--verify applies to --from-hf, --from-megatron and --from-torch")
    if args.seq_length and not (args.from_hf or args.from_torch):
        parser.error("--seq-length applies to --from-hf and --from-torch (Megatron's args set it)")
    try:
        if args.from_megatron:
            manifest = from_megatron(args.from_megatron, args.output, iteration=args.iteration,
                                     vocab_size=args.vocab_size, verify=args.verify, show_progress=not args.quiet,
                                     expert_layout=args.expert_layout)
        elif args.from_torch:
            manifest = from_torch(args.from_torch, args.output, args.model_config, args.key_map, args.seq_length,
                                  args.verify, show_progress=not args.quiet, expert_layout=args.expert_layout)
        elif args.to_megatron:
            manifest = to_megatron(args.to_megatron, args.output, args.tp, args.pp, args.iteration,
                                   args.model_config, show_progress=not args.quiet, ep=args.ep,
                                   grouped_gemm=args.grouped_gemm)
            layout = f"TP {args.tp} x PP {args.pp}" + (f" x EP {args.ep}" if args.ep > 1 else "") + \
                (", GroupedMLP experts: --moe-grouped-gemm" if args.grouped_gemm else "")
            print(f"wrote Megatron-LM legacy files ({layout}, {manifest['checkpoint']}) into "
                  f"{os.path.abspath(args.output)} in {manifest['seconds']:.1f} s; load them with Megatron-LM's "
                  "--load and --ckpt-format torch")
            return 0
        else:
            manifest = from_hf(args.from_hf, args.output, seq_length=args.seq_length, verify=args.verify,
                               show_progress=not args.quiet, expert_layout=args.expert_layout)
        print(summary(manifest, args.output))
        if manifest["source"].get("iteration") is not None:
            print(f"Megatron iteration {manifest['source']['iteration']}; {manifest['optimizer']['note']}.")
        if args.write_recipe:
            written = write_recipe(args.write_recipe, args.output, devices=args.devices)
            print(f"recipe: {written['path']} ({written['plan']})\n" + "\n".join(f"  {n}" for n in written["notes"]))
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
